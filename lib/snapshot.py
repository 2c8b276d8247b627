"""Notebook 02: the initial snapshot, read by Spark from the snapshot the slot exported, into Kafka.

How it stays consistent with the stream (docs/events.md, "Ordering rule"):

1. ``create_slot_with_snapshot`` creates the logical slot with ``SNAPSHOT 'export'`` on a
   replication connection. PostgreSQL returns the slot's consistent point C and the name of
   a snapshot that sees exactly the transactions committed before C. That snapshot lives only
   while the replication connection stays open and idle, so it is held until every read is done.
2. Every reader imports it: each Spark JDBC partition runs ``BEGIN ISOLATION LEVEL REPEATABLE
   READ READ ONLY; SET TRANSACTION SNAPSHOT '<name>'`` as its ``sessionInitStatement`` (Spark's
   PostgreSQL dialect then turns autocommit off for the cursor fetch; the driver sees the open
   transaction and sends no BEGIN of its own), so all partitions of all tables see one and the
   same database state, the state as of C.
3. Rows go to each table's topic as ``op 'r'`` events with ``source.commit_lsn = C`` and
   ``source.event_serial = -1``: every streamed change of the same key sorts after them.
4. The control record ``snapshot/<slot>`` says ``complete`` only after Spark's Kafka writes
   finished (the sink flushes and waits for acks when each task ends) and the topics' end
   offsets grew by at least the number of rows read. The stream refuses to start before that,
   so no snapshot row is ever sent after a streamed change.

Operators: while the snapshot runs, its readers hold back VACUUM on the whole database and
take ACCESS SHARE locks (ALTER TABLE on a source table waits), and the new slot retains WAL.
Creating the slot waits for transactions that already hold a transaction id to finish.

Values: each column is selected in a form that converts exactly to its Avro type (see
``column_transport``): temporal values as integers computed by PostgreSQL (so neither the
JVM's nor Spark's time zone can shift them; readers also set TimeZone=UTC), text forms from
the type's output function as in pgoutput, decimals as Spark decimals of exactly the Avro
precision and scale. Spark's ``to_avro`` encodes the key record and each row's ``Value``
record against the registered schemas; the rest of the envelope (``before`` null, ``source``,
``op``, ``ts_ms``, ...) is the same for every row of a table, so its Avro bytes are written once
with fastavro and concatenated around the record (Avro encodes a record as its fields one
after the other), after the Confluent header (magic byte 0, 4-byte schema id). Decimals above
38 digits, which Spark cannot hold, go through a Python UDF. The messages decode to the values
the stream produces from pgoutput text through ``lib.pgtypes``; the bytes are the same too,
except that Java writes a negative decimal such as -1.28 in its shortest two's complement
(one byte) where fastavro uses two (tests/test_snapshot.py).

Partitioning: a table whose first primary key column is an integer is split into equal key
ranges (Spark's numPartitions/lowerBound/upperBound between its min and max); any other key
(uuid, text, date, ...) is split at quantiles of a sample of that column, given to Spark as a
list of ``predicates`` on the raw key column (so PostgreSQL can use the key's index). The
number of partitions is rows / ``partition_rows``, rounded up to a multiple of Spark's cores
(at least one per core when the table has 10 000 rows per core); smaller tables are one
partition. Each running Spark task holds one PostgreSQL connection for its partition.

Settings (all optional, under ``snapshot:`` in conf): ``fetch_size`` (rows per JDBC round
trip, bounds each task's memory; default 10000), ``partition_rows`` (default 250000),
``max_partitions`` (per table; default 200), ``parallel_tables`` (tables written at once;
default 4), ``progress_s`` (seconds between progress lines; default 10), ``kafka_options``
(extra ``kafka.*`` settings for Spark's Kafka sink, e.g. security on a real cluster),
``jdbc_options`` (extra PostgreSQL JDBC properties, e.g. ``sslmode``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from decimal import Decimal

import fastavro
import psycopg2
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from lib import avro_schemas, catalog, config, control, pgtypes, schema_registry, secrets, source

PLUGIN = "pgoutput"
DEFAULT_FETCH_SIZE = 10_000
DEFAULT_PARTITION_ROWS = 250_000
DEFAULT_MAX_PARTITIONS = 200
DEFAULT_PROGRESS_S = 10.0
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


class SnapshotError(RuntimeError):
    """The snapshot cannot start or failed; the message names the slot/table/setting and the remedy."""


# ---------------------------------------------------------------------------------------------
# LSNs


def lsn_to_int(text: str) -> int:
    """'16/B374D848' -> 97500059720."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def int_to_lsn(value: int) -> str:
    """97500059720 -> '16/B374D848'."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


# ---------------------------------------------------------------------------------------------
# Slot and exported snapshot


def slot_info(conn, slot: str) -> dict | None:
    """The slot's row in pg_replication_slots as a dict, or None when it does not exist."""
    with conn.cursor() as cur:
        cur.execute("SELECT slot_name, plugin, slot_type, database, active, active_pid, "
                    "confirmed_flush_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = %s",
                    (slot,))
        row = cur.fetchone()
    if row is None:
        return None
    keys = ("slot", "plugin", "slot_type", "database", "active", "active_pid", "confirmed_flush_lsn", "wal_status")
    return dict(zip(keys, row, strict=True))


