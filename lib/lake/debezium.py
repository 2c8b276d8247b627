"""Change events written by Debezium's PostgreSQL connector, as the merge reads them (docs/debezium.md).

Debezium writes the same envelope as our capture (docs/events.md), with three differences the merge
(lib/lake/merge.py) smooths out here, per writer schema, with built-in Spark functions only:

- **Position.** ``source`` has no ``commit_lsn``/``event_serial``. Debezium's ``source.lsn`` is the
  change's own WAL position, which is not in commit order across interleaved transactions, and
  ``source.sequence`` is ``'["<last commit lsn>","<lsn>"]'`` where the first value is the end of the
  previous transaction's commit record (null for the first transaction after a snapshot). Events
  are positioned at ``(coalesce(sequence[0], lsn), lsn)``: increasing across transactions in commit
  order and inside a transaction in change order. Snapshot reads (``snapshot`` true, first, last,
  first_in_data_collection, last_in_data_collection) are ``(lsn, -1)``, lsn being the snapshot's
  position, so every streamed change of the same key sorts after them.
- **Semantic types.** With ``time.precision.mode=adaptive_time_microseconds`` (Debezium's default) and
  ``decimal.handling.mode=precise`` (default), temporal columns and unconstrained numeric columns carry
  Debezium types (``connect.name``); they are converted to what our capture gives the same column:
  ``Date`` (days) -> date, ``MicroTimestamp``/``Timestamp``/``NanoTimestamp`` and Connect's
  ``Timestamp`` -> timestamp_ntz, ``ZonedTimestamp`` (ISO text) -> timestamp, ``MicroTime``/``Time``/
  ``NanoTime`` and Connect's ``Time`` -> long microseconds, ``VariableScaleDecimal`` -> its decimal
  text, digits exact at any length (our unconstrained numeric is a string; Debezium itself already
  stripped trailing zeros and turned NaN into null).
- **TOAST.** An unchanged TOASTed value is the placeholder ``__debezium_unavailable_value`` (a string,
  its bytes for bytea, a one-element array for arrays); such fields become null and are listed in
  ``unchanged_cols``, which the merge already treats as "keep the stored value".
"""

from __future__ import annotations

import re

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

PLACEHOLDER = "__debezium_unavailable_value"
SNAPSHOT_MARKS = ("true", "first", "last", "first_in_data_collection", "last_in_data_collection")
_LIMB = 1_000_000_000  # VariableScaleDecimal digits are computed in base-10^9 limbs (any length, exact)
_EPOCH_NTZ = "TIMESTAMP_NTZ'1970-01-01 00:00:00'"


def _ntz(c: Column, unit: str) -> Column:
    return F.expr(_EPOCH_NTZ) + c * F.expr(f"INTERVAL '{unit}' SECOND")


CONVERSIONS = {  # connect.name -> (Spark type of the converted column, conversion of the decoded value)
    "io.debezium.time.Date": (T.DateType(), F.date_from_unix_date),
    "io.debezium.time.Timestamp": (T.TimestampNTZType(), lambda c: _ntz(c, "0.001")),
    "io.debezium.time.MicroTimestamp": (T.TimestampNTZType(), lambda c: _ntz(c, "0.000001")),
    "io.debezium.time.NanoTimestamp": (T.TimestampNTZType(),
                                       lambda c: _ntz(F.floor(c / 1000).cast("long"), "0.000001")),
    "org.apache.kafka.connect.data.Timestamp": (T.TimestampNTZType(),
                                                lambda c: _ntz(F.unix_micros(c), "0.000001")),
    "io.debezium.time.ZonedTimestamp": (T.TimestampType(), lambda c: c.cast("timestamp")),
    "io.debezium.time.Time": (T.LongType(), lambda c: c.cast("long") * 1000),
    "io.debezium.time.MicroTime": (T.LongType(), lambda c: c.cast("long")),
    "io.debezium.time.NanoTime": (T.LongType(), lambda c: F.floor(c / 1000).cast("long")),
    "org.apache.kafka.connect.data.Time": (T.LongType(), lambda c: c.cast("long") * 1000),
    "io.debezium.data.VariableScaleDecimal": (T.StringType(), lambda c: decimal_text(c)),
}


