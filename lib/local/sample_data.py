"""The sample bank's made-up reference data: branches, cities, names, streets, merchants, disclosures.

All personal data here is invented (emails at example.com/.net/.org, phones +1-AAA-555-01xx).
"""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

BANK_NAME = "Northwind Community Bank"

# branch_code, name, city, region, phone, opened_on
BRANCHES = (
    ("CHI-01", "Northwind Chicago Loop", "Chicago", "IL", "+1-312-555-0100", date(1998, 3, 2)),
    ("CHI-02", "Northwind Lincoln Park", "Chicago", "IL", "+1-773-555-0101", date(2004, 9, 13)),
    ("MIL-01", "Northwind Milwaukee Third Ward", "Milwaukee", "WI", "+1-414-555-0102", date(2001, 5, 7)),
    ("MAD-01", "Northwind Madison Capitol Square", "Madison", "WI", "+1-608-555-0103", date(2010, 1, 18)),
    ("MSP-01", "Northwind Minneapolis North Loop", "Minneapolis", "MN", "+1-612-555-0104", date(2008, 6, 30)),
    ("DSM-01", "Northwind Des Moines East Village", "Des Moines", "IA", "+1-515-555-0105", date(2012, 4, 2)),
    ("STL-01", "Northwind St. Louis Soulard", "St. Louis", "MO", "+1-314-555-0106", date(2015, 10, 5)),
    (
        "IND-01",
        "Northwind Indianapolis Fountain Sq.",
        "Indianapolis",
        "IN",
        "+1-317-555-0107",
        date(2018, 2, 26),
    ),
)

# city, region, first three zip digits, phone area code, nearest branch
CITIES = (
    ("Chicago", "IL", "606", "312", "CHI-01"),
    ("Chicago", "IL", "606", "773", "CHI-02"),
    ("Evanston", "IL", "602", "847", "CHI-02"),
    ("Oak Park", "IL", "603", "708", "CHI-01"),
    ("Naperville", "IL", "605", "630", "CHI-01"),
    ("Milwaukee", "WI", "532", "414", "MIL-01"),
    ("Green Bay", "WI", "543", "920", "MIL-01"),
    ("Madison", "WI", "537", "608", "MAD-01"),
    ("Minneapolis", "MN", "554", "612", "MSP-01"),
    ("St. Paul", "MN", "551", "651", "MSP-01"),
    ("Des Moines", "IA", "503", "515", "DSM-01"),
    ("St. Louis", "MO", "631", "314", "STL-01"),
    ("Indianapolis", "IN", "462", "317", "IND-01"),
)

FIRST_NAMES = (
    "Olivia",
    "Liam",
    "Emma",
    "Noah",
    "Ava",
    "Elijah",
    "Sophia",
    "James",
    "Isabella",
    "Lucas",
    "Mia",
    "Mateo",
    "Amelia",
    "Ethan",
    "Harper",
    "Aiden",
    "Evelyn",
    "Daniel",
    "Abigail",
    "Henry",
    "Emily",
    "Jackson",
    "Ella",
    "Sebastian",
    "Zoë",
    "José",
    "Aaliyah",
    "Chloé",
    "Wei",
    "Priya",
    "Mohammed",
    "Fatima",
    "Søren",
    "Ingrid",
    "Tomasz",
    "Kenji",
    "Yuki",
    "Chidi",
    "Ngozi",
    "Diego",
    "Lucía",
    "Hannah",
    "Samuel",
    "Grace",
    "Owen",
    "Nora",
    "Caleb",
    "Ruth",
    "Isaac",
    "Maya",
)
MIDDLE_NAMES = ("Ann", "Marie", "Lee", "James", "Rose", "Alan", "Jean", "Ray", "Lynn", "Kai")
LAST_NAMES = (
    "Smith",
    "Johnson",
    "Williams",
    "Brown",
    "Jones",
    "Garcia",
    "Miller",
    "Davis",
    "Rodriguez",
    "Martinez",
    "Hernandez",
    "Lopez",
    "Gonzalez",
    "Wilson",
    "Anderson",
    "Thomas",
    "Taylor",
    "Moore",
    "Jackson",
    "Martin",
    "Lee",
    "Pérez",
    "Thompson",
    "White",
    "Harris",
    "Clark",
    "Lewis",
    "Nguyen",
    "Kowalski",
    "Nowak",
    "Olsen",
    "Johansson",
    "Schmidt",
    "Müller",
    "O'Brien",
    "Murphy",
    "Okafor",
    "Adeyemi",
    "Patel",
    "Shah",
    "Kim",
    "Park",
    "Chen",
    "Wang",
    "Tanaka",
    "Sato",
    "Cohen",
    "Rossi",
    "Novak",
    "Haddad",
)
STREETS = (
    "Maple Avenue",
    "Oak Street",
    "Lakeshore Drive",
    "Elm Street",
    "Prairie Road",
    "Washington Boulevard",
    "Lincoln Avenue",
    "Cedar Lane",
    "Pine Street",
    "River Road",
    "Highland Avenue",
    "Park Place",
    "Church Street",
    "Mill Road",
    "Sunset Drive",
    "Walnut Street",
    "Chestnut Street",
    "Hickory Lane",
    "Birch Court",
    "Willow Way",
    "Franklin Street",
    "Jefferson Avenue",
    "Madison Street",
    "Monroe Drive",
    "Grand Avenue",
    "Division Street",
    "Harbor View Road",
    "Meadow Lane",
    "Orchard Street",
    "Clark Street",
)
EMAIL_DOMAINS = ("example.com", "example.net", "example.org")
EMPLOYERS = (
    "Acme Logistics",
    "Great Lakes Health",
    "Prairie State University",
    "Midwest Rail Co.",
    "Lakeside Software",
    "Heartland Foods",
    "River City Schools",
    "Northwind Community Bank",
)