def drop_slot(conn, slot: str) -> None:
    """Drop an inactive slot; an active one -> SnapshotError naming the process that holds it."""
    info = slot_info(conn, slot)
    if info is None:
        return
    if info["active"]:
        raise _active_slot(info)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        if not conn.autocommit:
            conn.commit()
    except psycopg2.errors.ObjectInUse as exc:
        if not conn.autocommit:
            conn.rollback()
        raise _active_slot(slot_info(conn, slot) or info) from exc


def _active_slot(info: dict) -> SnapshotError:
    return SnapshotError(
        f"replication slot {info['slot']} is in use by process {info['active_pid']} (a stream or another "
        f"snapshot is reading it), so it cannot be dropped for a new snapshot; stop that process first "
        f"(SELECT pg_terminate_backend({info['active_pid']}) if it is a leftover), then run the snapshot again")


def create_slot_with_snapshot(conf: dict, progress=print, resnapshot: bool = False):
    """Create the slot with an exported snapshot: (replication_conn, consistent_lsn, snapshot_name).

    Keep the returned connection open and idle until every reader imported the snapshot: any
    command on it, or closing it, ends the snapshot. Close it as soon as the reads are done.
    While the slot exists it retains WAL from its consistent point on: a slot nobody streams
    from fills the server's disk (bounded only by max_slot_wal_keep_size).

    When the slot exists already:

    - control says the snapshot is ``complete``: nothing to do, returns ``(None, consistent_lsn,
      None)`` with the recorded point (unless ``resnapshot``);
    - control says ``running`` or has no record (a snapshot failed or was killed): the slot is
      dropped and created again, which takes a NEW snapshot at a NEW consistent point. Topics may
      already hold 'r' rows of the failed attempt: harmless, the new snapshot sends every row
      again with the new (later) consistent point, and streamed changes sort after both; a key
      the failed attempt sent but that was deleted before the new point gets a delete event and
      a tombstone (``retract_stale_keys``). A slot that is active (someone streams from it) is
      never dropped: SnapshotError;
    - the slot uses another plugin or another database: SnapshotError naming it.

    ``resnapshot=True`` takes a new snapshot even after a complete one (the slot is dropped:
    changes it had not streamed yet are replaced by the new snapshot; keys deleted meanwhile are
    retracted as above). Stop the stream first. When the control record says complete but the
    slot is gone (dropped, or invalidated by max_slot_wal_keep_size), the stream cannot
    continue: this raises unless ``resnapshot``.
    """
    slot = config.get(conf, "source.slot")
    record = _snapshot_state(conf, slot)
    state = (record or {}).get("state")
    check = source.connect(conf)
    check.autocommit = True
    try:
        _check_server(check)
        info = slot_info(check, slot)
        with check.cursor() as cur:
            cur.execute("SELECT current_database()")
            database = cur.fetchone()[0]
        if info is not None and (info["plugin"] != PLUGIN or info["slot_type"] != "logical"
                                 or info["database"] != database):
            found = (f"with plugin {info['plugin']} on database {info['database']}" if info["slot_type"] == "logical"
                     else f"as a {info['slot_type']} slot")
            raise SnapshotError(
                f"replication slot {slot} exists {found}, but this pipeline needs a logical {PLUGIN} slot on "
                f"database {database}: "
                f"choose another source.slot in {conf.get('conf_file', 'conf')}, or drop the slot "
                f"(SELECT pg_drop_replication_slot('{slot}')) if nothing else uses it")
        if info is not None and state == "complete" and not resnapshot:
            progress(f"snapshot: slot {slot} exists and its snapshot is complete (consistent point "
                     f"{int_to_lsn(int(record['consistent_lsn']))}): nothing to do")
            return None, int(record["consistent_lsn"]), None
        if info is None and state == "complete" and not resnapshot:
            raise SnapshotError(
                f"the snapshot of slot {slot} is recorded as complete, but the slot does not exist any more "
                f"(dropped, or invalidated by max_slot_wal_keep_size): changes since then are lost to the "
                f"stream. Remedy: stop the stream and take a new snapshot with run(conf, spark, resnapshot=True)")
        if info is not None:
            reason = "a new snapshot was requested" if resnapshot else (
                f"its snapshot did not complete (control state {state or 'missing'})")
            progress(f"snapshot: slot {slot} exists but {reason}: dropping it and taking a new snapshot")
            drop_slot(check, slot)
    finally:
        check.close()
    return _create_slot(conf, slot)


def _snapshot_state(conf: dict, slot: str) -> dict | None:
    """control.snapshot_state, tolerating a control topic created a moment ago (metadata not there yet)."""
    for attempt in range(10):
        try:
            return control.snapshot_state(conf, slot)
        except control.ControlError:
            if attempt == 9:
                raise
            time.sleep(1)
    return None


def _check_server(conn) -> None:
    """PostgreSQL >= 13 (exported snapshots with pgoutput as used here)."""
    if conn.server_version < 130000:
        raise SnapshotError(f"PostgreSQL {conn.server_version} is too old: the pipeline needs 13 or newer")


