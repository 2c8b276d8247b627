"""Workload generator for the sample bank (schema ``bank``, see lib/local/sample_db.py).

Each iteration runs one *business transaction*: a few INSERT/UPDATE/DELETE
statements committed together (a card purchase, a transfer, a new customer,
closing a customer, ...; see OPERATIONS). Rate semantics: ``rate`` is the target
number of committed transactions per second. Transaction i is started no
earlier than ``i / rate`` seconds after the start; when the database is slower
than that, the generator runs flat out and does not skip (use
``rate=float("inf")`` to measure maximum throughput). The run stops after
``count`` transactions or ``duration`` seconds, whichever comes first.

Reproducible: the same seed on the same starting data gives the same sequence
of statements and the same final table contents (timestamps come from a
simulated clock, never from now()). The random stream is seeded with the seed
plus the starting data's latest booking time and transaction count, so running
the same seed again on data a previous run changed does not replay its UUIDs.
Customer and account ids are tracked in memory and other rows are found by
ordered queries, so a random pick never hits a deleted row; this assumes no
other writer deletes sample rows during the run.

CLI: python -m lib.local.workload --dsn "host=... dbname=..." --rate 50 --duration 10 --seed 1
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from . import sample_db as db

MIN_CUSTOMERS = 10  # close_customer turns into new_customer below this


# ---------------------------------------------------------------------------
# Plumbing: every write goes through _write/_insert, which count affected rows.


def _write(cur, tally: dict, action: str, table: str, query: str, params=()) -> int:
    """Run one UPDATE or DELETE on bank.<table>; count its rows under tally[action]."""
    cur.execute(query, params)
    tally[action][f"bank.{table}"] += cur.rowcount
    tally["statements"] += 1
    return cur.rowcount


def _insert(cur, tally: dict, table: str, rows: list[dict], returning: str | None = None) -> list:
    """Multi-row INSERT into bank.<table>; count rows; return the RETURNING values."""
    if not rows:
        return []
    result = db.insert_rows(cur, table, rows, returning)
    tally["inserts"][f"bank.{table}"] += len(rows)
    tally["statements"] += 1
    return [r[0] for r in result]


def _column(cur, query: str, params=()) -> list:
    """First column of an ordered SELECT (used to pick existing rows)."""
    cur.execute(query, params)
    return [r[0] for r in cur.fetchall()]


def _pairs(cur, query: str, params=()) -> list[tuple]:
    """Rows of an ordered two-column SELECT."""
    cur.execute(query, params)
    return [tuple(r) for r in cur.fetchall()]


def _change_balance(cur, tally, account_id: int, delta: Decimal, now: datetime) -> None:
    """Add delta to an account balance (an amount update)."""
    _write(
        cur,
        tally,
        "updates",
        "accounts",
        "UPDATE bank.accounts SET balance = balance + %s, updated_at = %s WHERE account_id = %s",
        (delta, now, account_id),
    )


# ---------------------------------------------------------------------------
# Business transactions. Each takes (cur, rng, ids, now, tally); ids holds the
# sorted lists ids["customers"] and ids["accounts"] of rows that exist.


def card_purchase(cur, rng, ids, now, tally):
    """1-4 card payments (one multi-row insert) on an account, then its balance update."""
    # an account without an active card (savings) pays a direct debit instead
    account_id = rng.choice(ids["accounts"])
    cards = _column(
        cur,
        "SELECT card_id FROM bank.cards WHERE account_id = %s AND is_active ORDER BY card_id",
        (account_id,),
    )
    if cards:
        rows = [
            db.card_payment(
                rng,
                account_id,
                rng.choice(cards),
                now + timedelta(seconds=i),
                "pending" if rng.random() < 0.4 else "posted",
            )
            for i in range(rng.randint(1, 4))
        ]
    else:
        payee, mcc = rng.choice(db.DIRECT_DEBITS)
        rows = [
            db.plain_transaction(
                rng,
                account_id,
                "direct_debit",
                -db.money(rng, 20, 300),
                now,
                f"Direct debit {payee}",
                merchant={"name": payee, "mcc": mcc},
            )
        ]
    _insert(cur, tally, "transactions", rows)
    _change_balance(cur, tally, account_id, sum((r["amount"] for r in rows), Decimal(0)), now)


def transfer(cur, rng, ids, now, tally):
    """Move money between two accounts: two transaction rows, two balance updates."""
    source, target = rng.sample(ids["accounts"], 2)
    numbers = dict(
        _pairs(
            cur,
            "SELECT account_id, account_number FROM bank.accounts WHERE account_id IN (%s, %s)",
            (source, target),
        )
    )
    amount = db.money(rng, 5, 1500)
    memo = rng.choice(("Rent", "Dinner", "Savings", "Gift", f"Invoice 2024-{rng.randint(1, 999):03d}"))
    _insert(
        cur,
        tally,
        "transactions",
        [
            db.plain_transaction(
                rng,
                source,
                "transfer_out",
                -amount,
                now,
                f"Transfer to {numbers[target]}: {memo}",
                counterparty=numbers[target],
            ),
            db.plain_transaction(
                rng,
                target,
                "transfer_in",
                amount,
                now,
                f"Transfer from {numbers[source]}: {memo}",
                counterparty=numbers[source],
            ),
        ],
    )
    _change_balance(cur, tally, source, -amount, now)
    _change_balance(cur, tally, target, amount, now)


def update_contact(cur, rng, ids, now, tally):
    """A customer changes email and/or phone (PII update; phone may become NULL)."""
    customer_id = rng.choice(ids["customers"])
    cur.execute(
        "SELECT first_name, last_name, email, phone FROM bank.customers WHERE customer_id = %s",
        (customer_id,),
    )
    first, last, email, phone = cur.fetchone()
    change = rng.choice(("email", "phone", "both"))
    if change in ("email", "both"):
        email = db.random_email(rng, first, last)
    if change in ("phone", "both"):
        phone = db.random_phone(rng) if rng.random() < 0.9 else None
    _write(
        cur,
        tally,
        "updates",
        "customers",
        "UPDATE bank.customers SET email = %s, phone = %s, updated_at = %s WHERE customer_id = %s",
        (email, phone, now, customer_id),
    )


def move_address(cur, rng, ids, now, tally):
    """A customer moves: home address updated in place; the mailing address may be added or dropped."""
    customer_id = rng.choice(ids["customers"])
    home = db.random_address(rng, "home")
    _write(
        cur,
        tally,
        "updates",
        "addresses",
        "UPDATE bank.addresses SET line1 = %s, line2 = %s, city = %s, region = %s, postal_code = %s,"
        " valid_from = %s, updated_at = %s WHERE customer_id = %s AND kind = 'home'",
        (
            home["line1"],
            home["line2"],
            home["city"],
            home["region"],
            home["postal_code"],
            now.date(),
            now,
            customer_id,
        ),
    )
    if rng.random() < 0.4:
        has_mailing = _column(
            cur,
            "SELECT address_id FROM bank.addresses WHERE customer_id = %s AND kind = 'mailing'",
            (customer_id,),
        )
        if has_mailing:
            _write(
                cur,
                tally,
                "deletes",
                "addresses",
                "DELETE FROM bank.addresses WHERE customer_id = %s AND kind = 'mailing'",
                (customer_id,),
            )
        else:
            mailing = {
                "customer_id": customer_id,
                **db.random_address(rng, "mailing"),
                "valid_from": now.date(),
                "updated_at": now,
            }
            _insert(cur, tally, "addresses", [mailing])


def new_customer(cur, rng, ids, now, tally):
    """Onboarding: customer, 1-2 addresses, checking account, holder, card and opening deposit."""
    person = db.random_person(rng, now)
    (customer_id,) = _insert(cur, tally, "customers", [person], returning="customer_id")
    kinds = ("home", "mailing") if rng.random() < 0.3 else ("home",)
    _insert(
        cur,
        tally,
        "addresses",
        [
            {
                "customer_id": customer_id,
                **db.random_address(rng, kind),
                "valid_from": now.date(),
                "updated_at": now,
            }
            for kind in kinds
        ],
    )
    deposit = db.money(rng, 50, 5000)
    account = {
        "account_number": f"NWB{rng.randint(10, 99)}-N{customer_id:07d}",
        "account_type": "checking",
        "status": "open",
        "currency": "USD",
        "balance": deposit,
        "credit_limit": None,
        "interest_rate": Decimal("0.0001"),
        "branch_code": person["home_branch"],
        "opened_on": now.date(),
        "closed_on": None,
        "updated_at": now,
    }
    (account_id,) = _insert(cur, tally, "accounts", [account], returning="account_id")
    _insert(
        cur,
        tally,
        "account_holders",
        [{"account_id": account_id, "customer_id": customer_id, "role": "primary", "added_on": now.date()}],
    )
    _insert(cur, tally, "cards", [db.random_card(rng, account_id, customer_id, now)])
    _insert(
        cur,
        tally,
        "transactions",
        [db.plain_transaction(rng, account_id, "deposit", deposit, now, "Opening deposit")],
    )
    ids["customers"].append(customer_id)
    ids["accounts"].append(account_id)


def add_joint_holder(cur, rng, ids, now, tally):
    """Another customer joins an account (composite-PK insert) and gets a card unless it is savings."""
    account_id = rng.choice(ids["accounts"])
    holders = set(
        _column(
            cur,
            "SELECT customer_id FROM bank.account_holders WHERE account_id = %s ORDER BY 1",
            (account_id,),
        )
    )
    candidates = [c for c in rng.sample(ids["customers"], min(5, len(ids["customers"]))) if c not in holders]
    if not candidates:
        return update_contact(cur, rng, ids, now, tally)
    customer_id = candidates[0]
    _insert(
        cur,
        tally,
        "account_holders",
        [
            {
                "account_id": account_id,
                "customer_id": customer_id,
                "role": rng.choice(("joint", "authorized_user")),
                "added_on": now.date(),
            }
        ],
    )
    cur.execute("SELECT account_type FROM bank.accounts WHERE account_id = %s", (account_id,))
    if cur.fetchone()[0] != "savings":
        _insert(cur, tally, "cards", [db.random_card(rng, account_id, customer_id, now)])


def remove_joint_holder(cur, rng, ids, now, tally):
    """A non-primary holder leaves an account: their cards go (history kept), then the holder row."""
    pairs = _pairs(
        cur,
        "SELECT account_id, customer_id FROM bank.account_holders"
        " WHERE role <> 'primary' ORDER BY account_id, customer_id",
    )
    if not pairs:
        return add_joint_holder(cur, rng, ids, now, tally)
    account_id, customer_id = rng.choice(pairs)
    _write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET card_id = NULL WHERE card_id IN"
        " (SELECT card_id FROM bank.cards WHERE account_id = %s AND customer_id = %s)",
        (account_id, customer_id),
    )
    _write(
        cur,
        tally,
        "deletes",
        "cards",
        "DELETE FROM bank.cards WHERE account_id = %s AND customer_id = %s",
        (account_id, customer_id),
    )
    _write(
        cur,
        tally,
        "deletes",
        "account_holders",
        "DELETE FROM bank.account_holders WHERE account_id = %s AND customer_id = %s",
        (account_id, customer_id),
    )


def view_statement(cur, rng, ids, now, tally):
    """A customer opens a statement: viewed_at/view_count change, the big TOASTed body does not."""
    if rng.random() < 0.6:  # prefer the long (out-of-line) bodies, the interesting CDC case
        query = "SELECT statement_id FROM bank.statements WHERE pg_column_size(body) > 2048 ORDER BY 1"
    else:
        query = "SELECT statement_id FROM bank.statements ORDER BY 1"
    statements = _column(cur, query)
    if not statements:
        return issue_statement(cur, rng, ids, now, tally)
    _write(
        cur,
        tally,
        "updates",
        "statements",
        "UPDATE bank.statements SET viewed_at = %s, view_count = view_count + 1,"
        " delivery = CASE WHEN delivery = 'post' THEN 'app' ELSE delivery END WHERE statement_id = %s",
        (now, rng.choice(statements)),
    )


def issue_statement(cur, rng, ids, now, tally):
    """The bank renders a statement of an account's latest transactions (often > 2 kB)."""
    account_id = rng.choice(ids["accounts"])
    cur.execute(
        "SELECT a.account_number, a.balance, c.first_name || ' ' || c.last_name, c.customer_id"
        " FROM bank.accounts a"
        " JOIN bank.account_holders h ON h.account_id = a.account_id AND h.role = 'primary'"
        " JOIN bank.customers c ON c.customer_id = h.customer_id"
        " WHERE a.account_id = %s",
        (account_id,),
    )
    number, balance, holder, customer_id = cur.fetchone()
    cur.execute(
        "SELECT line1, line2, city, region, postal_code FROM bank.addresses"
        " WHERE customer_id = %s AND kind = 'home'",
        (customer_id,),
    )
    address = dict(zip(("line1", "line2", "city", "region", "postal_code"), cur.fetchone(), strict=True))
    cur.execute(
        "SELECT (booked_at AT TIME ZONE 'UTC')::date, description, amount FROM bank.transactions"
        " WHERE account_id = %s ORDER BY booked_at DESC, transaction_id LIMIT 40",
        (account_id,),
    )
    lines = list(reversed(cur.fetchall()))
    opening = balance - sum((amount for _, _, amount in lines), Decimal(0))
    period = ((now - timedelta(days=30)).date(), now.date())
    body = db.render_statement(
        number, holder, address, period, opening, lines, disclosures=rng.random() < 0.5
    )
    _insert(
        cur,
        tally,
        "statements",
        [
            {
                "account_id": account_id,
                "period_start": period[0],
                "period_end": period[1],
                "opening_balance": opening,
                "closing_balance": balance,
                "body": body,
                "delivery": rng.choice(("email", "app", "post")),
                "viewed_at": None,
                "view_count": 0,
                "generated_at": now,
            }
        ],
    )


