"""Merge stage: the table topics (Confluent Avro, Debezium envelope) -> Delta bronze change log and silver tables.

One Structured Streaming query reads every configured table topic; ``foreachBatch`` splits each
micro-batch by topic and, per table:

- **bronze** ``<lake.root>/bronze/<schema>/<table>``: every event and tombstone, decoded (``key``,
  ``before``, ``after``, ``source``, ``op``, ...) plus its Kafka coordinates. Each append's commit
  carries the micro-batch id in ``userMetadata``, so a retried micro-batch never adds rows twice.
- **silver** ``<lake.root>/silver/<schema>/<table>``: the source table's columns (Avro field names)
  plus ``_commit_lsn``, ``_event_serial``, ``_op``, ``_deleted``, ``_deleted_at``, ``_updated_at``
  and ``_unknown_cols``. Exactly one MERGE per table per micro-batch. An event is applied only when
  its (commit_lsn, event_serial) is newer than the stored one, so running a batch's MERGE again
  changes no row.
  Deletes keep a soft tombstone (``_deleted = true``, position kept) until
  ``merge.tombstone_retention_hours``; ``cleanup_tombstones`` removes older ones.
- poison input (not Confluent-framed, unknown schema id, undecodable, null key, impossible event)
  goes to ``<lake.root>/_dead_letter`` with its raw bytes and a reason; the stream goes on.

Decisions an operator should know (docs/events.md is the event contract):

- Silver column names are the Avro field names (a column whose name is not a valid Avro name,
  e.g. ``first name``, is ``first_name`` in silver; Delta refuses such names without column mapping).
- TOAST: a column listed in ``unchanged_cols`` keeps the stored value. When no row is stored yet
  (only possible if the stream started without the snapshot), the row is inserted with null there
  and the column is listed in ``_unknown_cols`` until a later event carries its value;
  ``summary`` counts such rows and ``reconcile`` reports them as different.
- A tombstone (null value) whose ``d`` event is in the same batch changes nothing. A tombstone
  alone for a key (its ``d`` was compacted away) soft-deletes the stored row with ``_op =
  'tombstone'`` keeping the stored position; an event at exactly that position may re-apply
  (a replay of the stored state), an older one may not.
- An update whose ``before`` carries another primary key (a key change) also soft-deletes the old
  key at the update's position (Debezium's d + c for a key change works too).
- Truncates come from the control topic (``truncate/<schema.table>``, lib/control.py), read at the
  start of every micro-batch (the query subscribes to the control topic too, so a truncate alone
  starts a batch): rows older than the truncate are soft-deleted (``_op = 't'``) in the same MERGE,
  and incoming events older than it are ignored.
- Schema changes: each message is decoded with its own writer schema (never a fixed reader: the
  registry's compatibility check ignores logical types, so reading decimal(14,2) bytes with a
  decimal(14,3) reader would shift values), then conformed by name to the union of every version
  of the value subject (types of the newest version that has the field). New columns are added to
  silver (ALTER TABLE ADD COLUMNS) and bronze (mergeSchema); a dropped column stays in silver and is
  null in rows written by newer events; int -> bigint is widened (Delta type widening).
- Idempotence ids: ``<query name>-<query id>/<schema.table>`` (``.../_dead_letter`` for the
  dead-letter table) with the batch id, in each append's commit ``userMetadata``
  (``{"merge_batch": ..., "batch": ...}``). The query id lives in the checkpoint, so a new checkpoint gets new
  ids (an old id would make every batch whose id is not above the old checkpoint's look done).
- The Delta writes of one micro-batch (each table's bronze append and MERGE, the dead letters) run
  up to ``merge.parallelism`` at a time; the batch fails as a whole if any of them fails.
- When Delta refuses a MERGE because the source's cached state changed while it ran
  (DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION; seen once re-running a batch a stopped service left
  uncommitted), the MERGE runs once more on a checkpointed copy of the source.

Settings (all optional, under ``merge:``): ``query_name``, ``max_offsets_per_trigger`` (100000),
``fail_on_data_loss`` (true), ``kafka_options`` (extra Kafka consumer options, values may be secret
references), ``tombstone_retention_hours`` (168), ``cleanup_interval_minutes`` (60),
``control_timeout_s`` (30), ``restart_attempts`` (2, run_until_caught_up only), ``parallelism`` (4),
``unknown_schema_wait_s`` (30), ``unknown_schema_ids`` (``fail`` or ``dead_letter``).

A writer schema id the registry does not serve (a replica behind, a restore) is asked for again for
``unknown_schema_wait_s``; then the micro-batch fails naming topic, offset and id, so nothing is set
aside and a restart retries it. With ``unknown_schema_ids: dead_letter`` such events go to the
dead-letter table instead and the stream goes on; silver then lacks them until
``replay_dead_letters(spark, conf)`` re-reads the ones that decode now (position-guarded, so late is safe).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from confluent_kafka.schema_registry.error import SchemaRegistryError
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro

from lib import avro_schemas, catalog, config, control, debezium, events, schema_registry, secrets

log = logging.getLogger(__name__)

META_COLUMNS = ("_commit_lsn", "_event_serial", "_op", "_deleted", "_deleted_at", "_updated_at", "_unknown_cols")
REASONS = ("not_framed", "null_key", "unknown_schema_id", "undecodable", "bad_event")
OPS = ("c", "u", "d", "r")
DEFAULT_MAX_OFFSETS = 100_000
DEFAULT_RETENTION_HOURS = 168
DEFAULT_CLEANUP_MINUTES = 60
DEFAULT_PARALLELISM = 4
DEFAULT_UNKNOWN_SCHEMA_WAIT_S = 30.0
UNKNOWN_SCHEMA_RECHECK_S = 60.0  # a missing id is asked for again after this long
APPEND_HISTORY_COMMITS = 100  # commits searched for a retried batch's append (bronze, dead letters)

SOURCE_TYPE = T.StructType([T.StructField(name, kind) for name, kind in (
    ("version", T.StringType()), ("connector", T.StringType()), ("name", T.StringType()),
    ("ts_ms", T.LongType()), ("snapshot", T.StringType()), ("db", T.StringType()),
    ("sequence", T.StringType()), ("schema", T.StringType()), ("table", T.StringType()),
    ("txId", T.LongType()), ("lsn", T.LongType()), ("xmin", T.LongType()),
    ("commit_lsn", T.LongType()), ("event_serial", T.LongType()))])
TRANSACTION_TYPE = T.StructType([T.StructField("id", T.StringType()), T.StructField("total_order", T.LongType()),
                                 T.StructField("data_collection_order", T.LongType())])
DEAD_LETTER_SCHEMA = T.StructType([
    T.StructField("topic", T.StringType()), T.StructField("partition", T.IntegerType()),
    T.StructField("offset", T.LongType()), T.StructField("timestamp", T.TimestampType()),
    T.StructField("key", T.BinaryType()), T.StructField("value", T.BinaryType()),
    T.StructField("reason", T.StringType()), T.StructField("detail", T.StringType()),
    T.StructField("key_schema_id", T.LongType()), T.StructField("value_schema_id", T.LongType()),
    T.StructField("batch_id", T.LongType()), T.StructField("query", T.StringType()),
    T.StructField("ingested_at", T.TimestampType())])
_NOT_FRAMED = "is not Confluent wire format (magic byte 0 + 4-byte schema id): produce with the registry's serializer"


class MergeError(RuntimeError):
    """The merge cannot go on: the message names the table, column or setting and the remedy."""


# ---------------------------------------------------------------------------------------------
# tables, names, paths


@dataclass(frozen=True)
class TableSpec:
    """A configured table: its schema, name and topic."""

    schema: str
    name: str
    topic: str

    @property
    def qualified(self) -> str:
        """schema.table (as in the control topic's truncate/<schema.table> keys)."""
        return f"{self.schema}.{self.name}"


def table_specs(conf: dict) -> list[TableSpec]:
    """The configured tables (source.tables) with their topics; unquoted names fold to lower case like SQL."""
    prefix = config.get(conf, "kafka.topic_prefix")
    specs = []
    for name in config.get(conf, "source.tables"):
        schema, table = catalog.normalize(name)
        specs.append(TableSpec(schema, table, avro_schemas.topic_name(prefix, f"{schema}.{table}")))
    return specs


def quote(name: str) -> str:
    """A SQL identifier in backticks."""
    return "`" + name.replace("`", "``") + "`"


def _path(conf: dict, *parts: str) -> str:
    return "/".join([config.location(config.get(conf, "lake.root")).rstrip("/"), *parts])


def bronze_path(conf: dict, spec: TableSpec) -> str:
    """<lake.root>/bronze/<schema>/<table> (catalog.path_segment: a name can never leave its folder)."""
    return _path(conf, "bronze", catalog.path_segment(spec.schema), catalog.path_segment(spec.name))


def silver_path(conf: dict, spec: TableSpec) -> str:
    """<lake.root>/silver/<schema>/<table> (catalog.path_segment: a name can never leave its folder)."""
    return _path(conf, "silver", catalog.path_segment(spec.schema), catalog.path_segment(spec.name))


def dead_letter_path(conf: dict) -> str:
    """<lake.root>/_dead_letter."""
    return _path(conf, "_dead_letter")


def checkpoint_path(conf: dict, query_name: str) -> str:
    """<lake.root>/_checkpoints/<query name>: one folder per streaming query."""
    return _path(conf, "_checkpoints", query_name)


def query_name(conf: dict) -> str:
    """merge.query_name, default 'merge_<topic prefix>' (names must be unique among a session's queries)."""
    default = "merge_" + re.sub(r"[^A-Za-z0-9_]", "_", str(config.get(conf, "kafka.topic_prefix")))
    return str(config.get(conf, "merge.query_name", default))


# ---------------------------------------------------------------------------------------------
# schemas from the registry


class Schemas:
    """Writer schemas by id (each fetched once) and the versions of each subject, cached on the driver."""

    def __init__(self, conf: dict, client=None):
        self.client = client or schema_registry.client(conf)
        self.url = config.get(conf, "registry.url", "")
        self.wait_s = float(config.get(conf, "merge.unknown_schema_wait_s", DEFAULT_UNKNOWN_SCHEMA_WAIT_S))
        self.by_id: dict[int, dict] = {}
        self.missing: dict[int, float] = {}  # id -> when the registry last said 404 (asked again later)
        self.subject_ids: dict[str, list[int]] = {}  # subject -> ids, oldest version first
        self.spark_types: dict[int, T.DataType] = {}

    def writer(self, schema_id: int) -> dict | None:
        """The parsed writer schema of an id; None while the registry does not serve it (404 for wait_s)."""
        if schema_id in self.by_id:
            return self.by_id[schema_id]
        missed = self.missing.get(schema_id)
        if missed is not None and time.monotonic() - missed < UNKNOWN_SCHEMA_RECHECK_S:
            return None
        deadline, delay = time.monotonic() + self.wait_s, 0.5
        while True:
            try:
                self.by_id[schema_id] = json.loads(self.client.get_schema(schema_id).schema_str)
                self.missing.pop(schema_id, None)
                return self.by_id[schema_id]
            except SchemaRegistryError as exc:
                if exc.http_status_code != 404:
                    raise MergeError(f"schema registry {self.url} failed to return schema id {schema_id} "
                                     f"(HTTP {exc.http_status_code}): {exc.error_message}; check registry.url "
                                     f"and the registry's log") from exc
            if time.monotonic() >= deadline:
                self.missing[schema_id] = time.monotonic()
                log.warning("schema registry %s does not serve schema id %s (asked for %.0f s)", self.url,
                            schema_id, self.wait_s)
                return None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def versions(self, subject: str, refresh: bool = False) -> list[int]:
        """Schema ids of every version of subject, oldest first ([] when the subject does not exist)."""
        if refresh or subject not in self.subject_ids:
            try:
                numbers = sorted(self.client.get_versions(subject))
            except SchemaRegistryError as exc:
                if exc.http_status_code != 404:
                    raise MergeError(f"schema registry {self.url} failed to list versions of {subject} "
                                     f"(HTTP {exc.http_status_code}): {exc.error_message}") from exc
                numbers = []
            ids = []
            for number in numbers:
                registered = self.client.get_version(subject, number)
                self.by_id.setdefault(registered.schema_id, json.loads(registered.schema.schema_str))
                ids.append(registered.schema_id)
            self.subject_ids[subject] = ids
        return self.subject_ids[subject]

    def spark_type(self, spark: SparkSession, schema_id: int) -> T.DataType:
        """The Spark type from_avro gives a writer schema (analysis only, no job)."""
        if schema_id not in self.spark_types:
            text = json.dumps(self.by_id[schema_id])
            frame = spark.range(0).select(from_avro(F.lit(None).cast("binary"), text).alias("x"))
            self.spark_types[schema_id] = frame.schema["x"].dataType
        return self.spark_types[schema_id]


@dataclass
class Layout:
    """How one table's messages in a batch decode: writer ids, target row and key structs."""

    value_ids: list[int]
    key_ids: list[int]
    row: T.StructType  # union of every version's Value fields
    key: T.StructType
    nullable: set[str]  # fields that may be null in some version (TOAST candidates)
    pg_names: dict[int, dict[str, str]]  # writer id -> {pg column: avro field} where they differ
    semantic: dict[int, dict[str, str]] = field(default_factory=dict)  # id -> Debezium types to convert


def _value_record(schema: dict) -> dict | None:
    """The 'Value' record inside an envelope schema (defined in before or after)."""
    for fld in schema.get("fields", []):
        if fld["name"] in ("before", "after"):
            types = fld["type"] if isinstance(fld["type"], list) else [fld["type"]]
            for t in types:
                if isinstance(t, dict) and t.get("type") == "record":
                    return t
    return None


def _layout(spark: SparkSession, schemas: Schemas, spec: TableSpec, value_ids: set[int],
            key_ids: set[int]) -> Layout:
    """Resolve the writer ids seen in a batch and the table's target structs."""
    key_subject, value_subject = schema_registry.subjects(spec.topic)
    versions = schemas.versions(value_subject)
    if any(i not in versions for i in value_ids):
        versions = schemas.versions(value_subject, refresh=True)
    known_values = sorted(i for i in value_ids if schemas.writer(i) is not None)
    ordered = list(reversed(versions)) + [i for i in known_values if i not in versions]
    row_fields: dict[str, T.StructField] = {}
    nullable: set[str] = set()
    pg_names: dict[int, dict[str, str]] = {}
    semantic: dict[int, dict[str, str]] = {}
    for schema_id in ordered:
        record = _value_record(schemas.by_id[schema_id]) or {"fields": []}
        after = schemas.spark_type(spark, schema_id)["after"].dataType
        if debezium.is_debezium(schemas.by_id[schema_id]):  # Debezium's types and TOAST placeholders
            semantic[schema_id] = debezium.semantic_fields(record)
            after = debezium.row_type(after, semantic[schema_id])
            nullable |= debezium.toast_candidates(after)
        for fld in after.fields:
            row_fields.setdefault(fld.name.lower(), T.StructField(fld.name, fld.dataType))
        for fld in record["fields"]:
            if isinstance(fld["type"], list) and "null" in fld["type"]:
                nullable.add(fld["name"])
        renamed = {f["pg.column"]: f["name"] for f in record["fields"] if "pg.column" in f}
        if renamed:
            pg_names[schema_id] = renamed
    key_versions = schemas.versions(key_subject)
    if any(i not in key_versions for i in key_ids):
        key_versions = schemas.versions(key_subject, refresh=True)
    known_keys = sorted(i for i in key_ids if schemas.writer(i) is not None)
    key_order = list(reversed(key_versions)) + [i for i in known_keys if i not in key_versions]
    for i in key_order:
        semantic[i] = debezium.semantic_fields(schemas.by_id[i])
    key_type = debezium.row_type(schemas.spark_type(spark, key_order[0]), semantic[key_order[0]]) if key_order \
        else T.StructType([])
    row = T.StructType(list(row_fields.values()))
    for name in (f.name for f in row.fields):
        if name.lower() in META_COLUMNS or name.startswith("__"):
            raise MergeError(f"table {spec.qualified} has a column {name} whose name the merge reserves for its own "
                             f"columns ({', '.join(META_COLUMNS)}, __*): rename the source column")
    missing = [f.name for f in key_type.fields if f.name.lower() not in row_fields]
    if missing and row.fields:
        raise MergeError(f"topic {spec.topic}: key field(s) {', '.join(missing)} are not fields of the value "
                         f"schema; the key must be the table's primary key columns (see docs/events.md)")
    return Layout(known_values, known_keys, row, key_type, nullable, pg_names, semantic)


# ---------------------------------------------------------------------------------------------
# decoding (built-in functions only: no Python on the hot path)


def _framed(c: Column) -> Column:
    return c.isNotNull() & (F.length(c) >= 5) & (F.hex(F.substring(c, 1, 1)) == F.lit("00"))


def _schema_id(c: Column) -> Column:
    return F.when(_framed(c), F.conv(F.hex(F.substring(c, 2, 4)), 16, 10).cast("long"))


def headers(raw: DataFrame) -> DataFrame:
    """Kafka rows -> the same rows plus framing flags, key/value schema ids (nulls when not framed) and a
    tombstone's position (__tlsn, __tserial: the delete it follows, from the capture's Kafka header)."""
    tlsn = tserial = F.lit(None).cast("long")
    if "headers" in raw.columns:
        found = F.filter(F.col("headers"), lambda h: h["key"] == F.lit(events.POSITION_HEADER))
        pos = F.when(F.size(found) > 0, F.element_at(found, 1)["value"])
        pos = F.when(F.length(pos) == 16, pos)
        tlsn = F.conv(F.hex(F.substring(pos, 1, 8)), 16, 10).cast("long")
        tserial = F.conv(F.hex(F.substring(pos, 9, 8)), 16, 10).cast("long")  # a delete's serial is >= 0
    return raw.select(
        F.col("key").alias("__k"), F.col("value").alias("__v"), "topic", "partition", "offset", "timestamp",
        _framed(F.col("key")).alias("__kf"), _framed(F.col("value")).alias("__vf"),
        _schema_id(F.col("key")).alias("__kid"), _schema_id(F.col("value")).alias("__vid"),
        F.when(F.col("value").isNull(), tlsn).alias("__tlsn"),
        F.when(F.col("value").isNull(), tserial).alias("__tserial"))


def _conform(c: Column, src: T.DataType, dst: T.DataType) -> Column:
    """c (of type src) as type dst: structs matched by field name, missing fields null, atomic types cast."""
    if src == dst:
        return c
    if isinstance(src, T.StructType) and isinstance(dst, T.StructType):
        names = {f.name.lower(): f for f in src.fields}
        parts = []
        for f in dst.fields:
            have = names.get(f.name.lower())
            value = _conform(c[have.name], have.dataType, f.dataType) if have else F.lit(None).cast(f.dataType)
            parts.append(value.alias(f.name))
        return F.when(c.isNotNull(), F.struct(*parts))
    if isinstance(src, T.ArrayType) and isinstance(dst, T.ArrayType) and isinstance(dst.elementType, T.StructType):
        return F.transform(c, lambda x: _conform(x, src.elementType, dst.elementType))
    return c.cast(dst)


def _envelope_type(row: T.StructType) -> T.StructType:
    return T.StructType([
        T.StructField("before", row), T.StructField("after", row), T.StructField("source", SOURCE_TYPE),
        T.StructField("op", T.StringType()), T.StructField("ts_ms", T.LongType()),
        T.StructField("transaction", TRANSACTION_TYPE),
        T.StructField("unchanged_cols", T.ArrayType(T.StringType()))])


def _normalize(e: Column, writer: T.StructType, layout: Layout, schema_id: int) -> Column:
    """One writer's decoded envelope -> the table's envelope type (a Debezium writer, without our ordering
    fields, gets its position from lib/debezium.py; its types and TOAST placeholders were mapped in decode)."""
    names = {f.name: f.dataType for f in writer.fields}

    def part(name: str, dst: T.DataType) -> Column:
        return _conform(e[name], names[name], dst) if name in names else F.lit(None).cast(dst)

    source = part("source", SOURCE_TYPE)
    src_fields = {f.name for f in names["source"].fields} if isinstance(names.get("source"), T.StructType) else set()
    unchanged = F.coalesce(part("unchanged_cols", T.ArrayType(T.StringType())), F.array().cast("array<string>"))
    renamed = layout.pg_names.get(schema_id)
    if renamed:
        mapping = F.create_map(*[F.lit(x) for pair in renamed.items() for x in pair])
        unchanged = F.transform(unchanged, lambda x: F.coalesce(mapping[x], x))
    if "commit_lsn" not in src_fields or "event_serial" not in src_fields:
        source = debezium.position(source)
    return F.struct(part("before", layout.row).alias("before"), part("after", layout.row).alias("after"),
                    source.alias("source"), part("op", T.StringType()).alias("op"),
                    part("ts_ms", T.LongType()).alias("ts_ms"),
                    part("transaction", TRANSACTION_TYPE).alias("transaction"), unchanged.alias("unchanged_cols"))


def decode(framed: DataFrame, spark: SparkSession, schemas: Schemas, layout: Layout, batch_id: int) -> DataFrame:
    """One table's rows (from ``headers``) -> __key, __env and __tomb, or __reason/__detail for dead letters.

    Each writer id gets its own from_avro (PERMISSIVE: a body that does not decode gives nulls) under a
    ``when`` on the schema id, computed once in a projection of its own, then conformed to the table's
    structs and combined.
    """
    body = F.expr("substr(`__v`, 6)")
    kbody = F.expr("substr(`__k`, 6)")
    decoded = [F.col(c) for c in ("__k", "__v", "topic", "partition", "offset", "timestamp", "__kf", "__vf",
                                  "__kid", "__vid", "__tlsn", "__tserial")]
    for i in layout.value_ids:
        decoded.append(F.when(F.col("__vid") == i, from_avro(body, json.dumps(schemas.by_id[i]),
                                                             {"mode": "PERMISSIVE"})).alias(f"__v{i}"))
    for i in layout.key_ids:
        decoded.append(F.when(F.col("__kid") == i, from_avro(kbody, json.dumps(schemas.by_id[i]),
                                                             {"mode": "PERMISSIVE"})).alias(f"__k{i}"))
    stage = debezium.prepare(framed.select(*decoded), layout.semantic)  # Debezium writers: our types, TOAST
    env_type = _envelope_type(layout.row)
    env = F.lit(None).cast(env_type)
    for i in reversed(layout.value_ids):
        writer = stage.schema[f"__v{i}"].dataType
        env = F.when(F.col("__vid") == i, _normalize(F.col(f"__v{i}"), writer, layout, i)).otherwise(env)
    key = F.lit(None).cast(layout.key)
    for i in reversed(layout.key_ids):
        key = F.when(F.col("__kid") == i, _conform(F.col(f"__k{i}"), stage.schema[f"__k{i}"].dataType,
                                                   layout.key)).otherwise(key)
    out = stage.select("__k", "__v", "topic", "partition", "offset", "timestamp", "__kf", "__vf", "__kid", "__vid",
                       "__tlsn", "__tserial", key.alias("__key"), env.alias("__env"))
    known_v = F.col("__vid").isin(layout.value_ids) if layout.value_ids else F.lit(False)
    known_k = F.col("__kid").isin(layout.key_ids) if layout.key_ids else F.lit(False)
    first_key = layout.key.fields[0].name if layout.key.fields else None
    key_bad = F.col("__key").isNull() | (F.col("__key")[first_key].isNull() if first_key else F.lit(True))
    op, after = F.col("__env.op"), F.col("__env.after")
    where = F.concat_ws(" ", F.lit("at"), F.col("topic"), F.lit("partition"), F.col("partition").cast("string"),
                        F.lit("offset"), F.col("offset").cast("string"))
    tomb = F.col("__v").isNull()
    rules = [
        (F.col("__k").isNull(), "null_key", F.lit("message without a key")),
        (~tomb & ~F.col("__vf"), "not_framed",
         F.lit(f"value {_NOT_FRAMED}")),
        (~F.col("__kf"), "not_framed",
         F.lit(f"key {_NOT_FRAMED}")),
        (~tomb & ~known_v, "unknown_schema_id",
         F.concat(F.lit("value schema id "), F.col("__vid").cast("string"), F.lit(" is not in the registry"))),
        (~known_k, "unknown_schema_id",
         F.concat(F.lit("key schema id "), F.col("__kid").cast("string"), F.lit(" is not in the registry"))),
        (key_bad, "undecodable",
         F.concat(F.lit("key does not decode with schema id "), F.col("__kid").cast("string"))),
        (~tomb & op.isNull(), "undecodable",
         F.concat(F.lit("value does not decode with schema id "), F.col("__vid").cast("string"))),
        (~tomb & ~op.isin(*OPS), "bad_event",
         F.concat(F.lit("op "), op, F.lit(" is not one of c, u, d, r (truncates belong in the control topic)"))),
        (~tomb & (op != "d") & after.isNull(), "bad_event", F.concat(F.lit("op "), op, F.lit(" without after"))),
        (~tomb & F.col("__env.source.commit_lsn").isNull(), "bad_event",
         F.lit("source.commit_lsn (and source.lsn) missing: the event has no position")),
    ]
    reason, detail = F.lit(None).cast("string"), F.lit(None).cast("string")
    for cond, name, text in reversed(rules):
        reason = F.when(cond, F.lit(name)).otherwise(reason)
        detail = F.when(cond, F.concat_ws(" ", text, where)).otherwise(detail)
    return out.select("*", tomb.alias("__tomb"), reason.alias("__reason"), detail.alias("__detail"),
                      F.lit(batch_id).cast("long").alias("__batch"))


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


# ---------------------------------------------------------------------------------------------
# silver: one row per key per batch, then one MERGE


def merge_source(decoded: DataFrame, layout: Layout, truncate: tuple[int, int] | None, toast: bool) -> DataFrame:
    """Good rows -> one row per key: the newest event (by commit_lsn, event_serial, partition, offset),
    TOAST-unchanged columns filled from older events of the batch, or a lone tombstone."""
    keys = [f.name for f in layout.key.fields]
    key_lower = {k.lower() for k in keys}
    payload = [f.name for f in layout.row.fields if f.name.lower() not in key_lower]
    good = decoded.filter(F.col("__reason").isNull())
    lsn, serial = F.col("__env.source.commit_lsn"), F.col("__env.source.event_serial")
    events = good.filter(~F.col("__tomb"))
    if truncate is not None:
        events = events.filter((lsn > truncate[0]) | ((lsn == truncate[0]) & (serial > truncate[1])))

    def shape(frame: DataFrame, key_of, kind: str, op: Column, after: Column) -> DataFrame:
        return frame.select(
            *[key_of(k).alias(k) for k in keys], after.alias("__after"), op.alias("__op"),
            lsn.alias("__lsn"), serial.alias("__serial"), F.col("partition").alias("__part"),
            F.col("offset").alias("__off"),
            F.coalesce(F.timestamp_millis(F.col("__env.source.ts_ms")), F.col("timestamp")).alias("__ts"),
            F.col("__env.unchanged_cols").alias("__unchanged"), F.lit(kind).alias("__kind"))

    rows = shape(events, lambda k: F.col("__key")[k], "event", F.col("__env.op"), F.col("__env.after"))
    # an update that changed the primary key (before carries the old key): the old key is deleted
    before = F.col("__env.before")
    moved = None
    if keys:
        changed = functools.reduce(lambda a, b: a | b, [before[k] != F.col("__key")[k] for k in keys])
        complete = functools.reduce(lambda a, b: a & b, [before[k].isNotNull() for k in keys])
        moved = events.filter((F.col("__env.op") == "u") & before.isNotNull() & changed & complete)
    if moved is not None:
        rows = rows.unionByName(shape(moved, lambda k: before[k], "event", F.lit("d"),
                                      F.lit(None).cast(layout.row)))
    # a tombstone that carries its delete's position (our capture's) is that delete, guarded like any event;
    # one without (Debezium's, or written before positions were sent) soft-deletes a live row
    placed = F.col("__tlsn").isNotNull()
    tombs = good.filter(F.col("__tomb"))
    if truncate is not None:
        tombs = tombs.filter(~placed | (F.col("__tlsn") > truncate[0])
                             | ((F.col("__tlsn") == truncate[0]) & (F.col("__tserial") > truncate[1])))
    tombs = tombs.select(
        *[F.col("__key")[k].alias(k) for k in keys], F.lit(None).cast(layout.row).alias("__after"),
        F.when(placed, F.lit("d")).alias("__op"), F.col("__tlsn").alias("__lsn"),
        F.col("__tserial").alias("__serial"), F.col("partition").alias("__part"),
        F.col("offset").alias("__off"), F.col("timestamp").alias("__ts"),
        F.array().cast("array<string>").alias("__unchanged"),
        F.when(placed, F.lit("event")).otherwise(F.lit("tombstone")).alias("__kind"))
    rows = rows.unionByName(tombs)
    is_event = F.col("__kind") == "event"
    order = F.when(is_event, F.struct("__lsn", "__serial", "__part", "__off"))
    aggs = [F.max_by(F.struct("__after", "__op", "__lsn", "__serial", "__ts"), order).alias("__w"),
            F.count(F.when(is_event, 1)).alias("__n"), F.max(F.when(~is_event, F.col("__ts"))).alias("__tts")]
    candidates = [c for c in payload if c in layout.nullable] if toast else []
    for i, c in enumerate(candidates):
        known = is_event & (F.col("__op") != "d") & F.col("__after").isNotNull() \
            & ~F.array_contains(F.col("__unchanged"), c)
        aggs.append(F.max_by(F.struct(F.col("__after")[c].alias("v")), F.when(known, order)).alias(f"__f{i}"))
    reduced = rows.groupBy(*keys).agg(*aggs)
    filled = {c: F.when(F.col(f"__f{i}").isNotNull(), F.col(f"__f{i}.v")) for i, c in enumerate(candidates)}
    unknown = (F.array_compact(F.array(*[F.when(F.col(f"__f{i}").isNull(), F.lit(c))
                                         for i, c in enumerate(candidates)]))
               if candidates else F.array().cast("array<string>"))
    return reduced.select(
        *keys, *[filled.get(c, F.col("__w.__after")[c]).alias(c) for c in payload],
        F.when(F.col("__n") > 0, "event").otherwise("tombstone").alias("__kind"),
        F.col("__w.__op").alias("__op"), F.col("__w.__lsn").alias("__lsn"), F.col("__w.__serial").alias("__serial"),
        F.when(F.col("__n") > 0, F.col("__w.__ts")).otherwise(F.col("__tts")).alias("__ts"),
        unknown.alias("__unchanged"))


def silver_schema(layout: Layout) -> T.StructType:
    """Silver's columns: the row's fields, then the merge's own columns."""
    return T.StructType([T.StructField(f.name, f.dataType) for f in layout.row.fields] + [
        T.StructField("_commit_lsn", T.LongType()), T.StructField("_event_serial", T.LongType()),
        T.StructField("_op", T.StringType()), T.StructField("_deleted", T.BooleanType()),
        T.StructField("_deleted_at", T.TimestampType()), T.StructField("_updated_at", T.TimestampType()),
        T.StructField("_unknown_cols", T.ArrayType(T.StringType()))])


def _ensure_table(spark: SparkSession, path: str, schema: T.StructType, stats_columns: list[str] | None = None):
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


def _align_columns(spark: SparkSession, table, path: str, spec: TableSpec, row: T.StructType):
    """Add new columns to silver and widen changed types; a change Delta cannot make raises with the remedy."""
    current = {f.name.lower(): f for f in table.toDF().schema.fields}
    added = [f for f in row.fields if f.name.lower() not in current]
    ident = f"delta.{quote(path)}"
    if added:
        spark.sql(f"ALTER TABLE {ident} ADD COLUMNS ("
                  + ", ".join(f"{quote(f.name)} {f.dataType.simpleString()}" for f in added) + ")")
        log.info("merge %s: silver gained column(s) %s", spec.qualified, ", ".join(f.name for f in added))
    for f in row.fields:
        have = current.get(f.name.lower())
        if have is None or have.dataType.simpleString() == f.dataType.simpleString():
            continue
        if isinstance(have.dataType, T.DecimalType) and isinstance(f.dataType, T.DecimalType) \
                and f.dataType.precision - f.dataType.scale <= have.dataType.precision - have.dataType.scale \
                and f.dataType.scale <= have.dataType.scale:
            continue  # narrower decimal: values fit the stored type
        try:
            spark.sql(f"ALTER TABLE {ident} ALTER COLUMN {quote(have.name)} TYPE {f.dataType.simpleString()}")
        except Exception as exc:
            raise MergeError(
                f"silver table {spec.qualified} ({path}): column {have.name} is {have.dataType.simpleString()} but "
                f"the topic {spec.topic} now carries {f.dataType.simpleString()}, which Delta cannot widen to: "
                f"rebuild the silver table (move it away and replay the topic with a new checkpoint) or change the "
                f"column with ALTER TABLE; {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _merge_silver(spark: SparkSession, path: str, spec: TableSpec, layout: Layout, source: DataFrame,
                  truncate: tuple[int, int, object] | None, ready: dict | None = None) -> None:
    """The one MERGE of a table in a micro-batch.

    Running it again with the same source changes nothing (every clause requires a newer position or
    a live row), so a retried micro-batch needs no idempotence id here. ``ready`` (the context's
    per-table cache) skips the existence, schema and emptiness checks once they are known.
    """
    from delta.tables import DeltaTable

    keys = [f.name for f in layout.key.fields]
    key_lower = {k.lower() for k in keys}
    payload = [f.name for f in layout.row.fields if f.name.lower() not in key_lower]
    ready = {} if ready is None else ready
    known = ready.get(path)
    if known is None or known["row"] != layout.row:
        table = _ensure_table(spark, path, silver_schema(layout), keys + list(META_COLUMNS))
        _align_columns(spark, table, path, spec, layout.row)
        known = ready[path] = {"row": layout.row, "filled": False}
    table = DeltaTable.forPath(spark, path)
    if not known["filled"]:
        known["filled"] = bool(table.detail().select("numFiles").collect()[0][0])
    on = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in keys)
    newer = ("(s.__lsn > t._commit_lsn OR (s.__lsn = t._commit_lsn AND s.__serial > t._event_serial) "
             "OR (s.__lsn = t._commit_lsn AND s.__serial = t._event_serial AND t._op = 'tombstone' "
             "AND s.__op <> 'd'))")
    is_delete = "s.__op = 'd'"
    update = {quote(c): f"CASE WHEN {is_delete} OR array_contains(s.__unchanged, '{c}') THEN t.{quote(c)} "
                        f"ELSE s.{quote(c)} END" for c in payload}
    update.update({
        "_commit_lsn": "s.__lsn", "_event_serial": "s.__serial", "_op": "s.__op", "_deleted": is_delete,
        "_deleted_at": f"CASE WHEN {is_delete} THEN s.__ts END",
        "_updated_at": "s.__ts",
        "_unknown_cols": f"CASE WHEN {is_delete} THEN t._unknown_cols ELSE "
                         "nullif(array_intersect(coalesce(t._unknown_cols, array()), s.__unchanged), array()) END"})
    insert = {quote(c): f"s.{quote(c)}" for c in keys + payload}
    insert.update({"_commit_lsn": "s.__lsn", "_event_serial": "s.__serial", "_op": "s.__op", "_deleted": is_delete,
                   "_deleted_at": f"CASE WHEN {is_delete} THEN s.__ts END", "_updated_at": "s.__ts",
                   "_unknown_cols": f"CASE WHEN NOT {is_delete} THEN nullif(s.__unchanged, array()) END"})
    for attempt in (1, 2):
        builder = table.alias("t").merge(source.alias("s"), on)
        if known["filled"]:
            builder = builder.whenMatchedUpdate("s.__kind = 'tombstone' AND NOT t._deleted",
                                                {"_deleted": "true", "_op": "'tombstone'", "_deleted_at": "s.__ts"}) \
                .whenMatchedUpdate(f"s.__kind = 'event' AND {newer}", update)
        # an empty silver table (the first batch, typically the snapshot) takes Delta's insert-only MERGE path
        builder = builder.whenNotMatchedInsert("s.__kind = 'event'", insert)
        if truncate is not None:
            lsn, serial, ts_ms = truncate
            builder = builder.whenNotMatchedBySourceUpdate(
                f"NOT t._deleted AND (t._commit_lsn < {lsn} OR (t._commit_lsn = {lsn} AND t._event_serial < {serial}))",
                {"_deleted": "true", "_op": "'t'", "_commit_lsn": str(lsn), "_event_serial": str(serial),
                 "_deleted_at": f"timestamp_millis({int(ts_ms)})" if ts_ms is not None else "current_timestamp()"})
        try:
            builder.execute()  # "filled" stays as checked: the next batch looks again until the table has files
            return
        except Exception as exc:  # noqa: BLE001 - one known Delta refusal is retried, anything else raised
            if attempt == 2 or "DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION" not in str(exc):
                raise
            # Delta saw the source's cached state change while it ran (a source it did not materialize, such as
            # the insert-only path's): run it again on a copy of the source that no cache can change
            log.warning("merge %s: Delta refused the MERGE (%s); running it again on a checkpointed copy of "
                        "the source", spec.qualified, "DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION")
            source = source.localCheckpoint(eager=True)


