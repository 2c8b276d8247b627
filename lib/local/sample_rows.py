"""Row generators of the sample bank, shared by the loader (sample_db.load) and the workload: people, addresses,
cards, card payments, transactions, statements and branch visits, all from a seeded random.Random."""

from __future__ import annotations

import random
import unicodedata
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

from psycopg2.extras import Json

from lib.local import sample_data


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
    return f"{local}@{rng.choice(sample_data.EMAIL_DOMAINS)}"


def random_phone(rng: random.Random, area: str | None = None) -> str:
    """A fictional US phone number in the 555-01xx range."""
    area = area or rng.choice(sample_data.CITIES)[3]
    return f"+1-{area}-555-01{rng.randint(0, 99):02d}"


def random_address(rng: random.Random, kind: str = "home") -> dict:
    """Address columns (line1, line2, city, region, postal_code, country) plus kind."""
    city, region, zip3, _area, _branch = rng.choice(sample_data.CITIES)
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
        "line1": f"{rng.randint(10, 9899)} {rng.choice(sample_data.STREETS)}",
        "line2": line2,
        "city": city,
        "region": region,
        "postal_code": f"{zip3}{rng.randint(0, 99):02d}",
        "country": "US",
    }


def random_person(rng: random.Random, created_at: datetime) -> dict:
    """Customer columns (without customer_id) for a new person."""
    first, last = rng.choice(sample_data.FIRST_NAMES), rng.choice(sample_data.LAST_NAMES)
    city = rng.choice(sample_data.CITIES)
    born = date(1940, 1, 1) + timedelta(days=rng.randint(0, 65 * 365))
    return {
        "customer_uuid": new_uuid(rng),
        "first_name": first,
        "middle_name": rng.choice(sample_data.MIDDLE_NAMES) if rng.random() < 0.3 else None,
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
    name, mcc, city, country, currency, offset = rng.choice(sample_data.MERCHANTS)
    paid = money(rng, 2, 180)
    fx_rate = None
    amount = -paid
    if currency != "USD":
        # exact rate with 18 decimals: more precision than a double can hold
        fx_rate = sample_data.FX_TO_USD[currency] * (1 + Decimal(rng.randint(-20000, 20000)).scaleb(-6))
        fx_rate = fx_rate.quantize(Decimal(1).scaleb(-18))
        if currency == "JPY":
            paid = Decimal(rng.randint(500, 25000))
        amount = -(paid * fx_rate).quantize(Decimal("0.01"))
    tags = sorted(rng.sample(sample_data.CARD_TAGS, rng.randint(0, 2)))
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
        f"{sample_data.BANK_NAME.upper()} - ACCOUNT STATEMENT",
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
        out += ["", *sample_data.DISCLOSURES]
    return "\n".join(out) + "\n"


def branch_visit(rng: random.Random, branch_code: str, customer_id: int | None, when: datetime) -> dict:
    """A branch_visits row; visited_at is the branch's local wall-clock time."""
    purpose = rng.choice(sample_data.VISIT_PURPOSES)
    return {
        "visited_at": (when - timedelta(hours=5)).replace(tzinfo=None, microsecond=0),
        "branch_code": branch_code,
        "customer_id": customer_id,
        "purpose": purpose,
        "teller": rng.choice((None, "T. Olsen", "M. Garcia", "K. Tanaka", "D. Okafor", "R. Murphy")),
        "notes": f"Customer asked about {purpose}." if rng.random() < 0.4 else None,
    }


def _history_time(rng: random.Random, start: date, end: datetime) -> datetime:
    """A random UTC timestamp between start (a date) and end."""
    begin = datetime(start.year, start.month, start.day, tzinfo=timezone.utc)
    return begin + timedelta(seconds=rng.randint(0, int((end - begin).total_seconds())))
