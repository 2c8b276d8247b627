"""Silver, the current state: one row per key per micro-batch, then one MERGE guarded by the source position."""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from lib import config
from lib import spark as spark_session
from lib.capture import avro_schemas
from lib.lake import delta_io, lake_paths
from lib.lake.lake_paths import META_COLUMNS, MergeError, TableSpec, quote
from lib.lake.writer_schemas import Layout

log = logging.getLogger(__name__)

TOPIC_PROPERTY = "cdc.topic"  # the topic a silver table is built from (a re-keyed table moves to another)
KEY_PROPERTY = "cdc.key"  # its key columns, comma-separated (the views type the bronze log's keys by them)
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"  # what a commit says of itself
# Each MERGE writes new files (up to one per shuffle partition); without compaction a silver table fed every
# merge.silver_interval_s grows by hundreds of small files an hour (docs/benchmarks.md, the soak). Delta's auto
# compaction bins them once a table holds 50 small ones, right after the MERGE that made them.
AUTO_COMPACT = {"delta.autoOptimize.autoCompact": "true"}
HISTORY_COMMITS = 100  # silver commits searched for the bronze log commit applied last



def merge_source(decoded: DataFrame, layout: Layout, truncate: tuple[int, int] | None, toast: bool) -> DataFrame:
    """Good rows -> one row per key: the newest event (by commit_lsn, event_serial, partition, offset),
    TOAST-unchanged columns filled from older events of the batch, or a lone tombstone."""
    keys = [f.name for f in layout.key.fields]
    key_lower = {k.lower() for k in keys}
    payload = [f.name for f in layout.row.fields if f.name.lower() not in key_lower]
    good = decoded.filter(F.col("__reason").isNull())
    lsn, serial = F.col("__env.source.commit_lsn"), F.col("__env.source.event_serial")
    events = good.filter(~F.col("__tomb"))
    if truncate is not None:
        events = events.filter((lsn > truncate[0]) | ((lsn == truncate[0]) & (serial > truncate[1])))

    def shape(frame: DataFrame, key_of, kind: str, op: Column, after: Column) -> DataFrame:
        return frame.select(
            *[key_of(k).alias(k) for k in keys], after.alias("__after"), op.alias("__op"),
            lsn.alias("__lsn"), serial.alias("__serial"), F.col("partition").alias("__part"),
            F.col("offset").alias("__off"),
            F.coalesce(F.timestamp_millis(F.col("__env.source.ts_ms")), F.col("timestamp")).alias("__ts"),
            F.col("__env.unchanged_cols").alias("__unchanged"), F.lit(kind).alias("__kind"))

    rows = shape(events, lambda k: F.col("__key")[k], "event", F.col("__env.op"), F.col("__env.after"))
    # an update that changed the primary key (before carries the old key): the old key is deleted
    before = F.col("__env.before")
    moved = None
    if keys:
        changed = functools.reduce(lambda a, b: a | b, [before[k] != F.col("__key")[k] for k in keys])
        complete = functools.reduce(lambda a, b: a & b, [before[k].isNotNull() for k in keys])
        moved = events.filter((F.col("__env.op") == "u") & before.isNotNull() & changed & complete)
    if moved is not None:
        rows = rows.unionByName(shape(moved, lambda k: before[k], "event", F.lit("d"),
                                      F.lit(None).cast(layout.row)))
    # a tombstone that carries its delete's position (our capture's) is that delete, guarded like any event;
    # one without (Debezium's, or written before positions were sent) soft-deletes a live row
    placed = F.col("__tlsn").isNotNull()
    tombs = good.filter(F.col("__tomb"))
    if truncate is not None:
        tombs = tombs.filter(~placed | (F.col("__tlsn") > truncate[0])
                             | ((F.col("__tlsn") == truncate[0]) & (F.col("__tserial") > truncate[1])))
    tombs = tombs.select(
        *[F.col("__key")[k].alias(k) for k in keys], F.lit(None).cast(layout.row).alias("__after"),
        F.when(placed, F.lit("d")).alias("__op"), F.col("__tlsn").alias("__lsn"),
        F.col("__tserial").alias("__serial"), F.col("partition").alias("__part"),
        F.col("offset").alias("__off"), F.col("timestamp").alias("__ts"),
        F.array().cast("array<string>").alias("__unchanged"),
        F.when(placed, F.lit("event")).otherwise(F.lit("tombstone")).alias("__kind"))
    rows = rows.unionByName(tombs)
    is_event = F.col("__kind") == "event"
    order = F.when(is_event, F.struct("__lsn", "__serial", "__part", "__off"))
    aggs = [F.max_by(F.struct("__after", "__op", "__lsn", "__serial", "__ts"), order).alias("__w"),
            F.count(F.when(is_event, 1)).alias("__n"), F.max(F.when(~is_event, F.col("__ts"))).alias("__tts")]
    candidates = [c for c in payload if c in layout.nullable] if toast else []
    for i, c in enumerate(candidates):
        known = is_event & (F.col("__op") != "d") & F.col("__after").isNotNull() \
            & ~F.array_contains(F.col("__unchanged"), c)
        aggs.append(F.max_by(F.struct(F.col("__after")[c].alias("v")), F.when(known, order)).alias(f"__f{i}"))
    reduced = rows.groupBy(*keys).agg(*aggs)
    filled = {c: F.when(F.col(f"__f{i}").isNotNull(), F.col(f"__f{i}.v")) for i, c in enumerate(candidates)}
    unknown = (F.array_compact(F.array(*[F.when(F.col(f"__f{i}").isNull(), F.lit(c))
                                         for i, c in enumerate(candidates)]))
               if candidates else F.array().cast("array<string>"))
    return reduced.select(
        *keys, *[filled.get(c, F.col("__w.__after")[c]).alias(c) for c in payload],
        F.when(F.col("__n") > 0, "event").otherwise("tombstone").alias("__kind"),
        F.col("__w.__op").alias("__op"), F.col("__w.__lsn").alias("__lsn"), F.col("__w.__serial").alias("__serial"),
        F.when(F.col("__n") > 0, F.col("__w.__ts")).otherwise(F.col("__tts")).alias("__ts"),
        unknown.alias("__unchanged"))


