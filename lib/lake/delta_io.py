"""Delta through SQL (Spark Connect runs it too): create a table, ask what it is, let a column widen."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from lib.lake.lake_paths import quote


def ensure_table(spark: SparkSession, path: str, schema: T.StructType, stats_columns: list[str] | None = None,
                 properties: dict[str, str] | None = None) -> None:
    """Create the Delta table at path if missing (SQL, which Spark Connect runs too).

    Deletion vectors stay off: on small micro-batches they made each MERGE several jobs slower. Type
    widening is not on from the start: readers other than Spark (delta-rs, Polars, DuckDB) refuse a
    table with that feature, so allow_widening turns it on only when a column actually widens.
    """
    props = {"delta.enableDeletionVectors": "false", **(properties or {})}
    if stats_columns and len(schema.fields) > 32:
        props["delta.dataSkippingStatsColumns"] = ",".join(quote(c) for c in stats_columns)
    columns = ", ".join(f"{quote(f.name)} {sql_type(f.dataType)}" for f in schema.fields)
    options = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in props.items())
    spark.sql(f"CREATE TABLE IF NOT EXISTS delta.{quote(path)} ({columns}) USING delta TBLPROPERTIES ({options})")


def sql_type(datatype: T.DataType) -> str:
    """A Spark type as SQL, field names quoted (a column may be called `first name`)."""
    if isinstance(datatype, T.StructType):
        return "struct<" + ", ".join(f"{quote(f.name)}: {sql_type(f.dataType)}" for f in datatype.fields) + ">"
    if isinstance(datatype, T.ArrayType):
        return f"array<{sql_type(datatype.elementType)}>"
    if isinstance(datatype, T.MapType):
        return f"map<{sql_type(datatype.keyType)}, {sql_type(datatype.valueType)}>"
    return datatype.simpleString()


def literal(text: str) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("\\", "\\\\").replace("'", "\\'") + "'"


def properties(spark: SparkSession, path: str) -> dict[str, str]:
    """The table's properties (DESCRIBE DETAIL)."""
    return dict(spark.sql(f"DESCRIBE DETAIL delta.{quote(path)}").collect()[0]["properties"] or {})


def has_files(spark: SparkSession, path: str) -> bool:
    """True when the table holds data files."""
    return bool(spark.sql(f"DESCRIBE DETAIL delta.{quote(path)}").collect()[0]["numFiles"])


def is_table(spark: SparkSession, path: str) -> bool:
    """True when a Delta table exists at path (asked through SQL, which Spark Connect runs too)."""
    from pyspark.errors import AnalysisException

    try:
        spark.sql(f"DESCRIBE DETAIL delta.{quote(path)}").select("format").collect()
        return True
    except AnalysisException:
        return False


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


def newest_metadata(spark: SparkSession | None, path: str, key: str, limit: int = 100) -> dict | None:
    """The newest commit's userMetadata (JSON) that has key, or None; a local table is read from its _delta_log
    files (no Spark needed: make status, the monitor), a remote one through DESCRIBE HISTORY."""
    import json
    import os

    def parse(text):
        try:
            meta = json.loads(text or "{}")
        except ValueError:
            return None
        return meta if isinstance(meta, dict) and key in meta else None

    folder = os.path.join(path, "_delta_log")
    if "://" not in path or path.startswith("file:"):
        folder = folder.removeprefix("file:")
        if not os.path.isdir(folder):
            return None
        commits = sorted((name for name in os.listdir(folder) if name.endswith(".json") and name[:20].isdigit()),
                         reverse=True)[:limit]
        for name in commits:
            with open(os.path.join(folder, name)) as handle:
                for line in handle:
                    info = json.loads(line).get("commitInfo")
                    if info is not None:
                        found = parse(info.get("userMetadata"))
                        if found is not None:
                            return found
        return None
    if spark is None or not is_table(spark, path):
        return None
    for row in spark.sql(f"DESCRIBE HISTORY delta.{quote(path)} LIMIT {limit}").select("userMetadata").collect():
        found = parse(row["userMetadata"])
        if found is not None:
            return found
    return None