def is_debezium(envelope: dict) -> bool:
    """True for an envelope schema without our ordering fields in source (a Debezium writer)."""
    for fld in envelope.get("fields", []):
        if fld["name"] == "source" and isinstance(fld["type"], dict):
            names = {f["name"] for f in fld["type"].get("fields", [])}
            return not {"commit_lsn", "event_serial"} <= names
    return False


def semantic_fields(record: dict | None) -> dict[str, str]:
    """{field: connect.name} of a record's fields whose Debezium type the merge converts."""
    out = {}
    for fld in (record or {}).get("fields", []):
        types = fld["type"] if isinstance(fld["type"], list) else [fld["type"]]
        for t in types:
            if isinstance(t, dict) and t.get("connect.name") in CONVERSIONS:
                out[fld["name"]] = t["connect.name"]
    return out


def row_type(struct: T.StructType, semantic: dict[str, str]) -> T.StructType:
    """A decoded row type with the semantic fields' converted types."""
    return T.StructType([T.StructField(f.name, CONVERSIONS[semantic[f.name]][0], f.nullable) if f.name in semantic
                         else f for f in struct.fields])


def prepare(stage: DataFrame, semantic: dict[int, dict[str, str]]) -> DataFrame:
    """The merge's decoded stage (columns __v<id>, __k<id>) with Debezium writers mapped, in a projection of its own.

    ``semantic`` holds an entry for every Debezium value writer id (lib/lake/merge.py's Layout) and for key ids:
    values get their semantic fields converted and TOAST placeholders nulled (listed in a new ``unchanged_cols``),
    keys their semantic fields converted. Every other column passes unchanged; without work there is no projection.
    """
    mapped = mapped_columns(stage.schema, semantic)
    return stage.select(*[mapped.get(n, F.col(n)) for n in stage.columns]) if mapped else stage


def mapped_columns(schema: T.StructType, semantic: dict[int, dict[str, str]], tag: str = "") -> dict[str, Column]:
    """prepare's replacements for the stage columns __v<id><tag> and __k<id><tag> of this schema, by name."""
    types = {f.name: f.dataType for f in schema.fields}
    mapped = {}
    for name in schema.names:
        found = re.fullmatch(r"__([vk])(\d+)" + re.escape(tag), name)
        schema_id = int(found.group(2)) if found else None
        if found and found.group(1) == "v" and schema_id in semantic:
            mapped[name] = envelope(F.col(name), types[name], semantic[schema_id]).alias(name)
        elif found and found.group(1) == "k" and semantic.get(schema_id):
            mapped[name] = convert_row(F.col(name), types[name], semantic[schema_id]).alias(name)
    return mapped


def envelope(e: Column, writer: T.StructType, semantic: dict[str, str]) -> Column:
    """A Debezium envelope with before/after in our types, after's placeholders null and named in unchanged_cols."""
    parts, toasted = [], F.array().cast("array<string>")
    for fld in writer.fields:
        if fld.name in ("before", "after") and isinstance(fld.dataType, T.StructType):
            row, tests, values = e[fld.name], {}, []
            for col in fld.dataType.fields:
                value = row[col.name]
                if col.name in semantic:
                    value = CONVERSIONS[semantic[col.name]][1](value)
                elif fld.name == "after" and _holds_placeholder(col.dataType):
                    tests[col.name] = F.coalesce(_placeholder_test(value, col.dataType), F.lit(False))
                    value = F.when(tests[col.name], F.lit(None).cast(col.dataType)).otherwise(value)
                values.append(value.alias(col.name))
            parts.append(F.when(row.isNotNull(), F.struct(*values)).alias(fld.name))
            if tests:
                toasted = F.array_compact(F.array(*[F.when(test, F.lit(name)) for name, test in tests.items()]))
        elif fld.name != "unchanged_cols":
            parts.append(e[fld.name].alias(fld.name))
    parts.append(F.coalesce(toasted, F.array().cast("array<string>")).alias("unchanged_cols"))
    return F.when(e.isNotNull(), F.struct(*parts))


def convert_row(c: Column, struct: T.StructType, semantic: dict[str, str]) -> Column:
    """A decoded record (e.g. a key) with its semantic fields converted; null stays null."""
    parts = [CONVERSIONS[semantic[f.name]][1](c[f.name]).alias(f.name) if f.name in semantic
             else c[f.name].alias(f.name) for f in struct.fields]
    return F.when(c.isNotNull(), F.struct(*parts))