def silver_schema(layout: Layout) -> T.StructType:
    """Silver's columns: the row's fields, then the merge's own columns."""
    return T.StructType([T.StructField(f.name, f.dataType) for f in layout.row.fields] + [
        T.StructField("_commit_lsn", T.LongType()), T.StructField("_event_serial", T.LongType()),
        T.StructField("_op", T.StringType()), T.StructField("_deleted", T.BooleanType()),
        T.StructField("_deleted_at", T.TimestampType()), T.StructField("_updated_at", T.TimestampType()),
        T.StructField("_unknown_cols", T.ArrayType(T.StringType())), T.StructField("_bronze_seq", T.LongType())])


def _align_columns(spark: SparkSession, path: str, spec: TableSpec, row: T.StructType):
    """Add new columns to silver and widen changed types; a change Delta cannot make raises with the remedy."""
    current = {f.name.lower(): f for f in spark.read.format("delta").load(path).schema.fields}
    added = [f for f in row.fields if f.name.lower() not in current]
    if "_bronze_seq" not in current:  # a silver table from before the bronze log
        added.append(T.StructField("_bronze_seq", T.LongType()))
    ident = f"delta.{quote(path)}"
    if added:
        spark.sql(f"ALTER TABLE {ident} ADD COLUMNS ("
                  + ", ".join(f"{quote(f.name)} {delta_io.sql_type(f.dataType)}" for f in added) + ")")
        log.info("merge %s: silver gained column(s) %s", spec.qualified, ", ".join(f.name for f in added))
    for f in row.fields:
        have = current.get(f.name.lower())
        if have is None or have.dataType.simpleString() == f.dataType.simpleString():
            continue
        if isinstance(have.dataType, T.DecimalType) and isinstance(f.dataType, T.DecimalType) \
                and f.dataType.precision - f.dataType.scale <= have.dataType.precision - have.dataType.scale \
                and f.dataType.scale <= have.dataType.scale:
            continue  # narrower decimal: values fit the stored type
        try:
            delta_io.allow_widening(spark, path)
            spark.sql(f"ALTER TABLE {ident} ALTER COLUMN {quote(have.name)} TYPE {f.dataType.simpleString()}")
        except Exception as exc:
            raise MergeError(
                f"silver table {spec.qualified} ({path}): column {have.name} is {have.dataType.simpleString()} but "
                f"the topic {spec.topic} now carries {f.dataType.simpleString()}, which Delta cannot widen to: "
                f"rebuild the silver table (move it away and replay the topic with a new checkpoint) or change the "
                f"column with ALTER TABLE; {type(exc).__name__}: {spark_session.error_line(exc)}") from exc


@dataclass(frozen=True)
class Clause:
    """One WHEN clause of the silver MERGE."""

    kind: str  # "matched update", "not matched insert" or "not matched by source update"
    condition: str
    assignments: dict[str, str]


