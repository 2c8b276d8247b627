"""Reconcile silver with the source: row counts, an order-independent checksum and a sample of differing keys.

The source is read where the data is, as the snapshot reads it: a driver connection exports a snapshot
(``pg_export_snapshot``) and keeps it open while the executors read each table with the snapshot's reader
(``snapshot.reader``: Spark's JDBC reader by key ranges, or COPY by block ranges; JDBC when a caller lends its own
connection), every connection inside that one snapshot (``snapshot_read.read_table``, the snapshot's own SQL and
conversions). Each row is then encoded with the table's Avro value schema and decoded again with it
(``to_avro`` then ``from_avro``), which is what the pipeline does to every value between PostgreSQL and silver,
and compared in Spark with silver's live rows (``_deleted = false``; the merge's ``_`` columns left out). Only
counts, checksums and a sample of differing keys come back to the driver, however large the table.

Both sides are put in one canonical form before hashing: dates as days since 1970-01-01,
timestamps (with or without time zone) as microseconds since the epoch, everything else in the
Spark type the merge gives the column. A row's hash is ``xxhash64`` over all its columns (none left out); the
table's checksum is the sum of the hashes, so row order does not matter. When counts or checksums differ,
a full outer join on the primary key finds a sample of keys that are missing, extra or different, and for a
different row the columns that differ.

Columns the source has but silver lacks (added in the source, no change since) are compared as
null; columns only silver has (dropped in the source) are left out and listed.
"""

from __future__ import annotations

import functools
import json
import math

import psycopg2
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro, to_avro

from lib import config, schema_registry, source
from lib import spark as spark_session
from lib.capture import avro_schemas, catalog, pgtypes, snapshot_read, snapshot_write
from lib.lake import delta_io, lake_paths
from lib.lake.lake_paths import META_COLUMNS, MergeError, quote

# the counting job's tasks each read this many of the source's partitions (and silver's files beside them), at least
# one task per core: every task sends the driver its result and the metrics of every table's plan (docs/benchmarks.md)
PARTITIONS_PER_TASK = 8


def type_sql(dtype: T.DataType) -> str:
    """dtype as a CAST in Spark SQL names it (struct fields in backticks)."""
    if isinstance(dtype, T.ArrayType):
        return f"array<{type_sql(dtype.elementType)}>"
    if isinstance(dtype, T.MapType):
        return f"map<{type_sql(dtype.keyType)},{type_sql(dtype.valueType)}>"
    if isinstance(dtype, T.StructType):
        return "struct<" + ",".join(f"{quote(f.name)}:{type_sql(f.dataType)}" for f in dtype.fields) + ">"
    return dtype.simpleString()


def canonical(expr: str, dtype: T.DataType, depth: int = 0) -> str:
    """Spark SQL of expr (of type dtype) in its canonical form, dates as int days, timestamps as long
    microseconds (arrays element-wise); no time zone involved.

    SQL text rather than Column objects: one call per frame builds a table's projection (a Column is a call to the
    driver's JVM each, from the notebook's Python)."""
    if isinstance(dtype, T.DateType):
        return f"unix_date({expr})"
    if isinstance(dtype, T.TimestampType):
        return f"unix_micros({expr})"
    if isinstance(dtype, T.TimestampNTZType):  # extract(SECOND ...) is decimal(8,6): seconds with their fraction
        return (f"CAST(unix_date(to_date({expr})) AS BIGINT) * 86400000000 + CAST(hour({expr}) AS BIGINT) * 3600000000"
                f" + CAST(minute({expr}) AS BIGINT) * 60000000 + CAST(extract(SECOND FROM {expr}) * 1000000 AS BIGINT)")
    if isinstance(dtype, T.ArrayType):
        element = f"x{depth}"
        return f"transform({expr}, {element} -> {canonical(element, dtype.elementType, depth + 1)})"
    return expr


def source_types(spark: SparkSession, table: catalog.Table, conf: dict) -> T.StructType:
    """Spark types the merge gives the table's columns (from its Avro value schema; no job)."""
    schema = avro_schemas.value_schema(table, config.get(conf, "kafka.topic_prefix"),
                                       config.get(conf, "source.unknown_types"))
    frame = spark.range(0).select(from_avro(F.lit(None).cast("binary"), json.dumps(schema)).alias("e"))
    return frame.schema["e"].dataType["after"].dataType


