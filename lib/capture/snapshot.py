"""Notebook 02: the initial snapshot, read by Spark from the snapshot the slot exported, into Kafka.

How it works and what it guarantees: docs/snapshot.md.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import psycopg2
import psycopg2.errors

from lib import config, control, kafka_client, schema_registry, source
from lib import spark as spark_session
from lib.capture import avro_schemas, catalog, slot_position, snapshot_read, snapshot_slot, snapshot_write
from lib.capture.catalog import sql_ident
from lib.capture.pgoutput import lsn_to_str
from lib.capture.snapshot_slot import SnapshotError

TABLES_PER_JOB = 100  # measured: a union of 500 small tables took Spark 3.7 s to build, of 50 tables 0.3 s

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
    """Every interval seconds, one line per table being written: rows so far (topic end offsets), rows/s; a table
    whose rows have all reached its topic gets one last line."""

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
        admin = kafka_client.admin(self.conf)
        while not self.stop.wait(self.interval):
            with self.lock:
                active = dict(self.active)
            if not active:
                continue
            try:
                ends = snapshot_write.end_offsets(admin, sorted({topic for topic, *_ in active.values()}), timeout=5)
            except Exception:  # a log line is not worth failing the snapshot
                continue
            for table, (topic, start_offset, expected, started) in active.items():
                done = sum(ends[topic].values()) - start_offset
                rate = done / max(time.monotonic() - started, 1e-6)
                share = f" ({100 * done / expected:.0f}%)" if expected else ""
                self.progress(f"snapshot {table}: {done:,}/{expected:,} rows{share}, {rate:,.0f} rows/s")
                if done >= expected:
                    self.untrack(table)  # sent in full: no more lines for it while the others run


# ---------------------------------------------------------------------------------------------
# The whole snapshot


def run(conf: dict, spark, log=print, resnapshot: bool = False) -> dict:
    """Slot + exported snapshot, every table read by Spark into its topic, control record 'complete'.

    Safe to run again: once complete it does nothing (see create_slot_with_snapshot for the
    restart and ``resnapshot`` paths). On failure the new slot is dropped again (it would retain
    WAL while nobody streams from it) and the control record stays 'running' with the error;
    running again takes a new snapshot. All tables are written by one Spark job (_write_all).
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
    schemas = _register_all(conf, tables, topics)

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
    _record_position(conf, slot, consistent_lsn)
    control.put(conf, f"snapshot/{slot}", record)
    log(f"snapshot: complete, {total:,} rows in {elapsed:.1f} s ({record['rows_per_s']:,} rows/s); "
        f"the stream may start from {record['consistent_point']}")
    return {"status": "complete", "already_complete": False, **record, "stats": stats}


def _record_position(conf: dict, slot: str, consistent_lsn: int) -> None:
    """The slot's first position record: its consistent point on this server (slot_position.py)."""
    repl = source.connect(conf, replication=True)
    try:
        identity = slot_position.identify(repl)
    finally:
        repl.close()
    control.put(conf, slot_position.key(slot), slot_position.record(identity, consistent_lsn))


def _register_all(conf: dict, tables: dict[str, catalog.Table], topics: dict[str, str]) -> dict[str, tuple]:
    """Per table (key schema, value schema, key id, value id), registered (or found) several tables at once."""
    registry = schema_registry.client(conf)
    prefix, unknown_types = config.get(conf, "kafka.topic_prefix"), config.get(conf, "source.unknown_types")

    def register(name):
        key_subject, value_subject = schema_registry.subjects(topics[name])
        key = avro_schemas.key_schema(tables[name], prefix, unknown_types)
        value = avro_schemas.value_schema(tables[name], prefix, unknown_types)
        return (key, value, schema_registry.register(registry, key_subject, key)[0],
                schema_registry.register(registry, value_subject, value)[0])

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(tables))), thread_name_prefix="cdc-snapshot-schemas") as pool:
        return dict(zip(tables, pool.map(register, tables), strict=True))


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
    """Every table read, encoded and written to its topic by one Spark job; then each topic's growth checked.

    The tables are one union, smallest first: Spark starts a job's tasks in partition order, so
    small tables finish in the first seconds instead of queueing behind a large one, and the job
    pays Spark's per-job cost once instead of once per table. Each row carries its topic. Past
    TABLES_PER_JOB tables the next ones go to another job (Spark analyses a long union slowly).
    """
    conf, spark, log = job["conf"], job["spark"], job["log"]
    order = sorted(tables, key=lambda n: plans[n]["rows"])
    admin = kafka_client.admin(conf)
    earlier = snapshot_write.end_offsets(admin, [topics[n] for n in order])
    reporter = _Progress(conf, float(config.get(conf, "snapshot.progress_s")), log)
    for name in order:
        log(f"snapshot {name}: {plans[name]['rows']:,} rows in {plans[name]['partitions']} partition(s) "
            f"-> {topics[name]}")
        reporter.track(name, topics[name], sum(earlier[topics[name]].values()), plans[name]["rows"])
    reporter.start()
    started, fields = time.monotonic(), {}
    spark.addTag(job["tag"])
    try:
        for first in range(0, len(order), TABLES_PER_JOB):
            names = order[first:first + TABLES_PER_JOB]
            frames = _frames(job, tables, topics, schemas, plans, names)
            fields.update({n: frames[n][1] for n in names})
            try:
                snapshot_write.write(functools.reduce(lambda a, b: a.union(b), [frames[n][0] for n in names]), conf)
            except Exception as exc:
                failed = _failed_table(exc, [(tables[n], plans[n]["partitions"]) for n in names])
                raise _read_failed(failed or [tables[n] for n in names], exc) from exc
    finally:
        spark.removeTag(job["tag"])
        reporter.stop.set()
        reporter.join()
    elapsed = time.monotonic() - started
    after = snapshot_write.end_offsets(admin, [topics[n] for n in order])
    stats = {}
    for name in order:
        stats[name] = _check_written(job, tables[name], topics[name], schemas[name], plans[name], fields[name],
                                     earlier[topics[name]], after[topics[name]], elapsed)
    return stats