_BUILDER = {"matched update": "whenMatchedUpdate", "not matched insert": "whenNotMatchedInsert",
            "not matched by source update": "whenNotMatchedBySourceUpdate"}


def merge_rule(keys: list[str], payload: list[str], filled: bool = True,
               truncate: tuple[int, int, object] | None = None, seq: int | None = None) -> tuple[str, list[Clause]]:
    """The silver rule as data: the ON condition and the clauses in order, for target t and source s.

    s holds one row per key (merge_source): its newest event (__kind 'event') or only a tombstone.
    An event applies when it is newer than the row (position (__lsn, __serial)), a delete keeps the
    row's values and marks it deleted; a tombstone marks a live row deleted; a new key is inserted.
    A truncate marks every older live row deleted. An empty table gets the insert clause only. Every row
    written gets _bronze_seq = seq, the bronze log commit silver is brought up to (the fresh view's bound).
    """
    stamp = {"_bronze_seq": str(int(seq))} if seq is not None else {}
    on = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in keys)
    newer = ("(s.__lsn > t._commit_lsn OR (s.__lsn = t._commit_lsn AND s.__serial > t._event_serial) "
             "OR (s.__lsn = t._commit_lsn AND s.__serial = t._event_serial AND t._op = 'tombstone' "
             "AND s.__op <> 'd'))")
    is_delete = "s.__op = 'd'"
    update = {quote(c): f"CASE WHEN {is_delete} OR array_contains(s.__unchanged, '{c}') THEN t.{quote(c)} "
                        f"ELSE s.{quote(c)} END" for c in payload}
    update.update({
        "_commit_lsn": "s.__lsn", "_event_serial": "s.__serial", "_op": "s.__op", "_deleted": is_delete,
        "_deleted_at": f"CASE WHEN {is_delete} THEN s.__ts END",
        "_updated_at": "s.__ts",
        "_unknown_cols": f"CASE WHEN {is_delete} THEN t._unknown_cols ELSE "
                         "nullif(array_intersect(coalesce(t._unknown_cols, array()), s.__unchanged), array()) END"})
    insert = {quote(c): f"s.{quote(c)}" for c in keys + payload}
    insert.update({"_commit_lsn": "s.__lsn", "_event_serial": "s.__serial", "_op": "s.__op", "_deleted": is_delete,
                   "_deleted_at": f"CASE WHEN {is_delete} THEN s.__ts END", "_updated_at": "s.__ts",
                   "_unknown_cols": f"CASE WHEN NOT {is_delete} THEN nullif(s.__unchanged, array()) END"})
    clauses = []
    if filled:  # an empty silver table (the first batch, typically the snapshot) takes Delta's insert-only path
        clauses += [Clause("matched update", "s.__kind = 'tombstone' AND NOT t._deleted",
                           {"_deleted": "true", "_op": "'tombstone'", "_deleted_at": "s.__ts", **stamp}),
                    Clause("matched update", f"s.__kind = 'event' AND {newer}", {**update, **stamp})]
    clauses.append(Clause("not matched insert", "s.__kind = 'event'", {**insert, **stamp}))
    if truncate is not None:
        lsn, serial, ts_ms = truncate
        clauses.append(Clause(
            "not matched by source update",
            f"NOT t._deleted AND (t._commit_lsn < {lsn} OR (t._commit_lsn = {lsn} AND t._event_serial < {serial}))",
            {"_deleted": "true", "_op": "'t'", "_commit_lsn": str(lsn), "_event_serial": str(serial),
             "_deleted_at": f"timestamp_millis({int(ts_ms)})" if ts_ms is not None else "current_timestamp()",
             **stamp}))
    return on, clauses


def merge_sql(target: str, source: str, keys: list[str], payload: list[str], filled: bool = True,
              truncate: tuple[int, int, object] | None = None, seq: int | None = None) -> str:
    """The silver MERGE as one SQL statement (what merge_silver runs)."""
    on, clauses = merge_rule(keys, payload, filled, truncate, seq)
    lines = [f"MERGE INTO {target} AS t", f"USING {source} AS s", f"ON {on}"]
    for clause in clauses:
        head = f"WHEN {clause.kind.rsplit(' ', 1)[0].upper()} AND {clause.condition} THEN"
        if clause.kind.endswith("insert"):
            columns = ", ".join(clause.assignments)
            values = ",\n    ".join(clause.assignments.values())
            lines.append(f"{head} INSERT ({columns})\n  VALUES (\n    {values})")
        else:
            sets = ",\n    ".join(f"{column} = {value}" for column, value in clause.assignments.items())
            lines.append(f"{head} UPDATE SET\n    {sets}")
    return "\n".join(lines)


