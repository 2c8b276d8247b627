"""Bronze, every change as it arrived, and the dead-letter table: appended once per micro-batch."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

DEAD_LETTER_SCHEMA = T.StructType([
    T.StructField("topic", T.StringType()), T.StructField("partition", T.IntegerType()),
    T.StructField("offset", T.LongType()), T.StructField("timestamp", T.TimestampType()),
    T.StructField("key", T.BinaryType()), T.StructField("value", T.BinaryType()),
    T.StructField("reason", T.StringType()), T.StructField("detail", T.StringType()),
    T.StructField("key_schema_id", T.LongType()), T.StructField("value_schema_id", T.LongType()),
    T.StructField("batch_id", T.LongType()), T.StructField("query", T.StringType()),
    T.StructField("ingested_at", T.TimestampType())])


def bronze_rows(decoded: DataFrame) -> DataFrame:
    """Good decoded rows -> the bronze change-log layout (tombstones have op null and _tombstone true)."""
    return decoded.filter(F.col("__reason").isNull()).select(
        F.col("__key").alias("key"), F.col("__env.op").alias("op"), F.col("__env.before").alias("before"),
        F.col("__env.after").alias("after"), F.col("__env.source").alias("source"),
        F.col("__env.ts_ms").alias("ts_ms"), F.col("__env.transaction").alias("transaction"),
        F.col("__env.unchanged_cols").alias("unchanged_cols"), F.col("__tomb").alias("_tombstone"),
        F.col("topic").alias("_kafka_topic"), F.col("partition").alias("_kafka_partition"),
        F.col("offset").alias("_kafka_offset"), F.col("timestamp").alias("_kafka_timestamp"),
        F.col("__kid").alias("_key_schema_id"), F.col("__vid").alias("_value_schema_id"),
        F.col("__batch").alias("_batch_id"))


def dead_letter_rows(decoded: DataFrame, query: str) -> DataFrame:
    """Rows with a reason -> the dead-letter layout (raw bytes kept)."""
    return decoded.filter(F.col("__reason").isNotNull()).select(
        "topic", "partition", "offset", "timestamp", F.col("__k").alias("key"), F.col("__v").alias("value"),
        F.col("__reason").alias("reason"), F.col("__detail").alias("detail"),
        F.col("__kid").alias("key_schema_id"), F.col("__vid").alias("value_schema_id"),
        F.col("__batch").alias("batch_id"), F.lit(query).alias("query"), F.current_timestamp().alias("ingested_at"))