def _create_slot(conf: dict, slot: str):
    """CREATE_REPLICATION_SLOT ... with an exported snapshot, on a new replication connection."""
    # the connection must survive idle while Spark reads: no idle timeouts, TCP keepalives on
    conn = source.connect(conf, replication=True, keepalives=1, keepalives_idle=30,
                          options="-c idle_session_timeout=0 -c idle_in_transaction_session_timeout=0 "
                                  "-c statement_timeout=0")
    if conn.server_version >= 150000:
        command = f"CREATE_REPLICATION_SLOT {_ident(slot)} LOGICAL {PLUGIN} (SNAPSHOT 'export')"
    else:
        command = f"CREATE_REPLICATION_SLOT {_ident(slot)} LOGICAL {PLUGIN} EXPORT_SNAPSHOT"
    try:
        with conn.cursor() as cur:
            cur.execute(command)  # waits for transactions that hold an XID to finish
            _, consistent_point, snapshot_name, _ = cur.fetchone()
    except psycopg2.Error as exc:
        conn.close()
        reason = str(exc).strip().splitlines()[0]
        raise SnapshotError(f"cannot create replication slot {slot}: {reason}; check that the role "
                            f"{config.get(conf, 'source.user')} has REPLICATION and that max_replication_slots "
                            f"is not exhausted (notebook 01 checks both)") from exc
    return conn, lsn_to_int(consistent_point), snapshot_name