def insert_sql(target: str, source: str, keys: list[str], payload: list[str], seq: int | None = None) -> str:
    """What the MERGE does to an empty silver table, as a plain append: its insert clause alone (source s holds one
    row per key, so nothing to match)."""
    _, clauses = merge_rule(keys, payload, filled=False, seq=seq)
    (insert,) = clauses
    values = ",\n  ".join(f"{value} AS {column}" for column, value in insert.assignments.items())
    return (f"INSERT INTO {target} ({', '.join(insert.assignments)})\nSELECT\n  {values}\nFROM {source} AS s\n"
            f"WHERE {insert.condition}")


def key_columns(conf: dict, spark: SparkSession, spec: TableSpec) -> list[str]:
    """A silver table's key columns: its cdc.key property, else the topic's newest key schema in the registry."""
    from lib import schema_registry

    path = lake_paths.silver_path(conf, spec)
    stored = delta_io.properties(spark, path).get(KEY_PROPERTY) if delta_io.is_table(spark, path) else None
    if stored:
        return stored.split(",")
    key_subject, _ = schema_registry.subjects(spec.topic)
    key = json.loads(schema_registry.client(conf).get_latest_version(key_subject).schema.schema_str)
    return [f["name"] for f in key["fields"]]


def merge_statement(conf: dict, spark: SparkSession, table: str) -> str:
    """The MERGE a silver step runs into a table's silver table, as SQL to read (its source: the table's bronze
    events since the last step, one row per key)."""
    spec = lake_paths.table_spec(conf, table)
    keys = key_columns(conf, spark, spec)
    silver = spark.read.format("delta").load(lake_paths.silver_path(conf, spec)).schema
    payload = [f.name for f in silver.fields if f.name not in keys and f.name not in META_COLUMNS]
    return merge_sql(f"delta.{quote(lake_paths.silver_path(conf, spec))}", "pending", keys, payload, seq=0)


def merge_silver(spark: SparkSession, path: str, spec: TableSpec, layout: Layout, source: DataFrame,
                 truncate: tuple[int, int, object] | None, seq: int, ready: dict | None = None,
                 offsets: dict[int, int] | None = None) -> None:
    """A table's MERGE of the bronze events up to log commit seq, recorded in the MERGE's own commit.

    The commit's userMetadata {"bronze_seq": seq} is what silver has applied (last_applied reads it back), so
    a step repeated after a crash reads the same events again and changes nothing (every clause requires a
    newer position or a live row). ``ready`` (the caller's per-table cache) skips the existence, schema and
    emptiness checks once they are known. ``offsets`` ({partition: the last Kafka offset of the table's topic
    silver holds}) goes into the same record: the fresh reader (lib/lake/fresh_read.py) reads the topic after it.
    """
    keys = [f.name for f in layout.key.fields]
    key_lower = {k.lower() for k in keys}
    payload = [f.name for f in layout.row.fields if f.name.lower() not in key_lower]
    ready = {} if ready is None else ready
    known = ready.get(path)
    if known is not None and known["row"] == layout.row and not known["filled"]:
        known["filled"] = delta_io.detail(spark, path)["numFiles"] > 0
    if known is None or known["row"] != layout.row:
        delta_io.ensure_table(spark, path, silver_schema(layout), keys + list(META_COLUMNS),
                              {TOPIC_PROPERTY: spec.topic, KEY_PROPERTY: ",".join(keys), **AUTO_COMPACT})
        _align_columns(spark, path, spec, layout.row)
        known = ready[path] = {"row": layout.row, "filled": False}
        found = delta_io.detail(spark, path)
        known["filled"] = found["numFiles"] > 0
        if any(found["properties"].get(k) != v for k, v in AUTO_COMPACT.items()):  # made before it was set
            options = ", ".join(f"{delta_io.literal(k)} = {delta_io.literal(v)}" for k, v in AUTO_COMPACT.items())
            spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ({options})")
    # a global view: the source may belong to another session than the MERGE (silver_step's side-by-side MERGEs)
    view = "cdc_silver_pending_" + re.sub(r"[^A-Za-z0-9_]", "_", spec.qualified)
    target, pending = f"delta.{quote(path)}", f"global_temp.{view}"
    # an empty table (the first step, typically the snapshot): the MERGE's insert clause as a plain append, no join
    statement = merge_sql(target, pending, keys, payload, True, truncate, seq) if known["filled"] \
        else insert_sql(target, pending, keys, payload, seq)
    source.createOrReplaceGlobalTempView(view)
    spark.conf.set(USER_METADATA, json.dumps(applied_record(spec, seq, offsets)))
    try:
        spark.sql(statement)
    finally:
        spark.conf.unset(USER_METADATA)
        spark.catalog.dropGlobalTempView(view)