def _truncate_pending(spark: SparkSession, path: str, truncate: tuple[int, int, object]) -> bool:
    """True when silver still holds a live row older than the truncate's position."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return False
    lsn, serial, _ = truncate
    older = (F.col("_commit_lsn") < lsn) | ((F.col("_commit_lsn") == lsn) & (F.col("_event_serial") < serial))
    return bool(spark.read.format("delta").load(path).filter(~F.col("_deleted") & older).limit(1).count())


# ---------------------------------------------------------------------------------------------
# the micro-batch


@dataclass
class MergeContext:
    """What the micro-batch function keeps across batches: conf, caches, the query's identity, stats."""

    conf: dict
    query: str
    specs: list[TableSpec]
    schemas: Schemas
    app_id: str | None = None  # '<query name>-<query id>' once known
    truncates_applied: dict[str, tuple] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    last_cleanup: float = field(default_factory=time.monotonic)
    fault: object = None  # tests: fault(stage, batch_id, table) may raise to simulate a crash
    session: SparkSession | None = None  # the session that started the query (knows its id)
    failure: tuple[int, BaseException] | None = None  # the last batch that raised, and why
    ready: dict = field(default_factory=dict)  # Delta path -> what is known of it (schema, has files)
    appended: dict = field(default_factory=dict)  # bronze path -> last batch id appended by this context

    def spec(self, topic: str) -> TableSpec | None:
        """The table a topic belongs to."""
        return next((s for s in self.specs if s.topic == topic), None)


