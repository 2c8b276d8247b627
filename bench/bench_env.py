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
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from psycopg2 import sql

from lib import config, source
from lib.capture import snapshot_slot
from lib.lake import lake_paths
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
REPO = Path(__file__).resolve().parents[1]


def isolated(tables: list[str] | None = None, extra: dict | None = None, schema_sql: str | None = None,
             schemas: tuple[str, ...] = ("bank",)) -> dict:
    """conf for a new database bench_<id> with the sample schema (small), the writer procedure and read grants.

    tables: source.tables (default: conf's list, the sample's tables that have a key). schema_sql: run
    instead of loading the sample (it then creates ``schemas``, which the pipeline role may read).
    """
    run = uuid.uuid4().hex[:8]
    database = f"bench_{run}"
    overrides = {"CDC__SOURCE__DATABASE": database, "CDC__SOURCE__SLOT": database,
                 "CDC__SOURCE__PUBLICATION": database, "CDC__KAFKA__TOPIC_PREFIX": f"bench-{run}", **(extra or {})}
    if tables:
        overrides["CDC__SOURCE__TABLES"] = "[" + ", ".join(tables) + "]"
    conf = config.apply_overrides(config.load(None), overrides)  # CDC_TARGET (default local): also a cluster or Connect
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
        if schema_sql is None:
            sample_db.create_schema(conn)
            sample_db.load(conn, customers=20)
        else:
            with conn.cursor() as cur:
                cur.execute(schema_sql)
        pipeline = sql.Identifier(config.get(conf, "source.user"))
        with conn.cursor() as cur:
            for schema in schemas:
                cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {0} TO {1}; GRANT SELECT ON ALL TABLES IN SCHEMA {0} TO {1}")
                            .format(sql.Identifier(schema), pipeline))
            if schema_sql is None:
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


def background_workload(conf: dict, rate: float):
    """lib.local.workload at rate business transactions/s in a thread, in runs of 1 s, reconnecting when the server
    drops the connection; returns stop() -> {transactions, reconnects} (stops after the current run)."""
    from lib.local import workload

    stopping, done = threading.Event(), {"transactions": 0, "reconnects": 0}

    def run() -> None:
        conn, seed = None, 0
        while not stopping.is_set():
            try:
                conn, seed = conn or source.connect(conf, admin=True), seed + 1
                done["transactions"] += workload.run(conn, rate, duration=1, seed=seed)["transactions"]
            except Exception:  # noqa: BLE001 - a restarted server: reconnect and go on
                with contextlib.suppress(Exception):
                    conn.close()
                conn, done["reconnects"] = None, done["reconnects"] + 1
                stopping.wait(1.0)
        with contextlib.suppress(Exception):
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return lambda: (stopping.set(), thread.join(60), dict(done))[-1]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """Poll predicate until truthy; returns its value; TimeoutError naming what did not happen."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
    return value


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


def cpu_seconds(conf: dict) -> dict[str, float]:
    """CPU seconds used so far (user + system, with waited-for children) per part of the local stack: postgres
    (the postmaster and its backends), kafka, registry, and spark (this process, its JVM and Python workers)."""
    from lib.local import stack

    folder = stack.stack_dir(conf)
    roots = {"spark": os.getpid()}
    for name, pid_file in (("postgres", folder / "postgres" / "data" / "postmaster.pid"),
                           ("kafka", folder / "run" / "kafka.pid"), ("registry", folder / "run" / "registry.pid")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            roots[name] = int(pid_file.read_text().split()[0])
    parents, used = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            used[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    owners = {pid: name for name, pid in roots.items()}
    totals = dict.fromkeys(roots, 0.0)
    for pid, seconds in used.items():
        walk = pid
        while walk not in owners and walk in parents and walk > 1:
            walk = parents[walk]
        if walk in owners:
            totals[owners[walk]] += seconds
    return totals


def drop_slot_when_free(conn, slot: str, attempts: int = 100) -> None:
    """Drop a replication slot on conn, retrying while its walsender is still going away (up to 20 s)."""
    for _ in range(attempts):
        try:
            snapshot_slot.drop_slot(conn, slot)
            return
        except snapshot_slot.SnapshotError:
            time.sleep(0.2)


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
            drop_slot_when_free(pipeline, slot)
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    finally:
        admin.close()
        pipeline.close()
    doomed = teardown.delete_prefix(conf, prefix)
    log(f"cleanup: dropped database {database} and its {len(slots)} slot(s), {len(doomed)} topic(s) {prefix}*")


def start_capture(conf: dict, folder: str, name: str = "capture", interval: float = 5) -> subprocess.Popen:
    """python -m lib.capture.stream --until forever with this run's overrides; returns once the slot is caught up."""
    env = {**os.environ, **conf["env"]}
    out = open(os.path.join(folder, f"{name}.out"), "w")  # noqa: SIM115 - closed with the process
    err = open(os.path.join(folder, f"{name}.err"), "w")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "lib.capture.stream", "--until", "forever", "--heartbeat-s", "10",
                                "--interval", f"{interval:g}"], cwd=REPO, env=env, stdout=out, stderr=err)
    wait_active(conf)
    wait_confirmed(conf, wal_lsn(conf), timeout_s=300)
    time.sleep(1.0)  # the first status messages and metrics have gone out: the process is settled
    if process.poll() is not None:
        raise RuntimeError(f"the capture exited with {process.returncode}: see {err.name}")
    return process