def applied_record(spec: TableSpec, seq: int, offsets: dict[int, int] | None = None) -> dict:
    """What a silver commit says it applied: the bronze log commit reached and, when known, the last offset of
    each of the table's topic partitions it holds."""
    record = {"bronze_seq": int(seq), "table": spec.qualified}
    if offsets is not None:
        record.update(topic=spec.topic, offsets={str(p): int(o) for p, o in sorted(offsets.items())})
    return record


def record_applied(spark: SparkSession, path: str, spec: TableSpec, seq: int,
                   offsets: dict[int, int] | None = None) -> None:
    """Record that silver reached bronze log commit seq when it had nothing to change (a commit of its own)."""
    if not delta_io.is_table(spark, path):
        return
    spark.conf.set(USER_METADATA, json.dumps(applied_record(spec, seq, offsets)))
    try:
        spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('cdc.bronze_seq' = '{int(seq)}')")
    finally:
        spark.conf.unset(USER_METADATA)


def last_applied(spark: SparkSession, path: str) -> dict:
    """The record (applied_record) of silver's newest commit that has one; {} when none has."""
    return newest_record(delta_io.commit_metadata(spark, path, HISTORY_COMMITS))


def newest_record(texts) -> dict:
    """The first silver record among commits' userMetadata texts, newest first ({} when none is one)."""
    return delta_io.first_with(texts, "bronze_seq") or {}


def rebuild_moved(conf: dict, spark: SparkSession) -> list[str]:
    """Empty the silver table of each table conf now reads from a new topic (a re-keyed table); their names.

    Operators: the rows come back as the merge reads the new topic, which holds the table's chunked
    snapshot (python -m lib.operate.tables rekey); silver lacks rows until then.
    """
    prefix, emptied = config.get(conf, "kafka.topic_prefix"), []
    for spec in lake_paths.table_specs(conf):
        default = avro_schemas.topic_name(prefix, spec.qualified)
        path = lake_paths.silver_path(conf, spec)
        if spec.topic == default or not delta_io.is_table(spark, path):
            continue  # only a table named under kafka.topics can have moved
        built_from = delta_io.properties(spark, path).get(TOPIC_PROPERTY, default)
        if built_from == spec.topic:
            continue
        spark.sql(f"DELETE FROM delta.{quote(path)}")  # first: a crash before the property just empties it again
        spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('{TOPIC_PROPERTY}' = '{spec.topic}')")
        log.warning("merge %s: silver was built from topic %s and conf now reads %s (a re-keyed table): emptied, "
                    "rebuilt from %s", spec.qualified, built_from, spec.topic, spec.topic)
        emptied.append(spec.qualified)
    return emptied


def truncate_pending(spark: SparkSession, path: str, truncate: tuple[int, int, object]) -> bool:
    """True when silver still holds a live row older than the truncate's position."""
    if not delta_io.is_table(spark, path):
        return False
    lsn, serial, _ = truncate
    older = (F.col("_commit_lsn") < lsn) | ((F.col("_commit_lsn") == lsn) & (F.col("_event_serial") < serial))
    return bool(spark.read.format("delta").load(path).filter(~F.col("_deleted") & older).limit(1).count())


def cleanup_tombstones(conf: dict, spark: SparkSession, retention_hours: float | None = None) -> dict[str, int]:
    """Physically delete soft tombstones older than merge.tombstone_retention_hours; rows removed per table.

    Careful: after this, an event older than a removed tombstone (a replay from before the delete)
    can bring the row back. Keep the retention longer than the topics' delete.retention.ms and
    than any replay you may run.
    """
    hours = float(retention_hours if retention_hours is not None
                  else config.get(conf, "merge.tombstone_retention_hours"))
    removed = {}
    for spec in lake_paths.table_specs(conf):
        path = lake_paths.silver_path(conf, spec)
        if not delta_io.is_table(spark, path):
            continue
        done = spark.sql(f"DELETE FROM delta.{quote(path)} WHERE _deleted AND _deleted_at < current_timestamp() - "
                         f"make_dt_interval(0, 0, 0, {hours * 3600})").collect()
        removed[spec.qualified] = int(done[0][0]) if done and done[0][0] is not None else 0
    return removed
