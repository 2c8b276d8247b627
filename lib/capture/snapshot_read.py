"""Reading a table inside the exported snapshot with Spark's JDBC source: each column's transport (so values arrive
exactly as pgoutput would send them) and the table's split into key ranges."""

from __future__ import annotations

import math
from decimal import Decimal

from lib import config, secrets, source
from lib.capture import avro_schemas, catalog, pgtypes, snapshot_copy, snapshot_slot
from lib.capture.catalog import sql_ident, sql_literal
from lib.capture.snapshot_slot import SnapshotError

MIN_SPLIT_ROWS = 10_000  # below this many rows per core a table is not split just to use every core
SPARK_MAX_PRECISION = 38
SPLIT_COLUMN = "__cdc_split"
LONG_MAX, LONG_MIN = pgtypes.LONG_MAX, pgtypes.LONG_MIN
_INTEGRAL = {"int2", "int4", "int8"}
# Text forms that PostgreSQL's explicit cast to text changes (char(n) loses its padding, inet
# gains a /32 netmask, ...): these are selected through their output function, like pgoutput.
_OUTPUT_FUNCTIONS = {"bpchar": "bpcharout", "inet": "inet_out", "cidr": "cidr_out", "char": "charout",
                     "name": "nameout", "xml": "xml_out", "macaddr": "macaddr_out", "macaddr8": "macaddr8_out"}
_AS_TEXT = {"text", "varchar", "uuid", "json", "jsonb", "timetz", "interval", "numeric"}


def column_transport(column: catalog.Column, unknown_types: str = "error") -> dict:
    """How a column is selected: {'sql', 'spark_type', 'post', 'wire'}.

    ``sql`` yields a value Spark's JDBC reader maps losslessly; ``post`` (Column -> Column)
    turns it into exactly the Catalyst type ``spark_type`` that ``to_avro`` needs for the
    column's Avro type. Temporal values travel as integers computed by PostgreSQL, so no JVM or
    Spark time zone can shift them; text forms come from the type's output function, as in
    pgoutput. ``wire`` replaces the Avro type given to ``to_avro`` where Spark cannot express
    it (decimals above 38 digits travel as ready-made bytes): the encoding is the same.
    """
    ref = sql_ident(column.name)
    avro = pgtypes.avro_type(None, column, unknown_types, nullable=False)
    t = column.type.resolved()
    if t.kind == "array" and isinstance(avro, dict) and avro.get("type") == "array":
        return _array(column, t, ref, avro)
    sql, spark_type = _scalar(column, t, ref, avro)
    if spark_type == "bigdecimal":
        return {"sql": sql, "spark_type": "binary", "post": _big_decimal(column, avro["scale"], False),
                "wire": "bytes"}
    return {"sql": sql, "spark_type": spark_type, "post": _cast(spark_type), "wire": None}


def _scalar(column, t, ref: str, avro) -> tuple[str, str]:
    """(SQL expression, Spark type) of one non-array value; ref may be an array element."""
    name = t.name if t.schema == "pg_catalog" else None
    if avro == "string" or (isinstance(avro, dict) and avro.get("type") == "string"):
        if t.kind == "enum" or name in _AS_TEXT:
            return f"({ref})::text", "string"
        if name in _OUTPUT_FUNCTIONS:
            return f"textin({_OUTPUT_FUNCTIONS[name]}({ref}))", "string"
        return _output_text(ref), "string"
    if name == "bool":
        return ref, "boolean"
    if name in ("int2", "int4"):
        return ref, "int"
    if name == "int8":
        return ref, "bigint"
    if name == "oid":
        return f"({ref})::int8", "bigint"
    if name == "float4":
        return ref, "float"
    if name == "float8":
        return ref, "double"
    if name == "bytea":
        return ref, "binary"
    if name == "date":
        return f"(({ref}) - DATE '1970-01-01')", "int"
    if name == "timestamp":
        return _micros(ref), "bigint"
    if name == "timestamptz":
        return _micros(f"({ref}) AT TIME ZONE 'UTC'"), "bigint"
    if name == "time":
        return f"round(date_part('epoch', {ref}) * 1000000)::int8", "bigint"
    if isinstance(avro, dict) and avro.get("logicalType") == "decimal":
        precision, scale = avro["precision"], avro["scale"]
        same = name == "numeric" and catalog.numeric_precision_scale(t) == (precision, scale)
        numeric = ref if same else f"({ref})::numeric({precision},{scale})"
        if precision <= SPARK_MAX_PRECISION:
            return numeric, f"decimal({precision},{scale})"
        # Spark decimals stop at 38 digits: the exact text becomes Avro's bytes in a Python UDF
        return f"({numeric})::text", "bigdecimal"
    raise SnapshotError(f"column {column.qualified} has type {column.type_name} with Avro type {avro}, "
                        f"which the snapshot cannot select; report this as a bug")


