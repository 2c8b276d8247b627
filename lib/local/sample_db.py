"""Sample CDC source database: a small retail bank in schema ``bank``.

``create_schema(conn)`` (re)creates the schema from ``sample_bank.sql``;
``load(conn, customers, seed)`` fills it with a reproducible data set: the same
seed always gives the same rows. All personal data is made up here (emails at
example.com/.net/.org, phones +1-AAA-555-01xx, national ids 9xx-xx-xxxx).
The small value generators below are shared with ``lib.local.workload``.
"""

from __future__ import annotations

import random
import unicodedata
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from psycopg2 import sql
from psycopg2.extras import Json, execute_values

DDL_PATH = Path(__file__).with_name("sample_bank.sql")
SCHEMA = "bank"

# Tables in insert order (parents first); delete in the reverse order.
TABLES = (
    "branches",
    "customers",
    "addresses",
    "accounts",
    "account_holders",
    "cards",
    "transactions",
    "statements",
    "branch_visits",
)

# Identity columns whose sequences load() moves past the explicit ids it inserts.
IDENTITY_COLUMNS = {
    "customers": "customer_id",
    "addresses": "address_id",
    "accounts": "account_id",
    "cards": "card_id",
    "statements": "statement_id",
}

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


def tables() -> list[str]:
    """Qualified names of the sample tables, parents first."""
    return [f"{SCHEMA}.{name}" for name in TABLES]


def create_schema(conn) -> None:
    """Drop schema bank (CASCADE) if it exists and create it from sample_bank.sql."""
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        cur.execute(DDL_PATH.read_text(encoding="utf-8"))
    conn.commit()


def insert_rows(cur, table: str, rows: list[dict], returning: str | None = None) -> list[tuple]:
    """INSERT dict rows into bank.<table> as one multi-row statement; return RETURNING rows."""
    if not rows:
        return []
    columns = list(rows[0])
    query = sql.SQL("INSERT INTO {} ({}) VALUES %s{}").format(
        sql.Identifier(SCHEMA, table),
        sql.SQL(", ").join(map(sql.Identifier, columns)),
        sql.SQL(" RETURNING {}").format(sql.Identifier(returning)) if returning else sql.SQL(""),
    )
    values = [tuple(row[c] for c in columns) for row in rows]
    return execute_values(cur, query, values, page_size=len(values), fetch=returning is not None) or []


def row_counts(conn) -> dict[str, int]:
    """Number of rows in each sample table."""
    counts = {}
    with conn.cursor() as cur:
        for name in TABLES:
            cur.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(SCHEMA, name)))
            counts[f"{SCHEMA}.{name}"] = cur.fetchone()[0]
    return counts


def digests(conn) -> dict[str, str]:
    """md5 of each sample table's rows (as text, sorted): equal digests = equal contents."""
    result = {}
    with conn.cursor() as cur:
        for name in TABLES:
            cur.execute(
                sql.SQL(
                    "SELECT md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '')) FROM {} t"
                ).format(sql.Identifier(SCHEMA, name))
            )
            result[f"{SCHEMA}.{name}"] = cur.fetchone()[0]
    return result


# ---------------------------------------------------------------------------
# Value generators (shared with lib.local.workload); each takes a random.Random.


