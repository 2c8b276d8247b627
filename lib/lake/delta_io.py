"""Delta writes the merge repeats per table: create a table once, append a frame once per micro-batch."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from lib.lake.lake_paths import quote


def ensure_table(spark: SparkSession, path: str, schema: T.StructType, stats_columns: list[str] | None = None,
                 properties: dict[str, str] | None = None):
    """Create the Delta table at path if missing.

    Deletion vectors stay off: on small micro-batches they made each MERGE several jobs slower. Type
    widening is not on from the start: readers other than Spark (delta-rs, Polars, DuckDB) refuse a
    table with that feature, so allow_widening turns it on only when a column actually widens.
    """
    from delta.tables import DeltaTable

    if DeltaTable.isDeltaTable(spark, path):
        return DeltaTable.forPath(spark, path)
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema) \
        .property("delta.enableDeletionVectors", "false")
    if stats_columns and len(schema.fields) > 32:
        builder = builder.property("delta.dataSkippingStatsColumns", ",".join(quote(c) for c in stats_columns))
    for key, value in (properties or {}).items():
        builder = builder.property(key, value)
    return builder.execute()


def widens(current: T.DataType, new: T.DataType) -> bool:
    """True when new changes the type of a field current has (at any depth), e.g. int -> bigint."""
    if isinstance(current, T.StructType) and isinstance(new, T.StructType):
        have = {f.name.lower(): f.dataType for f in current.fields}
        return any(widens(have[f.name.lower()], f.dataType) for f in new.fields if f.name.lower() in have)
    if isinstance(current, T.ArrayType) and isinstance(new, T.ArrayType):
        return widens(current.elementType, new.elementType)
    return current.simpleString() != new.simpleString()


def allow_widening(spark: SparkSession, path: str) -> None:
    """Turn on Delta type widening for the table at path, before a column widens in place.

    Operators: from then on the table carries the typeWidening reader feature, which Spark and
    Databricks read and some other readers (delta-rs 1.6, hence Polars and DuckDB's delta) refuse.
    """
    spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('delta.enableTypeWidening' = 'true')")
