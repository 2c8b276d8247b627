"""Kafka records to change rows with Spark's built-in functions only: framing, Avro, envelope, and why a record
cannot be decoded (the dead letters' reasons)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro

from lib.capture import events
from lib.lake import debezium
from lib.lake.writer_schemas import Layout, Schemas

REASONS = ("not_framed", "null_key", "unknown_schema_id", "undecodable", "bad_event")
OPS = ("c", "u", "d", "r")
SOURCE_TYPE = T.StructType([T.StructField(name, kind) for name, kind in (
    ("version", T.StringType()), ("connector", T.StringType()), ("name", T.StringType()),
    ("ts_ms", T.LongType()), ("snapshot", T.StringType()), ("db", T.StringType()),
    ("sequence", T.StringType()), ("schema", T.StringType()), ("table", T.StringType()),
    ("txId", T.LongType()), ("lsn", T.LongType()), ("xmin", T.LongType()),
    ("commit_lsn", T.LongType()), ("event_serial", T.LongType()))])
TRANSACTION_TYPE = T.StructType([T.StructField("id", T.StringType()), T.StructField("total_order", T.LongType()),
                                 T.StructField("data_collection_order", T.LongType())])
_NOT_FRAMED = "is not Confluent wire format (magic byte 0 + 4-byte schema id): produce with the registry's serializer"


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
    fields, gets its position from lib/lake/debezium.py; its types and TOAST placeholders were mapped in decode)."""
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


BASE = ("__k", "__v", "topic", "partition", "offset", "timestamp", "__kf", "__vf", "__kid", "__vid", "__tlsn",
        "__tserial")  # the columns of ``headers``


@dataclass
class Plan:
    """One table's decode as Spark columns, built once per writer layout and applied to every batch's rows.

    Building the columns (thousands of Python-to-JVM calls for a table with a few writer versions) cost about
    0.25 s per table per batch; a batch touching 51 tables paid 13 s before any row was read. Its column names
    carry the plan's ``tag`` (``__v<id><tag>``, ``__key<tag>``, ``__env<tag>``), so that the plans of every
    table of a batch apply side by side in one projection (lib/lake/micro_batch.py).
    """

    stage: list[Column]  # one from_avro per writer id
    mapped: dict[str, Column]  # stage columns replaced: Debezium writers mapped (lib/lake/debezium.py)
    out: list[Column]  # __key<tag> and __env<tag> in the table's types
    reason: Column  # why a row cannot be merged (null: it can), over __key<tag> and __env<tag>
    detail: Column  # the reason in words, with the row's topic, partition and offset


def plan(framed: DataFrame, schemas: Schemas, layout: Layout, tag: str = "", guard: Column | None = None) -> Plan:
    """The decode of a table's rows (from ``headers``) -> __key, __env (names + ``tag``), or why not.

    Each writer id gets its own from_avro (PERMISSIVE: a body that does not decode gives nulls) under a
    ``when`` on the schema id, computed once in a projection of its own, then conformed to the table's
    structs and combined. ``guard``: a condition the row must meet to be decoded at all (a batch of many
    tables: its table), else every column is null. ``framed`` gives the input's columns; the plan applies
    to any frame like it.
    """
    def guarded(c: Column) -> Column:
        return F.when(guard, c) if guard is not None else c

    body = F.expr("substr(`__v`, 6)")
    kbody = F.expr("substr(`__k`, 6)")
    own = []
    for i in layout.value_ids:
        own.append(guarded(F.when(F.col("__vid") == i, from_avro(body, json.dumps(schemas.by_id[i]),
                                                                 {"mode": "PERMISSIVE"}))).alias(f"__v{i}{tag}"))
    for i in layout.key_ids:
        own.append(guarded(F.when(F.col("__kid") == i, from_avro(kbody, json.dumps(schemas.by_id[i]),
                                                                 {"mode": "PERMISSIVE"}))).alias(f"__k{i}{tag}"))
    stage = framed.select("*", *own)
    mapped = debezium.mapped_columns(stage.schema, layout.semantic, tag)  # Debezium writers: our types, TOAST
    stage_schema = stage.select(*[mapped.get(n, F.col(n)) for n in stage.columns]).schema if mapped else stage.schema
    env_type = _envelope_type(layout.row)
    env = F.lit(None).cast(env_type)
    for i in reversed(layout.value_ids):
        writer = stage_schema[f"__v{i}{tag}"].dataType
        env = F.when(F.col("__vid") == i, _normalize(F.col(f"__v{i}{tag}"), writer, layout, i)).otherwise(env)
    key = F.lit(None).cast(layout.key)
    for i in reversed(layout.key_ids):
        key = F.when(F.col("__kid") == i, _conform(F.col(f"__k{i}{tag}"), stage_schema[f"__k{i}{tag}"].dataType,
                                                   layout.key)).otherwise(key)
    out = [guarded(key).alias(f"__key{tag}"), guarded(env).alias(f"__env{tag}")]
    known_v = F.col("__vid").isin(layout.value_ids) if layout.value_ids else F.lit(False)
    known_k = F.col("__kid").isin(layout.key_ids) if layout.key_ids else F.lit(False)
    first_key = layout.key.fields[0].name if layout.key.fields else None
    key_col, env_col = F.col(f"__key{tag}"), F.col(f"__env{tag}")
    key_bad = key_col.isNull() | (key_col[first_key].isNull() if first_key else F.lit(True))
    op, after = env_col["op"], env_col["after"]
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
        (~tomb & env_col["source"]["commit_lsn"].isNull(), "bad_event",
         F.lit("source.commit_lsn (and source.lsn) missing: the event has no position")),
    ]
    reason, detail = F.lit(None).cast("string"), F.lit(None).cast("string")
    for cond, name, text in reversed(rules):
        reason = F.when(cond, F.lit(name)).otherwise(reason)
        detail = F.when(cond, F.concat_ws(" ", text, where)).otherwise(detail)
    return Plan(stage=own, mapped=mapped, out=out, reason=reason, detail=detail)


def apply(decoding: Plan, framed: DataFrame, batch_id: int) -> DataFrame:
    """A table's rows (from ``headers``) decoded by its plan (built with no tag), with the micro-batch id (__batch)."""
    stage = framed.select("*", *decoding.stage)
    if decoding.mapped:
        stage = stage.select(*[decoding.mapped.get(n, F.col(n)) for n in stage.columns])
    return stage.select(*BASE, *decoding.out).select(
        "*", F.col("__v").isNull().alias("__tomb"), decoding.reason.alias("__reason"),
        decoding.detail.alias("__detail"), F.lit(batch_id).cast("long").alias("__batch"))


def decode(framed: DataFrame, spark: SparkSession, schemas: Schemas, layout: Layout, batch_id: int) -> DataFrame:
    """One table's rows (from ``headers``) -> __key, __env and __tomb, or __reason/__detail for dead letters."""
    return apply(plan(framed, schemas, layout), framed, batch_id)
