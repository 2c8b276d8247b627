"""One micro-batch of the merge: decode each table's records, append bronze, MERGE silver, set dead letters aside.

``process_batch`` is the streaming query's foreachBatch function; a batch's Delta writes run side by side
(``merge.parallelism``) and each is idempotent, so a retried batch changes nothing it already wrote.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lib import config, control
from lib import spark as spark_session
from lib.lake import bronze_table, decode, delta_io, lake_paths, silver_table, writer_schemas
from lib.lake.lake_paths import MergeError, TableSpec
from lib.lake.writer_schemas import Layout, Schemas

log = logging.getLogger(__name__)

APPEND_HISTORY_COMMITS = 100  # commits searched for a retried batch's append (bronze, dead letters)


@dataclass
class TableWork:
    """One table's part of a micro-batch."""

    spec: TableSpec
    layout: Layout
    decoded: DataFrame  # the table's records decoded (none when only a truncate is pending)
    has_rows: bool  # the batch holds records of the table
    truncate: tuple | None  # the table's latest truncate record (commit_lsn, event_serial, ts_ms)
    pending_truncate: tuple | None  # that truncate, when silver still holds rows it removes


@dataclass
class MergeContext:
    """What the micro-batch function keeps across batches: conf, caches, the query's identity, stats."""

    conf: dict
    query: str
    specs: list[TableSpec]
    schemas: Schemas
    app_id: str | None = None  # '<query name>-<query id>' once known
    truncates_applied: dict[str, tuple] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    last_cleanup: float = field(default_factory=time.monotonic)
    session: SparkSession | None = None  # the session that started the query (knows its id)
    failure: tuple[int, BaseException] | None = None  # the last batch that raised, and why
    ready: dict = field(default_factory=dict)  # Delta path -> what is known of it (schema, has files)
    appended: dict = field(default_factory=dict)  # bronze path -> last batch id appended by this context
    retired: frozenset = frozenset()  # topics re-keyed tables wrote before: read (Spark needs it), skipped

    def spec(self, topic: str) -> TableSpec | None:
        """The table a topic belongs to."""
        return next((s for s in self.specs if s.topic == topic), None)


def context(conf: dict, query: str | None = None, app_id: str | None = None) -> MergeContext:
    """A MergeContext for conf (start() makes one; tests call process_batch with it directly)."""
    return MergeContext(conf=conf, query=query or lake_paths.query_name(conf), specs=lake_paths.table_specs(conf),
                        schemas=Schemas(conf), app_id=app_id)


def truncates(conf: dict) -> dict[str, tuple[int, int, object]]:
    """Latest truncate per table from the control topic: {'schema.table': (commit_lsn, event_serial, ts_ms)}."""
    found = {}
    for key, record in control.read_all(conf, timeout=float(config.get(conf, "merge.control_timeout_s"))).items():
        if key.startswith("truncate/") and record.get("commit_lsn") is not None:
            found[key[len("truncate/"):]] = (int(record["commit_lsn"]), int(record.get("event_serial", 0)),
                                             record.get("ts_ms"))
    return found


def _app_id(ctx: MergeContext, spark: SparkSession) -> str:
    if ctx.app_id is None:  # foreachBatch runs in a clone of the session, whose query manager is empty
        active = [q for q in (ctx.session or spark).streams.active if q.name == ctx.query]
        if not active:
            raise MergeError(f"merge query {ctx.query} is not active in this session, so its id (part of the Delta "
                             f"idempotence ids) is unknown; pass app_id to context() when calling process_batch")
        ctx.app_id = f"{ctx.query}-{active[0].id}"
    return ctx.app_id


def process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    """foreachBatch body: bronze append, one silver MERGE per table, dead letters; returns the batch's counts.

    Safe to run again with the same batch_id (a retried batch): a bronze or dead-letter append that
    was committed is skipped, and the silver MERGEs change nothing the second time.
    """
    try:
        return _process_batch(batch, batch_id, ctx)
    except BaseException as exc:
        ctx.failure = (batch_id, exc)
        raise


