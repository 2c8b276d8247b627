"""The workload's plumbing: every write goes through write/insert, which count the rows they touch."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from lib.local import sample_db as db


def write(cur, tally: dict, action: str, table: str, query: str, params=()) -> int:
    """Run one UPDATE or DELETE on bank.<table>; count its rows under tally[action]."""
    cur.execute(query, params)
    tally[action][f"bank.{table}"] += cur.rowcount
    tally["statements"] += 1
    return cur.rowcount


def insert(cur, tally: dict, table: str, rows: list[dict], returning: str | None = None) -> list:
    """Multi-row INSERT into bank.<table>; count rows; return the RETURNING values."""
    if not rows:
        return []
    result = db.insert_rows(cur, table, rows, returning)
    tally["inserts"][f"bank.{table}"] += len(rows)
    tally["statements"] += 1
    return [r[0] for r in result]


def column(cur, query: str, params=()) -> list:
    """First column of an ordered SELECT (used to pick existing rows)."""
    cur.execute(query, params)
    return [r[0] for r in cur.fetchall()]


def pairs(cur, query: str, params=()) -> list[tuple]:
    """Rows of an ordered two-column SELECT."""
    cur.execute(query, params)
    return [tuple(r) for r in cur.fetchall()]


def change_balance(cur, tally, account_id: int, delta: Decimal, now: datetime) -> None:
    """Add delta to an account balance (an amount update)."""
    write(
        cur,
        tally,
        "updates",
        "accounts",
        "UPDATE bank.accounts SET balance = balance + %s, updated_at = %s WHERE account_id = %s",
        (delta, now, account_id),
    )