def _ident(name: str) -> str:
    """A double-quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    """A single-quoted SQL string literal (standard_conforming_strings)."""
    return "'" + text.replace("'", "''") + "'"


def import_snapshot_sql(snapshot_name: str) -> str:
    """What every reader runs first: session settings, then a transaction on the exported snapshot."""
    return ("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, MDY'; SET IntervalStyle = 'iso_8601'; "
            "SET lc_monetary = 'C'; SET bytea_output = 'hex'; SET extra_float_digits = 3; "
            "SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0; "
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; "
            f"SET TRANSACTION SNAPSHOT {_literal(snapshot_name)}")


def snapshot_connection(conf: dict, snapshot_name: str):
    """A psycopg2 connection (pipeline role) inside a transaction on the exported snapshot."""
    conn = source.connect(conf)
    conn.autocommit = True  # the explicit BEGIN below opens the transaction; psycopg2 must not open another
    try:
        with conn.cursor() as cur:
            cur.execute(import_snapshot_sql(snapshot_name))
    except psycopg2.Error as exc:
        conn.close()
        raise _import_failed(snapshot_name, exc) from exc
    return conn


def _import_failed(snapshot_name: str, exc: Exception) -> SnapshotError:
    return SnapshotError(
        f"cannot import snapshot {snapshot_name}: {str(exc).strip().splitlines()[0]}; the replication "
        f"connection that exported it was closed or used for another command. Remedy: run the snapshot again "
        f"(a new slot and snapshot are taken)")


# ---------------------------------------------------------------------------------------------
# What each column is selected as


def column_transport(column: catalog.Column, unknown_types: str = "error") -> dict:
    """How a column is selected: {'sql', 'spark_type', 'post', 'wire'}.

    ``sql`` yields a value Spark's JDBC reader maps losslessly; ``post`` (Column -> Column)
    turns it into exactly the Catalyst type ``spark_type`` that ``to_avro`` needs for the
    column's Avro type. Temporal values travel as integers computed by PostgreSQL, so no JVM or
    Spark time zone can shift them; text forms come from the type's output function, as in
    pgoutput. ``wire`` replaces the Avro type given to ``to_avro`` where Spark cannot express
    it (decimals above 38 digits travel as ready-made bytes): the encoding is the same.
    """
    ref = _ident(column.name)
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


# ---------------------------------------------------------------------------------------------
# Reading a table


def select_sql(table: catalog.Table, unknown_types: str = "error") -> tuple[str, list[dict]]:
    """The per-table subquery (columns aliased c0, c1, ...) and, per Value field, how to finish it in Spark."""
    names = avro_schemas.field_names(table.columns)
    fields, parts = [], []
    for i, column in enumerate(c for c in table.columns if not c.generated):
        transport = column_transport(column, unknown_types)
        alias = f"c{i}"
        parts.append(f"{transport['sql']} AS {alias}")
        fields.append({"column": column.name, "field": names[column.name], "alias": alias, **transport,
                       "raw": transport["sql"] == _ident(column.name)})
    first_key = table.column(table.primary_key[0])
    key_field = next(f for f in fields if f["column"] == first_key.name)
    if not (_integral(first_key) and key_field["raw"]):
        parts.append(f"{_ident(first_key.name)} AS {SPLIT_COLUMN}")
    only = "ONLY " if table.kind == "r" else ""
    query = f"SELECT {', '.join(parts)} FROM {only}{_ident(table.schema)}.{_ident(table.name)}"
    return query, fields


def _integral(column: catalog.Column) -> bool:
    t = column.type.resolved()
    return t.kind == "base" and t.schema == "pg_catalog" and t.name in _INTEGRAL


def plan_partitions(conn, table: catalog.Table, partition_rows: int = DEFAULT_PARTITION_ROWS,
                    max_partitions: int = DEFAULT_MAX_PARTITIONS, parallelism: int = 1) -> dict:
    """Exact row count on conn's snapshot and how to split the read: rows, partitions, bounds or predicates.

    A table gets ceil(rows / partition_rows) partitions rounded up to a multiple of
    ``parallelism`` (Spark's cores), at least ``parallelism`` once it has MIN_SPLIT_ROWS rows per
    core, so every core reads; at most max_partitions.
    """
    key = table.column(table.primary_key[0])
    relation = f"{'ONLY ' if table.kind == 'r' else ''}{_ident(table.schema)}.{_ident(table.name)}"
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {relation}")
        rows = cur.fetchone()[0]
        wanted = max(math.ceil(rows / max(1, partition_rows)), min(parallelism, rows // MIN_SPLIT_ROWS))
        if wanted > parallelism > 1:  # whole waves: no core idles while the last partition runs alone
            wanted = math.ceil(wanted / parallelism) * parallelism
        wanted = max(1, min(max_partitions, wanted))
        if wanted == 1:
            return {"rows": rows, "partitions": 1}
        if _integral(key):
            cur.execute(f"SELECT min({_ident(key.name)}), max({_ident(key.name)}) FROM {relation}")
            low, high = cur.fetchone()
            n = max(1, min(wanted, high - low + 1))
            return {"rows": rows, "partitions": n, "bounds": (low, high + 1)}
        # quantiles of a sample of the key (the split points only balance the work; any points are correct)
        sample = min(100.0, max(0.01, 100.0 * max(100 * wanted, 20_000) / rows))
        fractions = [i / wanted for i in range(1, wanted)]
        tablesample = f" TABLESAMPLE SYSTEM ({sample})" if sample < 100 else ""
        cur.execute(f"SELECT (percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {_ident(key.name)}))::text[] "
                    f"FROM {relation}{tablesample}", (fractions,))
        points = [p for p in dict.fromkeys(cur.fetchone()[0] or []) if p is not None]
    if not points:
        return {"rows": rows, "partitions": 1}
    split = _ident(SPLIT_COLUMN)
    literals = [f"{_literal(p)}::{key.type_name}" for p in points]
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
        "sessionInitStatement": import_snapshot_sql(snapshot_name),
        # > 0 makes Spark's PostgreSQL dialect turn autocommit off, so the driver streams with a cursor
        "fetchsize": str(int(config.get(conf, "snapshot.fetch_size", DEFAULT_FETCH_SIZE))),
        "ApplicationName": f"{config.get(conf, 'spark.app_name', 'cdc-pipeline')}-snapshot",
        "tcpKeepAlive": "true",
    }
    options.update({str(k): str(v) for k, v in (config.get(conf, "snapshot.jdbc_options", {}) or {}).items()})
    return options


def read_table(spark, conf: dict, table: catalog.Table, snapshot_name: str, plan: dict,
               unknown_types: str = "error"):
    """A DataFrame of the table as of the snapshot: one column per Value field, typed for to_avro."""
    query, fields = select_sql(table, unknown_types)
    reader = spark.read.format("jdbc").options(**jdbc_options(conf, snapshot_name))
    reader = reader.option("dbtable", f"({query}) AS snapshot_rows")
    if "bounds" in plan:
        key_alias = next(f["alias"] for f in fields if f["column"] == table.primary_key[0])
        reader = (reader.option("partitionColumn", key_alias).option("lowerBound", str(plan["bounds"][0]))
                  .option("upperBound", str(plan["bounds"][1])).option("numPartitions", str(plan["partitions"])))
        df = reader.load()
    elif "predicates" in plan:
        properties = jdbc_options(conf, snapshot_name)
        url = properties.pop("url")
        df = spark.read.jdbc(url, f"({query}) AS snapshot_rows", predicates=plan["predicates"],
                             properties=properties)
    else:
        df = reader.load()
    columns = []
    for f in fields:
        columns.append(f["post"](df[f["alias"]]).alias(f["field"]))
    return df.select(*columns), fields


# ---------------------------------------------------------------------------------------------
# Encoding


def wire_record(record: dict, fields: list[dict]) -> dict:
    """The record schema handed to to_avro: the registered one, with wire types where Spark needs them (same bytes)."""
    wire = {f["field"]: f["wire"] for f in fields if f["wire"]}
    if not wire:
        return record
    record = json.loads(json.dumps(record))
    for field in record["fields"]:
        if field["name"] in wire:
            nullable = isinstance(field["type"], list)
            field["type"] = ["null", wire[field["name"]]] if nullable else wire[field["name"]]
    return record


def _without_logical_types(schema):
    """The schema with every logical type but decimal removed (same bytes, raw values)."""
    if isinstance(schema, dict):
        return {k: _without_logical_types(v) for k, v in schema.items()
                if not (k == "logicalType" and v != "decimal")}
    if isinstance(schema, list):
        return [_without_logical_types(v) for v in schema]
    return schema


def confluent_header(schema_id: int) -> bytes:
    """Magic byte 0 and the 4-byte big-endian schema id."""
    return b"\x00" + int(schema_id).to_bytes(4, "big")


def envelope_parts(table: catalog.Table, conf: dict, value_schema: dict, consistent_lsn: int, snapshot_ts_ms: int,
                   now_ms: int, op: str = "r") -> tuple[bytes, bytes]:
    """Avro bytes of an 'r' envelope before and after its ``after`` record (the same for every row).

    Avro writes a record as its fields' encodings one after the other, so an envelope is
    ``before`` (null: union branch 0), ``after`` (union branch 1, then the Value record), then
    the constant ``source``, ``op``, ``ts_ms``, ``transaction`` and ``unchanged_cols``. These
    are encoded once here with fastavro against the registered schema; Spark encodes only the
    Value record of each row.
    """
    fields = {f["name"]: f for f in value_schema["fields"]}
    assert [f["name"] for f in value_schema["fields"]] == ["before", "after", "source", "op", "ts_ms", "transaction",
                                                          "unchanged_cols"], "envelope layout changed"
    tail_schema = {"type": "record", "name": "EnvelopeTail", "namespace": value_schema["namespace"],
                   "fields": [fields[n] for n in ("source", "op", "ts_ms", "transaction", "unchanged_cols")]}
    source_block = {
        "version": _connector_version(), "connector": avro_schemas.CONNECTOR,
        "name": config.get(conf, "kafka.topic_prefix"), "ts_ms": snapshot_ts_ms, "snapshot": "true",
        "db": config.get(conf, "source.database"), "sequence": f'[null,"{consistent_lsn}"]',
        "schema": table.schema, "table": table.name, "txId": None, "lsn": consistent_lsn, "xmin": None,
        "commit_lsn": consistent_lsn, "event_serial": -1,
    }
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(tail_schema), {
        "source": source_block, "op": op, "ts_ms": now_ms, "transaction": None, "unchanged_cols": []})
    return b"\x00\x02", buffer.getvalue()  # before: null (branch 0); after: branch 1 of ["null", Value]


def encode(rows, table: catalog.Table, conf: dict, key_schema: dict, value_schema: dict, key_id: int,
           value_id: int, consistent_lsn: int, snapshot_ts_ms: int, fields: list[dict]):
    """DataFrame (key, value): Confluent-framed Avro key and 'r' envelope for every row (to_avro per row)."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import to_avro

    value_record = value_schema["fields"][0]["type"][1]  # the Value record, defined in 'before'
    names = avro_schemas.field_names(table.columns)
    key_struct = F.struct(*[F.col(names[c]) for c in table.primary_key])
    after = F.struct(*[F.col(f["field"]) for f in fields])
    head, tail = envelope_parts(table, conf, value_schema, consistent_lsn, snapshot_ts_ms, int(time.time() * 1000))
    key_json = avro_schemas.canonical_json(wire_record(key_schema, fields))
    value_json = avro_schemas.canonical_json(wire_record(value_record, fields))
    return rows.select(
        F.concat(F.lit(confluent_header(key_id)), to_avro(key_struct, key_json)).alias("key"),
        F.concat(F.lit(confluent_header(value_id) + head), to_avro(after, value_json), F.lit(tail)).alias("value"),
    )


def _connector_version() -> str:
    try:
        return importlib.metadata.version("cdc-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def write(encoded, conf: dict, topic: str) -> None:
    """Spark's Kafka sink: idempotent producer, acks=all; returns when every task flushed its sends."""
    options = {
        "kafka.bootstrap.servers": str(config.get(conf, "kafka.bootstrap_servers")),
        "kafka.enable.idempotence": "true",
        "kafka.acks": "all",
        "kafka.linger.ms": "20",
        "kafka.batch.size": str(512 * 1024),
        "kafka.compression.type": "lz4",
        "topic": topic,
    }
    options.update(_kafka_options(conf))
    encoded.write.format("kafka").options(**options).save()


def _kafka_options(conf: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in (config.get(conf, "snapshot.kafka_options", {}) or {}).items()}


def retract_stale_keys(spark, conf: dict, table: catalog.Table, topic: str, schemas: tuple, fields: list[dict],
                       earlier: dict[int, int], written: dict[int, int], consistent_lsn: int,
                       snapshot_ts_ms: int) -> int:
    """Delete events (+ tombstones) for keys that earlier messages hold but this snapshot does not; their count.

    A topic can hold rows from before this snapshot: a failed attempt, or the snapshot and
    stream before a re-snapshot. A key deleted in the source since then is absent from the new
    snapshot and no streamed change will ever mention it again, so without this its old row
    would stay in the topic (and in silver) forever. Each such key gets a 'd' event at the new
    consistent point (newer than anything before it) and a tombstone, like a streamed delete.
    ``earlier`` and ``written`` are per-partition end offsets before and after this snapshot's rows.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro, to_avro

    if not any(earlier.values()):
        return 0
    key_schema, value_schema, key_id, value_id = schemas
    value_record = value_schema["fields"][0]["type"][1]
    names = avro_schemas.field_names(table.columns)
    key_fields = {names[c] for c in table.primary_key}
    plain = [f["name"] for f in value_record["fields"]
             if f["name"] not in key_fields and not isinstance(f["type"], list)]
    if plain:
        raise SnapshotError(
            f"topic {topic} holds rows from before this snapshot, and keys deleted since then must be retracted, "
            f"but table {table.qualified} (REPLICA IDENTITY FULL) needs the whole old row for a delete event "
            f"(non-null fields {', '.join(plain)}); remedy: snapshot into new topics (a new kafka.topic_prefix, or "
            f"delete the table's topic and rerun notebook 01)")

    def keys(start: dict, end: dict):
        """Distinct Avro keys (without the Confluent header) of the messages in [start, end) per partition."""
        return (spark.read.format("kafka")
                .option("kafka.bootstrap.servers", config.get(conf, "kafka.bootstrap_servers"))
                .options(**_kafka_options(conf)).option("subscribe", topic).option("failOnDataLoss", "false")
                .option("startingOffsets", json.dumps({topic: {str(p): o for p, o in start.items()}}))
                .option("endingOffsets", json.dumps({topic: {str(p): o for p, o in end.items()}}))
                .load().select(F.expr("substring(key, 6)").alias("k")).distinct())

    stale = keys({p: -2 for p in earlier}, earlier).join(keys(earlier, written), "k", "left_anti")
    # decoded without logical types (dates as int, timestamps as long, ...), exactly as column_transport selects them
    key_json = avro_schemas.canonical_json(_without_logical_types(wire_record(key_schema, fields)))
    value_json = avro_schemas.canonical_json(wire_record(value_record, fields))
    decoded = stale.select("k", from_avro(F.col("k"), key_json).alias("key"))
    before = F.struct(*[(F.col(f"key.{f['field']}").cast(f["spark_type"]) if f["field"] in key_fields
                         else F.lit(None).cast(f["spark_type"])).alias(f["field"]) for f in fields])
    _, tail = envelope_parts(table, conf, value_schema, consistent_lsn, snapshot_ts_ms, int(time.time() * 1000), "d")
    delete = F.concat(F.lit(confluent_header(value_id) + b"\x02"), to_avro(before, value_json), F.lit(b"\x00" + tail))
    events = decoded.select(F.concat(F.lit(confluent_header(key_id)), F.col("k")).alias("key"),
                            F.explode(F.array(delete, F.lit(None).cast("binary"))).alias("value"))  # d, then tombstone
    consumer = _consumer(conf)
    try:
        start = end_offsets(consumer, topic)
        write(events, conf, topic)
        return (end_offsets(consumer, topic) - start) // 2
    finally:
        consumer.close()


# ---------------------------------------------------------------------------------------------
# Kafka side helpers


def end_offsets(consumer: Consumer, topic: str, timeout: float = 30.0) -> int:
    """Sum of the topic's end offsets over its partitions."""
    return sum(partition_end_offsets(consumer, topic, timeout).values())


def partition_end_offsets(consumer: Consumer, topic: str, timeout: float = 30.0) -> dict[int, int]:
    """The topic's end offset per partition."""
    metadata = consumer.list_topics(topic, timeout=timeout).topics[topic]
    if metadata.error is not None:
        raise SnapshotError(f"topic {topic} is not readable: {metadata.error}; run notebook 01 to create it")
    return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1]
            for p in sorted(metadata.partitions)}