def context(conf: dict, query: str | None = None, app_id: str | None = None, fault=None) -> MergeContext:
    """A MergeContext for conf (start() makes one; tests call process_batch with it directly)."""
    return MergeContext(conf=conf, query=query or query_name(conf), specs=table_specs(conf), schemas=Schemas(conf),
                        app_id=app_id, fault=fault)


def truncates(conf: dict) -> dict[str, tuple[int, int, object]]:
    """Latest truncate per table from the control topic: {'schema.table': (commit_lsn, event_serial, ts_ms)}."""
    found = {}
    for key, record in control.read_all(conf, timeout=float(config.get(conf, "merge.control_timeout_s", 30))).items():
        if key.startswith("truncate/") and record.get("commit_lsn") is not None:
            found[key[len("truncate/"):]] = (int(record["commit_lsn"]), int(record.get("event_serial", 0)),
                                             record.get("ts_ms"))
    return found


def _app_id(ctx: MergeContext, spark: SparkSession) -> str:
    if ctx.app_id is None:  # foreachBatch runs in a clone of the session, whose query manager is empty
        active = [q for q in (ctx.session or spark).streams.active if q.name == ctx.query]
        if not active:
            raise MergeError(f"merge query {ctx.query} is not active in this session, so its id (part of the Delta "
                             f"idempotence ids) is unknown; pass app_id to context() when calling process_batch")
        ctx.app_id = f"{ctx.query}-{active[0].id}"
    return ctx.app_id