_SQL_ARRAY = {"boolean": "bool[]", "int": "int4[]", "bigint": "int8[]", "float": "float4[]",
              "double": "float8[]", "string": "text[]"}


def _array(column, t, ref: str, avro) -> dict:
    """One-dimensional arrays: elements converted like scalars, order kept (unnest WITH ORDINALITY)."""
    element_avro = next(x for x in avro["items"] if x != "null")
    sql, spark_type = _scalar(column, t.element.resolved(), "u.x", element_avro)
    post, wire = None, None
    if spark_type == "binary":
        sql, post = "encode(u.x, 'hex')", _transform_unhex
    elif spark_type == "bigdecimal":
        post, wire = _big_decimal(column, element_avro["scale"], True), {"type": "array", "items": ["null", "bytes"]}
    elif spark_type.startswith("decimal"):
        sql = f"({sql})::text"  # JDBC reads numeric[] as decimal(38,18): carry the exact text, cast in Spark
    sql_type = _SQL_ARRAY.get(spark_type, "text[]")
    if sql == "u.x":
        body = ref  # as it is: bool, integer and float elements
    elif sql == "(u.x)::text":
        body = f"({ref})::text[]"  # the same cast, element by element
    else:
        body = f"ARRAY(SELECT {sql} FROM unnest({ref}) WITH ORDINALITY AS u(x, n) ORDER BY u.n)"
    # a multi-dimensional value fails the read naming the column (the stream refuses it too);
    # the text depends on the row, so the planner cannot evaluate the failing cast early
    named = column.qualified.replace("'", "''")  # inside a SQL string literal
    error = (f"('cdc snapshot: column {named} holds a multi-dimensional array, which has no Avro "
             f"mapping; store it as jsonb or a one-dimensional array (dimensions: ' || array_ndims({ref}) "
             f"|| ')')::int")
    expr = (f"CASE WHEN ({ref}) IS NULL THEN NULL WHEN array_ndims({ref}) > 1 THEN ({error})::text::{sql_type} "
            f"ELSE {body} END")
    target = "binary" if spark_type in ("binary", "bigdecimal") else spark_type
    return {"sql": expr, "spark_type": f"array<{target}>", "post": post or _cast(f"array<{target}>"),
            "wire": wire}


def _output_text(ref: str) -> str:
    """The type's output function text (what pgoutput sends), NULL kept."""
    return f"CASE WHEN ({ref}) IS NULL THEN NULL ELSE format('%s', {ref}) END"


def _micros(ref: str) -> str:
    """Microseconds since 1970-01-01 00:00 of a timestamp, exact for every year; ±infinity -> Long.MAX/MIN.

    Whole days by date arithmetic plus the time of day; the time of day as a double holds at
    most 11 significant digits, so rounding it back to microseconds is exact (and much cheaper
    than numeric EXTRACT(EPOCH ...) on PostgreSQL >= 14).
    """
    return (f"CASE WHEN isfinite({ref}) THEN (({ref})::date - DATE '1970-01-01')::int8 * 86400000000 "
            f"+ round(date_part('epoch', ({ref})::time) * 1000000)::int8 "
            f"WHEN ({ref}) = 'infinity' THEN {LONG_MAX} WHEN ({ref}) = '-infinity' THEN {LONG_MIN} END")


def _cast(spark_type: str):
    return lambda c: c.cast(spark_type)


def _transform_unhex(c):
    from pyspark.sql import functions as F

    return F.transform(c, F.unhex)