def _process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    spark = batch.sparkSession
    app = _app_id(ctx, spark)
    began = time.monotonic()
    control_topic = control.topic(ctx.conf)
    # one cached partition per core, not one per topic-partition: every table's decode, append and MERGE
    # scans this cache, and with many tables the tasks, not the rows, were the cost (docs/merge.md)
    cores = spark_session.cores(spark)
    raw = decode.headers(batch.coalesce(cores) if cores else batch).persist()
    frames = [raw]
    try:
        present = {row["topic"]: row for row in raw.groupBy("topic").agg(
            F.collect_set("__vid").alias("v"), F.collect_set("__kid").alias("k")).collect()}
        stats = {"batch_id": batch_id, "tables": {}, "dead_letters": {}, "seconds_by_table": {}}
        if not present:
            return stats
        unknown = [t for t in present if t != control_topic and t not in ctx.retired and ctx.spec(t) is None]
        if unknown:
            raise MergeError(f"micro-batch {batch_id} holds topic(s) {', '.join(unknown)}, which are not configured "
                             f"tables' topics; check source.tables and kafka.topic_prefix")
        cuts = truncates(ctx.conf)
        work: list[TableWork] = []
        for spec in ctx.specs:
            row = present.get(spec.topic)
            cut = cuts.get(spec.qualified)
            truncate_new = cut is not None and ctx.truncates_applied.get(spec.qualified) != cut
            if row is None and not truncate_new:
                continue
            silver_path = lake_paths.silver_path(ctx.conf, spec)
            pending = cut if truncate_new and silver_table.truncate_pending(spark, silver_path, cut) else None
            layout = writer_schemas.table_layout(spark, ctx.schemas, spec, set(row["v"]) if row else set(),
                                                 set(row["k"]) if row else set())
            if row is not None:
                _refuse_unknown_ids(ctx, raw, spec, layout, set(row["v"]), set(row["k"]))
            decoded = decode.decode(raw.filter(F.col("topic") == spec.topic), spark, ctx.schemas, layout, batch_id)
            if row is not None:
                decoded = decoded.persist()
                frames.append(decoded)
            work.append(TableWork(spec, layout, decoded, row is not None, cut, pending))
        counts = _counts([(w.spec.qualified, w.decoded) for w in work if w.has_rows])
        tasks, dead = [], []  # the batch's Delta writes: independent tables, run side by side
        for w in work:
            spec, layout, decoded, cut, pending = w.spec, w.layout, w.decoded, w.truncate, w.pending_truncate
            mine = counts.get(spec.qualified, {})
            good = mine.get(None)
            bad = {reason: c["n"] for reason, c in mine.items() if reason is not None}
            if w.has_rows:
                stats["tables"][spec.qualified] = {
                    "events": good["n"] - good["tombs"] if good else 0, "tombstones": good["tombs"] if good else 0,
                    "dead_letters": sum(bad.values())}
            for reason, n in bad.items():
                stats["dead_letters"][reason] = stats["dead_letters"].get(reason, 0) + n
            if bad:
                dead.append(bronze_table.dead_letter_rows(decoded, ctx.query))
            if good is None and pending is None:
                continue
            timing = stats["seconds_by_table"].setdefault(spec.qualified, {})
            if good is not None:
                tasks.append(functools.partial(_write_bronze, spark, ctx, spec, decoded, app, batch_id, timing))
            source = silver_table.merge_source(decoded, layout, cut[:2] if cut else None,
                                               toast=good is not None and good["toast"] > 0)
            tasks.append(functools.partial(_write_silver, spark, ctx, spec, layout, source, pending, batch_id, timing))
            if pending is not None:
                stats["tables"].setdefault(spec.qualified, {})["truncated_before"] = list(cut[:2])
        if dead:
            poison = functools.reduce(DataFrame.unionByName, dead)
            tasks.append(functools.partial(_write_dead_letters, spark, ctx, poison, app, batch_id,
                                           stats["dead_letters"]))
        _clear_failed_creations([p for w in work for p in (lake_paths.bronze_path(ctx.conf, w.spec),
                                                           lake_paths.silver_path(ctx.conf, w.spec))
                                 if p not in ctx.ready] + ([lake_paths.dead_letter_path(ctx.conf)] if dead else []))
        _run_all(tasks, int(config.get(ctx.conf, "merge.parallelism")), spark)
        for w in work:
            if w.truncate is not None:
                ctx.truncates_applied[w.spec.qualified] = w.truncate
        interval = float(config.get(ctx.conf, "merge.cleanup_interval_minutes")) * 60
        if interval > 0 and time.monotonic() - ctx.last_cleanup >= interval:
            silver_table.cleanup_tombstones(ctx.conf, spark)
            ctx.last_cleanup = time.monotonic()
        stats["seconds"] = round(time.monotonic() - began, 2)
        ctx.history = (ctx.history + [stats])[-100:]
        log.info("merge batch %s: %s", batch_id, stats)
        return stats
    finally:
        for frame in frames:
            frame.unpersist()


