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

from lib.local import workload_customers, workload_payments, workload_sql

# Business transaction -> relative weight (how often it is picked).
OPERATIONS = {
    workload_payments.card_purchase: 28,
    workload_payments.transfer: 12,
    workload_customers.update_contact: 8,
    workload_customers.move_address: 6,
    workload_customers.new_customer: 6,
    workload_customers.add_joint_holder: 4,
    workload_customers.remove_joint_holder: 3,
    workload_payments.view_statement: 7,
    workload_payments.issue_statement: 3,
    workload_payments.settle_payment: 8,
    workload_payments.expire_authorization: 3,
    workload_customers.replace_card: 3,
    workload_payments.accrue_interest: 2,
    workload_customers.branch_visit: 5,
    workload_customers.close_customer: 2,
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
        "customers": workload_sql.column(cur, "SELECT customer_id FROM bank.customers ORDER BY 1"),
        "accounts": workload_sql.column(cur, "SELECT account_id FROM bank.accounts ORDER BY 1"),
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
