"""What the benchmarks share: a throwaway database with the sample schema, a row writer, cleanup.

Every benchmark run gets its own database ``bench_<id>`` (created with the admin role), its
own slot/publication names and topic prefix ``bench-<id>``, so it never touches the dev
stack's ``bank`` database, the ``cdc_bank`` slot or the ``cdc`` topics. ``cleanup`` drops the
slots of that database, the database, the topics and the registry subjects of the prefix.

Rows are written by a server-side procedure ``bench_write(total, tx_rows, rate, tag)``: it
inserts ``total`` rows into ``bank.transactions`` (the sample's widest table: 15 columns with
uuid, enums, numeric(14,2), unconstrained numeric, text, jsonb, text[], timestamptz, timestamp
and date) in transactions of ``tx_rows`` rows, paced at ``rate`` rows/s (0 = as fast as the
server goes). The writer thus costs no client CPU, and its commit times are PostgreSQL's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

from psycopg2 import sql

from lib import config, source
from lib.capture import snapshot_slot
from lib.local import sample_db
from lib.operate import teardown

WRITER_SQL = """
CREATE OR REPLACE PROCEDURE public.bench_write(total bigint, tx_rows int, rate float8, tag text)
LANGUAGE plpgsql AS $$
DECLARE
    accounts bigint[] := ARRAY(SELECT account_id FROM bank.accounts ORDER BY account_id);
    na int := cardinality(accounts);
    kinds bank.txn_kind[] := enum_range(NULL::bank.txn_kind);
    done bigint := 0;
    n bigint;
    started timestamptz := clock_timestamp();
BEGIN
    WHILE done < total LOOP
        n := least(tx_rows, total - done);
        INSERT INTO bank.transactions (transaction_id, account_id, card_id, kind, status, amount, currency,
                                       fx_rate, description, merchant, tags, counterparty, booked_at,
                                       local_time, value_date)
        SELECT gen_random_uuid(), accounts[1 + i % na], NULL, kinds[1 + i % 6], 'posted',
               round((random() * 400 - 200)::numeric, 2), 'USD',
               CASE WHEN i % 7 = 0 THEN 0.92318475 END,
               tag || ' card purchase at Corner Store #' || (i % 500),
               jsonb_build_object('name', 'Corner Store #' || (i % 500), 'mcc', '5411', 'city', 'Springfield',
                                  'country', 'US'),
               ARRAY['groceries', tag],
               CASE WHEN i % 5 = 0 THEN 'NW' || lpad((i % 100000)::text, 10, '0') END,
               clock_timestamp(), localtimestamp, current_date
        FROM generate_series(done + 1, done + n) AS i;
        COMMIT;
        done := done + n;
        IF rate > 0 THEN
            PERFORM pg_sleep(greatest(0, done / rate - extract(epoch FROM clock_timestamp() - started)));
        END IF;
    END LOOP;
END $$
"""


def isolated(tables: list[str] | None = None, extra: dict | None = None) -> dict:
    """conf for a new database bench_<id> with the sample schema (small), the writer procedure and read grants.

    tables: source.tables (default: conf's list, the sample's tables that have a key).
    """
    run = uuid.uuid4().hex[:8]
    database = f"bench_{run}"
    overrides = {"CDC__SOURCE__DATABASE": database, "CDC__SOURCE__SLOT": database,
                 "CDC__SOURCE__PUBLICATION": database, "CDC__KAFKA__TOPIC_PREFIX": f"bench-{run}", **(extra or {})}
    if tables:
        overrides["CDC__SOURCE__TABLES"] = "[" + ", ".join(tables) + "]"
    conf = config.apply_overrides(config.load("local"), overrides)
    conf["env"] = overrides
    conf["bench_prefix"] = f"bench-{run}"
    conf.setdefault("spark", {}).setdefault("settings", {})["spark.ui.showConsoleProgress"] = "false"
    admin = source.connect(conf, admin=True, dbname="postgres")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    admin.close()
    conn = source.connect(conf, admin=True)
    try:
        sample_db.create_schema(conn)
        sample_db.load(conn, customers=20)
        pipeline = sql.Identifier(config.get(conf, "source.user"))
        with conn.cursor() as cur:
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                        .format(pipeline))
            cur.execute(WRITER_SQL)
        conn.commit()
    finally:
        conn.close()
    return conf


def write(conf: dict, total: int, tx_rows: int, rate: float = 0.0, tag: str = "bench") -> float:
    """Insert total rows through bench_write (see the module doc); returns the seconds it took."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True  # CALL must not run inside a transaction block: the procedure commits itself
    try:
        began = time.monotonic()
        with conn.cursor() as cur:
            cur.execute("CALL public.bench_write(%s, %s, %s, %s)", (total, tx_rows, rate, tag))
        return time.monotonic() - began
    finally:
        conn.close()


