"""The dead-letter table: messages the merge cannot decode, with their raw bytes and why; appended once per
decode step (lib/lake/decode_step.py) and replayed by merge.replay_dead_letters once they decode."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

SCHEMA = T.StructType([
    T.StructField("topic", T.StringType()), T.StructField("partition", T.IntegerType()),
    T.StructField("offset", T.LongType()), T.StructField("timestamp", T.TimestampType()),
    T.StructField("key", T.BinaryType()), T.StructField("value", T.BinaryType()),
    T.StructField("reason", T.StringType()), T.StructField("detail", T.StringType()),
    T.StructField("key_schema_id", T.LongType()), T.StructField("value_schema_id", T.LongType()),
    T.StructField("batch_id", T.LongType()), T.StructField("query", T.StringType()),
    T.StructField("ingested_at", T.TimestampType())])


REPLAY_PREFIX = "replay-dead-letters-"  # the query name of merge.replay_dead_letters' records in the raw log


def rows(combined: DataFrame) -> DataFrame:
    """The rows with a reason (lib/lake/bronze_log.py rows_of_tables) in the dead-letter layout."""
    return combined.filter(F.col("__reason").isNotNull()).select(
        F.col("_kafka_topic").alias("topic"), F.col("_kafka_partition").alias("partition"),
        F.col("_kafka_offset").alias("offset"), F.col("_kafka_timestamp").alias("timestamp"),
        F.col("__k").alias("key"), F.col("__v").alias("value"), F.col("__reason").alias("reason"),
        F.col("__detail").alias("detail"), F.col("_key_schema_id").alias("key_schema_id"),
        F.col("_value_schema_id").alias("value_schema_id"), F.col("_batch_id").alias("batch_id"),
        F.col("_query").alias("query"), F.current_timestamp().alias("ingested_at"))