def process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    """foreachBatch body: bronze append, one silver MERGE per table, dead letters; returns the batch's counts.

    Safe to run again with the same batch_id (a retried batch): a bronze or dead-letter append that
    was committed is skipped, and the silver MERGEs change nothing the second time.
    """
    try:
        return _process_batch(batch, batch_id, ctx)
    except BaseException as exc:
        ctx.failure = (batch_id, exc)
        raise


def _process_batch(batch: DataFrame, batch_id: int, ctx: MergeContext) -> dict:
    spark = batch.sparkSession
    app = _app_id(ctx, spark)
    began = time.monotonic()
    control_topic = control.topic(ctx.conf)
    raw = headers(batch).persist()
    frames = [raw]
    try:
        present = {row["topic"]: row for row in raw.groupBy("topic").agg(
            F.collect_set("__vid").alias("v"), F.collect_set("__kid").alias("k")).collect()}
        stats = {"batch_id": batch_id, "tables": {}, "dead_letters": {}, "seconds_by_table": {}}
        if not present:
            return stats
        unknown = [t for t in present if t != control_topic and ctx.spec(t) is None]
        if unknown:
            raise MergeError(f"micro-batch {batch_id} holds topic(s) {', '.join(unknown)}, which are not configured "
                             f"tables' topics; check source.tables and kafka.topic_prefix")
        cuts = truncates(ctx.conf)
        work = []  # (spec, layout, decoded or None, truncate record or None, pending truncate or None)
        for spec in ctx.specs:
            row = present.get(spec.topic)
            cut = cuts.get(spec.qualified)
            truncate_new = cut is not None and ctx.truncates_applied.get(spec.qualified) != cut
            if row is None and not truncate_new:
                continue
            pending = cut if truncate_new and _truncate_pending(spark, silver_path(ctx.conf, spec), cut) else None
            layout = _layout(spark, ctx.schemas, spec, set(row["v"]) if row else set(), set(row["k"]) if row else set())
            if row is not None:
                _refuse_unknown_ids(ctx, raw, spec, layout, set(row["v"]), set(row["k"]))
            decoded = decode(raw.filter(F.col("topic") == spec.topic), spark, ctx.schemas, layout, batch_id)
            if row is not None:
                decoded = decoded.persist()
                frames.append(decoded)
            work.append((spec, layout, decoded, row is not None, cut, pending))
        counts = _counts([(spec.qualified, decoded) for spec, _, decoded, has_rows, _, _ in work if has_rows])
        tasks, dead = [], []  # the batch's Delta writes: independent tables, run side by side
        for spec, layout, decoded, has_rows, cut, pending in work:
            mine = counts.get(spec.qualified, {})
            good = mine.get(None)
            bad = {reason: c["n"] for reason, c in mine.items() if reason is not None}
            if has_rows:
                stats["tables"][spec.qualified] = {
                    "events": good["n"] - good["tombs"] if good else 0, "tombstones": good["tombs"] if good else 0,
                    "dead_letters": sum(bad.values())}
            for reason, n in bad.items():
                stats["dead_letters"][reason] = stats["dead_letters"].get(reason, 0) + n
            if bad:
                dead.append(dead_letter_rows(decoded, ctx.query))
            if good is None and pending is None:
                continue
            timing = stats["seconds_by_table"].setdefault(spec.qualified, {})
            if good is not None:
                tasks.append(functools.partial(_write_bronze, spark, ctx, spec, decoded, app, batch_id, timing))
            source = merge_source(decoded, layout, cut[:2] if cut else None,
                                  toast=good is not None and good["toast"] > 0)
            tasks.append(functools.partial(_write_silver, spark, ctx, spec, layout, source, pending, batch_id, timing))
            if pending is not None:
                stats["tables"].setdefault(spec.qualified, {})["truncated_before"] = list(cut[:2])
        if dead:
            poison = functools.reduce(DataFrame.unionByName, dead)
            tasks.append(functools.partial(_write_dead_letters, spark, ctx, poison, app, batch_id,
                                           stats["dead_letters"]))
        _run_all(tasks, int(config.get(ctx.conf, "merge.parallelism", DEFAULT_PARALLELISM)), spark)
        for spec, _, _, _, cut, _ in work:
            if cut is not None:
                ctx.truncates_applied[spec.qualified] = cut
        interval = float(config.get(ctx.conf, "merge.cleanup_interval_minutes", DEFAULT_CLEANUP_MINUTES)) * 60
        if interval > 0 and time.monotonic() - ctx.last_cleanup >= interval:
            cleanup_tombstones(spark, ctx.conf)
            ctx.last_cleanup = time.monotonic()
        stats["seconds"] = round(time.monotonic() - began, 2)
        ctx.history = (ctx.history + [stats])[-100:]
        log.info("merge batch %s: %s", batch_id, stats)
        return stats
    finally:
        for frame in frames:
            frame.unpersist()


