"""Notebook 02: the initial snapshot, read by Spark from the snapshot the slot exported, into Kafka.

How it works and what it guarantees: docs/snapshot.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone

import psycopg2
import psycopg2.errors

from lib import config, control, kafka_client, schema_registry, source
from lib import spark as spark_session
from lib.capture import avro_schemas, catalog, snapshot_read, snapshot_slot, snapshot_write
from lib.capture.catalog import sql_ident
from lib.capture.pgoutput import lsn_to_str
from lib.capture.snapshot_slot import SnapshotError

# ---------------------------------------------------------------------------------------------
# Kafka side helpers


def _require_topics(conf: dict, names: list[str], wait_s: float = 10.0) -> None:
    """Every topic exists (waiting a little for topics created a moment ago to reach the metadata)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            existing = kafka_client.check(conf, timeout_s=30).topics
        except kafka_client.KafkaAccessError as exc:
            raise SnapshotError(str(exc)) from exc
        missing = [n for n in names if n not in existing]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        raise SnapshotError(f"topic(s) {', '.join(missing)} do not exist (Kafka does not create them here): "
                            f"run notebook 01 (lib.capture.bootstrap) first")


def _require_publication(conn, conf: dict, tables: dict[str, catalog.Table]) -> None:
    name = config.get(conf, "source.publication")
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        if cur.fetchone() is None:
            raise SnapshotError(f"publication {name} (source.publication) does not exist; create it before the slot "
                                f"(notebook 01): a pgoutput slot created before its publication fails to stream")
        cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s", (name,))
        published = {r[0] for r in cur.fetchall()}
    missing = sorted(t.qualified for t in tables.values() if t.qualified not in published)
    if missing:
        raise SnapshotError(f"publication {name} does not publish {', '.join(missing)}: their changes would never be "
                            f"streamed; ALTER PUBLICATION {name} ADD TABLE {', '.join(missing)} (notebook 01)")


class _Progress(threading.Thread):
    """Every interval seconds, one line per table being written: rows so far (topic end offsets), rows/s."""

    def __init__(self, conf: dict, interval: float, log):
        super().__init__(daemon=True, name="cdc-snapshot-progress")
        self.conf, self.interval, self.progress = conf, interval, log
        self.active: dict[str, tuple] = {}  # table -> (topic, start offset, expected rows, started)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def track(self, table: str, topic: str, start_offset: int, expected: int) -> None:
        with self.lock:
            self.active[table] = (topic, start_offset, expected, time.monotonic())

    def untrack(self, table: str) -> None:
        with self.lock:
            self.active.pop(table, None)

    def run(self):
        consumer = snapshot_write.topic_consumer(self.conf)
        try:
            while not self.stop.wait(self.interval):
                with self.lock:
                    active = dict(self.active)
                for table, (topic, start_offset, expected, started) in active.items():
                    try:
                        done = snapshot_write.end_offsets(consumer, topic, timeout=5) - start_offset
                    except Exception:  # a log line is not worth failing the snapshot
                        continue
                    rate = done / max(time.monotonic() - started, 1e-6)
                    share = f" ({100 * done / expected:.0f}%)" if expected else ""
                    self.progress(f"snapshot {table}: {done:,}/{expected:,} rows{share}, {rate:,.0f} rows/s")
        finally:
            consumer.close()


# ---------------------------------------------------------------------------------------------
# The whole snapshot


