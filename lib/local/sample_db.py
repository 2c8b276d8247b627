"""Sample CDC source database: a small retail bank in schema ``bank``.

``create_schema(conn)`` (re)creates the schema from ``sample_bank.sql``;
``load(conn, customers, seed)`` fills it with a reproducible data set: the same
seed always gives the same rows. All personal data is made up here (emails at
example.com/.net/.org, phones +1-AAA-555-01xx, national ids 9xx-xx-xxxx).
The row generators (lib/local/sample_rows.py) are shared with ``lib.local.workload``.
"""

from __future__ import annotations

import random
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from psycopg2 import sql
from psycopg2.extras import execute_values

from lib.local import sample_data, sample_rows
from lib.operate.examples import SAMPLE_MARK

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


def tables() -> list[str]:
    """Qualified names of the sample tables, parents first."""
    return [f"{SCHEMA}.{name}" for name in TABLES]


def create_schema(conn) -> None:
    """Drop schema bank (CASCADE) if it exists and create it from sample_bank.sql."""
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        cur.execute(DDL_PATH.read_text(encoding="utf-8"))
    mark(conn)


def mark(conn) -> None:
    """Mark schema bank as the local sample: the only place the notebooks write demo rows (lib/operate/examples.py)."""
    with conn.cursor() as cur:
        cur.execute(sql.SQL("COMMENT ON SCHEMA {} IS %s").format(sql.Identifier(SCHEMA)), (SAMPLE_MARK,))
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


# ---------------------------------------------------------------------------
# Initial data set: rows are built in Python with explicit ids, then inserted.

LOAD_PERIOD = (date(2024, 6, 1), date(2024, 6, 30))  # the statement month
ACCOUNTS_BEFORE = datetime(2024, 3, 31, tzinfo=timezone.utc)  # accounts are opened before this


def _add_customer(rng: random.Random, rows: dict, customer_id: int) -> None:
    """Append one customer with a home (and sometimes a mailing) address."""
    created = sample_rows._history_time(rng, date(2012, 1, 1), ACCOUNTS_BEFORE)
    person = {"customer_id": customer_id, **sample_rows.random_person(rng, created)}
    person["updated_at"] = min(created + timedelta(days=rng.randint(0, 900)), sample_data.SAMPLE_EPOCH)
    rows["customers"].append(person)
    for kind in ("home", "mailing") if rng.random() < 0.3 else ("home",):
        rows["addresses"].append(
            {
                "address_id": len(rows["addresses"]) + 1,
                "customer_id": customer_id,
                **sample_rows.random_address(rng, kind),
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
    opened = sample_rows._history_time(rng, owner["created_at"].date(), ACCOUNTS_BEFORE)
    return {
        "account_id": account_id,
        "account_number": sample_rows.account_number(rng, account_id),
        "account_type": account_type,
        "status": "open",
        "currency": "USD",
        "balance": Decimal(0),
        "credit_limit": Decimal(rng.choice((2000, 5000, 10000))) if account_type == "credit_card" else None,
        "interest_rate": rate,
        "branch_code": owner["home_branch"],
        "opened_on": opened.date(),
        "closed_on": None,
        "updated_at": sample_data.SAMPLE_EPOCH,
    }


def _account_history(rng: random.Random, account: dict, cards: list[int]) -> list[dict]:
    """Three months of transactions for one account."""
    account_id, account_type = account["account_id"], account["account_type"]
    start = max(sample_data.HISTORY_START, account["opened_on"])
    txns = []
    if account_type in ("checking", "credit_card"):
        for _ in range(rng.randint(4, 14)):
            booked = sample_rows._history_time(rng, start, sample_data.SAMPLE_EPOCH)
            status = "pending" if booked > sample_data.SAMPLE_EPOCH - timedelta(days=2) else "posted"
            txns.append(sample_rows.card_payment(rng, account_id, rng.choice(cards), booked, status))
    for month in (4, 5, 6):
        first = datetime(2024, month, 1, 8, 0, tzinfo=timezone.utc)
        if first.date() < start:
            continue
        if account_type == "checking":
            employer = rng.choice(sample_data.EMPLOYERS)
            txns.append(
                sample_rows.plain_transaction(
                    rng,
                    account_id,
                    "deposit",
                    sample_rows.money(rng, 1200, 4800),
                    first + timedelta(days=14),
                    f"Payroll {employer}",
                )
            )
            payee, mcc = rng.choice(sample_data.DIRECT_DEBITS)
            txns.append(
                sample_rows.plain_transaction(
                    rng,
                    account_id,
                    "direct_debit",
                    -sample_rows.money(rng, 40, 260),
                    first + timedelta(days=rng.randint(0, 27)),
                    f"Direct debit {payee}",
                    merchant={"name": payee, "mcc": mcc},
                )
            )
        elif account_type == "savings":
            txns.append(
                sample_rows.plain_transaction(
                    rng,
                    account_id,
                    "interest",
                    sample_rows.money(rng, 1, 120),
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
    body = sample_rows.render_statement(
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
        "viewed_at": sample_data.SAMPLE_EPOCH - timedelta(minutes=rng.randint(1, 600)) if viewed else None,
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
                    **sample_rows.random_card(rng, account["account_id"], customer_id, issued),
                }
                rows["cards"].append(card)
                cards.append(card["card_id"])
        txns = _account_history(rng, account, cards)
        rows["transactions"] += txns
        if account_type == "credit_card":
            opening = Decimal("0.00")
        else:
            low, high = (200, 6000) if account_type == "checking" else (1000, 40000)
            opening = sample_rows.money(rng, low, high)
        account["balance"] = opening + sum((t["amount"] for t in txns), Decimal(0))
        rows["statements"].append(
            _june_statement(rng, len(rows["statements"]) + 1, account, owner, home, txns)
        )


def _generate(rng: random.Random, n_customers: int) -> dict[str, list[dict]]:
    """All rows of the initial data set, keyed by table, with explicit ids."""
    rows: dict[str, list[dict]] = {name: [] for name in TABLES}
    columns = ("branch_code", "name", "city", "region", "phone", "opened_on")
    rows["branches"] = [dict(zip(columns, branch, strict=True)) for branch in sample_data.BRANCHES]
    for customer_id in range(1, n_customers + 1):
        _add_customer(rng, rows, customer_id)
    for owner in rows["customers"]:
        _add_accounts(rng, rows, owner, n_customers)
    for _ in range(n_customers * 6 // 10):
        branch = rng.choice(sample_data.BRANCHES)[0]
        customer_id = rng.randint(1, n_customers) if rng.random() < 0.9 else None
        when = sample_rows._history_time(rng, sample_data.HISTORY_START, sample_data.SAMPLE_EPOCH)
        rows["branch_visits"].append(sample_rows.branch_visit(rng, branch, customer_id, when))
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