def _require_topics(conf: dict, names: list[str], wait_s: float = 10.0) -> None:
    """Every topic exists (waiting a little for topics created a moment ago to reach the metadata)."""
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    deadline = time.monotonic() + wait_s
    while True:
        existing = admin.list_topics(timeout=30).topics
        missing = [n for n in names if n not in existing]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        raise SnapshotError(f"topic(s) {', '.join(missing)} do not exist (Kafka does not create them here): "
                            f"run notebook 01 (lib.bootstrap) first")


def _require_publication(conn, conf: dict, tables: dict[str, catalog.Table]) -> None:
    name = config.get(conf, "source.publication")
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        if cur.fetchone() is None:
            raise SnapshotError(f"publication {name} (source.publication) does not exist; create it before the slot "
                                f"(notebook 01): a pgoutput slot created before its publication fails to stream")
        cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s", (name,))
        published = {r[0] for r in cur.fetchall()}
    missing = sorted(t.qualified for t in tables.values() if t.qualified not in published)
    if missing:
        raise SnapshotError(f"publication {name} does not publish {', '.join(missing)}: their changes would never be "
                            f"streamed; ALTER PUBLICATION {name} ADD TABLE {', '.join(missing)} (notebook 01)")


class _Progress(threading.Thread):
    """Every interval seconds, one line per table being written: rows so far (topic end offsets), rows/s."""

    def __init__(self, conf: dict, interval: float, progress):
        super().__init__(daemon=True, name="cdc-snapshot-progress")
        self.conf, self.interval, self.progress = conf, interval, progress
        self.active: dict[str, tuple] = {}  # table -> (topic, start offset, expected rows, started)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def track(self, table: str, topic: str, start_offset: int, expected: int) -> None:
        with self.lock:
            self.active[table] = (topic, start_offset, expected, time.monotonic())

    def untrack(self, table: str) -> None:
        with self.lock:
            self.active.pop(table, None)

    def run(self):
        consumer = _consumer(self.conf)
        try:
            while not self.stop.wait(self.interval):
                with self.lock:
                    active = dict(self.active)
                for table, (topic, start_offset, expected, started) in active.items():
                    try:
                        done = end_offsets(consumer, topic, timeout=5) - start_offset
                    except Exception:  # a progress line is not worth failing the snapshot
                        continue
                    rate = done / max(time.monotonic() - started, 1e-6)
                    share = f" ({100 * done / expected:.0f}%)" if expected else ""
                    self.progress(f"snapshot {table}: {done:,}/{expected:,} rows{share}, {rate:,.0f} rows/s")
        finally:
            consumer.close()