def position(source: Column) -> Column:
    """source with commit_lsn and event_serial filled by Debezium's rule (see the module docstring)."""
    snapshot = F.coalesce(source["snapshot"], F.lit("false")).isin(*SNAPSHOT_MARKS)
    last_commit = F.from_json(source["sequence"], "array<string>")[0].cast("long")
    commit = F.when(snapshot, source["lsn"]).otherwise(F.coalesce(last_commit, source["lsn"]))
    serial = F.when(snapshot, F.lit(-1).cast("long")).otherwise(source["lsn"])
    return source.withField("commit_lsn", F.coalesce(source["commit_lsn"], commit)) \
        .withField("event_serial", F.coalesce(source["event_serial"], serial))


def toast_candidates(struct: T.StructType) -> set[str]:
    """Fields that can carry the placeholder: strings, bytes and arrays of strings."""
    return {f.name for f in struct.fields if _holds_placeholder(f.dataType)}


def _holds_placeholder(dtype: T.DataType) -> bool:
    return isinstance(dtype, (T.StringType, T.BinaryType)) or (
        isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.StringType))


def _placeholder_test(c: Column, dtype: T.DataType) -> Column | None:
    if isinstance(dtype, T.StringType):
        return c == F.lit(PLACEHOLDER)
    if isinstance(dtype, T.BinaryType):
        return c == F.lit(bytearray(PLACEHOLDER.encode()))
    if _holds_placeholder(dtype):
        return (F.size(c) == 1) & (c[0] == F.lit(PLACEHOLDER))
    return None


def _times_add(limbs: Column, factor: int, addend: Column) -> Column:
    """Little-endian base-10^9 limbs * factor + addend (addend < 10^9)."""
    def step(state, limb):
        x = limb * factor + state["c"]
        low = x % _LIMB
        return F.struct(F.concat(state["o"], F.array(low)).alias("o"), ((x - low) / _LIMB).cast("long").alias("c"))

    start = F.struct(F.array().cast("array<bigint>").alias("o"), addend.cast("long").alias("c"))
    return F.aggregate(limbs, start, step,
                       lambda state: F.when(state["c"] > 0, F.concat(state["o"], F.array(state["c"])))
                       .otherwise(state["o"]))


def _let(value: Column, body) -> Column:
    """body(x) with x bound to value once (the expression tree holds value a single time)."""
    return F.element_at(F.transform(F.array(value), body), 1)


def decimal_text(c: Column) -> Column:
    """Debezium's VariableScaleDecimal {scale, value: two's-complement big-endian bytes} as exact decimal text."""
    hexed = F.hex(c["value"])
    size = F.length(c["value"])
    negative = F.conv(F.substr(hexed, F.lit(1), F.lit(2)), 16, 10).cast("int") >= 128
    magnitude = F.transform(F.sequence(F.lit(0), size - 1), lambda i: _let(
        F.conv(F.substr(hexed, i * 2 + 1, F.lit(2)), 16, 10).cast("long"),
        lambda b: F.when(negative, 255 - b).otherwise(b)))  # a negative number is ~bytes + 1
    limbs = F.aggregate(magnitude, F.array(F.lit(0).cast("long")), lambda acc, b: _times_add(acc, 256, b))
    limbs = _times_add(limbs, 1, F.when(negative, F.lit(1)).otherwise(F.lit(0)))
    digits = F.array_join(F.transform(F.reverse(limbs), lambda x, i: F.when(i == 0, x.cast("string"))
                                      .otherwise(F.lpad(x.cast("string"), 9, "0"))), "")
    scale = c["scale"]

    def with_point(d: Column) -> Column:
        return _let(F.lpad(d, F.greatest(F.length(d), scale + 1), "0"), lambda padded: F.when(
            scale > 0, F.concat(F.substr(padded, F.lit(1), F.length(padded) - scale), F.lit("."),
                                F.substr(padded, F.length(padded) - scale + 1, scale)))
                    .when(scale < 0, F.concat(d, F.repeat(F.lit("0"), -scale))).otherwise(d))

    return F.when(c.isNotNull() & (size > 0),
                  F.concat(F.when(negative, F.lit("-")).otherwise(F.lit("")), _let(digits, with_point)))