def background_write(conf: dict, rate: float, tx_rows: int, tag: str):
    """Start bench_write at rate rows/s in a thread (for at most an hour); returns stop() -> (rows, seconds)."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    began = time.monotonic()

    def run():
        with contextlib.suppress(Exception), conn.cursor() as cur:  # ends with the cancel from stop()
            cur.execute("CALL public.bench_write(%s, %s, %s, %s)", (int(rate * 3600), tx_rows, rate, tag))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop() -> tuple[int, float]:
        seconds = time.monotonic() - began
        conn.cancel()
        thread.join()
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM bank.transactions WHERE %s = ANY (tags)", (tag,))
            rows = cur.fetchone()[0]
        conn.close()
        return rows, seconds

    return stop


def wal_lsn(conf: dict) -> str:
    """The server's current WAL position."""
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            return cur.fetchone()[0]
    finally:
        conn.close()


def _poll_slot(conf: dict, slot: str, column: str, params: tuple, timeout_s: float, failure: str):
    """Poll one column of the slot's pg_replication_slots row until it is truthy; returns it."""
    conn = source.connect(conf)
    conn.autocommit = True
    deadline = time.monotonic() + timeout_s
    try:
        with conn.cursor() as cur:
            while True:
                cur.execute(f"SELECT {column} FROM pg_replication_slots WHERE slot_name = %s", (*params, slot))
                row = cur.fetchone()
                if row and row[0]:
                    return row[0]
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{failure} within {timeout_s:.0f} s")
                time.sleep(0.1)
    finally:
        conn.close()


def wait_confirmed(conf: dict, lsn: str, slot: str | None = None, timeout_s: float = 600.0) -> float:
    """Wait until the slot's confirmed position reaches lsn; returns when (time.monotonic())."""
    slot = slot or config.get(conf, "source.slot")
    _poll_slot(conf, slot, "confirmed_flush_lsn >= %s::pg_lsn", (lsn,), timeout_s, f"slot {slot} did not reach {lsn}")
    return time.monotonic()


def wait_active(conf: dict, timeout_s: float = 120.0) -> int:
    """Wait until a process streams from the slot; returns the walsender's pid."""
    slot = config.get(conf, "source.slot")
    return _poll_slot(conf, slot, "active_pid", (), timeout_s, f"nothing streamed from slot {slot}")


def machine() -> str:
    """Cores and load average, for the report."""
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} (1 min) / {five:.1f} (5 min)"


def cleanup(conf: dict, log=print) -> None:
    """Drop the database's slots, the database, the prefix's topics and registry subjects."""
    database, prefix = config.get(conf, "source.database"), conf["bench_prefix"]
    admin = source.connect(conf, admin=True, dbname="postgres")
    admin.autocommit = True
    pipeline = source.connect(conf, dbname="postgres")  # the pipeline role may drop slots (REPLICATION)
    pipeline.autocommit = True
    try:
        with pipeline.cursor() as cur:
            cur.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (database,))
            slots = [r[0] for r in cur.fetchall()]
        for slot in slots:
            for _ in range(100):
                try:
                    snapshot_slot.drop_slot(pipeline, slot)
                    break
                except snapshot_slot.SnapshotError:  # its walsender is still going away
                    time.sleep(0.2)
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    finally:
        admin.close()
        pipeline.close()
    doomed = teardown.delete_prefix(conf, prefix)
    log(f"cleanup: dropped database {database} and its {len(slots)} slot(s), {len(doomed)} topic(s) {prefix}*")