def _frames(job: dict, tables, topics, schemas, plans, order: list[str]) -> dict[str, tuple]:
    """Per table: (DataFrame of topic, key, value, the Value fields); built side by side (each asks the source
    for its columns)."""
    from pyspark.sql import functions as F

    def frame(name):
        table = tables[name]
        key_schema, value_schema, key_id, value_id = schemas[name]
        try:
            rows, fields = snapshot_read.read_table(job["conf"], job["spark"], table, job["snapshot_name"],
                                                    plans[name], job["unknown_types"])
            encoded = snapshot_write.encode(rows, table, job["conf"], key_schema, value_schema, key_id, value_id,
                                            job["consistent_lsn"], job["snapshot_ts_ms"], fields)
        except SnapshotError:
            raise
        except Exception as exc:
            raise _read_failed(table, exc) from exc
        return encoded.select(F.lit(topics[name]).alias("topic"), "key", "value"), fields

    with ThreadPoolExecutor(max_workers=min(8, len(order)), thread_name_prefix="cdc-snapshot-plan") as pool:
        return dict(zip(order, pool.map(frame, order), strict=True))


def _check_written(job: dict, table: catalog.Table, topic: str, schemas: tuple, plan: dict, fields: list[dict],
                   earlier: dict[int, int], after: dict[int, int], elapsed: float) -> dict:
    """The topic grew by at least the rows read; keys of earlier messages that are gone are retracted."""
    conf, log = job["conf"], job["log"]
    written = sum(after.values()) - sum(earlier.values())
    if written < plan["rows"]:
        raise SnapshotError(f"snapshot of {table.qualified}: {plan['rows']} rows read but only {written} messages "
                            f"reached topic {topic}; run the snapshot again")
    if written > plan["rows"]:
        log(f"snapshot {table.qualified}: {written - plan['rows']} duplicate message(s) from retried Spark "
            f"tasks (harmless: same key, same position)")
    rate = plan["rows"] / elapsed if elapsed > 0 else 0.0
    log(f"snapshot {table.qualified}: {plan['rows']:,} rows in {elapsed:.1f} s ({rate:,.0f} rows/s, the job's time)")
    job["spark"].addTag(job["tag"])
    try:
        retracted = snapshot_write.retract_stale_keys(conf, job["spark"], table, topic, schemas, fields, earlier,
                                                      after, job["consistent_lsn"], job["snapshot_ts_ms"])
    except SnapshotError:
        raise
    except Exception as exc:
        raise _read_failed(table, exc) from exc
    finally:
        job["spark"].removeTag(job["tag"])
    if retracted:
        log(f"snapshot {table.qualified}: {retracted:,} key(s) from earlier messages in {topic} no longer "
            f"exist: delete events and tombstones written")
    return {"rows": plan["rows"], "messages": written, "partitions": plan["partitions"], "retracted": retracted,
            "elapsed_s": round(elapsed, 3), "rows_per_s": round(rate, 1), "topic": topic}


def _failed_table(exc: Exception, parts: list[tuple[catalog.Table, int]]) -> catalog.Table | None:
    """The table whose partition failed the job: Spark names the failed task, whose index is the partition of
    the union, in which the tables' partitions follow each other in order."""
    found = re.search(r"Lost task (\d+)\.\d+ in stage", str(exc))
    if found is None:
        return None
    index = int(found.group(1))
    for table, count in parts:
        if index < count:
            return table
        index -= count
    return None


def _read_failed(table: catalog.Table | list[catalog.Table], exc: Exception) -> SnapshotError:
    """A Spark/JDBC failure as a message naming the table (or the job's tables, when Spark did not say which
    task failed), the database's reason and a remedy."""
    tables = table if isinstance(table, list) else [table]
    text = str(exc)
    reason = spark_session.error_line(exc)
    for line in text.splitlines():  # the PostgreSQL or driver message is more useful than Spark's wrapper
        if "PSQLException:" in line or "cdc snapshot:" in line or "ValueError: column" in line:
            reason = line.rsplit("Exception:", 1)[-1].strip() if "cdc snapshot:" not in line else line.strip()
            break

    def columns(test) -> str:
        return ", ".join(c.name if len(tables) == 1 else c.qualified for t in tables for c in t.columns if test(c))

    hints = []
    if "snapshot" in reason and ("invalid" in reason or "does not exist" in reason):
        hints.append("the replication connection that exported the snapshot closed; run the snapshot again")
    if "NaN" in reason:
        hints.append(f"a numeric(p,s) column ({columns(lambda c: c.precision is not None)}) holds NaN, which has "
                     f"no Avro decimal value: replace it in the source or make the column unconstrained numeric")
    if "infinite" in reason:
        hints.append(f"a date column ({columns(lambda c: c.type.resolved().name == 'date')}) holds ±infinity, "
                     f"which has no Avro date value: replace it in the source")
    if "permission denied" in reason:
        hints.append(f"GRANT SELECT ON {', '.join(t.qualified for t in tables)} TO the pipeline role (source.user)")
    remedy = "; ".join(hints) or "see the Spark driver log for the full error, fix the cause and run again"
    subject = f"table {tables[0].qualified}" if len(tables) == 1 else \
        f"tables {', '.join(t.qualified for t in tables)}"
    return SnapshotError(f"snapshot of {subject} failed: {reason}; {remedy}")


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