def _source_frame(conf: dict, spark: SparkSession, conn, table: catalog.Table, snapshot: str,
                  types: T.StructType, login: dict | None) -> tuple[DataFrame, int]:
    """The source table's rows as of the exported snapshot, read by the executors, in canonical form; and the
    number of partitions the read is split into."""
    unknown_types = config.get(conf, "source.unknown_types")
    copy = config.get(conf, "snapshot.reader") == "copy" and login is None  # the snapshot's reader, as conf says
    plan = snapshot_read.plan_partitions(conn, table, int(config.get(conf, "snapshot.partition_rows")),
                                         int(config.get(conf, "snapshot.max_partitions")),
                                         spark_session.cores(spark) or 2, by_blocks=copy)
    rows, fields = snapshot_read.read_table(conf, spark, table, snapshot, plan, unknown_types, login=login)
    record = avro_schemas.value_record(avro_schemas.value_schema(table, config.get(conf, "kafka.topic_prefix"),
                                                                 unknown_types))
    wire = schema_registry.canonical_json(snapshot_write.wire_record(record, fields))
    after = F.struct(*[F.col(quote(f["field"])) for f in fields])
    decoded = rows.select(from_avro(to_avro(after, wire), json.dumps(record)).alias("r"))
    return decoded.selectExpr(*[f"{canonical('r.' + quote(f.name), f.dataType)} AS {quote(f.name)}"
                                for f in types.fields]), int(plan["partitions"])


def _login(conf: dict, conn) -> dict:
    """JDBC url, user and password of a caller's connection (its database and role), at conf's host and port."""
    url = snapshot_read.jdbc_url({**conf, "source": {**conf["source"], "database": conn.info.dbname}})
    return {"url": url, "user": conn.info.user, "password": conn.info.password or ""}


def declared_keys(conf: dict, specs: list) -> dict[str, list[str]]:
    """source.keys of the given table specs, by their schema.table names."""
    keys = config.get(conf, "source.keys") or {}
    names = dict(zip([s.qualified for s in lake_paths.table_specs(conf)], config.get(conf, "source.tables"),
                     strict=True))
    return {s.qualified: keys[names[s.qualified]] for s in specs if names.get(s.qualified) in keys}


def reconcile(conf: dict, spark: SparkSession, tables: list[str] | None = None, sample: int = 10,
              dbname: str | None = None, conn=None, against: dict[str, DataFrame] | None = None) -> list[dict]:
    """Compare every configured table (or those named) with its silver table, or with the frame
    ``against`` holds for it (such as the table's fresh view; its live rows, silver's column names).

    Returns per table: table, source_rows, silver_rows, equal, differences (up to ``sample`` dicts
    of the key columns plus ``kind``: missing_in_silver, extra_in_silver or different, and for a different row
    ``columns``, the columns whose values differ),
    columns_compared and columns_only_in_silver. ``conn`` (a psycopg2 connection, left open) replaces
    the pipeline role's connection to source.database (or ``dbname``): the snapshot is exported there and
    the executors read as its role.
    """
    specs = [s for s in lake_paths.table_specs(conf) if not tables or s.qualified in tables or s.name in tables]
    if dbname:
        conf = {**conf, "source": {**conf["source"], "database": dbname}}
    own, autocommit = conn is None, None
    if own:
        conn = source.connect(conf, options=pgtypes.session_options())
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        login = None
    else:  # a caller's connection: read in a transaction of our own, rolled back at the end
        autocommit, conn.autocommit = conn.autocommit, False
        login = _login(conf, conn)
        with conn.cursor() as cur:  # the text forms the key split points are read in; undone by the rollback
            for name, value in pgtypes.SESSION_SETTINGS.items():
                cur.execute("SELECT set_config(%s, %s, true)", (name, value))
    results = []
    try:
        with conn.cursor() as cur:  # every table read inside this one snapshot, exported while conn stays open
            cur.execute("SELECT pg_export_snapshot()")
            snapshot = cur.fetchone()[0]
        sql_names = {s.qualified: catalog.sql_name(s.schema, s.name) for s in specs}
        declared = {sql_names[q]: key for q, key in declared_keys(conf, specs).items()}
        described = catalog.describe_tables(conn, list(sql_names.values()), declared)
        pairs, read_parts = [], 0
        for spec in specs:
            table = described[sql_names[spec.qualified]]
            names = avro_schemas.field_names(table.columns)
            types = source_types(spark, table, conf)
            keys = [names[k] for k in table.primary_key]
            try:
                src, parts = _source_frame(conf, spark, conn, table, snapshot, types, login)
                read_parts += parts
            except psycopg2.errors.InsufficientPrivilege as exc:
                raise MergeError(f"reconcile {table.qualified}: {str(exc).strip().splitlines()[0]}; GRANT SELECT ON "
                                 f"{table.qualified} TO {login['user'] if login else config.get(conf, 'source.user')}"
                                 ) from exc
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
                value = f"CAST(NULL AS {type_sql(f.dataType)})" if found is None else quote(found.name) \
                    if found.dataType == f.dataType else f"CAST({quote(found.name)} AS {type_sql(f.dataType)})"
                cols.append(f"{canonical(value, f.dataType)} AS {quote(f.name)}")
            wanted = {f.name.lower() for f in types.fields}
            pairs.append((spec.qualified, src, silver.selectExpr(*cols), keys, {
                "columns_compared": [f.name for f in types.fields],
                "columns_only_in_silver": [f.name for f in have.values() if f.name.lower() not in wanted
                                           and f.name not in META_COLUMNS]}))
        tasks = max(spark_session.cores(spark) or 2, math.ceil(read_parts / PARTITIONS_PER_TASK))
        counted = totals([(name, src, silver, columns["columns_compared"]) for name, src, silver, _, columns in pairs],
                         tasks)
        for name, src, silver, keys, columns in pairs:
            results.append({"table": name, **compare(src, silver, keys, sample, counted.get(name, {}),
                                                     columns["columns_compared"]), **columns})
    finally:
        if own:
            conn.close()
        else:
            conn.rollback()
            conn.autocommit = autocommit
    return results


