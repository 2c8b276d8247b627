"""Test helper: an independent record of every committed row change of the source tables.

A trigger writes (xid, table, key) to an unpublished table in the same transaction as the change, so
the record holds exactly the committed changes. Tests then check that Kafka or bronze has an event
of that transaction for that key: final-state comparisons cannot see an intermediate change lost.
"""

from __future__ import annotations

from collections import Counter

from psycopg2 import sql

from lib import config, source
from lib.capture import catalog

AUDIT = """
CREATE SCHEMA audit_kill;
CREATE TABLE audit_kill.changes (xid bigint, tbl text, key text[]);
CREATE FUNCTION audit_kill.log() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r jsonb := to_jsonb(CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END);
    k text[] := '{}';
BEGIN
    FOR i IN 0 .. TG_NARGS - 1 LOOP
        k := k || (r ->> TG_ARGV[i]);
    END LOOP;
    INSERT INTO audit_kill.changes VALUES (txid_current() % 4294967296, TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, k);
    RETURN NULL;
END $$;
"""


def start(conf) -> None:
    """Record every committed row change of the source tables (xid, table, key) in an unpublished table."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        tables = catalog.describe_tables(conn, list(config.get(conf, "source.tables")))
        with conn.cursor() as cur:
            cur.execute(AUDIT)
            for table in tables.values():
                cur.execute(sql.SQL("CREATE TRIGGER audit_kill AFTER INSERT OR UPDATE OR DELETE ON {}.{} FOR EACH ROW "
                                    "EXECUTE FUNCTION audit_kill.log({})").format(
                    sql.Identifier(table.schema), sql.Identifier(table.name),
                    sql.SQL(", ").join(sql.Literal(k) for k in table.primary_key)))
    finally:
        conn.close()


def finish(conf) -> list[tuple]:
    """The recorded changes, and the triggers and their table removed."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        tables = catalog.describe_tables(conn, list(config.get(conf, "source.tables")))
        with conn.cursor() as cur:
            cur.execute("SELECT xid, tbl, key FROM audit_kill.changes")
            changes = [(xid, tbl, tuple(key)) for xid, tbl, key in cur.fetchall()]
            for table in tables.values():
                cur.execute(sql.SQL("DROP TRIGGER IF EXISTS audit_kill ON {}.{}").format(
                    sql.Identifier(table.schema), sql.Identifier(table.name)))
            cur.execute("DROP SCHEMA audit_kill CASCADE")
        return changes
    finally:
        conn.close()


def assert_all_seen(changes: list[tuple], seen: Counter, where: str) -> None:
    """seen counts (xid, table, key) events: each recorded change needs one of its own."""
    missing = [(change, n) for change, n in Counter(changes).items() if seen[change] < n]
    assert not missing, f"{len(missing)} committed change(s) have no event in {where}, e.g. {missing[:3]}"