def new_uuid(rng: random.Random) -> str:
    """A version-4 UUID string drawn from rng (reproducible, unlike uuid4())."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def money(rng: random.Random, low: float, high: float) -> Decimal:
    """A Decimal amount with 2 decimals between low and high."""
    return Decimal(rng.randint(int(low * 100), int(high * 100))).scaleb(-2)


def ascii_slug(text: str) -> str:
    """Lower-case ASCII form of a name for emails (Zoë -> zoe, O'Brien -> obrien)."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return "".join(ch for ch in plain.lower() if ch.isalnum())


def random_email(rng: random.Random, first: str, last: str) -> str:
    """An email address at one of the example.* domains."""
    style = rng.randrange(3)
    local = (
        f"{ascii_slug(first)}.{ascii_slug(last)}",
        f"{ascii_slug(first)[0]}{ascii_slug(last)}{rng.randint(1, 99)}",
        f"{ascii_slug(last)}.{ascii_slug(first)}{rng.randint(1970, 2005)}",
    )[style]
    return f"{local}@{rng.choice(EMAIL_DOMAINS)}"


def random_phone(rng: random.Random, area: str | None = None) -> str:
    """A fictional US phone number in the 555-01xx range."""
    area = area or rng.choice(CITIES)[3]
    return f"+1-{area}-555-01{rng.randint(0, 99):02d}"


def random_address(rng: random.Random, kind: str = "home") -> dict:
    """Address columns (line1, line2, city, region, postal_code, country) plus kind."""
    city, region, zip3, _area, _branch = rng.choice(CITIES)
    apartment = f"Apt {rng.randint(1, 40)}{rng.choice('ABCD')}"
    line2 = rng.choice((None, None, None, apartment, f"Unit {rng.randint(100, 999)}"))
    if kind == "mailing" and rng.random() < 0.5:
        return {
            "kind": kind,
            "line1": f"PO Box {rng.randint(100, 9999)}",
            "line2": None,
            "city": city,
            "region": region,
            "postal_code": f"{zip3}{rng.randint(0, 99):02d}",
            "country": "US",
        }
    return {
        "kind": kind,
        "line1": f"{rng.randint(10, 9899)} {rng.choice(STREETS)}",
        "line2": line2,
        "city": city,
        "region": region,
        "postal_code": f"{zip3}{rng.randint(0, 99):02d}",
        "country": "US",
    }


def random_person(rng: random.Random, created_at: datetime) -> dict:
    """Customer columns (without customer_id) for a new person."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    city = rng.choice(CITIES)
    born = date(1940, 1, 1) + timedelta(days=rng.randint(0, 65 * 365))
    return {
        "customer_uuid": new_uuid(rng),
        "first_name": first,
        "middle_name": rng.choice(MIDDLE_NAMES) if rng.random() < 0.3 else None,
        "last_name": last,
        "email": random_email(rng, first, last),
        "phone": random_phone(rng, city[3]) if rng.random() < 0.9 else None,
        "date_of_birth": born,
        "national_id": f"9{rng.randint(0, 99):02d}-{rng.randint(70, 99)}-{rng.randint(0, 9999):04d}"
        if rng.random() < 0.85
        else None,
        "kyc_status": rng.choices(("verified", "pending", "rejected"), (90, 8, 2))[0],
        "risk_score": Decimal(rng.randint(0, 9999)).scaleb(-2) if rng.random() < 0.8 else None,
        "preferences": Json(
            {
                "language": rng.choice(("en", "en", "en", "es", "pl", "de")),
                "paperless": rng.random() < 0.7,
                "alerts": {
                    "low_balance": rng.choice((None, 50, 100, 250)),
                    "large_purchase": rng.random() < 0.5,
                },
            }
        ),
        "marketing_opt_in": rng.random() < 0.35,
        "home_branch": city[4],
        "created_at": created_at,
        "updated_at": created_at,
    }


def random_card(rng: random.Random, account_id: int, customer_id: int, issued_at: datetime) -> dict:
    """Card columns (without card_id) for a new card of an account holder."""
    return {
        "account_id": account_id,
        "customer_id": customer_id,
        "network": rng.choice(("visa", "mastercard")),
        "pan_last4": f"{rng.randint(0, 9999):04d}",
        "expires_on": date(issued_at.year + 4, issued_at.month, 1),
        "chip_token": rng.randbytes(rng.choice((16, 24, 32))),
        "daily_limit": Decimal(rng.choice((500, 1000, 1500, 2500, 5000))),
        "is_active": True,
        "blocked_reason": None,
        "issued_at": issued_at,
    }


def account_number(rng: random.Random, account_id: int) -> str:
    """A bank-style account number, unique through the account id."""
    return f"NWB{rng.randint(10, 99)}-{account_id:08d}"


def card_payment(
    rng: random.Random, account_id: int, card_id: int | None, booked_at: datetime, status: str
) -> dict:
    """Transaction columns for a card purchase, possibly in a foreign currency."""
    name, mcc, city, country, currency, offset = rng.choice(MERCHANTS)
    paid = money(rng, 2, 180)
    fx_rate = None
    amount = -paid
    if currency != "USD":
        # exact rate with 18 decimals: more precision than a double can hold
        fx_rate = FX_TO_USD[currency] * (1 + Decimal(rng.randint(-20000, 20000)).scaleb(-6))
        fx_rate = fx_rate.quantize(Decimal(1).scaleb(-18))
        if currency == "JPY":
            paid = Decimal(rng.randint(500, 25000))
        amount = -(paid * fx_rate).quantize(Decimal("0.01"))
    tags = sorted(rng.sample(CARD_TAGS, rng.randint(0, 2)))
    return {
        "transaction_id": new_uuid(rng),
        "account_id": account_id,
        "card_id": card_id,
        "kind": "card",
        "status": status,
        "amount": amount,
        "currency": currency,
        "fx_rate": fx_rate,
        "description": f"Card payment {name}",
        "merchant": Json({"name": name, "mcc": mcc, "city": city, "country": country}),
        "tags": tags,
        "counterparty": None,
        "booked_at": booked_at,
        "local_time": (booked_at + timedelta(hours=offset)).replace(tzinfo=None),
        "value_date": booked_at.date(),
    }


def plain_transaction(
    rng: random.Random,
    account_id: int,
    kind: str,
    amount: Decimal,
    booked_at: datetime,
    description: str,
    counterparty: str | None = None,
    merchant: dict | None = None,
) -> dict:
    """Transaction columns for a non-card booking (deposit, transfer, direct debit, interest)."""
    return {
        "transaction_id": new_uuid(rng),
        "account_id": account_id,
        "card_id": None,
        "kind": kind,
        "status": "posted",
        "amount": amount,
        "currency": "USD",
        "fx_rate": None,
        "description": description,
        "merchant": Json(merchant) if merchant else None,
        "tags": ["recurring"] if kind in ("direct_debit", "interest") else [],
        "counterparty": counterparty,
        "booked_at": booked_at,
        "local_time": None,
        "value_date": (booked_at + timedelta(days=1 if kind.startswith("transfer") else 0)).date(),
    }


def render_statement(
    account_no: str,
    holder: str,
    address: dict,
    period: tuple[date, date],
    opening: Decimal,
    lines: list[tuple[date, str, Decimal]],
    disclosures: bool,
) -> str:
    """The text of a monthly statement; with disclosures it is well over 2 kB."""
    addr = [
        address["line1"],
        address["line2"],
        f"{address['city']}, {address['region']} {address['postal_code']}",
    ]
    out = [
        f"{BANK_NAME.upper()} - ACCOUNT STATEMENT",
        f"Account {account_no}    Period {period[0]:%Y-%m-%d} to {period[1]:%Y-%m-%d}",
        "",
        holder,
        *[a for a in addr if a],
        "",
        f"Opening balance {opening:>14,.2f} USD",
        "",
        f"{'Date':<12}{'Description':<48}{'Amount':>12}",
    ]
    balance = opening
    for day, text, amount in lines:
        balance += amount
        out.append(f"{day:%Y-%m-%d}  {text[:46]:<48}{amount:>12,.2f}")
    out += ["", f"Closing balance {balance:>14,.2f} USD", f"{len(lines)} transactions this period."]
    if disclosures:
        out += ["", *DISCLOSURES]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------
# Initial data set: rows are built in Python with explicit ids, then inserted.

LOAD_PERIOD = (date(2024, 6, 1), date(2024, 6, 30))  # the statement month
ACCOUNTS_BEFORE = datetime(2024, 3, 31, tzinfo=timezone.utc)  # accounts are opened before this


def _history_time(rng: random.Random, start: date, end: datetime) -> datetime:
    """A random UTC timestamp between start (a date) and end."""
    begin = datetime(start.year, start.month, start.day, tzinfo=timezone.utc)
    return begin + timedelta(seconds=rng.randint(0, int((end - begin).total_seconds())))


def branch_visit(rng: random.Random, branch_code: str, customer_id: int | None, when: datetime) -> dict:
    """A branch_visits row; visited_at is the branch's local wall-clock time."""
    purpose = rng.choice(VISIT_PURPOSES)
    return {
        "visited_at": (when - timedelta(hours=5)).replace(tzinfo=None, microsecond=0),
        "branch_code": branch_code,
        "customer_id": customer_id,
        "purpose": purpose,
        "teller": rng.choice((None, "T. Olsen", "M. Garcia", "K. Tanaka", "D. Okafor", "R. Murphy")),
        "notes": f"Customer asked about {purpose}." if rng.random() < 0.4 else None,
    }


def _add_customer(rng: random.Random, rows: dict, customer_id: int) -> None:
    """Append one customer with a home (and sometimes a mailing) address."""
    created = _history_time(rng, date(2012, 1, 1), ACCOUNTS_BEFORE)
    person = {"customer_id": customer_id, **random_person(rng, created)}
    person["updated_at"] = min(created + timedelta(days=rng.randint(0, 900)), SAMPLE_EPOCH)
    rows["customers"].append(person)
    for kind in ("home", "mailing") if rng.random() < 0.3 else ("home",):
        rows["addresses"].append(
            {
                "address_id": len(rows["addresses"]) + 1,
                "customer_id": customer_id,
                **random_address(rng, kind),
                "valid_from": created.date(),
                "updated_at": person["updated_at"],
            }
        )


def _new_account(rng: random.Random, account_id: int, account_type: str, owner: dict) -> dict:
    """Account columns; the balance is filled in once its history exists."""
    if account_type == "savings":
        rate = Decimal(rng.randint(250, 475)).scaleb(-4)
    elif account_type == "credit_card":
        rate = Decimal(rng.randint(1899, 2999)).scaleb(-4)
    else:
        rate = Decimal("0.0001")
    opened = _history_time(rng, owner["created_at"].date(), ACCOUNTS_BEFORE)
    return {
        "account_id": account_id,
        "account_number": account_number(rng, account_id),
        "account_type": account_type,
        "status": "open",
        "currency": "USD",
        "balance": Decimal(0),
        "credit_limit": Decimal(rng.choice((2000, 5000, 10000))) if account_type == "credit_card" else None,
        "interest_rate": rate,
        "branch_code": owner["home_branch"],
        "opened_on": opened.date(),
        "closed_on": None,
        "updated_at": SAMPLE_EPOCH,
    }


def _account_history(rng: random.Random, account: dict, cards: list[int]) -> list[dict]:
    """Three months of transactions for one account."""
    account_id, account_type = account["account_id"], account["account_type"]
    start = max(HISTORY_START, account["opened_on"])
    txns = []
    if account_type in ("checking", "credit_card"):
        for _ in range(rng.randint(4, 14)):
            booked = _history_time(rng, start, SAMPLE_EPOCH)
            status = "pending" if booked > SAMPLE_EPOCH - timedelta(days=2) else "posted"
            txns.append(card_payment(rng, account_id, rng.choice(cards), booked, status))
    for month in (4, 5, 6):
        first = datetime(2024, month, 1, 8, 0, tzinfo=timezone.utc)
        if first.date() < start:
            continue
        if account_type == "checking":
            employer = rng.choice(EMPLOYERS)
            txns.append(
                plain_transaction(
                    rng,
                    account_id,
                    "deposit",
                    money(rng, 1200, 4800),
                    first + timedelta(days=14),
                    f"Payroll {employer}",
                )
            )
            payee, mcc = rng.choice(DIRECT_DEBITS)
            txns.append(
                plain_transaction(
                    rng,
                    account_id,
                    "direct_debit",
                    -money(rng, 40, 260),
                    first + timedelta(days=rng.randint(0, 27)),
                    f"Direct debit {payee}",
                    merchant={"name": payee, "mcc": mcc},
                )
            )
        elif account_type == "savings":
            txns.append(
                plain_transaction(
                    rng,
                    account_id,
                    "interest",
                    money(rng, 1, 120),
                    first + timedelta(days=27),
                    "Monthly interest",
                )
            )
    return txns


def _june_statement(
    rng: random.Random, statement_id: int, account: dict, owner: dict, home: dict, txns: list[dict]
) -> dict:
    """The June 2024 statement of an account; every sixth one carries the long disclosures."""
    june = sorted(
        (t["booked_at"], t["description"], t["amount"])
        for t in txns
        if t["booked_at"].date() >= LOAD_PERIOD[0]
    )
    opening = account["balance"] - sum((amount for _, _, amount in june), Decimal(0))
    body = render_statement(
        account["account_number"],
        f"{owner['first_name']} {owner['last_name']}",
        home,
        LOAD_PERIOD,
        opening,
        [(b.date(), d, a) for b, d, a in june],
        disclosures=statement_id % 6 == 1,
    )
    viewed = rng.random() < 0.3
    return {
        "statement_id": statement_id,
        "account_id": account["account_id"],
        "period_start": LOAD_PERIOD[0],
        "period_end": LOAD_PERIOD[1],
        "opening_balance": opening,
        "closing_balance": account["balance"],
        "body": body,
        "delivery": rng.choice(("email", "email", "app", "post")),
        "viewed_at": SAMPLE_EPOCH - timedelta(minutes=rng.randint(1, 600)) if viewed else None,
        "view_count": 1 if viewed else 0,
        "generated_at": datetime(2024, 6, 30, 6, 0, tzinfo=timezone.utc),
    }


def _add_accounts(rng: random.Random, rows: dict, owner: dict, n_customers: int) -> None:
    """Append an owner's accounts (checking, maybe savings/credit) with holders, cards, history, statement."""
    types = ["checking"]
    if rng.random() < 0.5:
        types.append("savings")
    if rng.random() < 0.15:
        types.append("credit_card")
    home = next(
        a for a in rows["addresses"] if a["customer_id"] == owner["customer_id"] and a["kind"] == "home"
    )
    for account_type in types:
        account = _new_account(rng, len(rows["accounts"]) + 1, account_type, owner)
        rows["accounts"].append(account)
        holders = [(owner["customer_id"], "primary")]
        other = rng.randint(1, n_customers)
        if account_type == "checking" and rng.random() < 0.12 and other != owner["customer_id"]:
            holders.append((other, rng.choice(("joint", "authorized_user"))))
        cards = []
        for customer_id, role in holders:
            rows["account_holders"].append(
                {
                    "account_id": account["account_id"],
                    "customer_id": customer_id,
                    "role": role,
                    "added_on": account["opened_on"],
                }
            )
            if account_type != "savings":
                issued = datetime.combine(account["opened_on"], datetime.min.time(), timezone.utc)
                card = {
                    "card_id": len(rows["cards"]) + 1,
                    **random_card(rng, account["account_id"], customer_id, issued),
                }
                rows["cards"].append(card)
                cards.append(card["card_id"])
        txns = _account_history(rng, account, cards)
        rows["transactions"] += txns
        if account_type == "credit_card":
            opening = Decimal("0.00")
        else:
            opening = money(rng, 200, 6000) if account_type == "checking" else money(rng, 1000, 40000)
        account["balance"] = opening + sum((t["amount"] for t in txns), Decimal(0))
        rows["statements"].append(
            _june_statement(rng, len(rows["statements"]) + 1, account, owner, home, txns)
        )


def _generate(rng: random.Random, n_customers: int) -> dict[str, list[dict]]:
    """All rows of the initial data set, keyed by table, with explicit ids."""
    rows: dict[str, list[dict]] = {name: [] for name in TABLES}
    columns = ("branch_code", "name", "city", "region", "phone", "opened_on")
    rows["branches"] = [dict(zip(columns, branch, strict=True)) for branch in BRANCHES]
    for customer_id in range(1, n_customers + 1):
        _add_customer(rng, rows, customer_id)
    for owner in rows["customers"]:
        _add_accounts(rng, rows, owner, n_customers)
    for _ in range(n_customers * 6 // 10):
        branch = rng.choice(BRANCHES)[0]
        customer_id = rng.randint(1, n_customers) if rng.random() < 0.9 else None
        when = _history_time(rng, HISTORY_START, SAMPLE_EPOCH)
        rows["branch_visits"].append(branch_visit(rng, branch, customer_id, when))
    return rows


def load(conn, customers: int = 200, seed: int = 7) -> dict[str, int]:
    """Insert the reproducible initial data set into a fresh schema; return row counts per table."""
    rows = _generate(random.Random(seed), customers)
    with conn.cursor() as cur:
        for name in TABLES:
            for start in range(0, len(rows[name]), 1000):
                insert_rows(cur, name, rows[name][start : start + 1000])
        for name, column in IDENTITY_COLUMNS.items():
            # next identity value = max(id) + 1
            query = sql.SQL(
                "SELECT setval(pg_get_serial_sequence(%s, %s), coalesce(max({}), 0) + 1, false) FROM {}"
            ).format(sql.Identifier(column), sql.Identifier(SCHEMA, name))
            cur.execute(query, (f"{SCHEMA}.{name}", column))
    conn.commit()
    return {f"{SCHEMA}.{name}": len(rows[name]) for name in TABLES}