def stop_capture(process: subprocess.Popen, folder: str, name: str = "capture") -> str:
    """SIGTERM (a graceful stop), wait, return the final summary line."""
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    text = Path(folder, f"{name}.out").read_text()
    finals = [line for line in text.splitlines() if line.startswith("final ")]
    if process.returncode != 0 or not finals:
        raise RuntimeError(f"the capture ended with {process.returncode}: {Path(folder, f'{name}.err').read_text()}")
    return finals[-1]


def finish(conf: dict, folder: str, spark=None, capture: subprocess.Popen | None = None, log=print) -> None:
    """End a run whatever happened: kill a capture still running, stop Spark, drop what the run made, remove folder."""
    import shutil

    if capture is not None and capture.poll() is None:
        capture.kill()
        capture.wait(30)
    if spark is not None:
        spark.stop()
    cleanup(conf, log)
    shutil.rmtree(folder, ignore_errors=True)


def committed_offsets(conf: dict) -> dict[str, dict[str, int]]:
    """Kafka offsets up to which the merge checkpoint has finished micro-batches: {topic: {partition: offset}}."""
    folder = Path(lake_paths.checkpoint_path(conf, lake_paths.query_name(conf)))
    done = [int(p.name) for p in (folder / "commits").iterdir() if p.name.isdigit()] if (folder / "commits").is_dir() \
        else []
    if not done:
        return {}
    lines = (folder / "offsets" / str(max(done))).read_text().splitlines()
    offsets: dict[str, dict[str, int]] = {}
    for line in lines[2:]:  # 'v1', the batch metadata, then one JSON line per source
        if line.startswith("{"):
            offsets.update(json.loads(line))
    return offsets


def topic_ends(conf: dict, topics: list[str]) -> dict[str, dict[str, int]]:
    """Each topic's end offset per partition: {topic: {partition: offset}} (the form the checkpoint uses)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"bench-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=10).topics
        return {topic: {str(p): consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                        for p in metadata[topic].partitions} for topic in topics}
    finally:
        consumer.close()


def behind(ends: dict[str, dict[str, int]], read: dict[str, dict[str, int]]) -> int:
    """Messages in ends that read (committed offsets) has not reached."""
    return sum(max(0, end - int(read.get(topic, {}).get(p, 0))) for topic, parts in ends.items()
               for p, end in parts.items())