def _big_decimal(column: catalog.Column, scale: int, array: bool):
    """A Python UDF: exact decimal text (or an array of them) -> Avro decimal bytes, as fastavro writes them."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType

    qualified = column.qualified

    def to_bytes(text):
        if text is None:
            return None
        value = Decimal(text)
        if not value.is_finite():
            raise ValueError(f"column {qualified}: numeric {text} has no Avro decimal value; change the column "
                             f"to unconstrained numeric or replace the value in the source")
        sign, digits, exponent = value.as_tuple()  # exact: no decimal context rounding
        unscaled = int("".join(map(str, digits)) or "0") * 10 ** (exponent + scale)
        unscaled = -unscaled if sign else unscaled
        return unscaled.to_bytes((abs(unscaled).bit_length() + 8) // 8, "big", signed=True)

    if array:
        udf = F.udf(lambda items: None if items is None else [to_bytes(x) for x in items], ArrayType(BinaryType()))
    else:
        udf = F.udf(to_bytes, BinaryType())
    return lambda c: udf(c)


def select_sql(table: catalog.Table, unknown_types: str = "error") -> tuple[str, list[dict]]:
    """The per-table subquery (columns aliased c0, c1, ...) and, per Value field, how to finish it in Spark."""
    names = avro_schemas.field_names(table.columns)
    fields, parts = [], []
    for i, column in enumerate(c for c in table.columns if not c.generated):
        transport = column_transport(column, unknown_types)
        alias = f"c{i}"
        parts.append(f"{transport['sql']} AS {alias}")
        fields.append({"column": column.name, "field": names[column.name], "alias": alias, **transport,
                       "raw": transport["sql"] == sql_ident(column.name)})
    first_key = table.column(table.primary_key[0])
    key_field = next(f for f in fields if f["column"] == first_key.name)
    if not (_integral(first_key) and key_field["raw"]):
        parts.append(f"{sql_ident(first_key.name)} AS {SPLIT_COLUMN}")
    only = "ONLY " if table.kind == "r" else ""
    query = f"SELECT {', '.join(parts)} FROM {only}{sql_ident(table.schema)}.{sql_ident(table.name)}"
    return query, fields


def _integral(column: catalog.Column) -> bool:
    t = column.type.resolved()
    return t.kind == "base" and t.schema == "pg_catalog" and t.name in _INTEGRAL


def plan_partitions(conn, table: catalog.Table, partition_rows: int = config.DEFAULTS["snapshot.partition_rows"],
                    max_partitions: int = config.DEFAULTS["snapshot.max_partitions"], parallelism: int = 1,
                    by_blocks: bool = False) -> dict:
    """Exact row count on conn's snapshot and how to split the read: rows, partitions, and block ranges (by_blocks:
    the COPY reader), key bounds or key predicates (the JDBC reader).

    A table gets ceil(rows / partition_rows) partitions rounded up to a multiple of
    ``parallelism`` (Spark's cores), at least ``parallelism`` once it has MIN_SPLIT_ROWS rows per
    core, so every core reads; at most max_partitions.
    """
    key = table.column(table.primary_key[0])
    relation = f"{'ONLY ' if table.kind == 'r' else ''}{sql_ident(table.schema)}.{sql_ident(table.name)}"
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {relation}")
        rows = cur.fetchone()[0]
        wanted = max(math.ceil(rows / max(1, partition_rows)), min(parallelism, rows // MIN_SPLIT_ROWS))
        if wanted > parallelism > 1:  # whole waves: no core idles while the last partition runs alone
            wanted = math.ceil(wanted / parallelism) * parallelism
        wanted = max(1, min(max_partitions, wanted))
        if by_blocks:  # without TID range scans (PostgreSQL < 14) each range would read the whole table
            ranges = snapshot_copy.block_ranges(conn, table, wanted if conn.server_version >= 140000 else 1)
            return {"rows": rows, "partitions": len(ranges), "ranges": ranges, "partitioned": table.kind == "p"}
        if wanted == 1:
            return {"rows": rows, "partitions": 1}
        if _integral(key):
            cur.execute(f"SELECT min({sql_ident(key.name)}), max({sql_ident(key.name)}) FROM {relation}")
            low, high = cur.fetchone()
            n = max(1, min(wanted, high - low + 1))
            return {"rows": rows, "partitions": n, "bounds": (low, high + 1)}
        # quantiles of a sample of the key (the split points only balance the work; any points are correct)
        sample = min(100.0, max(0.01, 100.0 * max(100 * wanted, 20_000) / rows))
        fractions = [i / wanted for i in range(1, wanted)]
        tablesample = f" TABLESAMPLE SYSTEM ({sample})" if sample < 100 else ""
        cur.execute(f"SELECT (percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {sql_ident(key.name)}))::text[] "
                    f"FROM {relation}{tablesample}", (fractions,))
        points = [p for p in dict.fromkeys(cur.fetchone()[0] or []) if p is not None]
    if not points:
        return {"rows": rows, "partitions": 1}
    split = sql_ident(SPLIT_COLUMN)
    literals = [f"{sql_literal(p)}::{key.type_name}" for p in points]
    predicates = [f"{split} < {literals[0]}"]
    predicates += [f"{split} >= {a} AND {split} < {b}" for a, b in zip(literals, literals[1:], strict=False)]
    predicates.append(f"{split} >= {literals[-1]}")
    return {"rows": rows, "partitions": len(predicates), "predicates": predicates}


def jdbc_url(conf: dict) -> str:
    """jdbc:postgresql://host:port/database of the source."""
    return (f"jdbc:postgresql://{config.get(conf, 'source.host')}:{config.get(conf, 'source.port')}/"
            f"{config.get(conf, 'source.database')}")


def jdbc_options(conf: dict, snapshot_name: str) -> dict[str, str]:
    """Spark JDBC reader options: pipeline role, snapshot import per connection, bounded fetches."""
    options = {
        "url": jdbc_url(conf),
        "driver": "org.postgresql.Driver",
        "user": str(config.get(conf, "source.user")),
        "password": secrets.setting(conf, "source.password"),
        "sessionInitStatement": snapshot_slot.import_snapshot_sql(snapshot_name),
        # > 0 makes Spark's PostgreSQL dialect turn autocommit off, so the driver streams with a cursor
        "fetchsize": str(int(config.get(conf, "snapshot.fetch_size"))),
        "ApplicationName": f"{config.get(conf, 'spark.app_name')}-snapshot",
        "tcpKeepAlive": "true",
        **source.tls(conf),  # pgjdbc takes libpq's sslmode and sslrootcert (a path every executor can read)
    }
    options.update({str(k): str(v) for k, v in (config.get(conf, "snapshot.jdbc_options") or {}).items()})
    return options


def read_table(conf: dict, spark, table: catalog.Table, snapshot_name: str, plan: dict,
               unknown_types: str = "error", login: dict | None = None):
    """A DataFrame of the table as of the snapshot: one column per Value field, typed for to_avro.

    ``login`` (JDBC options: url, user, password) replaces the pipeline role's for the JDBC reader."""
    query, fields = select_sql(table, unknown_types)
    if "ranges" in plan:
        return snapshot_copy.read_table(conf, spark, snapshot_name, plan, fields), fields
    options = {**jdbc_options(conf, snapshot_name), **(login or {})}
    reader = spark.read.format("jdbc").options(**options)
    reader = reader.option("dbtable", f"({query}) AS snapshot_rows")
    if "bounds" in plan:
        key_alias = next(f["alias"] for f in fields if f["column"] == table.primary_key[0])
        reader = (reader.option("partitionColumn", key_alias).option("lowerBound", str(plan["bounds"][0]))
                  .option("upperBound", str(plan["bounds"][1])).option("numPartitions", str(plan["partitions"])))
        df = reader.load()
    elif "predicates" in plan:
        properties = dict(options)
        url = properties.pop("url")
        df = spark.read.jdbc(url, f"({query}) AS snapshot_rows", predicates=plan["predicates"],
                             properties=properties)
    else:
        df = reader.load()
    columns = []
    for f in fields:
        columns.append(f["post"](df[f["alias"]]).alias(f["field"]))
    return df.select(*columns), fields