def run(conf: dict, spark, log=print, resnapshot: bool = False) -> dict:
    """Slot + exported snapshot, every table read by Spark into its topic, control record 'complete'.

    Safe to run again: once complete it does nothing (see create_slot_with_snapshot for the
    restart and ``resnapshot`` paths). On failure the new slot is dropped again (it would retain
    WAL while nobody streams from it) and the control record stays 'running' with the error;
    running again takes a new snapshot. Up to ``snapshot.parallel_tables`` tables (default 4)
    are written at once, largest first, so small tables fill the cores a big one leaves idle.
    """
    slot = config.get(conf, "source.slot")
    prefix = config.get(conf, "kafka.topic_prefix")
    unknown_types = config.get(conf, "source.unknown_types")
    names = list(config.get(conf, "source.tables"))
    conn = source.connect(conf)
    try:
        tables = catalog.describe_tables(conn, names, config.get(conf, "source.keys"))
        for table in tables.values():
            catalog.check_capturable(table)
        _require_publication(conn, conf, tables)
    finally:
        conn.close()
    topics = {name: avro_schemas.topic_for(conf, table) for name, table in tables.items()}
    _require_topics(conf, list(topics.values()) + [control.topic(conf)])
    registry = schema_registry.client(conf)
    schemas = {}
    for name, table in tables.items():
        key_subject, value_subject = schema_registry.subjects(topics[name])
        key = avro_schemas.key_schema(table, prefix, unknown_types)
        value = avro_schemas.value_schema(table, prefix, unknown_types)
        schemas[name] = (key, value, schema_registry.register(registry, key_subject, key)[0],
                         schema_registry.register(registry, value_subject, value)[0])

    repl, consistent_lsn, snapshot_name = snapshot_slot.create_slot_with_snapshot(conf, log, resnapshot)
    if repl is None:
        record = snapshot_slot._snapshot_state(conf, slot)
        return {"status": "complete", "already_complete": True, **record}
    started = time.monotonic()
    started_at = datetime.now(timezone.utc)
    record = {"state": "running", "slot": slot, "consistent_lsn": consistent_lsn,
              "consistent_point": lsn_to_str(consistent_lsn), "snapshot_name": snapshot_name,
              "publication": config.get(conf, "source.publication"), "topic_prefix": prefix,
              "started_at": started_at.isoformat(), "tables": {}}
    log(f"snapshot: slot {slot} created at consistent point {record['consistent_point']}, "
        f"snapshot {snapshot_name}")
    job = {"conf": conf, "spark": spark, "snapshot_name": snapshot_name, "consistent_lsn": consistent_lsn,
           "snapshot_ts_ms": int(started_at.timestamp() * 1000), "unknown_types": unknown_types,
           "log": log, "tag": f"cdc-snapshot-{slot}"}
    try:
        control.put(conf, f"snapshot/{slot}", record)
        plans = _plan_all(conf, spark, snapshot_name, tables)
        total = sum(p["rows"] for p in plans.values())
        log(f"snapshot: {total:,} rows in {len(tables)} table(s): "
            + ", ".join(f"{n} {p['rows']:,} ({p['partitions']} partition(s))" for n, p in plans.items()))
        stats = _write_all(job, tables, topics, schemas, plans)
    except BaseException as exc:
        _abort(conf, repl, slot, record, exc, log)
        raise
    repl.close()  # every read is done: the exported snapshot is no longer needed
    elapsed = time.monotonic() - started
    record.update({"state": "complete", "tables": {name: stats[name]["rows"] for name in tables},
                   "finished_at": datetime.now(timezone.utc).isoformat(), "elapsed_s": round(elapsed, 3),
                   "rows": total, "rows_per_s": round(total / elapsed, 1) if elapsed > 0 else None,
                   "partitions": {name: stats[name]["partitions"] for name in tables}})
    control.put(conf, f"snapshot/{slot}", record)
    log(f"snapshot: complete, {total:,} rows in {elapsed:.1f} s ({record['rows_per_s']:,} rows/s); "
        f"the stream may start from {record['consistent_point']}")
    return {"status": "complete", "already_complete": False, **record, "stats": stats}


def _plan_all(conf: dict, spark, snapshot_name: str, tables: dict[str, catalog.Table]) -> dict[str, dict]:
    """Every table's exact row count and partitioning, on a connection that imported the snapshot."""
    planner = snapshot_slot.snapshot_connection(conf, snapshot_name)
    try:
        rows = int(config.get(conf, "snapshot.partition_rows"))
        most = int(config.get(conf, "snapshot.max_partitions"))
        reader = config.get(conf, "snapshot.reader")
        if reader not in ("copy", "jdbc"):
            raise SnapshotError(f"snapshot.reader is {reader!r}: use copy (COPY by block ranges in Spark tasks) or "
                                f"jdbc (Spark's JDBC reader by key ranges)")
        plans = {}
        for name, table in tables.items():
            try:
                plans[name] = snapshot_read.plan_partitions(planner, table, rows, most,
                                                            spark_session.cores(spark) or 2, reader == "copy")
            except psycopg2.errors.InsufficientPrivilege as exc:
                raise SnapshotError(f"snapshot of table {table.qualified}: {str(exc).strip().splitlines()[0]}; "
                                    f"GRANT SELECT ON {table.qualified} TO {config.get(conf, 'source.user')}") from exc
        return plans
    finally:
        planner.close()


def _write_all(job: dict, tables, topics, schemas, plans) -> dict[str, dict]:
    """Run _snapshot_table for every table, several at once; the first failure interrupts the others."""
    conf, spark, log = job["conf"], job["spark"], job["log"]
    reporter = _Progress(conf, float(config.get(conf, "snapshot.progress_s")), log)
    reporter.start()
    order = sorted(tables, key=lambda n: -plans[n]["rows"])
    workers = max(1, int(config.get(conf, "snapshot.parallel_tables")))
    stats, failure = {}, None
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cdc-snapshot") as pool:
            futures = {pool.submit(_snapshot_table, job, tables[n], topics[n], schemas[n], plans[n], reporter): n
                       for n in order}
            for future in as_completed(futures):
                try:
                    stats[futures[future]] = future.result()
                except BaseException as exc:
                    if failure is None:
                        failure = exc
                        for other in futures:
                            other.cancel()
                        with contextlib.suppress(Exception):
                            spark.interruptTag(job["tag"])
    finally:
        reporter.stop.set()
        reporter.join()
    if failure is not None:
        raise failure
    return stats


