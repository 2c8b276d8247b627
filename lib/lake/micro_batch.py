"""One micro-batch of the merge's bronze step: decode each table's records, append them all to the bronze log in
one commit, set dead letters aside. Silver is not touched here: lib/lake/silver_step.py applies the log on its own
cadence, so a trigger's cost does not grow with the tables it touches (docs/merge.md).

``process_batch`` is the streaming query's foreachBatch function; its writes are idempotent, so a retried
batch changes nothing it already wrote.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lib import config, control
from lib import spark as spark_session
from lib.lake import bronze_log, dead_letter, decode, delta_io, lake_paths, writer_schemas
from lib.lake.lake_paths import MergeError, TableSpec
from lib.lake.writer_schemas import Layout, Schemas

log = logging.getLogger(__name__)

APPEND_HISTORY_COMMITS = 100  # commits searched for a retried batch's dead-letter append


@dataclass
class MergeContext:
    """What the micro-batch function keeps across batches: conf, caches, the query's identity, stats."""

    conf: dict
    query: str
    specs: list[TableSpec]
    schemas: Schemas
    app_id: str | None = None  # '<query name>-<query id>' once known
    history: list[dict] = field(default_factory=list)
    session: SparkSession | None = None  # the session that started the query (knows its id)
    failure: tuple[int, BaseException] | None = None  # the last batch that raised, and why
    log_state: bronze_log.State | None = None  # the bronze log's last _seq and tables (read once, then kept)
    truncates_logged: dict[str, tuple] | None = None  # table -> the truncate the log holds last
    appended: dict = field(default_factory=dict)  # dead-letter path -> last batch id appended by this context
    retired: frozenset = frozenset()  # topics re-keyed tables wrote before: read (Spark needs it), skipped
    active: bool = False  # a micro-batch is running now (the silver cadence waits for bronze to be idle)
    active_since: float | None = None  # when the running micro-batch began (monotonic seconds)
    checkpoint: str | None = None  # the query's checkpoint: where its id is found when no session lists the query

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
        if active:
            ctx.app_id = f"{ctx.query}-{active[0].id}"
        elif ctx.checkpoint:  # over Spark Connect this runs on the server: the id the query wrote at its start
            ctx.app_id = f"{ctx.query}-{json.loads(spark.read.text(f'{ctx.checkpoint}/metadata').first()[0])['id']}"
        else:
            raise MergeError(f"merge query {ctx.query} is not active in this session, so its id (part of the Delta "
                             f"idempotence ids) is unknown; pass app_id to context() when calling process_batch")
    return ctx.app_id


_CONTEXTS: dict = {}  # (query, checkpoint) -> the MergeContext of a BatchFunction in this process (its caches)


@dataclass
class BatchFunction:
    """The foreachBatch function where it runs in another process (a Spark Connect server's Python worker): it
    carries only conf and names, and keeps its MergeContext (caches, registry client) in that process.

    Its records stay there too: a client reads a query's progress from Spark (query.recentProgress)."""

    conf: dict
    query: str
    checkpoint: str
    retired: frozenset = frozenset()
    root: str = str(config.PROJECT_ROOT)  # where conf's relative paths (lake.root) resolve: the client's project

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        key = (self.query, self.checkpoint)
        if key not in _CONTEXTS:
            if not config.PROJECT_ROOT.is_dir():  # lib came from the carried archive, not from a project folder
                config.use_project_root(self.root)
            _CONTEXTS[key] = context(self.conf, self.query)
            _CONTEXTS[key].checkpoint, _CONTEXTS[key].retired = self.checkpoint, self.retired
        process_batch(batch, batch_id, _CONTEXTS[key])


def process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    """foreachBatch body: every table's events into the bronze log (one commit), dead letters; the batch's counts.

    Safe to run again with the same batch_id (a retried batch): a log or dead-letter append that was
    committed is found by its batch id and not repeated.
    """
    ctx.active, ctx.active_since = True, time.monotonic()
    try:
        return _process_batch(batch, batch_id, ctx)
    except BaseException as exc:
        ctx.failure = (batch_id, exc)
        raise
    finally:
        ctx.active = False


