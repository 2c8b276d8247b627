"""Reconcile silver with the source: row counts, an order-independent checksum and a sample of differing keys.

For each table the source is read with psycopg2 on the driver (each value as its type's output
function writes it, which is what pgoutput sends (a cast to text differs for bool, char(n), inet, ...),
under ``pgtypes.SESSION_SETTINGS``, a server-side cursor read ``chunk_rows`` at a time, each value
through ``pgtypes.converter`` exactly as the capture converts it), loaded into a Spark DataFrame (chunks
beyond the first are staged as parquet under ``<lake.root>/_reconcile/<schema>/<table>``, so the
driver holds one chunk at a time), and compared in Spark with silver's live rows
(``_deleted = false``; the merge's ``_`` columns left out).

Both sides are put in one canonical form before hashing: dates as days since 1970-01-01,
timestamps (with or without time zone) as microseconds since the epoch, everything else in the
Spark type the merge gives the column. A row's hash is ``xxhash64`` over its columns; the table's
checksum is the sum of the hashes, so row order does not matter. When counts or checksums differ,
a full outer join on the primary key finds a sample of keys that are missing, extra or different.

Columns the source has but silver lacks (added in the source, no change since) are compared as
null; columns only silver has (dropped in the source) are left out and listed.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

from psycopg2 import sql
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro

from lib import config, source
from lib import spark as spark_session
from lib.capture import avro_schemas, catalog, pgtypes
from lib.lake import delta_io, lake_paths
from lib.lake.lake_paths import META_COLUMNS, MergeError, quote


def canonical_type(dtype: T.DataType) -> T.DataType:
    """The comparison type of a column: dates -> int days, timestamps -> long microseconds, arrays element-wise."""
    if isinstance(dtype, T.DateType):
        return T.IntegerType()
    if isinstance(dtype, (T.TimestampType, T.TimestampNTZType)):
        return T.LongType()
    if isinstance(dtype, T.ArrayType):
        return T.ArrayType(canonical_type(dtype.elementType))
    return dtype


def canonical(c: Column, dtype: T.DataType) -> Column:
    """A Spark column of type dtype in its canonical form (no time zone involved)."""
    if isinstance(dtype, T.DateType):
        return F.unix_date(c)
    if isinstance(dtype, T.TimestampType):
        return F.unix_micros(c)
    if isinstance(dtype, T.TimestampNTZType):
        seconds = F.extract(F.lit("SECOND"), c)  # decimal(8,6): seconds with their fraction
        return (F.unix_date(F.to_date(c)).cast("long") * 86_400_000_000 + F.hour(c).cast("long") * 3_600_000_000
                + F.minute(c).cast("long") * 60_000_000 + (seconds * 1_000_000).cast("long"))
    if isinstance(dtype, T.ArrayType):
        return F.transform(c, lambda x: canonical(x, dtype.elementType))
    return c


def source_types(spark: SparkSession, table: catalog.Table, conf: dict) -> T.StructType:
    """Spark types the merge gives the table's columns (from its Avro value schema; no job)."""
    schema = avro_schemas.value_schema(table, config.get(conf, "kafka.topic_prefix"),
                                       config.get(conf, "source.unknown_types"))
    frame = spark.range(0).select(from_avro(F.lit(None).cast("binary"), json.dumps(schema)).alias("e"))
    return frame.schema["e"].dataType["after"].dataType


def _source_frame(spark: SparkSession, conn, table: catalog.Table, fields: list[tuple[catalog.Column, str]],
                  schema: T.StructType, staging: str, chunk_rows: int, unknown_types: str) -> DataFrame:
    """The source table's rows in canonical form; staged as parquet when larger than one chunk."""
    convert = [pgtypes.converter(col, unknown_types) for col, _ in fields]
    query = sql.SQL("SELECT {} FROM {}.{}").format(
        sql.SQL(", ").join(sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE format('%s', {0}) END").format(
            sql.Identifier(col.name)) for col, _ in fields),
        sql.Identifier(table.schema), sql.Identifier(table.name))
    frame, staged = None, False
    with conn.cursor(name=f"reconcile_{uuid.uuid4().hex[:8]}") as cur:
        cur.itersize = chunk_rows
        cur.execute(query)
        while True:
            rows = cur.fetchmany(chunk_rows)
            if not rows and frame is not None:
                break
            try:
                chunk = [tuple(fn(value) for fn, value in zip(convert, row, strict=True)) for row in rows]
            except ValueError as exc:
                raise MergeError(f"reconcile {table.qualified}: {exc}") from exc
            part = spark.createDataFrame(chunk, schema) if spark_session.is_remote(spark) else \
                spark.createDataFrame(chunk, schema, verifySchema=False)  # Connect has no such option (it warns)
            if frame is None and len(rows) < chunk_rows:
                return part  # one chunk: no staging
            part.write.mode("append" if staged else "overwrite").parquet(staging)
            staged, frame = True, part
            if len(rows) < chunk_rows:
                break
    return spark.read.schema(schema).parquet(staging)


def declared_keys(conf: dict, specs: list) -> dict[str, list[str]]:
    """source.keys of the given table specs, by their schema.table names."""
    keys = config.get(conf, "source.keys") or {}
    names = dict(zip([s.qualified for s in lake_paths.table_specs(conf)], config.get(conf, "source.tables"),
                     strict=True))
    return {s.qualified: keys[names[s.qualified]] for s in specs if names.get(s.qualified) in keys}