def _consumer(conf: dict) -> Consumer:
    return Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                     "group.id": f"cdc-snapshot-offsets-{time.monotonic_ns()}", "enable.auto.commit": False})


# ---------------------------------------------------------------------------------------------
# The whole snapshot


def run(conf: dict, spark, progress=print, resnapshot: bool = False) -> dict:
    """Slot + exported snapshot, every table read by Spark into its topic, control record 'complete'.

    Safe to run again: once complete it does nothing (see create_slot_with_snapshot for the
    restart and ``resnapshot`` paths). On failure the new slot is dropped again (it would retain
    WAL while nobody streams from it) and the control record stays 'running' with the error;
    running again takes a new snapshot. Up to ``snapshot.parallel_tables`` tables (default 4)
    are written at once, largest first, so small tables fill the cores a big one leaves idle.
    """
    slot = config.get(conf, "source.slot")
    prefix = config.get(conf, "kafka.topic_prefix")
    unknown_types = config.get(conf, "source.unknown_types", "error")
    names = list(config.get(conf, "source.tables"))
    conn = source.connect(conf)
    try:
        tables = catalog.describe_tables(conn, names, config.get(conf, "source.keys", {}))
        for table in tables.values():
            catalog.check_capturable(table)
        _require_publication(conn, conf, tables)
    finally:
        conn.close()
    topics = {name: avro_schemas.topic_name(prefix, table) for name, table in tables.items()}
    _require_topics(conf, list(topics.values()) + [control.topic(conf)])
    registry = schema_registry.client(conf)
    schemas = {}
    for name, table in tables.items():
        key_subject, value_subject = schema_registry.subjects(topics[name])
        key = avro_schemas.key_schema(table, prefix, unknown_types)
        value = avro_schemas.value_schema(table, prefix, unknown_types)
        schemas[name] = (key, value, schema_registry.register(registry, key_subject, key)[0],
                         schema_registry.register(registry, value_subject, value)[0])

    repl, consistent_lsn, snapshot_name = create_slot_with_snapshot(conf, progress, resnapshot)
    if repl is None:
        record = _snapshot_state(conf, slot)
        return {"status": "complete", "already_complete": True, **record}
    started = time.monotonic()
    started_at = datetime.now(timezone.utc)
    record = {"state": "running", "slot": slot, "consistent_lsn": consistent_lsn,
              "consistent_point": int_to_lsn(consistent_lsn), "snapshot_name": snapshot_name,
              "publication": config.get(conf, "source.publication"), "topic_prefix": prefix,
              "started_at": started_at.isoformat(), "tables": {}}
    progress(f"snapshot: slot {slot} created at consistent point {record['consistent_point']}, "
             f"snapshot {snapshot_name}")
    job = {"conf": conf, "spark": spark, "snapshot_name": snapshot_name, "consistent_lsn": consistent_lsn,
           "snapshot_ts_ms": int(started_at.timestamp() * 1000), "unknown_types": unknown_types,
           "progress": progress, "tag": f"cdc-snapshot-{slot}"}
    try:
        control.put(conf, f"snapshot/{slot}", record)
        plans = _plan_all(conf, spark, snapshot_name, tables)
        total = sum(p["rows"] for p in plans.values())
        progress(f"snapshot: {total:,} rows in {len(tables)} table(s): "
                 + ", ".join(f"{n} {p['rows']:,} ({p['partitions']} partition(s))" for n, p in plans.items()))
        stats = _write_all(job, tables, topics, schemas, plans)
    except BaseException as exc:
        _abort(conf, repl, slot, record, exc, progress)
        raise
    repl.close()  # every read is done: the exported snapshot is no longer needed
    elapsed = time.monotonic() - started
    record.update({"state": "complete", "tables": {name: stats[name]["rows"] for name in tables},
                   "finished_at": datetime.now(timezone.utc).isoformat(), "elapsed_s": round(elapsed, 3),
                   "rows": total, "rows_per_s": round(total / elapsed, 1) if elapsed > 0 else None,
                   "partitions": {name: stats[name]["partitions"] for name in tables}})
    control.put(conf, f"snapshot/{slot}", record)
    progress(f"snapshot: complete, {total:,} rows in {elapsed:.1f} s ({record['rows_per_s']:,} rows/s); "
             f"the stream may start from {record['consistent_point']}")
    return {"status": "complete", "already_complete": False, **record, "stats": stats}