def _refuse_unknown_ids(ctx: MergeContext, raw: DataFrame, spec: TableSpec, layout: Layout, value_ids: set,
                        key_ids: set) -> None:
    """Fail the batch when a writer id is not served (merge.unknown_schema_ids: fail, the default)."""
    missing_v = {i for i in value_ids if i is not None} - set(layout.value_ids)
    missing_k = {i for i in key_ids if i is not None} - set(layout.key_ids)
    if not (missing_v or missing_k) or config.get(ctx.conf, "merge.unknown_schema_ids", "fail") == "dead_letter":
        return
    unknown = F.lit(False)
    if missing_v:
        unknown = unknown | F.col("__vid").isin(*missing_v)
    if missing_k:
        unknown = unknown | F.col("__kid").isin(*missing_k)
    first = raw.filter((F.col("topic") == spec.topic) & unknown).agg(
        F.min(F.struct("partition", "offset")).alias("p")).collect()[0]["p"]
    ids = ", ".join(str(i) for i in sorted(missing_v | missing_k))
    raise MergeError(
        f"topic {spec.topic} (table {spec.qualified}): schema id(s) {ids} are not served by the schema registry "
        f"{ctx.schemas.url} (asked for {ctx.schemas.wait_s:.0f} s), first at partition {first['partition']} offset "
        f"{first['offset']}. The merge stops rather than set those events aside: nothing is lost, and the batch runs "
        f"again on restart. Remedy: bring the registry back to a state that serves the id (a replica that caught "
        f"up, the restored registry storage), or set merge.unknown_schema_ids: dead_letter to let the stream go "
        f"on and replay the dead letters later with merge.replay_dead_letters(spark, conf)")