def reconcile(conf: dict, spark: SparkSession, tables: list[str] | None = None, sample: int = 10,
              dbname: str | None = None, chunk_rows: int = 50_000, conn=None,
              against: dict[str, DataFrame] | None = None) -> list[dict]:
    """Compare every configured table (or those named) with its silver table, or with the frame
    ``against`` holds for it (such as the table's fresh view; its live rows, silver's column names).

    Returns per table: table, source_rows, silver_rows, equal, differences (up to ``sample`` dicts
    of the key columns plus ``kind``: missing_in_silver, extra_in_silver or different),
    columns_compared and columns_only_in_silver. ``conn`` (a psycopg2 connection, left open) replaces
    the pipeline role's connection to source.database (or ``dbname``).
    """
    specs = [s for s in lake_paths.table_specs(conf) if not tables or s.qualified in tables or s.name in tables]
    unknown_types = config.get(conf, "source.unknown_types")
    own, autocommit = conn is None, None
    if own:
        conn = source.connect(conf, dbname=dbname, options=pgtypes.session_options())
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
    else:  # a caller's connection: read in a transaction of our own, rolled back at the end
        autocommit, conn.autocommit = conn.autocommit, False
        with conn.cursor() as cur:
            for name, value in pgtypes.SESSION_SETTINGS.items():
                cur.execute("SELECT set_config(%s, %s, true)", (name, value))
    results = []
    try:
        sql_names = {s.qualified: catalog.sql_name(s.schema, s.name) for s in specs}
        declared = {sql_names[q]: key for q, key in declared_keys(conf, specs).items()}
        described = catalog.describe_tables(conn, list(sql_names.values()), declared)
        for spec in specs:
            table = described[sql_names[spec.qualified]]
            names = avro_schemas.field_names(table.columns)
            fields = [(col, names[col.name]) for col in table.columns if not col.generated]
            types = source_types(spark, table, conf)
            schema = T.StructType([T.StructField(f.name, canonical_type(f.dataType)) for f in types.fields])
            keys = [names[k] for k in table.primary_key]
            staging = lake_paths.lake_path(conf, "_reconcile", spec.schema, spec.name)
            src = _source_frame(spark, conn, table, fields, schema, staging, chunk_rows, unknown_types)
            path = lake_paths.silver_path(conf, spec)
            if against and spec.qualified in against:
                silver = against[spec.qualified]
            elif delta_io.is_table(spark, path):
                silver = spark.read.format("delta").load(path).filter(~F.col("_deleted"))
            else:
                silver = spark.createDataFrame([], T.StructType([T.StructField(f.name, f.dataType)
                                                                 for f in types.fields]))
            have = {f.name.lower(): f for f in silver.schema.fields}
            cols = []
            for f in types.fields:
                found = have.get(f.name.lower())
                value = F.lit(None).cast(f.dataType) if found is None else \
                    F.col(quote(found.name)) if found.dataType == f.dataType else \
                    F.col(quote(found.name)).cast(f.dataType)
                cols.append(canonical(value, f.dataType).cast(canonical_type(f.dataType)).alias(f.name))
            silver = silver.select(*cols)
            result = compare(src, silver, keys, sample)
            wanted = {f.name.lower() for f in types.fields}
            results.append({"table": spec.qualified, **result, "columns_compared": [f.name for f in types.fields],
                            "columns_only_in_silver": [f.name for f in have.values() if f.name.lower() not in wanted
                                                       and f.name not in META_COLUMNS]})
            if not config.is_remote(staging) and os.path.isdir(staging):
                shutil.rmtree(staging, ignore_errors=True)
    finally:
        if own:
            conn.close()
        else:
            conn.rollback()
            conn.autocommit = autocommit
    return results


def compare(src: DataFrame, silver: DataFrame, keys: list[str], sample: int = 10) -> dict:
    """Counts and checksums of two frames with the same columns; a sample of differing keys when they differ."""
    columns = [quote(c) for c in src.columns]
    hashed_src = src.select(*[F.col(quote(k)) for k in keys], F.xxhash64(*columns).alias("__h"))
    hashed_silver = silver.select(*[F.col(quote(k)) for k in keys], F.xxhash64(*columns).alias("__h"))
    totals = {r["side"]: r for r in hashed_src.select(F.lit("source").alias("side"), "__h").unionByName(
        hashed_silver.select(F.lit("silver").alias("side"), "__h")).groupBy("side").agg(
        F.count(F.lit(1)).alias("n"), F.sum(F.col("__h").cast("decimal(38,0)")).alias("checksum")).collect()}
    src_n = totals["source"]["n"] if "source" in totals else 0
    silver_n = totals["silver"]["n"] if "silver" in totals else 0
    equal = src_n == silver_n and (src_n == 0 or totals["source"]["checksum"] == totals["silver"]["checksum"])
    differences = []
    if not equal:
        joined = hashed_src.withColumnRenamed("__h", "__hs").join(
            hashed_silver.withColumnRenamed("__h", "__ht"), keys, "full_outer")
        kind = F.when(F.col("__ht").isNull(), "missing_in_silver").when(F.col("__hs").isNull(), "extra_in_silver") \
            .otherwise("different")
        rows = joined.filter(F.col("__hs").isNull() | F.col("__ht").isNull() | (F.col("__hs") != F.col("__ht"))) \
            .select(*keys, kind.alias("kind")).orderBy(*keys).limit(sample).collect()
        differences = [r.asDict() for r in rows]
    return {"source_rows": src_n, "silver_rows": silver_n, "equal": equal, "differences": differences}


def as_frame(spark: SparkSession, results: list[dict]) -> DataFrame:
    """reconcile()'s results as a small DataFrame for display (differences as text)."""
    rows = [(r["table"], r["source_rows"], r["silver_rows"], r["equal"],
             "; ".join(", ".join(f"{k}={v}" for k, v in d.items()) for d in r["differences"])) for r in results]
    return spark.createDataFrame(rows, "table string, source_rows long, silver_rows long, equal boolean, "
                                       "sample_differences string")
