"""Bronze: one Delta change log for every table of a pipeline, appended once per decode step.

Each row is one event (or tombstone, or truncate) as the decode step (lib/lake/decode_step.py) decoded it from
the raw log (lib/lake/raw_log.py): the table it belongs to, the key and the row images as VARIANT (each table has
its own columns; one log holds them all, so a step costs one commit however many tables it covers), the
envelope's source and transaction, the Kafka coordinates and ``_seq``, the number of the raw log commit that
brought it (0, 1, 2, ... in commit order). Silver applies the log per table on its own cadence and records in
its own commit the ``_seq`` it applied up to (lib/lake/silver_step.py); the fresh view adds the log's newer rows
to silver.

Each commit's ``userMetadata`` holds {"merge_batch": "decode", "batch": <raw _seq reached>, "seq": <the same>,
"touched": {table: the last _seq holding one of its events}}: a repeated step starts after it, and a reader
learns which tables have events silver has not applied, without a scan. (The raw log's commits carry the same
keys, with the query and micro-batch that wrote them.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from lib.lake import decode, delta_io
from lib.lake.lake_paths import quote

HISTORY_COMMITS = 100  # commits searched for a retried batch's append and for the log's state
TRUNCATE_OP = "t"

SCHEMA = T.StructType([
    T.StructField("_table", T.StringType()), T.StructField("key", T.VariantType()),
    T.StructField("op", T.StringType()), T.StructField("before", T.VariantType()),
    T.StructField("after", T.VariantType()), T.StructField("source", decode.SOURCE_TYPE),
    T.StructField("ts_ms", T.LongType()), T.StructField("transaction", decode.TRANSACTION_TYPE),
    T.StructField("unchanged_cols", T.ArrayType(T.StringType())), T.StructField("_tombstone", T.BooleanType()),
    T.StructField("_tombstone_lsn", T.LongType()), T.StructField("_tombstone_serial", T.LongType()),
    T.StructField("_kafka_topic", T.StringType()), T.StructField("_kafka_partition", T.IntegerType()),
    T.StructField("_kafka_offset", T.LongType()), T.StructField("_kafka_timestamp", T.TimestampType()),
    T.StructField("_key_schema_id", T.LongType()), T.StructField("_value_schema_id", T.LongType()),
    T.StructField("_batch_id", T.LongType()), T.StructField("_seq", T.LongType())])


@dataclass
class State:
    """Where the log stands: its last _seq, and per table the last _seq holding one of its events."""

    seq: int = -1
    touched: dict[str, int] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)  # query marker -> its last micro-batch appended


def ensure(spark: SparkSession, path: str) -> None:
    """Create the log if missing (deletion vectors off: it is only ever appended to)."""
    delta_io.ensure_table(spark, path, SCHEMA)


PER_TABLE = ("_table", "key", "op", "before", "after", "source", "ts_ms", "transaction", "unchanged_cols",
             "__reason", "__detail")  # the log columns whose expression differs from table to table


def log_columns(table: str, tag: str, reason: Column, detail: Column) -> dict[str, Column]:
    """A table's decoded rows (lib/lake/decode.py, names with ``tag``) in the log's layout, their raw commit's _seq,
    plus why a row cannot be merged (reason, detail: dead letters, with their raw __k and __v), by column name."""
    env = F.col(f"__env{tag}")
    return {
        "_table": F.lit(table), "key": F.to_variant_object(F.col(f"__key{tag}")), "op": env["op"],
        "before": F.to_variant_object(env["before"]), "after": F.to_variant_object(env["after"]),
        "source": env["source"], "ts_ms": env["ts_ms"], "transaction": env["transaction"],
        "unchanged_cols": env["unchanged_cols"], "_tombstone": F.col("__v").isNull(),
        "_tombstone_lsn": F.col("__tlsn"), "_tombstone_serial": F.col("__tserial"),
        "_kafka_topic": F.col("topic"), "_kafka_partition": F.col("partition"), "_kafka_offset": F.col("offset"),
        "_kafka_timestamp": F.col("timestamp"), "_key_schema_id": F.col("__kid"), "_value_schema_id": F.col("__vid"),
        "__reason": reason, "__detail": detail, "_batch_id": F.col("_batch_id"), "_seq": F.col("_seq"),
        "_query": F.col("_query"), "__k": F.col("__k"), "__v": F.col("__v")}


def rows_of_tables(decoded: DataFrame, tables: list[tuple[Column, dict[str, Column]]]) -> DataFrame:
    """Decoded rows of several tables side by side (each row decoded for its own table) in the log's layout.

    ``tables``: per table, the condition its rows meet and its log_columns. A column that differs by table
    is one CASE over the tables, so the batch is one projection however many tables it holds.
    """
    columns = []
    for name in tables[0][1]:
        if name not in PER_TABLE or len(tables) == 1:
            columns.append(tables[0][1][name].alias(name))
            continue
        chosen = F.when(tables[0][0], tables[0][1][name])
        for condition, table_columns in tables[1:]:
            chosen = chosen.when(condition, table_columns[name])
        columns.append(chosen.alias(name))
    return decoded.select(*columns)


def good(combined: DataFrame) -> DataFrame:
    """The rows of rows_of_tables that go to the log."""
    return combined.filter(F.col("__reason").isNull()).select(*SCHEMA.fieldNames())


def truncates(spark: SparkSession, path: str) -> dict[str, tuple]:
    """The newest truncate the log holds per table: {table: (commit_lsn, event_serial, ts_ms)}."""
    found = spark.read.format("delta").load(path).filter(F.col("op") == TRUNCATE_OP).groupBy("_table").agg(
        F.max_by(F.struct(F.col("source.commit_lsn").alias("l"), F.col("source.event_serial").alias("s"),
                          F.col("ts_ms").alias("t")), F.col("_seq")).alias("c")).collect()
    return {row["_table"]: (row["c"]["l"], row["c"]["s"], row["c"]["t"]) for row in found}


def state(spark: SparkSession, path: str) -> State:
    """The log's state from its newest commits (a log without commits: seq -1)."""
    found = State()
    for text in delta_io.commit_metadata(spark, path, HISTORY_COMMITS):
        meta = _metadata(text)
        if meta is None:
            continue
        if found.seq < 0:
            found.seq, found.touched = int(meta["seq"]), {k: int(v) for k, v in meta.get("touched", {}).items()}
        found.batches.setdefault(meta["merge_batch"], int(meta["batch"]))
    return found