def _process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    spark = batch.sparkSession
    app = _app_id(ctx, spark)
    began = time.monotonic()
    path = lake_paths.bronze_path(ctx.conf)
    control_topic = control.topic(ctx.conf)
    # one cached partition per core, not one per topic-partition: the batch's decode scans this cache once, and each
    # task builds every table's decoders (a Hadoop Configuration per from_avro): 153 tasks over Connect took 344 s
    cores = spark_session.cores(spark)
    raw = decode.headers(batch.coalesce(cores) if cores else batch).persist()
    frames = [raw]
    phases, mark = {}, [time.monotonic()]

    def phase(name: str) -> None:  # seconds per part of the batch, in its stats (and the metrics records)
        now = time.monotonic()
        phases[name], mark[0] = round(now - mark[0], 3), now

    try:
        present = {row["topic"]: row for row in raw.groupBy("topic").agg(
            F.collect_set("__vid").alias("v"), F.collect_set("__kid").alias("k")).collect()}
        stats = {"batch_id": batch_id, "tables": {}, "dead_letters": {}, "phases": phases}
        phase("read")
        if not present:
            return stats
        unknown = [t for t in present if t != control_topic and t not in ctx.retired and ctx.spec(t) is None]
        if unknown:
            raise MergeError(f"micro-batch {batch_id} holds topic(s) {', '.join(unknown)}, which are not configured "
                             f"tables' topics; check source.tables and kafka.topic_prefix")
        _clear_failed_creations([path])
        if ctx.log_state is None:
            bronze_log.ensure(spark, path)
            ctx.log_state = bronze_log.state(spark, path)
        if ctx.truncates_logged is None:
            ctx.truncates_logged = bronze_log.truncates(spark, path)
        cuts = {table: cut for table, cut in truncates(ctx.conf).items()
                if ctx.truncates_logged.get(table) != cut and any(s.qualified == table for s in ctx.specs)}
        phase("control")
        plans = []
        for n, spec in enumerate(ctx.specs):
            row = present.get(spec.topic)
            if row is None:
                continue
            layout = writer_schemas.table_layout(spark, ctx.schemas, spec, set(row["v"]), set(row["k"]))
            _refuse_unknown_ids(ctx, raw, spec, layout, set(row["v"]), set(row["k"]))
            plans.append((n, spec.topic, _plan(ctx, n, spec, layout, raw)))
        combined = _decoded(raw, plans).persist() if plans else None
        if combined is not None:
            frames.append(combined)
            combined = combined.withColumn("_batch_id", F.lit(batch_id).cast("long"))  # over the cache: see _decoded
        phase("plan")
        if combined is None and not cuts:
            return stats
        counts = _counts(combined) if combined is not None else {}
        phase("decode")
        for table, mine in counts.items():
            good = mine.get(None)
            bad = {reason: c["n"] for reason, c in mine.items() if reason is not None}
            stats["tables"][table] = {"events": good["n"] - good["tombs"] if good else 0,
                                      "tombstones": good["tombs"] if good else 0, "dead_letters": sum(bad.values())}
            for reason, n in bad.items():
                stats["dead_letters"][reason] = stats["dead_letters"].get(reason, 0) + n
        logged = [bronze_log.good(combined)] if combined is not None else []
        if cuts:
            logged.append(bronze_log.truncate_rows(spark, cuts, batch_id))
            for table in cuts:
                stats["tables"].setdefault(table, {})["truncated_before"] = list(cuts[table][:2])
        touched = {t for t, c in counts.items() if c.get(None)} | set(cuts)
        if touched:
            bronze_log.append(spark, path, functools.reduce(DataFrame.unionByName, logged), ctx.log_state, app,
                              batch_id, touched)
        phase("append")
        _fire("after_bronze", batch_id, ",".join(sorted(touched)))
        ctx.truncates_logged.update(cuts)
        if stats["dead_letters"]:
            _write_dead_letters(spark, ctx, dead_letter.rows(combined, ctx.query), app, batch_id,
                                stats["dead_letters"])
        stats["seq"] = ctx.log_state.seq
        stats["seconds"] = round(time.monotonic() - began, 2)
        ctx.history = (ctx.history + [stats])[-100:]
        log.info("merge batch %s: %s", batch_id, stats)
        return stats
    finally:
        for frame in frames:
            frame.unpersist()


_PLANS: dict = {}  # (driver, table, writer layout) -> decode plan and log columns: a cache, never the lake's state
PLANS_KEPT = 2000


def _plan(ctx: MergeContext, n: int, spec: TableSpec, layout: Layout, raw: DataFrame) -> tuple:
    """A table's decode plan and log columns for a batch of many tables (the table: n, its place in ctx.specs),
    built once per process and writer layout (later batches and catch-ups reuse them)."""
    from pyspark import SparkContext

    key = (id(SparkContext._gateway), n, spec.qualified, tuple(layout.value_ids), tuple(layout.key_ids),
           layout.row.json(), layout.key.json(), json.dumps(layout.semantic, sort_keys=True),
           json.dumps(layout.pg_names, sort_keys=True))
    if key not in _PLANS:
        if len(_PLANS) >= PLANS_KEPT:
            _PLANS.clear()
        tag = f"_t{n}"
        decoding = decode.plan(raw.withColumn("__t", F.lit(n)), ctx.schemas, layout, tag, F.col("__t") == n)
        _PLANS[key] = (decoding, bronze_log.log_columns(spec.qualified, tag, decoding.reason, decoding.detail))
    return _PLANS[key]