# name, merchant category code, city, country, currency, UTC offset (hours)
MERCHANTS = (
    ("Blue Lake Coffee", "5814", "Chicago", "US", "USD", -5),
    ("Prairie Grocers", "5411", "Milwaukee", "US", "USD", -5),
    ("Lakeshore Fuel", "5541", "Evanston", "US", "USD", -5),
    ("Great River Pharmacy", "5912", "St. Louis", "US", "USD", -5),
    ("North Star Books", "5942", "Minneapolis", "US", "USD", -5),
    ("Midwest Hardware Co.", "5251", "Des Moines", "US", "USD", -5),
    ("Union Station Parking", "7523", "Chicago", "US", "USD", -5),
    ("Harbor Fish Market", "5422", "Green Bay", "US", "USD", -5),
    ("Cinema on State", "7832", "Madison", "US", "USD", -5),
    ("Corner Deli & Bagels", "5812", "Indianapolis", "US", "USD", -4),
    ("Gopher Electronics", "5732", "St. Paul", "US", "USD", -5),
    ("StreamFlix Subscription", "4899", "Los Gatos", "US", "USD", -7),
    ("ParcelNow Online", "5969", "Seattle", "US", "USD", -7),
    ("Café Lumière", "5812", "Paris", "FR", "EUR", 2),
    ("Buchhandlung Müller", "5942", "Berlin", "DE", "EUR", 2),
    ("Mercado São João", "5411", "Lisbon", "PT", "EUR", 1),
    ("King's Cross Books", "5942", "London", "GB", "GBP", 1),
    ("Tokyo Ramen Ichiban", "5812", "Tokyo", "JP", "JPY", 9),
)
# payee, merchant category code
DIRECT_DEBITS = (
    ("Midwest Power & Light", "4900"),
    ("Prairie Mutual Insurance", "6300"),
    ("LakeNet Broadband", "4814"),
    ("City Water Department", "4900"),
    ("Northwind Mortgage Servicing", "6012"),
)
# Reference rates to USD; each transaction gets a slightly different exact rate.
FX_TO_USD = {"EUR": Decimal("1.0842"), "GBP": Decimal("1.2705"), "JPY": Decimal("0.006372")}
CARD_TAGS = ("groceries", "dining", "travel", "fuel", "online", "subscription", "recurring", "gift")
VISIT_PURPOSES = (
    "cash deposit",
    "mortgage consultation",
    "open account",
    "replace card",
    "notary service",
    "safe deposit box",
    "update address",
    "wire transfer",
)
DISCLOSURES = (
    (
        "IMPORTANT INFORMATION ABOUT YOUR ACCOUNT. In case of errors or questions about your "
        "electronic transfers, call us at +1-312-555-0100 or write to Northwind Community Bank, "
        "Customer Care, 100 Lakeshore Drive, Chicago, IL 60601, as soon as you can if you think "
        "your statement or receipt is wrong or if you need more information about a transfer "
        "listed on the statement or receipt. We must hear from you no later than 60 days after "
        "we sent the FIRST statement on which the problem or error appeared."
    ),
    (
        "Tell us your name and account number. Describe the error or the transfer you are "
        "unsure about, and explain as clearly as you can why you believe it is an error or why "
        "you need more information. Tell us the dollar amount of the suspected error. We will "
        "investigate your complaint and will correct any error promptly. If we take more than "
        "10 business days to do this, we will credit your account for the amount you think is "
        "in error, so that you will have the use of the money during the time it takes us to "
        "complete our investigation."
    ),
    (
        "OVERDRAFT AND RETURNED ITEM FEES. Northwind does not charge overdraft fees on debit "
        "card purchases or ATM withdrawals. A returned item fee may apply to checks and "
        "pre-authorized payments presented against insufficient available funds. Available "
        "balance may differ from the ledger balance shown on this statement because of pending "
        "card authorizations and deposits on hold."
    ),
    (
        "FOREIGN TRANSACTIONS. Purchases made in a currency other than U.S. dollars are "
        "converted at the network rate in effect on the processing date, which may differ from "
        "the rate on the transaction date. The rate applied to each foreign transaction is "
        "shown next to it. Northwind does not add a foreign transaction fee for Everyday "
        "Checking and Northwind Rewards credit card accounts."
    ),
    (
        "PRIVACY. Federal law gives consumers the right to limit some but not all sharing of "
        "personal information. Our privacy notice explains how we collect, share, and protect "
        "your personal information, including your name, address, date of birth, and account "
        "history. You may opt out of marketing at any time in online banking under Settings > "
        "Communication preferences, or by calling us. Deposits are insured by the FDIC up to "
        "the maximum amount allowed by law."
    ),
)

SAMPLE_EPOCH = datetime(2024, 6, 30, 23, 0, tzinfo=timezone.utc)  # end of the loaded history
HISTORY_START = date(2024, 4, 1)  # first day of loaded transactions