def replay_dead_letters(spark: SparkSession, conf: dict) -> dict:
    """Merge dead letters again: those that decode now reach bronze and silver (position-guarded, so late is safe)
    and leave the dead-letter table; the others stay there with their (new) reason. Returns the batch's counts."""
    import hashlib

    from delta.tables import DeltaTable

    path = dead_letter_path(conf)
    if not DeltaTable.isDeltaTable(spark, path):
        return {"replayed": 0}
    letters = spark.read.format("delta").load(path).select("key", "value", "topic", "partition", "offset",
                                                             "timestamp").dropDuplicates(["topic", "partition",
                                                                                          "offset"])
    rows = letters.collect()
    if not rows:
        return {"replayed": 0}
    digest = hashlib.sha256(",".join(sorted(f"{r['topic']}/{r['partition']}/{r['offset']}" for r in rows))
                            .encode()).hexdigest()[:12]
    query = f"replay-dead-letters-{digest}"  # the same letters replayed again: their appends are found and skipped
    replay_conf = config.apply_overrides(conf, {"CDC__MERGE__UNKNOWN_SCHEMA_IDS": "dead_letter",
                                                "CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "0"})
    frame = spark.createDataFrame(rows, letters.schema)
    stats = process_batch(frame, 0, context(replay_conf, query=query, app_id=query))
    DeltaTable.forPath(spark, path).alias("d").merge(
        frame.select("topic", "partition", "offset").alias("r"),
        f"d.topic = r.topic AND d.partition = r.partition AND d.offset = r.offset AND d.query <> '{query}'") \
        .whenMatchedDelete().execute()
    still = sum(stats.get("dead_letters", {}).values())
    log.info("replayed %s dead letter(s): %s merged, %s still dead letters", len(rows), len(rows) - still, still)
    return {**stats, "replayed": len(rows) - still, "still_dead": still}


def _counts(decoded: list[tuple[str, DataFrame]]) -> dict[str, dict]:
    """One job for every table of the batch: {table: {reason or None: {n, tombs, toast}}}."""
    if not decoded:
        return {}
    parts = [frame.select(F.lit(name).alias("t"), "__reason", "__tomb",
                          (F.coalesce(F.size("__env.unchanged_cols"), F.lit(0)) > 0).alias("__toast"))
             for name, frame in decoded]
    rows = functools.reduce(DataFrame.unionByName, parts).groupBy("t", "__reason").agg(
        F.count(F.lit(1)).alias("n"), F.count(F.when(F.col("__tomb"), 1)).alias("tombs"),
        F.count(F.when(F.col("__toast"), 1)).alias("toast")).collect()
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["t"], {})[r["__reason"]] = {"n": r["n"], "tombs": r["tombs"], "toast": r["toast"]}
    return out


def _write_bronze(spark: SparkSession, ctx: MergeContext, spec: TableSpec, decoded: DataFrame, app: str,
                  batch_id: int, timing: dict) -> None:
    """Append a table's good rows to its bronze change log, once per micro-batch."""
    began = time.monotonic()
    bronze = bronze_path(ctx.conf, spec)
    rows = bronze_rows(decoded)
    if ctx.ready.get(bronze) != rows.schema:
        _ensure_table(spark, bronze, rows.schema)
        ctx.ready[bronze] = rows.schema
    _append_once(spark, ctx, bronze, rows, f"{app}/{spec.qualified}", batch_id, mergeSchema="true")
    timing.update(bronze_s=round(time.monotonic() - began, 2), bronze_at=time.time())
    _fire(ctx, "after_bronze", batch_id, spec)


def _append_once(spark: SparkSession, ctx: MergeContext, path: str, frame: DataFrame, marker: str, batch_id: int,
                 **options: str) -> None:
    """Append frame to a Delta table unless this micro-batch's append under marker is already there.

    The commit carries ``userMetadata`` {"merge_batch": marker, "batch": id}. A batch this context has
    not appended itself (the first one, or any after a failed batch) is first looked up in the table's
    last APPEND_HISTORY_COMMITS commits and skipped when found. Delta's txnAppId would do the same but
    rebuilds the table's whole state on every append.
    """
    done = ctx.appended.get(path)
    if done is None or ctx.failure is not None:
        done = _appended_batch(spark, path, marker)
    if done is not None and done >= batch_id:
        log.info("merge batch %s: %s already holds this batch (a retried batch): not appended again", batch_id, path)
    else:
        writer = frame.write.format("delta").mode("append") \
            .option("userMetadata", json.dumps({"merge_batch": marker, "batch": batch_id}))
        for key, value in options.items():
            writer = writer.option(key, value)
        writer.save(path)
    ctx.appended[path] = batch_id


def _appended_batch(spark: SparkSession, path: str, marker: str) -> int | None:
    """The newest micro-batch id appended under marker, from the table's last commits (None: none there)."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    for row in DeltaTable.forPath(spark, path).history(APPEND_HISTORY_COMMITS).select("userMetadata").collect():
        try:
            meta = json.loads(row["userMetadata"] or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and meta.get("merge_batch") == marker:
            return int(meta["batch"])
    return None


def _write_silver(spark: SparkSession, ctx: MergeContext, spec: TableSpec, layout: Layout, source: DataFrame,
                  pending: tuple | None, batch_id: int, timing: dict) -> None:
    """Run a table's one MERGE into silver, timed."""
    began = time.monotonic()
    _merge_silver(spark, silver_path(ctx.conf, spec), spec, layout, source, pending, ctx.ready)
    timing.update(silver_s=round(time.monotonic() - began, 2), silver_at=time.time())
    _fire(ctx, "after_silver", batch_id, spec)


def _write_dead_letters(spark: SparkSession, ctx: MergeContext, frame: DataFrame, app: str, batch_id: int,
                        reasons: dict) -> None:
    """Append the batch's poison messages to the dead-letter table, once per micro-batch like bronze."""
    _append_once(spark, ctx, dead_letter_path(ctx.conf), frame, f"{app}/_dead_letter", batch_id)
    log.warning("merge batch %s: %s message(s) went to the dead-letter table %s: %s", batch_id,
                sum(reasons.values()), dead_letter_path(ctx.conf), reasons)


def _run_all(tasks: list, parallelism: int, spark: SparkSession) -> None:
    """Run the batch's Delta writes, up to ``parallelism`` at once; every write finishes before the first
    error is raised (the micro-batch then fails as a whole and is retried)."""
    if parallelism <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    from pyspark import inheritable_thread_target

    # each task runs with this thread's Spark local properties and the session's tags (the query's job
    # group, so stopping the query cancels its writes too)
    inherit = inheritable_thread_target(spark)
    with ThreadPoolExecutor(max_workers=min(parallelism, len(tasks)), thread_name_prefix="merge-write") as pool:
        futures = [pool.submit(inherit(task)) for task in tasks]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def _fire(ctx: MergeContext, stage: str, batch_id: int, spec: TableSpec) -> None:
    if ctx.fault is not None:
        ctx.fault(stage, batch_id, spec.qualified)


# ---------------------------------------------------------------------------------------------
# the streaming query


def kafka_options(conf: dict) -> dict[str, str]:
    """Kafka source options from conf: servers, topics, earliest start, maxOffsetsPerTrigger, extras."""
    options = {
        "kafka.bootstrap.servers": str(config.get(conf, "kafka.bootstrap_servers")),
        # the control topic too: a truncate alone (no later change) must still start a micro-batch
        "subscribe": ",".join([spec.topic for spec in table_specs(conf)] + [control.topic(conf)]),
        # only for a new checkpoint: on a reused one Spark resumes from it and reads a topic added to conf since
        # (lib.incremental add) from its earliest offset (tests/test_incremental.py)
        "startingOffsets": "earliest",
        "includeHeaders": "true",  # a tombstone's position (lib/events.py tombstone_headers)
        "maxOffsetsPerTrigger": str(int(config.get(conf, "merge.max_offsets_per_trigger", DEFAULT_MAX_OFFSETS))),
        "failOnDataLoss": str(bool(config.get(conf, "merge.fail_on_data_loss", True))).lower(),
    }
    for key, value in (config.get(conf, "merge.kafka_options", {}) or {}).items():
        name = key if key.startswith("kafka.") or key in ("minPartitions", "fetchOffset.numRetries") else f"kafka.{key}"
        options[name] = secrets.setting(conf, f"merge.kafka_options.{key}") if secrets.is_reference(value) \
            else str(value)
    return options


def read_stream(conf: dict, spark: SparkSession) -> DataFrame:
    """The streaming DataFrame of every configured table topic (Kafka's key, value, topic, partition, ...)."""
    reader = spark.readStream.format("kafka")
    for key, value in kafka_options(conf).items():
        reader = reader.option(key, value)
    return reader.load()


def start(conf: dict, spark: SparkSession, trigger: str = "available_now", interval: str = "5 seconds",
          fault=None):
    """Start the merge query: trigger 'available_now' (catch up, then stop) or 'processing_time' (every interval).

    The checkpoint is <lake.root>/_checkpoints/<query name>. Deleting it replays the topics from
    the start (safe: silver only moves forward; bronze gets the events again).
    """
    name = query_name(conf)
    ctx = context(conf, name, fault=fault)
    ctx.session = spark
    writer = read_stream(conf, spark).writeStream.queryName(name) \
        .option("checkpointLocation", checkpoint_path(conf, name)) \
        .foreachBatch(lambda frame, batch_id: process_batch(frame, batch_id, ctx))
    if trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    elif trigger == "processing_time":
        writer = writer.trigger(processingTime=interval)
    else:
        raise ValueError(f"trigger must be 'available_now' or 'processing_time', not {trigger!r}")
    query = writer.start()
    query.merge_context = ctx  # the batches' counts: query.merge_context.history
    return query


def run_until_caught_up(conf: dict, spark: SparkSession, cleanup: bool = True, fault=None) -> dict:
    """Run the merge with availableNow until every topic is caught up; returns batches and counts.

    A failing batch raises MergeError naming the batch and the cause (the checkpoint keeps the
    batch, so the next run retries it; its Delta commits are idempotent). When Spark itself stops
    the query after batches went through (Spark 4.1.1's Kafka source fails computing its metrics
    right after re-running a batch left uncommitted by a crash), the query is started again, up to
    merge.restart_attempts (2) times.
    """
    from pyspark.errors import StreamingQueryException

    lease = control.running_service(conf, "merge")
    if lease is not None:
        raise MergeError(f"the continuous merge of slot {config.get(conf, 'source.slot')} runs "
                         f"({control.describe_lease(lease)}) on checkpoint {checkpoint_path(conf, query_name(conf))}, "
                         f"which serves one query: it already merges every change. Stop it first (make stop, or pause "
                         f"the cdc_merge job) to run this step, or skip this step")
    attempts = int(config.get(conf, "merge.restart_attempts", 2))
    history: list[dict] = []
    name = query_name(conf)
    for attempt in range(attempts + 1):
        query = start(conf, spark, "available_now", fault=fault)
        ctx = query.merge_context
        try:
            query.awaitTermination()
            history += ctx.history
            break
        except StreamingQueryException as exc:
            history += ctx.history
            if ctx.failure is not None:
                batch_id, cause = ctx.failure
                raise MergeError(
                    f"merge query {name} stopped in micro-batch {batch_id}: {type(cause).__name__}: {cause}. The "
                    f"checkpoint {checkpoint_path(conf, name)} keeps the batch; fix the cause and run again (the batch "
                    f"is retried, its Delta commits are idempotent)") from cause
            if not ctx.history or attempt == attempts:
                raise
            log.warning("merge query %s stopped by Spark after %s batch(es) (%s); starting it again (attempt %s of %s)",
                        name, len(ctx.history), str(exc).splitlines()[0][:300], attempt + 1, attempts)
        finally:
            if query.isActive:
                query.stop()
    if cleanup:
        cleanup_tombstones(spark, conf)
    totals: dict[str, int] = {}
    for batch in history:
        for counts in batch["tables"].values():
            for key, value in counts.items():
                if isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
    return {"query": name, "batches": len(history), **totals}


# ---------------------------------------------------------------------------------------------
# maintenance and what a notebook shows


def cleanup_tombstones(spark: SparkSession, conf: dict, retention_hours: float | None = None) -> dict[str, int]:
    """Physically delete soft tombstones older than merge.tombstone_retention_hours; rows removed per table.

    Careful: after this, an event older than a removed tombstone (a replay from before the delete)
    can bring the row back. Keep the retention longer than the topics' delete.retention.ms and
    than any replay you may run.
    """
    from delta.tables import DeltaTable

    hours = float(retention_hours if retention_hours is not None
                  else config.get(conf, "merge.tombstone_retention_hours", DEFAULT_RETENTION_HOURS))
    removed = {}
    for spec in table_specs(conf):
        path = silver_path(conf, spec)
        if not DeltaTable.isDeltaTable(spark, path):
            continue
        table = DeltaTable.forPath(spark, path)
        table.delete(f"_deleted AND _deleted_at < current_timestamp() - make_dt_interval(0, 0, 0, {hours * 3600})")
        metrics = table.history(1).select("operation", "operationMetrics").collect()[0]
        removed[spec.qualified] = int((metrics["operationMetrics"] or {}).get("numDeletedRows", 0)) \
            if metrics["operation"] == "DELETE" else 0
    return removed


def _lsn_text(c: Column) -> Column:
    """A PostgreSQL LSN as text 'X/Y' from its 64-bit value."""
    return F.concat(F.upper(F.hex(F.shiftright(c, 32))), F.lit("/"), F.upper(F.hex(c.bitwiseAND(0xFFFFFFFF))))


def summary(spark: SparkSession, conf: dict) -> DataFrame:
    """Per table: live silver rows, soft-deleted rows, rows with unknown TOAST columns, bronze events, last position."""
    from delta.tables import DeltaTable

    out_schema = "table string, silver_rows long, deleted_rows long, unknown_toast_rows long, bronze_events long, " \
                 "last_commit_lsn long, last_lsn string"
    frames = []
    for spec in table_specs(conf):
        silver, bronze = silver_path(conf, spec), bronze_path(conf, spec)
        if not DeltaTable.isDeltaTable(spark, silver):
            frames.append(spark.createDataFrame([(spec.qualified, None, None, None, None, None, None)], out_schema))
            continue
        events = spark.read.format("delta").load(bronze).filter(~F.col("_tombstone")).count() \
            if DeltaTable.isDeltaTable(spark, bronze) else None
        frames.append(spark.read.format("delta").load(silver).agg(
            F.lit(spec.qualified).alias("table"), F.count(F.when(~F.col("_deleted"), 1)).alias("silver_rows"),
            F.count(F.when(F.col("_deleted"), 1)).alias("deleted_rows"),
            F.count(F.when(F.col("_unknown_cols").isNotNull() & ~F.col("_deleted"), 1)).alias("unknown_toast_rows"),
            F.lit(events).cast("long").alias("bronze_events"), F.max("_commit_lsn").alias("last_commit_lsn"),
            _lsn_text(F.max("_commit_lsn")).alias("last_lsn")))
    result = frames[0]
    for frame in frames[1:]:
        result = result.unionByName(frame)
    return result


def dead_letter_counts(spark: SparkSession, conf: dict) -> DataFrame:
    """Dead-lettered messages by topic and reason, with the first and last offset of each."""
    from delta.tables import DeltaTable

    path = dead_letter_path(conf)
    if not DeltaTable.isDeltaTable(spark, path):
        return spark.createDataFrame([], "topic string, reason string, messages long, first_offset long, "
                                         "last_offset long")
    return spark.read.format("delta").load(path).groupBy("topic", "reason").agg(
        F.count(F.lit(1)).alias("messages"), F.min("offset").alias("first_offset"),
        F.max("offset").alias("last_offset")).orderBy("topic", "reason")


def table_spec(conf: dict, table: str) -> TableSpec:
    """The configured table named 'schema.table' (or just 'table')."""
    spec = next((s for s in table_specs(conf) if s.qualified == table or s.name == table), None)
    if spec is None:
        raise MergeError(f"table {table} is not in source.tables ({', '.join(s.qualified for s in table_specs(conf))})")
    return spec


def silver(spark: SparkSession, conf: dict, table: str, include_deleted: bool = False) -> DataFrame:
    """A silver table as a DataFrame (live rows only unless include_deleted)."""
    frame = spark.read.format("delta").load(silver_path(conf, table_spec(conf, table)))
    return frame if include_deleted else frame.filter(~F.col("_deleted"))


def bronze(spark: SparkSession, conf: dict, table: str) -> DataFrame:
    """A bronze change log as a DataFrame (every event and tombstone the merge received)."""
    return spark.read.format("delta").load(bronze_path(conf, table_spec(conf, table)))


def key_history(spark: SparkSession, conf: dict, table: str, key: dict) -> DataFrame:
    """Bronze events and tombstones of one key (a dict of primary key fields) in the order they arrived,
    each with its source position (commit_lsn, event_serial; ``position`` as text), transaction and commit time."""
    frame = bronze(spark, conf, table)
    fields = frame.schema["key"].dataType.fieldNames()
    if sorted(key) != sorted(fields):
        raise MergeError(f"key of {table} is ({', '.join(fields)}), not ({', '.join(key)}): pass every key field")
    for name, value in key.items():
        frame = frame.filter(F.col("key").getField(name) == F.lit(value))
    lsn = _lsn_text(F.col("source.commit_lsn"))
    return frame.orderBy("_batch_id", "_kafka_partition", "_kafka_offset").select(
        "op", F.when(lsn.isNotNull(), F.format_string("(%s, %d)", lsn, F.col("source.event_serial"))).alias("position"),
        F.col("source.commit_lsn").alias("commit_lsn"), lsn.alias("lsn"),
        F.col("source.event_serial").alias("event_serial"), F.col("source.txId").cast("string").alias("tx_id"),
        F.timestamp_millis(F.col("source.ts_ms")).alias("commit_ts"), F.col("_tombstone").alias("tombstone"),
        "before", "after", "unchanged_cols", F.col("_kafka_partition").alias("partition"),
        F.col("_kafka_offset").alias("offset"), F.col("_batch_id").alias("batch"))