def settle_payment(cur, rng, ids, now, tally):
    """A pending card payment posts, sometimes with a tip: amount, status, tags and jsonb change."""
    pending = _pairs(
        cur,
        "SELECT transaction_id, account_id FROM bank.transactions WHERE status = 'pending'"
        " ORDER BY booked_at, transaction_id LIMIT 10",
    )
    if not pending:
        return card_purchase(cur, rng, ids, now, tally)
    transaction_id, account_id = rng.choice(pending)
    tip = db.money(rng, 1, 15) if rng.random() < 0.3 else Decimal("0.00")
    _write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET status = 'posted', amount = amount - %s,"
        " tags = array_append(tags, 'settled'),"
        " merchant = merchant || jsonb_build_object('tip', %s::numeric), value_date = %s"
        " WHERE transaction_id = %s",
        (tip, tip, now.date(), transaction_id),
    )
    if tip:
        _change_balance(cur, tally, account_id, -tip, now)


def expire_authorization(cur, rng, ids, now, tally):
    """The oldest pending card payment is never captured: delete it and give the money back."""
    cur.execute(
        "SELECT transaction_id, account_id, amount FROM bank.transactions WHERE status = 'pending'"
        " ORDER BY booked_at, transaction_id LIMIT 1"
    )
    row = cur.fetchone()
    if row is None:
        return card_purchase(cur, rng, ids, now, tally)
    transaction_id, account_id, amount = row
    _write(
        cur,
        tally,
        "deletes",
        "transactions",
        "DELETE FROM bank.transactions WHERE transaction_id = %s",
        (transaction_id,),
    )
    _change_balance(cur, tally, account_id, -amount, now)


