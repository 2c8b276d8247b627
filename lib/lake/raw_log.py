"""The raw log: every table's Kafka records as they arrived, appended once per trigger without decoding them.

The merge's streaming query writes here and nothing else (lib/lake/micro_batch.py): the bytes of key and value,
their schema ids, a tombstone's position, the Kafka coordinates, and per commit the same ``_seq`` and
``userMetadata`` as the bronze log (lib/lake/bronze_log.py: {"merge_batch", "batch", "seq", "touched"}). A trigger
is one projection of fixed width and one commit, however many tables and writer schemas it holds, so its cost
does not grow with the tables. A truncate from the control topic is a row with ``op = 't'`` and its position.

lib/lake/decode_step.py decodes the commits the bronze log lacks into it (the rows keep their ``_seq``), beside the
silver step, so the bronze log, silver and the views read decoded rows as before.
"""

from __future__ import annotations

import json
import logging

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from lib.lake import bronze_log, decode, delta_io, lake_paths
from lib.lake.bronze_log import TRUNCATE_OP  # the decode step copies a truncate row's op into bronze

log = logging.getLogger(__name__)

SCHEMA = T.StructType([
    T.StructField("_table", T.StringType()), T.StructField("_key", T.BinaryType()),
    T.StructField("_value", T.BinaryType()), T.StructField("_key_framed", T.BooleanType()),
    T.StructField("_value_framed", T.BooleanType()), T.StructField("_key_schema_id", T.LongType()),
    T.StructField("_value_schema_id", T.LongType()), T.StructField("_tombstone_lsn", T.LongType()),
    T.StructField("_tombstone_serial", T.LongType()), T.StructField("_kafka_topic", T.StringType()),
    T.StructField("_kafka_partition", T.IntegerType()), T.StructField("_kafka_offset", T.LongType()),
    T.StructField("_kafka_timestamp", T.TimestampType()), T.StructField("op", T.StringType()),
    T.StructField("_commit_lsn", T.LongType()), T.StructField("_event_serial", T.LongType()),
    T.StructField("ts_ms", T.LongType()), T.StructField("_query", T.StringType()),
    T.StructField("_batch_id", T.LongType()), T.StructField("_seq", T.LongType())])

FROM_HEADERS = {"__k": "_key", "__v": "_value", "__kf": "_key_framed", "__vf": "_value_framed",
                "__kid": "_key_schema_id", "__vid": "_value_schema_id", "__tlsn": "_tombstone_lsn",
                "__tserial": "_tombstone_serial", "topic": "_kafka_topic", "partition": "_kafka_partition",
                "offset": "_kafka_offset", "timestamp": "_kafka_timestamp"}  # decode.headers' names -> the log's


def ensure(spark: SparkSession, path: str) -> None:
    """Create the raw log if missing."""
    delta_io.ensure_table(spark, path, SCHEMA)


def rows(framed: DataFrame, table: Column, query: str, batch_id: int) -> DataFrame:
    """A trigger's Kafka rows (from decode.headers) in the raw log's layout (no _seq yet); table: each row's table."""
    values = {**{log: F.col(name) for name, log in FROM_HEADERS.items()}, "_table": table,
              "_query": F.lit(query), "_batch_id": F.lit(batch_id).cast("long")}
    return framed.select(*[values[f.name].alias(f.name) if f.name in values else F.lit(None).cast(f.dataType)
                           .alias(f.name) for f in SCHEMA.fields if f.name != "_seq"])


def append(spark: SparkSession, path: str, frame: DataFrame, log_state: bronze_log.State, marker: str, batch_id: int,
           tables: set[str]) -> bool:
    """Append frame as the log's next commit (its _seq), once per micro-batch; False when already there.

    A micro-batch the log holds already (a retried batch after a crash past the commit) is not
    appended again: its marker and batch id are in the commit's userMetadata.
    """
    if log_state.batches.get(marker, -1) >= batch_id:
        return False
    seq = log_state.seq + 1
    touched = {**log_state.touched, **{table: seq for table in tables}}
    meta = {"merge_batch": marker, "batch": batch_id, "seq": seq, "touched": touched}
    frame.withColumn("_seq", F.lit(seq).cast("long")).write.format("delta").mode("append") \
        .option("userMetadata", json.dumps(meta, sort_keys=True)).save(path)
    log_state.seq, log_state.touched, log_state.batches[marker] = seq, touched, batch_id
    return True