def _plan_all(conf: dict, spark, snapshot_name: str, tables: dict[str, catalog.Table]) -> dict[str, dict]:
    """Every table's exact row count and partitioning, on a connection that imported the snapshot."""
    planner = snapshot_connection(conf, snapshot_name)
    try:
        return {name: plan_partitions(planner, table,
                                      int(config.get(conf, "snapshot.partition_rows", DEFAULT_PARTITION_ROWS)),
                                      int(config.get(conf, "snapshot.max_partitions", DEFAULT_MAX_PARTITIONS)),
                                      _parallelism(spark))
                for name, table in tables.items()}
    finally:
        planner.close()


def _parallelism(spark) -> int:
    """Spark's default parallelism (its cores), or 2 where the session does not expose it (Spark Connect)."""
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:
        return 2


def _write_all(job: dict, tables, topics, schemas, plans) -> dict[str, dict]:
    """Run _snapshot_table for every table, several at once; the first failure interrupts the others."""
    conf, spark, progress = job["conf"], job["spark"], job["progress"]
    reporter = _Progress(conf, float(config.get(conf, "snapshot.progress_s", DEFAULT_PROGRESS_S)), progress)
    reporter.start()
    order = sorted(tables, key=lambda n: -plans[n]["rows"])
    workers = max(1, int(config.get(conf, "snapshot.parallel_tables", 4)))
    stats, failure = {}, None
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cdc-snapshot") as pool:
            futures = {pool.submit(_snapshot_table, job, tables[n], topics[n], schemas[n], plans[n], reporter): n
                       for n in order}
            for future in as_completed(futures):
                try:
                    stats[futures[future]] = future.result()
                except BaseException as exc:
                    if failure is None:
                        failure = exc
                        for other in futures:
                            other.cancel()
                        with contextlib.suppress(Exception):
                            spark.interruptTag(job["tag"])
    finally:
        reporter.stop.set()
        reporter.join()
    if failure is not None:
        raise failure
    return stats