def _snapshot_table(job: dict, table: catalog.Table, topic: str, schemas: tuple, plan: dict,
                    reporter: _Progress) -> dict:
    """Read, encode and write one table; checks that the topic grew by at least the rows read."""
    conf, spark, log = job["conf"], job["spark"], job["log"]
    key_schema, value_schema, key_id, value_id = schemas
    consumer = snapshot_write.topic_consumer(conf)
    try:
        earlier = snapshot_write.partition_end_offsets(consumer, topic)
        before = sum(earlier.values())
        started = time.monotonic()
        log(f"snapshot {table.qualified}: {plan['rows']:,} rows in {plan['partitions']} partition(s) -> {topic}")
        reporter.track(table.qualified, topic, before, plan["rows"])
        spark.addTag(job["tag"])
        try:
            rows, fields = snapshot_read.read_table(conf, spark, table, job["snapshot_name"], plan,
                                                    job["unknown_types"])
            encoded = snapshot_write.encode(rows, table, conf, key_schema, value_schema, key_id, value_id,
                                            job["consistent_lsn"], job["snapshot_ts_ms"], fields)
            snapshot_write.write(encoded, conf, topic)
        except Exception as exc:
            raise _read_failed(table, exc) from exc
        finally:
            spark.removeTag(job["tag"])
            reporter.untrack(table.qualified)
        elapsed = time.monotonic() - started
        after = snapshot_write.partition_end_offsets(consumer, topic)
        written = sum(after.values()) - before
        if written < plan["rows"]:
            raise SnapshotError(f"snapshot of {table.qualified}: {plan['rows']} rows read but only {written} messages "
                                f"reached topic {topic}; run the snapshot again")
        if written > plan["rows"]:
            log(f"snapshot {table.qualified}: {written - plan['rows']} duplicate message(s) from retried Spark "
                f"tasks (harmless: same key, same position)")
        rate = plan["rows"] / elapsed if elapsed > 0 else 0.0
        log(f"snapshot {table.qualified}: {plan['rows']:,} rows in {elapsed:.1f} s ({rate:,.0f} rows/s)")
        spark.addTag(job["tag"])
        try:
            retracted = snapshot_write.retract_stale_keys(conf, spark, table, topic, schemas, fields, earlier, after,
                                                          job["consistent_lsn"], job["snapshot_ts_ms"])
        except SnapshotError:
            raise
        except Exception as exc:
            raise _read_failed(table, exc) from exc
        finally:
            spark.removeTag(job["tag"])
        if retracted:
            log(f"snapshot {table.qualified}: {retracted:,} key(s) from earlier messages in {topic} no longer "
                f"exist: delete events and tombstones written")
    finally:
        consumer.close()
    return {"rows": plan["rows"], "messages": written, "partitions": plan["partitions"], "retracted": retracted,
            "elapsed_s": round(elapsed, 3), "rows_per_s": round(rate, 1), "topic": topic}


def _read_failed(table: catalog.Table, exc: Exception) -> SnapshotError:
    """A Spark/JDBC failure as a message naming the table, the database's reason and a remedy."""
    text = str(exc)
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    for line in text.splitlines():  # the PostgreSQL or driver message is more useful than Spark's wrapper
        if "PSQLException:" in line or "cdc snapshot:" in line or "ValueError: column" in line:
            reason = line.split("Exception:", 1)[-1].strip() if "cdc snapshot:" not in line else line.strip()
            break
    hints = []
    if "snapshot" in reason and ("invalid" in reason or "does not exist" in reason):
        hints.append("the replication connection that exported the snapshot closed; run the snapshot again")
    if "NaN" in reason:
        cols = [c.name for c in table.columns if c.precision is not None]
        hints.append(f"a numeric(p,s) column ({', '.join(cols)}) holds NaN, which has no Avro decimal value: "
                     f"replace it in the source or make the column unconstrained numeric")
    if "infinite" in reason:
        cols = [c.name for c in table.columns if c.type.resolved().name == "date"]
        hints.append(f"a date column ({', '.join(cols)}) holds ±infinity, which has no Avro date value: "
                     f"replace it in the source")
    if "permission denied" in reason:
        hints.append(f"GRANT SELECT ON {table.qualified} TO the pipeline role (source.user)")
    remedy = "; ".join(hints) or "see the Spark driver log for the full error, fix the cause and run again"
    return SnapshotError(f"snapshot of table {table.qualified} failed: {reason}; {remedy}")


def _abort(conf: dict, repl, slot: str, record: dict, exc: BaseException, log) -> None:
    """After a failure: drop the new slot (it would retain WAL) and leave control 'running' with the error."""
    try:
        with repl.cursor() as cur:
            cur.execute(f"DROP_REPLICATION_SLOT {sql_ident(slot)}")
        log(f"snapshot: failed, slot {slot} dropped again; run the snapshot again")
    except Exception:
        log(f"snapshot: failed and slot {slot} could not be dropped now; the next run drops it "
            f"(until then it retains WAL)")
    finally:
        with contextlib.suppress(Exception):
            repl.close()
    with contextlib.suppress(Exception):
        control.put(conf, f"snapshot/{slot}", {**record, "state": "running",
                                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