def replace_card(cur, rng, ids, now, tally):
    """A card is reported lost: block it and issue a new one (new bytea chip token)."""
    account_id = rng.choice(ids["accounts"])
    cards = _pairs(
        cur,
        "SELECT card_id, customer_id FROM bank.cards WHERE account_id = %s AND is_active ORDER BY card_id",
        (account_id,),
    )
    if not cards:
        return card_purchase(cur, rng, ids, now, tally)
    card_id, customer_id = rng.choice(cards)
    _write(
        cur,
        tally,
        "updates",
        "cards",
        "UPDATE bank.cards SET is_active = false, blocked_reason = %s WHERE card_id = %s",
        (rng.choice(("lost", "stolen", "damaged", "suspected fraud")), card_id),
    )
    _insert(cur, tally, "cards", [db.random_card(rng, account_id, customer_id, now)])


def accrue_interest(cur, rng, ids, now, tally):
    """Monthly interest on a savings account: interest transaction plus balance update."""
    savings = _pairs(
        cur,
        "SELECT account_id, round(balance * interest_rate / 12, 2) FROM bank.accounts"
        " WHERE account_type = 'savings' AND balance > 0 ORDER BY account_id",
    )
    if not savings:
        return transfer(cur, rng, ids, now, tally)
    account_id, interest = rng.choice(savings)
    _insert(
        cur,
        tally,
        "transactions",
        [db.plain_transaction(rng, account_id, "interest", interest, now, "Monthly interest")],
    )
    _change_balance(cur, tally, account_id, interest, now)


