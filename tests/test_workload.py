"""The workload commits what it reports, is reproducible from a seed, and validates its arguments."""

import math
import os
import subprocess
import sys
from pathlib import Path

import psycopg2
import pytest

from lib.local import sample_db, workload

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def conn(bank_conn):
    """A connection to a freshly created and loaded schema bank (dropped afterwards)."""
    _reset(bank_conn)
    return bank_conn


def _reset(conn):
    """Recreate schema bank with the same small starting data."""
    sample_db.create_schema(conn)
    sample_db.load(conn, customers=40, seed=7)


def _cli(*args):
    """Run the workload CLI in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "lib.local.workload", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_count_commits_that_many_and_counts_match_row_changes(conn, pg_admin_dsn):
    before = sample_db.row_counts(conn)
    result = workload.run(conn, rate=math.inf, count=300, seed=1)
    assert result["transactions"] == 300
    assert sum(result["operations"].values()) == 300
    other = psycopg2.connect(pg_admin_dsn)  # a second session sees only committed rows
    try:
        after = sample_db.row_counts(other)
    finally:
        other.close()
    for table in sample_db.tables():
        change = result["inserts"].get(table, 0) - result["deletes"].get(table, 0)
        assert after[table] - before[table] == change, table


def test_workload_exercises_every_kind_of_change(conn):
    result = workload.run(conn, rate=math.inf, count=400, seed=2)
    assert len(result["inserts"]) >= 6
    for table in (
        "bank.customers",
        "bank.addresses",
        "bank.accounts",
        "bank.transactions",
        "bank.statements",
        "bank.cards",
    ):
        assert result["updates"].get(table, 0) > 0, f"updates of {table}"
    for table in ("bank.customers", "bank.addresses", "bank.transactions", "bank.cards"):
        assert result["deletes"].get(table, 0) > 0, f"deletes from {table}"
    assert result["inserts"]["bank.account_holders"] > 0
    assert result["deletes"]["bank.account_holders"] > 0
    assert result["inserts"]["bank.branch_visits"] > 0
    assert "bank.branch_visits" not in result["updates"] and "bank.branch_visits" not in result["deletes"]
    assert result["statements"] > result["transactions"]
    assert result["operations"]["card_purchase"] > 0 and result["operations"]["close_customer"] > 0


def test_statement_views_keep_the_toasted_body(conn):
    query = (
        "SELECT statement_id, md5(body), view_count FROM bank.statements"
        " WHERE octet_length(body) > 2048 ORDER BY 1"
    )
    with conn.cursor() as cur:
        cur.execute(query)
        before = {r[0]: r[1:] for r in cur.fetchall()}
        workload.run(conn, rate=math.inf, count=300, seed=3)
        cur.execute(query)
        after = {r[0]: r[1:] for r in cur.fetchall()}
    conn.rollback()
    kept = before.keys() & after.keys()
    assert all(after[i][0] == before[i][0] for i in kept)
    assert any(after[i][1] > before[i][1] for i in kept), "some big statement was viewed"


def test_same_seed_same_contents_other_seed_differs(conn):
    workload.run(conn, rate=math.inf, count=150, seed=5)
    first = sample_db.digests(conn)
    _reset(conn)
    workload.run(conn, rate=math.inf, count=150, seed=5)
    assert sample_db.digests(conn) == first
    _reset(conn)
    workload.run(conn, rate=math.inf, count=150, seed=6)
    assert sample_db.digests(conn) != first


def test_rate_paces_transactions(conn):
    result = workload.run(conn, rate=20, count=11, seed=1)
    assert result["transactions"] == 11
    assert result["elapsed_s"] >= 0.5  # the 11th starts 10/20 s after the first
    result = workload.run(conn, rate=40, duration=0.5, seed=1)
    assert 1 <= result["transactions"] <= 21  # the rate caps it; how close it gets depends on the machine's load


def test_autocommit_connection_is_restored(conn):
    conn.autocommit = True
    result = workload.run(conn, rate=math.inf, count=5, seed=1)
    assert result["transactions"] == 5
    assert conn.autocommit is True


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rate": 10}, "duration"),
        ({"rate": 0, "count": 5}, "rate must be > 0"),
        ({"rate": -1, "duration": 1}, "rate must be > 0"),
        ({"rate": math.nan, "count": 5}, "rate must be > 0"),
        ({"rate": 10, "count": 0}, "count must be >= 1"),
        ({"rate": 10, "duration": 0}, "duration must be > 0"),
    ],
)
def test_run_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        workload.run(None, **kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "5"], "give a duration (seconds) or a count"),
        (["--rate", "0", "--count", "3"], "rate must be > 0"),
        (["--rate", "-2", "--duration", "1"], "rate must be > 0"),
        (["--count", "many"], "invalid int value"),
    ],
)
def test_cli_rejects_bad_arguments(args, message):
    done = _cli("--dsn", "host=/nonexistent", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "usage: python -m lib.local.workload" in done.stderr


def test_cli_runs_and_prints_one_line(conn, pg_admin_dsn):
    done = _cli("--dsn", pg_admin_dsn, "--rate", "200", "--count", "20", "--seed", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("workload: 20 transactions committed")


def test_cli_explains_missing_schema(pg_admin_dsn):
    admin = psycopg2.connect(pg_admin_dsn)
    try:
        with admin.cursor() as cur:
            cur.execute("DROP SCHEMA IF EXISTS bank CASCADE")
        admin.commit()
    finally:
        admin.close()
    done = _cli("--dsn", pg_admin_dsn, "--count", "1")
    assert done.returncode == 1
    assert "schema bank is missing" in done.stderr
