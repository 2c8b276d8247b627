"""Delta writes the merge repeats per table: create a table once, append a frame once per micro-batch."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from lib.lake.lake_paths import quote


def ensure_table(spark: SparkSession, path: str, schema: T.StructType, stats_columns: list[str] | None = None):
    """Create the Delta table at path if missing, with type widening on (int -> bigint in place).

    Deletion vectors stay off: on small micro-batches they made each MERGE several jobs slower.
    """
    from delta.tables import DeltaTable

    if DeltaTable.isDeltaTable(spark, path):
        return DeltaTable.forPath(spark, path)
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema) \
        .property("delta.enableDeletionVectors", "false").property("delta.enableTypeWidening", "true")
    if stats_columns and len(schema.fields) > 32:
        builder = builder.property("delta.dataSkippingStatsColumns", ",".join(quote(c) for c in stats_columns))
    return builder.execute()