def _decoded(raw: DataFrame, plans: list[tuple]) -> DataFrame:
    """Every table's rows of the batch decoded side by side, in the log's layout (bronze_log.rows_of_tables).

    One projection per step for the whole batch, each row decoded by its own table's plan only (the plans'
    guard: __t, the table's place in ctx.specs), instead of a branch per table scanning the batch again: a
    batch's decode, and the plan Spark builds for it, no longer grow with the tables it touches.
    ``plans``: (n, topic, (decode plan, log columns)) per table present.

    Nothing in it changes from batch to batch (the batch id is added over its cached result): Spark compiles a
    projection to Java once per distinct code, and writes a long literal into that code, so a projection that held
    the batch id was compiled again on every batch (seconds for 51 tables; and a new class each time).
    """
    place = F.create_map(*[F.lit(x) for n, topic, _ in plans for x in (topic, n)])[F.col("topic")]
    framed = raw.select(*decode.BASE, place.alias("__t")).filter(F.col("__t").isNotNull())
    stage = framed.select("*", *[c for _, _, (decoding, _) in plans for c in decoding.stage])
    mapped = {name: c for _, _, (decoding, _) in plans for name, c in decoding.mapped.items()}
    if mapped:
        stage = stage.select(*[mapped.get(name, F.col(name)) for name in stage.columns])
    out = stage.select(*decode.BASE, "__t", *[c for _, _, (decoding, _) in plans for c in decoding.out])
    return bronze_log.rows_of_tables(out, [(F.col("__t") == n, columns) for n, _, (_, columns) in plans])


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


def _counts(combined: DataFrame) -> dict[str, dict]:
    """One job for every table of the batch: {table: {reason or None: {n, tombs}}}."""
    rows = combined.groupBy("_table", "__reason").agg(
        F.count(F.lit(1)).alias("n"), F.count(F.when(F.col("_tombstone"), 1)).alias("tombs")).collect()
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["_table"], {})[r["__reason"]] = {"n": r["n"], "tombs": r["tombs"]}
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


def _fire(stage: str, batch_id: int, tables: str) -> None:
    """Called after a batch's bronze commit; nothing here (a test replaces it to crash at that point)."""


def _write_dead_letters(spark: SparkSession, ctx: MergeContext, frame: DataFrame, app: str, batch_id: int,
                        reasons: dict) -> None:
    """Append the batch's poison messages to the dead-letter table, once per micro-batch like bronze."""
    path = lake_paths.dead_letter_path(ctx.conf)
    _clear_failed_creations([path])
    _append_once(spark, ctx, path, frame, f"{app}/_dead_letter", batch_id)
    log.warning("merge batch %s: %s message(s) went to the dead-letter table %s: %s", batch_id,
                sum(reasons.values()), path, reasons)


def _append_once(spark: SparkSession, ctx: MergeContext, path: str, frame: DataFrame, marker: str,
                 batch_id: int) -> None:
    """Append frame to a Delta table unless this micro-batch's append under marker is already there.

    The commit carries ``userMetadata`` {"merge_batch": marker, "batch": id}. A batch this context has
    not appended itself (the first one, or any after a failed batch) is first looked up in the table's
    last APPEND_HISTORY_COMMITS commits and skipped when found.
    """
    done = ctx.appended.get(path)
    if done is None or ctx.failure is not None:
        done = _appended_batch(spark, path, marker)
    if done is not None and done >= batch_id:
        log.info("merge batch %s: %s already holds this batch (a retried batch): not appended again", batch_id, path)
    else:
        frame.write.format("delta").mode("append") \
            .option("userMetadata", json.dumps({"merge_batch": marker, "batch": batch_id})).save(path)
    ctx.appended[path] = batch_id


def _appended_batch(spark: SparkSession, path: str, marker: str) -> int | None:
    """The newest micro-batch id appended under marker, from the table's last commits (None: none there)."""
    for text in delta_io.commit_metadata(spark, path, APPEND_HISTORY_COMMITS):
        try:
            meta = json.loads(text or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and meta.get("merge_batch") == marker:
            return int(meta["batch"])
    return None