def _snapshot_table(job: dict, table: catalog.Table, topic: str, schemas: tuple, plan: dict,
                    reporter: _Progress) -> dict:
    """Read, encode and write one table; checks that the topic grew by at least the rows read."""
    conf, spark, progress = job["conf"], job["spark"], job["progress"]
    key_schema, value_schema, key_id, value_id = schemas
    consumer = _consumer(conf)
    try:
        earlier = partition_end_offsets(consumer, topic)
        before = sum(earlier.values())
        started = time.monotonic()
        progress(f"snapshot {table.qualified}: {plan['rows']:,} rows in {plan['partitions']} partition(s) -> {topic}")
        reporter.track(table.qualified, topic, before, plan["rows"])
        spark.addTag(job["tag"])
        try:
            rows, fields = read_table(spark, conf, table, job["snapshot_name"], plan, job["unknown_types"])
            encoded = encode(rows, table, conf, key_schema, value_schema, key_id, value_id, job["consistent_lsn"],
                             job["snapshot_ts_ms"], fields)
            write(encoded, conf, topic)
        except Exception as exc:
            raise _read_failed(table, exc) from exc
        finally:
            spark.removeTag(job["tag"])
            reporter.untrack(table.qualified)
        elapsed = time.monotonic() - started
        after = partition_end_offsets(consumer, topic)
        written = sum(after.values()) - before
        if written < plan["rows"]:
            raise SnapshotError(f"snapshot of {table.qualified}: {plan['rows']} rows read but only {written} messages "
                                f"reached topic {topic}; run the snapshot again")
        if written > plan["rows"]:
            progress(f"snapshot {table.qualified}: {written - plan['rows']} duplicate message(s) from retried Spark "
                     f"tasks (harmless: same key, same position)")
        rate = plan["rows"] / elapsed if elapsed > 0 else 0.0
        progress(f"snapshot {table.qualified}: {plan['rows']:,} rows in {elapsed:.1f} s ({rate:,.0f} rows/s)")
        spark.addTag(job["tag"])
        try:
            retracted = retract_stale_keys(spark, conf, table, topic, schemas, fields, earlier, after,
                                           job["consistent_lsn"], job["snapshot_ts_ms"])
        except SnapshotError:
            raise
        except Exception as exc:
            raise _read_failed(table, exc) from exc
        finally:
            spark.removeTag(job["tag"])
        if retracted:
            progress(f"snapshot {table.qualified}: {retracted:,} key(s) from earlier messages in {topic} no longer "
                     f"exist: delete events and tombstones written")
    finally:
        consumer.close()
    return {"rows": plan["rows"], "messages": written, "partitions": plan["partitions"], "retracted": retracted,
            "elapsed_s": round(elapsed, 3), "rows_per_s": round(rate, 1), "topic": topic}


def _read_failed(table: catalog.Table, exc: Exception) -> SnapshotError:
    """A Spark/JDBC failure as a message naming the table, the database's reason and a remedy."""
    text = str(exc)
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    for line in text.splitlines():  # the PostgreSQL or driver message is more useful than Spark's wrapper
        if "PSQLException:" in line or "cdc snapshot:" in line or "ValueError: column" in line:
            reason = line.split("Exception:", 1)[-1].strip() if "cdc snapshot:" not in line else line.strip()
            break
    hints = []
    if "snapshot" in reason and ("invalid" in reason or "does not exist" in reason):
        hints.append("the replication connection that exported the snapshot closed; run the snapshot again")
    if "NaN" in reason:
        cols = [c.name for c in table.columns if c.precision is not None]
        hints.append(f"a numeric(p,s) column ({', '.join(cols)}) holds NaN, which has no Avro decimal value: "
                     f"replace it in the source or make the column unconstrained numeric")
    if "infinite" in reason:
        cols = [c.name for c in table.columns if c.type.resolved().name == "date"]
        hints.append(f"a date column ({', '.join(cols)}) holds ±infinity, which has no Avro date value: "
                     f"replace it in the source")
    if "permission denied" in reason:
        hints.append(f"GRANT SELECT ON {table.qualified} TO the pipeline role (source.user)")
    remedy = "; ".join(hints) or "see the Spark driver log for the full error, fix the cause and run again"
    return SnapshotError(f"snapshot of table {table.qualified} failed: {reason}; {remedy}")


def _abort(conf: dict, repl, slot: str, record: dict, exc: BaseException, progress) -> None:
    """After a failure: drop the new slot (it would retain WAL) and leave control 'running' with the error."""
    try:
        with repl.cursor() as cur:
            cur.execute(f"DROP_REPLICATION_SLOT {_ident(slot)}")
        progress(f"snapshot: failed, slot {slot} dropped again; run the snapshot again")
    except Exception:
        progress(f"snapshot: failed and slot {slot} could not be dropped now; the next run drops it "
                 f"(until then it retains WAL)")
    finally:
        with contextlib.suppress(Exception):
            repl.close()
    with contextlib.suppress(Exception):
        control.put(conf, f"snapshot/{slot}", {**record, "state": "running",
                                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