def totals(pairs: list[tuple[str, DataFrame, DataFrame, list[str]]], tasks: int | None = None
           ) -> dict[str, dict[str, tuple[int, object]]]:
    """Row count and checksum of each side of every (table, source, silver, columns) pair, in one Spark job for all of
    them (a job per table costs the driver a task binary per stage), read by at most ``tasks`` tasks (each task's
    result carries the metrics of every table's plan): {table: {"source"|"silver": (rows, checksum)}}."""
    if not pairs:
        return {}
    parts = [frame.selectExpr(f"{delta_io.literal(name)} AS __t", f"'{side}' AS __side",
                              f"xxhash64({', '.join(quote(c) for c in columns)}) AS __h")
             for name, src, silver, columns in pairs for side, frame in (("source", src), ("silver", silver))]
    found: dict[str, dict] = {}
    union = functools.reduce(DataFrame.unionByName, parts)
    for r in (union.coalesce(tasks) if tasks else union).groupBy("__t", "__side").agg(
            F.count(F.lit(1)).alias("n"), F.sum(F.col("__h").cast("decimal(38,0)")).alias("checksum")).collect():
        found.setdefault(r["__t"], {})[r["__side"]] = (r["n"], r["checksum"])
    return found


def compare(src: DataFrame, silver: DataFrame, keys: list[str], sample: int = 10,
            counted: dict[str, tuple] | None = None, columns: list[str] | None = None) -> dict:
    """Counts and checksums of two frames with the same columns (``counted``: totals() found them already); a sample
    of differing keys when they differ."""
    columns = columns or src.columns
    if counted is None:
        counted = totals([("t", src, silver, columns)]).get("t", {})
    (src_n, src_sum), (silver_n, silver_sum) = counted.get("source", (0, None)), counted.get("silver", (0, None))
    equal = src_n == silver_n and (src_n == 0 or src_sum == silver_sum)
    differences = []
    if not equal:
        hashed = f"xxhash64({', '.join(quote(c) for c in columns)})"
        joined = src.selectExpr(*[quote(k) for k in keys], f"{hashed} AS __hs").join(
            silver.selectExpr(*[quote(k) for k in keys], f"{hashed} AS __ht"), keys, "full_outer")
        kind = F.when(F.col("__ht").isNull(), "missing_in_silver").when(F.col("__hs").isNull(), "extra_in_silver") \
            .otherwise("different")
        rows = joined.filter(F.col("__hs").isNull() | F.col("__ht").isNull() | (F.col("__hs") != F.col("__ht"))) \
            .select(*keys, kind.alias("kind")).orderBy(*keys).limit(sample).collect()
        differences = [r.asDict() for r in rows]
        changed = [d for d in differences if d["kind"] == "different"]
        if changed:
            named = changed_columns(src, silver, keys, changed)
            for d in changed:
                d["columns"] = named.get(tuple(d[k] for k in keys), [])
    return {"source_rows": src_n, "silver_rows": silver_n, "equal": equal, "differences": differences}


def changed_columns(src: DataFrame, silver: DataFrame, keys: list[str], rows: list[dict]) -> dict[tuple, list[str]]:
    """For the given keys (a sample: a few rows), the columns whose values differ between the two frames."""
    wanted = functools.reduce(lambda a, b: a | b, [
        functools.reduce(lambda a, b: a & b, [F.col(quote(k)).eqNullSafe(F.lit(r[k])) for k in keys]) for r in rows])
    others = [c for c in src.columns if c not in keys]
    pairs = src.filter(wanted).alias("s").join(silver.filter(wanted).alias("t"), keys)
    named = F.array_compact(F.array(*[F.when(~F.col(f"s.{quote(c)}").eqNullSafe(F.col(f"t.{quote(c)}")), F.lit(c))
                                      for c in others])) if others else F.array().cast("array<string>")
    return {tuple(r[k] for k in keys): list(r["__columns"]) for r in pairs.select(*keys, named.alias("__columns"))
            .collect()}


def as_frame(spark: SparkSession, results: list[dict]) -> DataFrame:
    """reconcile()'s results as a small DataFrame for display (differences as text)."""
    rows = [(r["table"], r["source_rows"], r["silver_rows"], r["equal"],
             "; ".join(", ".join(f"{k}={v}" for k, v in d.items()) for d in r["differences"])) for r in results]
    return spark.createDataFrame(rows, "table string, source_rows long, silver_rows long, equal boolean, "
                                       "sample_differences string")
