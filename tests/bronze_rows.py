"""Tests' way into the bronze log: rows written in the per-table typed layout (key, before, after as structs, a
source struct with some of the envelope's fields) become log rows of one table, as the merge's bronze step writes
them (lib/lake/bronze_log.py)."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from lib.lake import bronze_log, decode


def append(frame: DataFrame, table: str, path: str, seq: int) -> None:
    """Append typed rows of table to the bronze log at path as its log commit seq (creating the log)."""
    spark = frame.sparkSession
    bronze_log.ensure(spark, path)
    have = frame.columns
    source_fields = frame.schema["source"].dataType.fieldNames() if "source" in have else []
    source = F.struct(*[(F.col("source")[f.name] if f.name in source_fields else F.lit(None)).cast(f.dataType)
                        .alias(f.name) for f in decode.SOURCE_TYPE.fields])
    values = {"_table": F.lit(table), "key": F.to_variant_object("key"), "before": F.to_variant_object("before"),
              "after": F.to_variant_object("after"), "source": source, "_seq": F.lit(seq).cast("long"),
              "_tombstone": F.col("op").isNull() & F.col("after").isNull()}
    columns = [(values[f.name] if f.name in values else F.col(f.name) if f.name in have
                else F.lit(None)).cast(f.dataType).alias(f.name) if f.name not in ("key", "before", "after")
               else values[f.name].alias(f.name) for f in bronze_log.SCHEMA.fields]
    frame.select(*columns).write.format("delta").mode("append").save(path)
