"""lib/lake/debezium.py on small frames: Debezium's positions, semantic types, TOAST placeholders and variable-scale
decimals, as the merge maps them (the real connector runs in tests/test_debezium_interop.py)."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from lib.lake import debezium

SOURCE = "snapshot string, sequence string, lsn long, commit_lsn long, event_serial long"


def unscaled_bytes(text: str) -> tuple[int, bytes]:
    """(scale, two's-complement big-endian unscaled value) of a decimal, as Debezium's VariableScaleDecimal."""
    sign, digits, exponent = Decimal(text).as_tuple()
    unscaled = int("".join(map(str, digits))) * (-1 if sign else 1)
    return -exponent, unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)


@pytest.mark.parametrize("text", ["0", "0.000", "1.50", "-0.5", "0.33333333333333333333", "255", "-256", "128",
                                  "-129", "-1", "100000000000000000000", "1E+3",
                                  "-12345678901234567890123456789012345678901234.5678"])
def test_variable_scale_decimal_becomes_exact_text(spark_session, text):
    scale, value = unscaled_bytes(text)
    frame = spark_session.createDataFrame([(scale, value)], "scale int, value binary")
    got = frame.select(debezium.decimal_text(F.struct("scale", "value")).alias("t")).first()["t"]
    expected = Decimal(text)
    assert Decimal(got) == expected and Decimal(got).as_tuple().exponent == min(expected.as_tuple().exponent, 0)


def test_positions_of_snapshot_rows_streamed_changes_and_our_own_events(spark_session):
    rows = [("first", '[null,"500"]', 500, None, None),  # Debezium snapshot row: (snapshot lsn, -1)
            ("false", '[null,"700"]', 700, None, None),  # first transaction after the snapshot: (lsn, lsn)
            ("false", '["900","650"]', 650, None, None),  # later: (previous commit end, lsn), even if lsn is lower
            ("incremental", '["900","950"]', 950, None, None),  # incremental snapshot reads sit in the stream
            ("false", None, 1000, 1200, 3)]  # our capture's fields are kept
    frame = spark_session.createDataFrame(rows, SOURCE).select(debezium.position(F.struct("*")).alias("s"))
    assert [(r["s"]["commit_lsn"], r["s"]["event_serial"]) for r in frame.collect()] == [
        (500, -1), (700, 700), (900, 650), (900, 950), (1200, 3)]


def test_envelope_converts_semantic_types_and_nulls_placeholders(spark_session):
    row = T.StructType([T.StructField(n, t) for n, t in (
        ("id", T.LongType()), ("d", T.IntegerType()), ("ts", T.LongType()), ("ms", T.LongType()),
        ("zoned", T.StringType()), ("t", T.LongType()), ("note", T.StringType()), ("blob", T.BinaryType()),
        ("tags", T.ArrayType(T.StringType())), ("free", T.StructType([T.StructField("scale", T.IntegerType()),
                                                                      T.StructField("value", T.BinaryType())])))])
    writer = T.StructType([T.StructField("before", row), T.StructField("after", row),
                           T.StructField("op", T.StringType())])
    semantic = {"d": "io.debezium.time.Date", "ts": "io.debezium.time.MicroTimestamp",
                "ms": "io.debezium.time.Timestamp", "zoned": "io.debezium.time.ZonedTimestamp",
                "t": "io.debezium.time.MicroTime", "free": "io.debezium.data.VariableScaleDecimal"}
    placeholder = debezium.PLACEHOLDER
    after = (1, 19723, 1_700_000_000_123_456, 1_700_000_000_123, "2024-01-01T10:00:00.5Z", 3_723_000_001,
             placeholder, bytearray(placeholder.encode()), [placeholder], (2, bytearray(b"\x04\xd2")))
    frame = spark_session.createDataFrame([(None, after, "u")], writer)
    out = frame.select(debezium.envelope(F.struct("*"), writer, semantic).alias("e")).first()["e"]
    got = out["after"]
    assert got["d"] == datetime.date(2024, 1, 1)
    assert got["ts"] == datetime.datetime(2023, 11, 14, 22, 13, 20, 123456)  # wall clock, no zone
    assert got["ms"] == datetime.datetime(2023, 11, 14, 22, 13, 20, 123000)
    assert got["zoned"].astimezone(datetime.timezone.utc) == datetime.datetime(2024, 1, 1, 10, 0, 0, 500000,
                                                                               tzinfo=datetime.timezone.utc)
    assert (got["t"], got["free"]) == (3_723_000_001, "12.34")
    assert (got["note"], got["blob"], got["tags"]) == (None, None, None)
    assert sorted(out["unchanged_cols"]) == ["blob", "note", "tags"] and out["before"] is None and out["op"] == "u"
    converted = frame.select(debezium.envelope(F.struct("*"), writer, semantic).alias("e")).schema["e"].dataType
    assert converted["after"].dataType == debezium.row_type(row, semantic)


def test_writer_detection_and_semantic_fields():
    ours = {"fields": [{"name": "source", "type": {"type": "record", "name": "Source", "fields": [
        {"name": "lsn", "type": "long"}, {"name": "commit_lsn", "type": "long"}, {"name": "event_serial",
                                                                                  "type": "long"}]}}]}
    theirs = {"fields": [{"name": "source", "type": {"type": "record", "name": "Source", "fields": [
        {"name": "lsn", "type": ["null", "long"]}, {"name": "sequence", "type": ["null", "string"]}]}}]}
    assert not debezium.is_debezium(ours) and debezium.is_debezium(theirs)
    record = {"fields": [
        {"name": "d", "type": ["null", {"type": "int", "connect.name": "io.debezium.time.Date"}]},
        {"name": "j", "type": {"type": "string", "connect.name": "io.debezium.data.Json"}},
        {"name": "n", "type": "long"}]}
    assert debezium.semantic_fields(record) == {"d": "io.debezium.time.Date"}


def test_prepare_leaves_our_own_writers_alone(spark_session):
    stage = spark_session.createDataFrame([(("c",), (1,))], "__v7 struct<op: string>, __k8 struct<id: long>")
    assert debezium.prepare(stage, {8: {}}) is stage