def _refuse_unknown_ids(ctx: MergeContext, raw: DataFrame, spec: TableSpec, layout: Layout, value_ids: set,
                        key_ids: set) -> None:
    """Fail the batch when a writer id is not served (merge.unknown_schema_ids: fail, the default)."""
    missing_v = {i for i in value_ids if i is not None} - set(layout.value_ids)
    missing_k = {i for i in key_ids if i is not None} - set(layout.key_ids)
    if not (missing_v or missing_k) or config.get(ctx.conf, "merge.unknown_schema_ids") == "dead_letter":
        return
    unknown = F.lit(False)
    if missing_v:
        unknown = unknown | F.col("__vid").isin(*missing_v)
    if missing_k:
        unknown = unknown | F.col("__kid").isin(*missing_k)
    first = raw.filter((F.col("topic") == spec.topic) & unknown).agg(
        F.min(F.struct("partition", "offset")).alias("p")).collect()[0]["p"]
    ids = ", ".join(str(i) for i in sorted(missing_v | missing_k))
    raise MergeError(
        f"topic {spec.topic} (table {spec.qualified}): schema id(s) {ids} are not served by the schema registry "
        f"{ctx.schemas.url} (asked for {ctx.schemas.wait_s:.0f} s), first at partition {first['partition']} offset "
        f"{first['offset']}. The merge stops rather than set those events aside: nothing is lost, and the batch runs "
        f"again on restart. Remedy: bring the registry back to a state that serves the id (a replica that caught "
        f"up, the restored registry storage), or set merge.unknown_schema_ids: dead_letter to let the stream go "
        f"on and replay the dead letters later with merge.replay_dead_letters(conf, spark)")


def _counts(decoded: list[tuple[str, DataFrame]]) -> dict[str, dict]:
    """One job for every table of the batch: {table: {reason or None: {n, tombs, toast}}}."""
    if not decoded:
        return {}
    parts = [frame.select(F.lit(name).alias("t"), "__reason", "__tomb",
                          (F.coalesce(F.size("__env.unchanged_cols"), F.lit(0)) > 0).alias("__toast"))
             for name, frame in decoded]
    rows = functools.reduce(DataFrame.unionByName, parts).groupBy("t", "__reason").agg(
        F.count(F.lit(1)).alias("n"), F.count(F.when(F.col("__tomb"), 1)).alias("tombs"),
        F.count(F.when(F.col("__toast"), 1)).alias("toast")).collect()
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["t"], {})[r["__reason"]] = {"n": r["n"], "tombs": r["tombs"], "toast": r["toast"]}
    return out


def _clear_failed_creations(paths: list[str]) -> None:
    """Remove the _delta_log of a local table whose creation failed before its first commit (a full disk).

    Such a log holds no commit, only Delta's temporary file, and Delta then refuses to create the table there
    (DELTA_TABLE_NOT_FOUND) on every retry, so the merge could not recover by itself once space was back. Only a
    log without any commit, checkpoint or staged commit is removed; remote paths are left alone.
    """
    for path in paths:
        log_dir = os.path.join(path, "_delta_log")
        if config.is_remote(path) or not os.path.isdir(log_dir):
            continue
        entries = [name for name in os.listdir(log_dir) if not name.startswith(".")]
        staged = os.path.join(log_dir, "_staged_commits")
        if set(entries) <= {"_staged_commits"} and not (os.path.isdir(staged) and os.listdir(staged)):
            log.warning("merge: %s holds no commit (its creation failed, e.g. on a full disk): removing it so the "
                        "table is created again", log_dir)
            shutil.rmtree(log_dir, ignore_errors=True)


