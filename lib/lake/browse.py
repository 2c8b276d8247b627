"""Read the lake back: silver, bronze, one key's history, and a per-table summary."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from lib.lake import delta_io, lake_paths
from lib.lake.lake_paths import MergeError


def _lsn_text(c: Column) -> Column:
    """A PostgreSQL LSN as text 'X/Y' from its 64-bit value."""
    return F.concat(F.upper(F.hex(F.shiftright(c, 32))), F.lit("/"), F.upper(F.hex(c.bitwiseAND(0xFFFFFFFF))))


def summary(conf: dict, spark: SparkSession) -> DataFrame:
    """Per table: live silver rows, soft-deleted rows, rows with unknown TOAST columns, bronze events, last position."""
    out_schema = "table string, silver_rows long, deleted_rows long, unknown_toast_rows long, bronze_events long, " \
                 "last_commit_lsn long, last_lsn string"
    log = lake_paths.bronze_path(conf)
    events = spark.read.format("delta").load(log).filter(F.col("op").isNotNull() & (F.col("op") != "t")) \
        .groupBy(F.col("_table").alias("table")).agg(F.count(F.lit(1)).alias("bronze_events")) \
        if delta_io.is_table(spark, log) else spark.createDataFrame([], "table string, bronze_events long")
    frames = []
    for spec in lake_paths.table_specs(conf):
        silver = lake_paths.silver_path(conf, spec)
        if not delta_io.is_table(spark, silver):
            frames.append(spark.createDataFrame([(spec.qualified, None, None, None, None, None)],
                                                "table string, silver_rows long, deleted_rows long, "
                                                "unknown_toast_rows long, last_commit_lsn long, last_lsn string"))
            continue
        frames.append(spark.read.format("delta").load(silver).agg(  # one job for all tables, not one per table
            F.lit(spec.qualified).alias("table"), F.count(F.when(~F.col("_deleted"), 1)).alias("silver_rows"),
            F.count(F.when(F.col("_deleted"), 1)).alias("deleted_rows"),
            F.count(F.when(F.col("_unknown_cols").isNotNull() & ~F.col("_deleted"), 1)).alias("unknown_toast_rows"),
            F.max("_commit_lsn").alias("last_commit_lsn"), _lsn_text(F.max("_commit_lsn")).alias("last_lsn")))
    result = frames[0]
    for frame in frames[1:]:
        result = result.unionByName(frame)
    result = result.join(events, "table", "left")
    return result.select(*[part.split()[0] for part in out_schema.split(", ")])


def silver(conf: dict, spark: SparkSession, table: str, include_deleted: bool = False) -> DataFrame:
    """A silver table as a DataFrame (live rows only unless include_deleted)."""
    frame = spark.read.format("delta").load(lake_paths.silver_path(conf, lake_paths.table_spec(conf, table)))
    return frame if include_deleted else frame.filter(~F.col("_deleted"))


def bronze(conf: dict, spark: SparkSession, table: str) -> DataFrame:
    """A table's part of the bronze log, typed like its silver table (every event and tombstone the merge got)."""
    from lib.views import masking

    spec = lake_paths.table_spec(conf, table)
    silver_path = lake_paths.silver_path(conf, spec)
    schema = spark.read.format("delta").load(silver_path).schema if delta_io.is_table(spark, silver_path) else None
    relation = masking.bronze_relation(conf, spark, {}, spec.qualified, schema)
    if relation is None:
        raise MergeError(f"no bronze log at {lake_paths.bronze_path(conf)} yet for {spec.qualified}: run the merge "
                         f"(notebook 04) first")
    return spark.sql(f"SELECT * FROM {relation}")


def fresh(conf: dict, spark: SparkSession, table: str) -> DataFrame:
    """A table's current rows as the fresh view computes them, unmasked: silver plus the bronze log's events silver
    has not applied yet (notebook 04 shows it before a silver step; analysts query the masked <table>_fresh)."""
    from lib.views import masking, versions

    spec = lake_paths.table_spec(conf, table)
    silver_path = lake_paths.silver_path(conf, spec)
    if not delta_io.is_table(spark, silver_path):
        raise MergeError(f"no silver table for {spec.qualified} yet: run a silver step (merge.run_until_caught_up)")
    silver_source = f"delta.{lake_paths.quote(silver_path)}"
    schema = spark.read.format("delta").load(silver_path).schema
    relation = masking.bronze_relation(conf, spark, {}, spec.qualified, schema)
    select, _ = versions.fresh_select(spec.qualified, schema, spark.sql(f"SELECT * FROM {relation} LIMIT 0").schema,
                                      {"default": "keep"}, silver_source, relation, "unused.key_table")
    return spark.sql(select)


def busiest_key(conf: dict, spark: SparkSession, table: str) -> dict | None:
    """The key with the most events in a table's bronze (ties: the smallest key); None when bronze is empty."""
    row = bronze(conf, spark, table).filter(F.col("op").isNotNull()).groupBy("key").count() \
        .orderBy(F.desc("count"), "key").first()
    return row["key"].asDict() if row is not None else None


def silver_key(conf: dict, spark: SparkSession, table: str, key: dict | None) -> DataFrame:
    """The silver row of one key (a dict of primary key fields), soft-deleted or not; no row for None."""
    frame = silver(conf, spark, table, include_deleted=True)
    condition = F.lit(key is not None)
    for name, value in (key or {}).items():
        condition = condition & (F.col(name) == F.lit(value))
    return frame.filter(condition)


def key_history(conf: dict, spark: SparkSession, table: str, key: dict | None) -> DataFrame:
    """Bronze events and tombstones of one key (a dict of primary key fields) in the order they arrived,
    each with its source position (commit_lsn, event_serial; ``position`` as text), transaction and commit time."""
    frame = bronze(conf, spark, table)
    fields = frame.schema["key"].dataType.fieldNames()
    if key is None:  # no key to follow (an empty table): no events
        frame, key = frame.filter(F.lit(False)), {}
    elif sorted(key) != sorted(fields):
        raise MergeError(f"key of {table} is ({', '.join(fields)}), not ({', '.join(key)}): pass every key field")
    for name, value in key.items():
        frame = frame.filter(F.col("key").getField(name) == F.lit(value))
    lsn = _lsn_text(F.col("source.commit_lsn"))
    return frame.orderBy("_seq", "_kafka_partition", "_kafka_offset").select(
        "op", F.when(lsn.isNotNull(), F.format_string("(%s, %d)", lsn, F.col("source.event_serial"))).alias("position"),
        F.col("source.commit_lsn").alias("commit_lsn"), lsn.alias("lsn"),
        F.col("source.event_serial").alias("event_serial"), F.col("source.txId").cast("string").alias("tx_id"),
        F.timestamp_millis(F.col("source.ts_ms")).alias("commit_ts"), F.col("_tombstone").alias("tombstone"),
        "before", "after", "unchanged_cols", F.col("_kafka_partition").alias("partition"),
        F.col("_kafka_offset").alias("offset"), F.col("_batch_id").alias("batch"))


def dead_letter_counts(conf: dict, spark: SparkSession) -> DataFrame:
    """Dead-lettered messages by topic and reason, with the first and last offset of each."""
    path = lake_paths.dead_letter_path(conf)
    if not delta_io.is_table(spark, path):
        return spark.createDataFrame([], "topic string, reason string, messages long, first_offset long, "
                                         "last_offset long")
    return spark.read.format("delta").load(path).groupBy("topic", "reason").agg(
        F.count(F.lit(1)).alias("messages"), F.min("offset").alias("first_offset"),
        F.max("offset").alias("last_offset")).orderBy("topic", "reason")