def branch_visit(cur, rng, ids, now, tally):
    """1-3 visits appended to the log without primary key (insert only, see sample_bank.sql)."""
    branch = rng.choice(db.BRANCHES)[0]
    _insert(
        cur,
        tally,
        "branch_visits",
        [
            db.branch_visit(
                rng,
                branch,
                rng.choice(ids["customers"]) if rng.random() < 0.9 else None,
                now + timedelta(minutes=7 * i),
            )
            for i in range(rng.randint(1, 3))
        ],
    )


def close_customer(cur, rng, ids, now, tally):
    """A customer leaves: explicit deletes of every child row, children first (no ON DELETE CASCADE)."""
    # Accounts they are primary holder of go with their transactions, statements, cards and
    # holders; on other accounts only their own cards and holder rows go. branch_visits is kept.
    if len(ids["customers"]) <= MIN_CUSTOMERS:
        return new_customer(cur, rng, ids, now, tally)
    customer_id = rng.choice(ids["customers"])
    owned = _column(
        cur,
        "SELECT account_id FROM bank.account_holders WHERE customer_id = %s AND role = 'primary'"
        " ORDER BY account_id",
        (customer_id,),
    )
    _write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET card_id = NULL WHERE card_id IN (SELECT card_id FROM bank.cards"
        " WHERE customer_id = %s AND account_id <> ALL(%s))",
        (customer_id, owned),
    )
    _write(
        cur,
        tally,
        "deletes",
        "transactions",
        "DELETE FROM bank.transactions WHERE account_id = ANY(%s)",
        (owned,),
    )
    _write(
        cur,
        tally,
        "deletes",
        "statements",
        "DELETE FROM bank.statements WHERE account_id = ANY(%s)",
        (owned,),
    )
    _write(
        cur,
        tally,
        "deletes",
        "cards",
        "DELETE FROM bank.cards WHERE account_id = ANY(%s) OR customer_id = %s",
        (owned, customer_id),
    )
    _write(
        cur,
        tally,
        "deletes",
        "account_holders",
        "DELETE FROM bank.account_holders WHERE account_id = ANY(%s) OR customer_id = %s",
        (owned, customer_id),
    )
    _write(
        cur, tally, "deletes", "accounts", "DELETE FROM bank.accounts WHERE account_id = ANY(%s)", (owned,)
    )
    _write(
        cur,
        tally,
        "deletes",
        "addresses",
        "DELETE FROM bank.addresses WHERE customer_id = %s",
        (customer_id,),
    )
    _write(
        cur,
        tally,
        "deletes",
        "customers",
        "DELETE FROM bank.customers WHERE customer_id = %s",
        (customer_id,),
    )
    ids["customers"].remove(customer_id)
    for account_id in owned:
        ids["accounts"].remove(account_id)