def truncate_rows(spark: SparkSession, cuts: dict[str, tuple], query: str, batch_id: int) -> DataFrame:
    """One 't' row per table truncated since the last trigger: {table: (commit_lsn, event_serial, ts_ms)}."""
    found = [(table, TRUNCATE_OP, int(lsn), int(serial), int(ts) if ts is not None else None)
             for table, (lsn, serial, ts) in sorted(cuts.items())]
    frame = spark.createDataFrame(found, "_table string, op string, _commit_lsn long, _event_serial long, "
                                         "ts_ms long")
    values = {"_query": F.lit(query), "_batch_id": F.lit(batch_id).cast("long")}
    return frame.select(*[F.col(f.name) if f.name in frame.columns else values.get(f.name, F.lit(None)).cast(
        f.dataType).alias(f.name) for f in SCHEMA.fields if f.name != "_seq"])


def truncates(spark: SparkSession, path: str) -> dict[str, tuple]:
    """The newest truncate the raw log holds per table: {table: (commit_lsn, event_serial, ts_ms)}."""
    if not delta_io.is_table(spark, path):
        return {}
    found = spark.read.format("delta").load(path).filter(F.col("op") == TRUNCATE_OP).groupBy("_table").agg(
        F.max_by(F.struct("_commit_lsn", "_event_serial", "ts_ms"), F.col("_seq")).alias("c")).collect()
    return {row["_table"]: (row["c"]["_commit_lsn"], row["c"]["_event_serial"], row["c"]["ts_ms"]) for row in found}


def pending(spark: SparkSession, path: str, after_seq: int, upto_seq: int) -> DataFrame:
    """The raw rows of the commits after after_seq up to upto_seq."""
    return spark.read.format("delta").load(path).filter((F.col("_seq") > after_seq) & (F.col("_seq") <= upto_seq))


PRUNE_ATTEMPTS = 3  # a trigger appends every second: a DELETE that meets one is tried again, then left for later


def prune(spark: SparkSession, path: str, decoded_seq: int) -> bool:
    """Delete the raw rows of the commits the bronze log holds decoded (_seq <= decoded_seq): the raw log keeps
    only what the decode step has still to read. Its commits' userMetadata, which the trigger's sequence and
    retried-batch check read, stay in the Delta log.

    Delta refuses the DELETE when a trigger appended meanwhile (ConcurrentAppendException, though the new rows are
    all above decoded_seq): it is tried again, and after PRUNE_ATTEMPTS left to the next compaction (False), with
    a warning: the raw log then keeps more rows a while, and nothing is lost."""
    if decoded_seq < 0:
        return True
    for attempt in range(1, PRUNE_ATTEMPTS + 1):
        try:
            spark.sql(f"DELETE FROM delta.{lake_paths.quote(path)} WHERE _seq <= {int(decoded_seq)}")
            return True
        except Exception as exc:  # noqa: BLE001 - only Delta's concurrent-append conflict is expected here
            if "ConcurrentAppendException" not in str(exc) and "DELTA_CONCURRENT_APPEND" not in str(exc):
                raise
            log.info("raw log %s: prune to _seq %s met a trigger's append (attempt %s of %s)", path, decoded_seq,
                     attempt, PRUNE_ATTEMPTS)
    log.warning("raw log %s: prune to _seq %s met a trigger's append %s times; left to the next compaction (the "
                "raw log keeps those decoded rows meanwhile; nothing is lost)", path, decoded_seq, PRUNE_ATTEMPTS)
    return False


def as_headers(raw: DataFrame) -> DataFrame:
    """Raw log rows (records, not truncates) named as decode.headers names them, with _table, _query, _batch_id and
    _seq: what decode.plan reads."""
    return raw.filter(F.col("op").isNull()).select(
        *[F.col(log).alias(name) for name, log in FROM_HEADERS.items()], "_table", "_query", "_batch_id", "_seq")


def bronze_truncates(raw: DataFrame) -> DataFrame:
    """The raw rows' truncates as bronze log rows (lib/lake/bronze_log.py's layout), their _seq kept."""
    position = {"commit_lsn": F.col("_commit_lsn"), "event_serial": F.col("_event_serial"), "ts_ms": F.col("ts_ms")}
    source = F.struct(*[position.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
                        for f in decode.SOURCE_TYPE.fields])
    values = {"_table": F.col("_table"), "op": F.col("op"), "ts_ms": F.col("ts_ms"), "_batch_id": F.col("_batch_id"),
              "_seq": F.col("_seq"), "source": source}
    return raw.filter(F.col("op") == TRUNCATE_OP).select(*[
        values[f.name].alias(f.name) if f.name in values else F.lit(None).cast(f.dataType).alias(f.name)
        for f in bronze_log.SCHEMA.fields])

