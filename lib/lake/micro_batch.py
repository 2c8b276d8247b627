"""One micro-batch of the merge's streaming query: every table's Kafka records appended undecoded to the raw log in
one commit (lib/lake/raw_log.py), with the truncates the control topic announced. The decode step
(lib/lake/decode_step.py) fills the bronze log from the raw log and silver applies it on its own cadence
(lib/lake/silver_step.py), so a trigger is one projection of fixed width and its cost does not grow with the
tables it touches (docs/merge.md). A trigger of few tables (merge.decode_in_trigger_tables) in the merge service
decodes its own rows into bronze right after its raw commit: on a trickle a row waits for one trigger, not for a
trigger and then a decode step.

``process_batch`` is the streaming query's foreachBatch function; its write is idempotent, so a retried
batch changes nothing it already wrote.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lib import config, control
from lib import spark as spark_session
from lib.lake import bronze_log, decode, decode_step, delta_io, lake_paths, raw_log
from lib.lake.lake_paths import MergeError, TableSpec

log = logging.getLogger(__name__)


@dataclass
class MergeContext:
    """What the micro-batch function keeps across batches: conf, caches, the query's identity, stats."""

    conf: dict
    query: str
    specs: list[TableSpec]
    app_id: str | None = None  # '<query name>-<query id>' once known
    history: list[dict] = field(default_factory=list)
    session: SparkSession | None = None  # the session that started the query (knows its id)
    failure: tuple[int, BaseException] | None = None  # the last batch that raised, and why
    log_state: bronze_log.State | None = None  # the raw log's last _seq and tables (read once, then kept)
    truncates_logged: dict[str, tuple] | None = None  # table -> the truncate the log holds last
    retired: frozenset = frozenset()  # topics re-keyed tables wrote before: read (Spark needs it), skipped
    active: bool = False  # a micro-batch is running now (the silver cadence waits for bronze to be idle)
    active_since: float | None = None  # when the running micro-batch began (monotonic seconds)
    checkpoint: str | None = None  # the query's checkpoint: where its id is found when no session lists the query
    decoding: decode_step.Decoding | None = None  # set: a trigger of few tables decodes them itself (in_trigger)

    def spec(self, topic: str) -> TableSpec | None:
        """The table a topic belongs to."""
        return next((s for s in self.specs if s.topic == topic), None)


def context(conf: dict, query: str | None = None, app_id: str | None = None) -> MergeContext:
    """A MergeContext for conf (start() makes one; tests call process_batch with it directly)."""
    return MergeContext(conf=conf, query=query or lake_paths.query_name(conf), specs=lake_paths.table_specs(conf),
                        app_id=app_id)


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
    path = lake_paths.raw_path(ctx.conf)
    control_topic = control.topic(ctx.conf)
    # one partition per core, not one per topic-partition: each task writes a file of the commit (153 topic-partitions
    # would leave 153 small files per trigger)
    cores = spark_session.cores(spark)
    raw = decode.headers(batch.coalesce(cores) if cores else batch).persist()
    phases, mark = {}, [time.monotonic()]

    def phase(name: str) -> None:  # seconds per part of the batch, in its stats (and the metrics records)
        now = time.monotonic()
        phases[name], mark[0] = round(now - mark[0], 3), now

    try:
        present = {row["topic"]: row for row in raw.groupBy("topic").agg(
            F.count(F.lit(1)).alias("n"), F.count(F.when(F.col("__v").isNull(), 1)).alias("tombs"),
            F.collect_set("__vid").alias("v"), F.collect_set("__kid").alias("k")).collect()}
        stats = {"batch_id": batch_id, "tables": {}, "phases": phases}
        phase("read")
        if not present:
            return stats
        unknown = [t for t in present if t != control_topic and t not in ctx.retired and ctx.spec(t) is None]
        if unknown:
            raise MergeError(f"micro-batch {batch_id} holds topic(s) {', '.join(unknown)}, which are not configured "
                             f"tables' topics; check source.tables and kafka.topic_prefix")
        if ctx.log_state is None:
            delta_io.clear_failed_creation(path)
            raw_log.ensure(spark, path)
            ctx.log_state = _log_state(spark, ctx.conf, path)
        if ctx.truncates_logged is None:
            bronze = lake_paths.bronze_path(ctx.conf)  # a lake from before the raw log: its truncates count too
            ctx.truncates_logged = {**(bronze_log.truncates(spark, bronze) if delta_io.is_table(spark, bronze)
                                       else {}), **raw_log.truncates(spark, path)}
        cuts = {table: cut for table, cut in truncates(ctx.conf).items()
                if ctx.truncates_logged.get(table) != cut and any(s.qualified == table for s in ctx.specs)}
        phase("control")
        mine = [spec for spec in ctx.specs if spec.topic in present]
        for spec in mine:
            row = present[spec.topic]
            stats["tables"][spec.qualified] = {"events": row["n"] - row["tombs"], "tombstones": row["tombs"]}
        logged = []
        if mine:
            table = F.create_map(*[F.lit(x) for spec in mine for x in (spec.topic, spec.qualified)])[F.col("topic")]
            logged.append(raw_log.rows(raw, table, ctx.query, batch_id).filter(F.col("_table").isNotNull()))
        if cuts:
            logged.append(raw_log.truncate_rows(spark, cuts, ctx.query, batch_id))
            for name in cuts:
                stats["tables"].setdefault(name, {})["truncated_before"] = list(cuts[name][:2])
        touched = {spec.qualified for spec in mine} | set(cuts)
        appended = False
        if touched:
            frame = functools.reduce(DataFrame.unionByName, logged)
            appended = raw_log.append(spark, path, frame, ctx.log_state, app, batch_id, touched)
        phase("append")
        _fire("after_bronze", batch_id, ",".join(sorted(touched)))
        if appended and ctx.decoding is not None and len(touched) <= int(
                config.get(ctx.conf, "merge.decode_in_trigger_tables")):
            seq = ctx.log_state.seq
            ids = {**{table: ([], []) for table in cuts},
                   **{spec.qualified: (present[spec.topic]["v"], present[spec.topic]["k"]) for spec in mine}}
            written = frame.withColumn("_seq", F.lit(seq).cast("long"))
            stats["decoded"] = decode_step.in_trigger(ctx.conf, spark, ctx.decoding, written, seq, ids)["seq"]
            phase("decode")
        ctx.truncates_logged.update(cuts)
        stats["seq"] = ctx.log_state.seq
        stats["seconds"] = round(time.monotonic() - began, 2)
        ctx.history = (ctx.history + [stats])[-100:]
        log.info("merge batch %s: %s", batch_id, stats)
        return stats
    finally:
        raw.unpersist()


def _log_state(spark: SparkSession, conf: dict, path: str) -> bronze_log.State:
    """The raw log's state; a new raw log beside a bronze log from before it goes on from that log's numbers (so a
    _seq never repeats, and silver's record of the bronze commit it applied keeps its meaning)."""
    found = bronze_log.state(spark, path)
    bronze = lake_paths.bronze_path(conf)
    if found.seq < 0 and delta_io.is_table(spark, bronze):
        before = bronze_log.state(spark, bronze)
        found.seq, found.touched = before.seq, dict(before.touched)
    return found


def _fire(stage: str, batch_id: int, tables: str) -> None:
    """Called after a batch's bronze commit; nothing here (a test replaces it to crash at that point)."""