# Business transaction -> relative weight (how often it is picked).
OPERATIONS = {
    card_purchase: 28,
    transfer: 12,
    update_contact: 8,
    move_address: 6,
    new_customer: 6,
    add_joint_holder: 4,
    remove_joint_holder: 3,
    view_statement: 7,
    issue_statement: 3,
    settle_payment: 8,
    expire_authorization: 3,
    replace_card: 3,
    accrue_interest: 2,
    branch_visit: 5,
    close_customer: 2,
}


# ---------------------------------------------------------------------------
# Driver


def check_args(rate: float, duration: float | None, count: int | None) -> str | None:
    """Why these run arguments are invalid, or None when they are fine."""
    if duration is None and count is None:
        return "give a duration (seconds) or a count (transactions), or both"
    if not rate > 0:  # also rejects NaN
        return f"rate must be > 0 transactions/s (got {rate})"
    if duration is not None and not duration > 0:
        return f"duration must be > 0 seconds (got {duration})"
    if count is not None and count < 1:
        return f"count must be >= 1 (got {count})"
    return None


def _start_state(cur) -> tuple[dict, datetime, int]:
    """Ids of existing customers/accounts, latest booking time (clock start) and transaction count."""
    cur.execute("SELECT to_regclass('bank.customers') IS NOT NULL")
    if not cur.fetchone()[0]:
        raise ValueError("schema bank is missing: run lib.local.sample_db.create_schema() and load() first")
    ids = {
        "customers": _column(cur, "SELECT customer_id FROM bank.customers ORDER BY 1"),
        "accounts": _column(cur, "SELECT account_id FROM bank.accounts ORDER BY 1"),
    }
    if len(ids["customers"]) < 2 or len(ids["accounts"]) < 2:
        raise ValueError("schema bank has no sample data: run lib.local.sample_db.load() first")
    cur.execute("SELECT max(booked_at), count(*) FROM bank.transactions")
    latest, n_transactions = cur.fetchone()
    return ids, (latest or datetime(2024, 7, 1, tzinfo=timezone.utc)).astimezone(timezone.utc), n_transactions