def _run_all(tasks: list, parallelism: int, spark: SparkSession) -> None:
    """Run the batch's Delta writes, up to ``parallelism`` at once; every write finishes before the first
    error is raised (the micro-batch then fails as a whole and is retried)."""
    if parallelism <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    from pyspark import inheritable_thread_target

    # each task runs with this thread's Spark local properties and the session's tags (the query's job
    # group, so stopping the query cancels its writes too)
    inherit = inheritable_thread_target(spark)
    with ThreadPoolExecutor(max_workers=min(parallelism, len(tasks)), thread_name_prefix="merge-write") as pool:
        futures = [pool.submit(inherit(task)) for task in tasks]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def _fire(stage: str, batch_id: int, table: str) -> None:
    """Called after each of a batch's Delta writes; nothing here (a test replaces it to crash at that point)."""


def _write_bronze(spark: SparkSession, ctx: MergeContext, spec: TableSpec, decoded: DataFrame, app: str,
                  batch_id: int, timing: dict) -> None:
    """Append a table's good rows to its bronze change log, once per micro-batch."""
    began = time.monotonic()
    bronze = lake_paths.bronze_path(ctx.conf, spec)
    rows = bronze_table.bronze_rows(decoded)
    if ctx.ready.get(bronze) != rows.schema:
        table = delta_io.ensure_table(spark, bronze, rows.schema)
        if delta_io.widens(table.toDF().schema, rows.schema):  # the append widens a column: Delta must allow it
            delta_io.allow_widening(spark, bronze)
        ctx.ready[bronze] = rows.schema
    _append_once(spark, ctx, bronze, rows, f"{app}/{spec.qualified}", batch_id, mergeSchema="true")
    timing.update(bronze_s=round(time.monotonic() - began, 2), bronze_at=time.time())
    _fire("after_bronze", batch_id, spec.qualified)


def _write_dead_letters(spark: SparkSession, ctx: MergeContext, frame: DataFrame, app: str, batch_id: int,
                        reasons: dict) -> None:
    """Append the batch's poison messages to the dead-letter table, once per micro-batch like bronze."""
    _append_once(spark, ctx, lake_paths.dead_letter_path(ctx.conf), frame, f"{app}/_dead_letter", batch_id)
    log.warning("merge batch %s: %s message(s) went to the dead-letter table %s: %s", batch_id,
                sum(reasons.values()), lake_paths.dead_letter_path(ctx.conf), reasons)


def _write_silver(spark: SparkSession, ctx: MergeContext, spec: TableSpec, layout: Layout, source: DataFrame,
                  pending: tuple | None, batch_id: int, timing: dict) -> None:
    """Run a table's one MERGE into silver, timed."""
    began = time.monotonic()
    silver_table.merge_silver(spark, lake_paths.silver_path(ctx.conf, spec), spec, layout, source, pending, ctx.ready)
    timing.update(silver_s=round(time.monotonic() - began, 2), silver_at=time.time())
    _fire("after_silver", batch_id, spec.qualified)


def _append_once(spark: SparkSession, ctx: MergeContext, path: str, frame: DataFrame, marker: str, batch_id: int,
                 **options: str) -> None:
    """Append frame to a Delta table unless this micro-batch's append under marker is already there.

    The commit carries ``userMetadata`` {"merge_batch": marker, "batch": id}. A batch this context has
    not appended itself (the first one, or any after a failed batch) is first looked up in the table's
    last APPEND_HISTORY_COMMITS commits and skipped when found. Delta's txnAppId would do the same but
    rebuilds the table's whole state on every append.
    """
    done = ctx.appended.get(path)
    if done is None or ctx.failure is not None:
        done = _appended_batch(spark, path, marker)
    if done is not None and done >= batch_id:
        log.info("merge batch %s: %s already holds this batch (a retried batch): not appended again", batch_id, path)
    else:
        writer = frame.write.format("delta").mode("append") \
            .option("userMetadata", json.dumps({"merge_batch": marker, "batch": batch_id}))
        for key, value in options.items():
            writer = writer.option(key, value)
        writer.save(path)
    ctx.appended[path] = batch_id


def _appended_batch(spark: SparkSession, path: str, marker: str) -> int | None:
    """The newest micro-batch id appended under marker, from the table's last commits (None: none there)."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    for row in DeltaTable.forPath(spark, path).history(APPEND_HISTORY_COMMITS).select("userMetadata").collect():
        try:
            meta = json.loads(row["userMetadata"] or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and meta.get("merge_batch") == marker:
            return int(meta["batch"])
    return None
