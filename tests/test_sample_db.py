"""The sample bank schema has every type the pipeline must carry, and load() is reproducible."""

import pytest

from lib.local import sample_db


@pytest.fixture
def conn(bank_conn):
    """A connection with a freshly created schema bank (dropped afterwards)."""
    return bank_conn


@pytest.fixture
def loaded(conn):
    """Row counts returned by load(customers=60, seed=7) into the fresh schema."""
    return sample_db.load(conn, customers=60, seed=7)


def _query(conn, query, params=()):
    """All rows of a query."""
    with conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


def test_tables_match_schema(conn, loaded):
    rows = _query(
        conn,
        "SELECT table_schema || '.' || table_name FROM information_schema.tables"
        " WHERE table_schema = 'bank' AND table_type = 'BASE TABLE'",
    )
    assert sorted(r[0] for r in rows) == sorted(sample_db.tables())


def test_schema_has_every_required_type(conn, loaded):
    rows = _query(
        conn,
        """
        SELECT c.table_name, c.column_name, c.data_type, c.udt_name, c.numeric_precision, t.typtype
        FROM information_schema.columns c
        JOIN pg_type t ON t.typname = c.udt_name
        JOIN pg_namespace n ON n.oid = t.typnamespace AND n.nspname = c.udt_schema
        WHERE c.table_schema = 'bank'""",
    )
    types = {r[2] for r in rows}
    for expected in (
        "numeric",
        "timestamp with time zone",
        "timestamp without time zone",
        "date",
        "boolean",
        "uuid",
        "jsonb",
        "bytea",
        "text",
    ):
        assert expected in types, expected
    assert any(r[2] == "numeric" and r[4] is not None for r in rows), "numeric(p,s) column"
    assert any(r[2] == "numeric" and r[4] is None for r in rows), "unconstrained numeric column"
    assert any(r[2] == "ARRAY" and r[3] == "_text" for r in rows), "text[] column"
    assert any(r[2] == "USER-DEFINED" and r[5] == "e" for r in rows), "enum column"
    nullable = _query(
        conn,
        "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'bank' AND is_nullable = 'YES'",
    )
    assert nullable[0][0] >= 5


def test_primary_keys_composite_and_exactly_one_table_without(conn, loaded):
    rows = _query(
        conn,
        """
        SELECT c.relname, (SELECT array_length(k.conkey, 1) FROM pg_constraint k
                           WHERE k.conrelid = c.oid AND k.contype = 'p')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'bank' AND c.relkind = 'r'""",
    )
    keys = dict(rows)
    assert [name for name, width in keys.items() if width is None] == ["branch_visits"]
    assert keys["account_holders"] == 2
    fks = _query(
        conn,
        "SELECT count(*) FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
        " WHERE n.nspname = 'bank' AND c.contype = 'f'",
    )
    assert fks[0][0] >= 8


def test_statements_have_toasted_bodies(conn, loaded):
    ((longest, big),) = _query(
        conn,
        "SELECT max(octet_length(body)), count(*) FILTER"
        " (WHERE octet_length(body) > 2048) FROM bank.statements",
    )
    assert longest > 2048 and big >= 3
    ((toast_bytes,),) = _query(
        conn,
        "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'bank.statements'::regclass",
    )
    assert toast_bytes > 0, "long statement bodies are stored out of line"


def test_load_counts_match_tables_and_data_looks_real(conn, loaded):
    assert loaded == sample_db.row_counts(conn)
    assert loaded["bank.customers"] == 60
    for table, count in loaded.items():
        assert count > 0, table
    ((bad_emails,),) = _query(
        conn, "SELECT count(*) FROM bank.customers WHERE email !~ '@example\\.(com|net|org)$'"
    )
    assert bad_emails == 0
    ((orphans,),) = _query(
        conn,
        "SELECT count(*) FROM bank.customers c WHERE NOT EXISTS"
        " (SELECT 1 FROM bank.addresses a WHERE a.customer_id = c.customer_id)",
    )
    assert orphans == 0
    ((foreign,),) = _query(conn, "SELECT count(*) FROM bank.transactions WHERE fx_rate IS NOT NULL")
    assert foreign > 0


def test_load_is_reproducible(conn, loaded):
    first = sample_db.digests(conn)
    sample_db.create_schema(conn)
    sample_db.load(conn, customers=60, seed=7)
    assert sample_db.digests(conn) == first
    sample_db.create_schema(conn)
    sample_db.load(conn, customers=60, seed=8)
    other = sample_db.digests(conn)
    assert other["bank.customers"] != first["bank.customers"]
    assert other["bank.branches"] == first["bank.branches"]


def test_identity_sequences_continue_after_load(conn, loaded):
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO bank.statements (account_id, period_start, period_end, opening_balance,"
            " closing_balance, body, delivery, generated_at)"
            " VALUES (1, '2024-07-01', '2024-07-31', 0, 0, 'x', 'app', now()) RETURNING statement_id"
        )
        (new_id,) = cur.fetchone()
    conn.rollback()
    assert new_id == loaded["bank.statements"] + 1