# run() returns: transactions (committed), statements (INSERT/UPDATE/DELETE statements run),
# inserts/updates/deletes ({"bank.<table>": rows affected}), operations ({name: times run}),
# elapsed_s, tx_per_s and seed. The connection should be idle; its autocommit setting is restored.
def run(conn, rate: float, duration: float | None = None, count: int | None = None, seed: int = 1) -> dict:
    """Run business transactions at `rate` tx/s until `count` tx or `duration` s; return what changed."""
    problem = check_args(rate, duration, count)
    if problem:
        raise ValueError(problem)
    tally = {"statements": 0, "inserts": Counter(), "updates": Counter(), "deletes": Counter()}
    operations = Counter()
    names, weights = list(OPERATIONS), list(OPERATIONS.values())
    was_autocommit = conn.autocommit
    if was_autocommit:
        conn.autocommit = False  # each business transaction is one explicit transaction
    done = 0
    try:
        with conn.cursor() as cur:
            ids, now, n_transactions = _start_state(cur)
            conn.commit()
            rng = random.Random(f"{seed}|{now.isoformat()}|{n_transactions}")
            start = time.monotonic()
            deadline = start + duration if duration is not None else math.inf
            while count is None or done < count:
                due = start + done / rate
                if due >= deadline:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                now += timedelta(seconds=rng.randint(1, 90), microseconds=rng.randint(0, 999999))
                operation = rng.choices(names, weights)[0]
                operation(cur, rng, ids, now, tally)
                conn.commit()
                operations[operation.__name__] += 1
                done += 1
                if time.monotonic() >= deadline:
                    break
            elapsed = time.monotonic() - start
    except BaseException:
        conn.rollback()
        raise
    finally:
        if was_autocommit:
            conn.autocommit = True
    return {
        "transactions": done,
        "statements": tally["statements"],
        "inserts": dict(sorted(tally["inserts"].items())),
        "updates": dict(sorted(tally["updates"].items())),
        "deletes": dict(sorted(tally["deletes"].items())),
        "operations": dict(sorted(operations.items())),
        "elapsed_s": round(elapsed, 3),
        "tx_per_s": round(done / elapsed, 1) if elapsed > 0 else 0.0,
        "seed": seed,
    }


def summary(result: dict) -> str:
    """One-line human summary of a run() result."""
    rows = {k: sum(result[k].values()) for k in ("inserts", "updates", "deletes")}
    return (
        f"workload: {result['transactions']} transactions committed in {result['elapsed_s']:.2f}s "
        f"({result['tx_per_s']} tx/s), {result['statements']} statements; rows inserted {rows['inserts']}, "
        f"updated {rows['updates']}, deleted {rows['deletes']}; seed {result['seed']}"
    )


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: parse arguments, connect, run, print a summary line."""
    parser = argparse.ArgumentParser(
        prog="python -m lib.local.workload",
        description="Run inserts/updates/deletes on schema bank (see lib/local/sample_db.py) at a target rate.",
    )
    parser.add_argument(
        "--dsn", default="", help="libpq connection string (default: PG* environment variables)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=10.0,
        help="target transactions per second; 'inf' = as fast as possible (default 10)",
    )
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--count", type=int, help="stop after this many transactions")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    args = parser.parse_args(argv)
    problem = check_args(args.rate, args.duration, args.count)
    if problem:
        parser.error(problem)

    import psycopg2

    try:
        conn = psycopg2.connect(args.dsn)
        try:
            result = run(conn, args.rate, args.duration, args.count, args.seed)
        finally:
            conn.close()
    except (psycopg2.Error, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {str(exc).strip()}\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