def _metadata(text: str | None) -> dict | None:
    """A log commit's userMetadata, or None for a commit the merge did not write (OPTIMIZE, table creation)."""
    try:
        meta = json.loads(text or "{}")
    except ValueError:
        return None
    return meta if isinstance(meta, dict) and "seq" in meta and "merge_batch" in meta else None


def append_decoded(spark: SparkSession, path: str, frame: DataFrame, meta: dict) -> None:
    """Append a decode step's rows (each keeps its raw log _seq) as one commit carrying meta (lib/lake/decode_step)."""
    frame.write.format("delta").mode("append").option("userMetadata", json.dumps(meta, sort_keys=True)).save(path)


def pending_slice(spark: SparkSession, path: str, after: dict[str, int], upto_seq: int) -> DataFrame:
    """The log rows of the tables in ``after`` ({table: the _seq silver applied}) up to upto_seq, in one read."""
    return spark.read.format("delta").load(path).filter(
        F.col("_table").isin(*after) & (F.col("_seq") > min(after.values())) & (F.col("_seq") <= upto_seq))


def events(spark: SparkSession, path: str, table: str, after_seq: int, upto_seq: int, key: T.StructType,
           row: T.StructType, log: DataFrame | None = None) -> DataFrame:
    """A table's log rows with after_seq < _seq <= upto_seq, shaped like decode's output (typed again).

    What silver_table.merge_source reads: __key, __env (before, after, source, op, unchanged_cols), __tomb,
    __tlsn, __tserial, partition, offset, timestamp, __reason (always null: dead letters never reach the log).
    ``log``: where to read them (pending_slice's rows), else the log at path.
    """
    log = (log if log is not None else spark.read.format("delta").load(path)).filter(
        (F.col("_table") == table) & (F.col("_seq") > after_seq) & (F.col("_seq") <= upto_seq)
        & ((F.col("op") != TRUNCATE_OP) | F.col("op").isNull()))
    env = F.struct(F.col("before").cast(row).alias("before"), F.col("after").cast(row).alias("after"),
                   F.col("source"), F.col("op"), F.col("ts_ms"), F.col("transaction"),
                   F.coalesce(F.col("unchanged_cols"), F.array().cast("array<string>")).alias("unchanged_cols"))
    return log.select(
        F.col("key").cast(key).alias("__key"), env.alias("__env"), F.col("_tombstone").alias("__tomb"),
        F.col("_tombstone_lsn").alias("__tlsn"), F.col("_tombstone_serial").alias("__tserial"),
        F.col("_kafka_partition").alias("partition"), F.col("_kafka_offset").alias("offset"),
        F.col("_kafka_timestamp").alias("timestamp"), F.lit(None).cast("string").alias("__reason"),
        F.col("_value_schema_id").alias("__vid"), F.col("_key_schema_id").alias("__kid"))


def relation(source: str, table: str, key: T.StructType, row: T.StructType) -> str:
    """SQL of a table's part of the log (source: how SQL names the log, e.g. delta.`<path>`), typed as the views
    read it: key, before and after as structs, every other column as stored."""
    typed = {"key": key, "before": row, "after": row}
    columns = ", ".join(f"CAST({quote(f.name)} AS {delta_io.sql_type(typed[f.name])}) AS {quote(f.name)}"
                        if f.name in typed else quote(f.name) for f in SCHEMA.fields)
    return f"(SELECT {columns} FROM {source} WHERE `_table` = {delta_io.literal(table)})"

