"""The type mapping: every PostgreSQL type's Avro type, text -> Python, and a fastavro round trip."""

from __future__ import annotations

import datetime
import io
import math
import uuid
from decimal import Decimal

import fastavro
import pytest

from lib.capture import pgtypes
from lib.capture.catalog import Column, PgType
from lib.capture.pgtypes import UnsupportedTypeError, ValueConversionError

UTC = datetime.timezone.utc


def builtin(name: str, typmod: int = -1, category: str = "U") -> PgType:
    return PgType(oid=0, schema="pg_catalog", name=name, kind="base", category=category, typmod=typmod)


def numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


def array_of(element: PgType) -> PgType:
    return PgType(oid=0, schema="pg_catalog", name=f"_{element.name}", kind="array", category="A",
                  typmod=element.typmod, element=element)


def col(pgtype: PgType | str, not_null: bool = False, name: str = "c", type_name: str | None = None) -> Column:
    t = builtin(pgtype) if isinstance(pgtype, str) else pgtype
    return Column(table="bank.t", name=name, attnum=1, type_name=type_name or t.name, type=t, not_null=not_null)


NUMERIC_14_2 = builtin("numeric", numeric_typmod(14, 2))
ENUM = PgType(oid=0, schema="bank", name="kyc_status", kind="enum", labels=("pending", "verified"))
DOMAIN = PgType(oid=0, schema="bank", name="amount", kind="domain", base=builtin("numeric", numeric_typmod(10, 2)))
CITEXT = PgType(oid=0, schema="public", name="citext", kind="base", category="S")

DECIMAL_14_2 = {"type": "bytes", "logicalType": "decimal", "precision": 14, "scale": 2}

MAPPING = [
    ("bool", "boolean"), ("int2", "int"), ("int4", "int"), ("int8", "long"), ("oid", "long"),
    ("float4", "float"), ("float8", "double"), (NUMERIC_14_2, DECIMAL_14_2), ("numeric", "string"),
    (builtin("numeric", numeric_typmod(5, -2)), {"type": "bytes", "logicalType": "decimal", "precision": 7,
                                                 "scale": 0}),
    (builtin("numeric", numeric_typmod(2, 5)), {"type": "bytes", "logicalType": "decimal", "precision": 5,
                                                "scale": 5}),
    ("money", {"type": "bytes", "logicalType": "decimal", "precision": 19, "scale": 2}),
    ("text", "string"), ("varchar", "string"), ("bpchar", "string"), ("name", "string"), ("char", "string"),
    ("xml", "string"), ("inet", "string"), ("cidr", "string"), ("macaddr", "string"), ("macaddr8", "string"),
    (CITEXT, "string"),
    ("uuid", {"type": "string", "logicalType": "uuid"}),
    ("json", {"type": "string", "connect.name": "io.debezium.data.Json"}),
    ("jsonb", {"type": "string", "connect.name": "io.debezium.data.Json"}),
    ("bytea", "bytes"), ("date", {"type": "int", "logicalType": "date"}),
    ("timestamp", {"type": "long", "logicalType": "local-timestamp-micros"}),
    ("timestamptz", {"type": "long", "logicalType": "timestamp-micros"}),
    ("time", {"type": "long", "logicalType": "time-micros"}), ("timetz", "string"),
    ("interval", {"type": "string", "connect.name": "io.debezium.time.Interval"}),
    (array_of(builtin("text", category="S")), {"type": "array", "items": ["null", "string"]}),
    (array_of(NUMERIC_14_2), {"type": "array", "items": ["null", DECIMAL_14_2]}),
    (ENUM, "string"), (array_of(ENUM), {"type": "array", "items": ["null", "string"]}),
    (DOMAIN, {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}),
]


@pytest.mark.parametrize(("pgtype", "expected"), MAPPING, ids=lambda v: v if isinstance(v, str) else None)
def test_avro_type_of_every_supported_type(pgtype, expected):
    assert pgtypes.avro_type(None, col(pgtype, not_null=True)) == expected
    assert pgtypes.avro_type(None, col(pgtype)) == ["null", expected]
    fastavro.parse_schema(record_schema(col(pgtype)))


def test_unsupported_type_names_the_column_type_and_remedy():
    point = col(builtin("point", category="G"), name="location", type_name="point")
    with pytest.raises(UnsupportedTypeError) as err:
        pgtypes.avro_type(None, point)
    message = str(err.value)
    assert "bank.t.location" in message and "point" in message
    assert "source.unknown_types: string" in message and "ALTER TABLE" in message
    assert not pgtypes.is_supported(point)
    with pytest.raises(UnsupportedTypeError):
        pgtypes.converter(point)


def test_unknown_types_string_carries_the_text_form():
    point = col(builtin("point", category="G"))
    assert pgtypes.avro_type(None, point, unknown_types="string") == ["null", "string"]
    assert pgtypes.to_python("(1,2)", point, unknown_types="string") == "(1,2)"
    points = col(array_of(builtin("point", category="G")))
    assert pgtypes.avro_type(None, points, unknown_types="string") == ["null", "string"]
    assert pgtypes.to_python('{"(1,2)";"(3,4)"}', points, unknown_types="string") == '{"(1,2)";"(3,4)"}'
    with pytest.raises(ValueError, match="unknown_types must be one of"):
        pgtypes.avro_type(None, point, unknown_types="skip")


def record_schema(column: Column, nullable: bool | None = None) -> dict:
    return {"type": "record", "name": "Row", "namespace": "test",
            "fields": [{"name": "v", "type": pgtypes.avro_type(None, column, nullable=nullable)}]}


def strip_logical(schema):
    """The schema with logical types removed (reads the raw int/long the way Spark or Java see it)."""
    if isinstance(schema, dict):
        return {k: strip_logical(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [strip_logical(v) for v in schema]
    return schema


def roundtrip(column: Column, value, raw: bool = False):
    """Write {'v': value} with the column's schema, read it back (raw=True: without logical types)."""
    schema = record_schema(column)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), {"v": value})
    buf.seek(0)
    read_as = strip_logical(schema) if raw else schema  # same binary encoding
    return fastavro.schemaless_reader(buf, fastavro.parse_schema(read_as), None)["v"]


def micros(dt: datetime.datetime) -> int:
    base = datetime.datetime(1970, 1, 1, tzinfo=dt.tzinfo)
    delta = dt - base
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


# (type, pgoutput text, Python value, value fastavro reads back with logical types)
CONVERSIONS = [
    ("bool", "t", True, True), ("bool", "f", False, False),
    ("int2", "-32768", -32768, -32768), ("int4", "2147483647", 2147483647, 2147483647),
    ("int8", "-9223372036854775808", -(2**63), -(2**63)), ("oid", "4294967295", 4294967295, 4294967295),
    ("float8", "1e+30", 1e30, 1e30), ("float8", "-0.1", -0.1, -0.1), ("float8", "Infinity", math.inf, math.inf),
    ("float8", "-Infinity", -math.inf, -math.inf), ("float4", "0.5", 0.5, 0.5),
    (NUMERIC_14_2, "1234.56", Decimal("1234.56"), Decimal("1234.56")),
    (NUMERIC_14_2, "-999999999999.99", Decimal("-999999999999.99"), Decimal("-999999999999.99")),
    (NUMERIC_14_2, "0.00", Decimal("0.00"), Decimal("0.00")),
    (builtin("numeric", numeric_typmod(5, -2)), "1200", Decimal("1200"), Decimal("1200")),
    (builtin("numeric", numeric_typmod(2, 5)), "0.00012", Decimal("0.00012"), Decimal("0.00012")),
    ("numeric", "1234567890123456789012345678901234567890.0123456789",
     "1234567890123456789012345678901234567890.0123456789",
     "1234567890123456789012345678901234567890.0123456789"),
    ("numeric", "NaN", "NaN", "NaN"), ("numeric", "-0.000000000000000000000000000000000000001",
                                       "-0.000000000000000000000000000000000000001",
                                       "-0.000000000000000000000000000000000000001"),
    ("money", "$1,234.56", Decimal("1234.56"), Decimal("1234.56")),
    ("money", "-$1,234.56", Decimal("-1234.56"), Decimal("-1234.56")),
    ("money", "($1,234.56)", Decimal("-1234.56"), Decimal("-1234.56")),
    ("money", "$0.00", Decimal("0.00"), Decimal("0.00")),
    ("money", "-$92,233,720,368,547,758.08", Decimal("-92233720368547758.08"), Decimal("-92233720368547758.08")),
    ("text", "héllo wörld ✓", "héllo wörld ✓", "héllo wörld ✓"), ("bpchar", "US ", "US ", "US "),
    ("inet", "10.0.0.1/8", "10.0.0.1/8", "10.0.0.1/8"), ("xml", "<a>1</a>", "<a>1</a>", "<a>1</a>"),
    (CITEXT, "MiXeD", "MiXeD", "MiXeD"),
    ("uuid", "6f1c1f0e-3c1d-4d3e-9a4b-1c2d3e4f5a6b", "6f1c1f0e-3c1d-4d3e-9a4b-1c2d3e4f5a6b",
     uuid.UUID("6f1c1f0e-3c1d-4d3e-9a4b-1c2d3e4f5a6b")),
    ("jsonb", '{"a": [1, 2.5, null], "b": "x"}', '{"a": [1, 2.5, null], "b": "x"}', '{"a": [1, 2.5, null], "b": "x"}'),
    ("bytea", "\\x0102ff", b"\x01\x02\xff", b"\x01\x02\xff"), ("bytea", "\\x", b"", b""),
    ("bytea", "a\\000\\\\b\\377", b"a\x00\\b\xff", b"a\x00\\b\xff"),
    ("date", "1970-01-01", 0, datetime.date(1970, 1, 1)), ("date", "2024-02-29", 19782, datetime.date(2024, 2, 29)),
    ("date", "1969-12-31", -1, datetime.date(1969, 12, 31)), ("date", "0001-01-01", -719162, datetime.date(1, 1, 1)),
    ("timestamp", "2024-01-02 03:04:05.5", micros(datetime.datetime(2024, 1, 2, 3, 4, 5, 500000)),
     datetime.datetime(2024, 1, 2, 3, 4, 5, 500000)),
    ("timestamp", "1900-02-28 23:59:59.999999", micros(datetime.datetime(1900, 2, 28, 23, 59, 59, 999999)),
     datetime.datetime(1900, 2, 28, 23, 59, 59, 999999)),
    ("timestamptz", "2024-01-02 03:04:05+00", micros(datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)),
     datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ("timestamptz", "2024-01-02 08:34:05.123+05:30", micros(datetime.datetime(2024, 1, 2, 3, 4, 5, 123000, UTC)),
     datetime.datetime(2024, 1, 2, 3, 4, 5, 123000, UTC)),
    ("timestamptz", "2024-01-01 23:04:05.000001-04", micros(datetime.datetime(2024, 1, 2, 3, 4, 5, 1, UTC)),
     datetime.datetime(2024, 1, 2, 3, 4, 5, 1, UTC)),
    ("timestamptz", "1900-01-01 00:00:00+05:53:28", micros(datetime.datetime(1899, 12, 31, 18, 6, 32, tzinfo=UTC)),
     datetime.datetime(1899, 12, 31, 18, 6, 32, tzinfo=UTC)),
    ("time", "13:14:15.000123", (13 * 3600 + 14 * 60 + 15) * 1_000_000 + 123, datetime.time(13, 14, 15, 123)),
    ("time", "00:00:00", 0, datetime.time(0, 0)),
    ("timetz", "03:04:05+02", "03:04:05+02", "03:04:05+02"),
    ("interval", "1 year 2 mons 3 days 04:05:06.5", "P1Y2M3DT4H5M6.5S", "P1Y2M3DT4H5M6.5S"),
    (ENUM, "verified", "verified", "verified"),
    (DOMAIN, "12.30", Decimal("12.30"), Decimal("12.30")),
    (array_of(builtin("text", category="S")), '{a,b,NULL,"x y"}', ["a", "b", None, "x y"], ["a", "b", None, "x y"]),
    (array_of(builtin("int4")), "{1,-2,NULL}", [1, -2, None], [1, -2, None]),
    (array_of(NUMERIC_14_2), "{1.50,NULL}", [Decimal("1.50"), None], [Decimal("1.50"), None]),
    (array_of(builtin("date")), "{2024-02-29,NULL}", [19782, None], [datetime.date(2024, 2, 29), None]),
]


@pytest.mark.parametrize(("pgtype", "text", "value", "read_back"), CONVERSIONS)
def test_text_converts_and_round_trips_through_avro(pgtype, text, value, read_back):
    column = col(pgtype)
    converted = pgtypes.to_python(text, column)
    assert converted == value
    assert type(converted) is type(value)
    assert roundtrip(column, converted) == read_back
    assert roundtrip(column, None) is None
    assert pgtypes.to_python(None, column) is None


def test_float_nan_round_trips():
    column = col("float8")
    assert math.isnan(roundtrip(column, pgtypes.to_python("NaN", column)))
    assert roundtrip(col("float4"), pgtypes.to_python("1.1", col("float4"))) == pytest.approx(1.1, rel=1e-7)


def test_unconstrained_numeric_keeps_every_digit():
    text = "-98765432109876543210987654321098765432.10"
    assert len(text.replace("-", "").replace(".", "")) == 40
    value = pgtypes.to_python(text, col("numeric"))
    assert value == text and Decimal(value) == Decimal(text)
    assert roundtrip(col("numeric"), value) == text


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_numeric_nan_or_infinity_in_decimal_column_is_an_error_naming_the_column(text):
    amount = col(NUMERIC_14_2, name="amount")
    with pytest.raises(ValueConversionError) as err:
        pgtypes.to_python(text, amount)
    message = str(err.value)
    assert "bank.t.amount" in message
    assert f"numeric {text} cannot be represented in decimal(14,2)" in message


@pytest.mark.parametrize("text", ["1.234,56 €", "1,00 €", "¥1,235", "EUR 12"])
def test_money_in_another_locale_is_an_error_not_a_guess(text):
    with pytest.raises(ValueConversionError, match="lc_monetary=C"):
        pgtypes.to_python(text, col("money", name="fee"))


ARRAY_CASES = [
    # PostgreSQL's own output of ARRAY['a','b',NULL,'x y','NULL','q"u','b\s','',' sp']
    ('{a,b,NULL,"x y","NULL","q\\"u","b\\\\s",""," sp"}', ["a", "b", None, "x y", "NULL", 'q"u', "b\\s", "", " sp"]),
    ("{}", []),
    ('{""}', [""]),
    ('{"{\\"a\\": 1}",NULL}', ['{"a": 1}', None]),
    ('{"a,b","c}d","{e}"}', ["a,b", "c}d", "{e}"]),
    ("[0:1]={x,y}", ["x", "y"]),
    ("{NULLX,null}", ["NULLX", "null"]),
]


@pytest.mark.parametrize(("text", "expected"), ARRAY_CASES)
def test_text_array_parsing(text, expected):
    column = col(array_of(builtin("text", category="S")), name="tags")
    value = pgtypes.to_python(text, column)
    assert value == expected
    assert roundtrip(column, value) == expected


def test_bytea_array_elements_are_decoded():
    column = col(array_of(builtin("bytea")))
    assert pgtypes.to_python('{"\\\\x01ff",NULL}', column) == [b"\x01\xff", None]


@pytest.mark.parametrize("text", ["{{1,2},{3,4}}", "[1:2][1:1]={{1},{2}}"])
def test_multi_dimensional_array_is_an_error(text):
    with pytest.raises(ValueConversionError, match="bank.t.grid: multi-dimensional"):
        pgtypes.to_python(text, col(array_of(builtin("int4")), name="grid"))


INTERVALS = [
    ("1 year 2 mons 3 days 04:05:06.5", "P1Y2M3DT4H5M6.5S"),
    ("-1 days +02:03:00", "P-1DT2H3M"),
    ("-04:05:06.5", "PT-4H-5M-6.5S"),
    ("-1 years -2 mons", "P-1Y-2M"),
    ("1 day -00:00:01", "P1DT-1S"),
    ("00:00:00", "PT0S"),
    ("100:00:00", "PT100H"),
    ("1 day", "P1D"),
    ("3 mons", "P3M"),
    ("00:00:00.000001", "PT0.000001S"),
    ("00:01:00", "PT1M"),
    ("178000000 years", "P178000000Y"),
    ("P1Y2M", "P1Y2M"),  # IntervalStyle iso_8601 passes through
]


@pytest.mark.parametrize(("text", "iso"), INTERVALS)
def test_interval_to_iso_8601(text, iso):
    column = col("interval")
    assert pgtypes.to_python(text, column) == iso
    assert roundtrip(column, iso) == iso


def test_interval_in_sql_standard_style_is_an_error():
    with pytest.raises(ValueConversionError, match="IntervalStyle=postgres"):
        pgtypes.to_python("1-2 3 4:05:06", col("interval", name="gap"))


def test_date_infinity_is_an_error_naming_the_column():
    with pytest.raises(ValueConversionError) as err:
        pgtypes.to_python("infinity", col("date", name="valid_to"))
    assert "bank.t.valid_to" in str(err.value) and "infinity" in str(err.value)


def test_timestamp_infinity_uses_debeziums_sentinels():
    for kind in ("timestamp", "timestamptz"):
        assert pgtypes.to_python("infinity", col(kind)) == pgtypes.LONG_MAX
        assert pgtypes.to_python("-infinity", col(kind)) == pgtypes.LONG_MIN
        assert roundtrip(col(kind), pgtypes.LONG_MAX, raw=True) == pgtypes.LONG_MAX


def test_dates_outside_python_range():
    date = col("date")
    day_before_year_1 = pgtypes.to_python("0001-12-31 BC", date)  # astronomical year 0
    assert day_before_year_1 == pgtypes.to_python("0001-01-01", date) - 1
    assert pgtypes.to_python("10000-01-01", date) == pgtypes.to_python("9999-12-31", date) + 1
    assert pgtypes.to_python("0044-03-15 BC", date) == pgtypes.days_from_civil(-43, 3, 15)
    assert roundtrip(date, day_before_year_1, raw=True) == day_before_year_1
    ts = col("timestamp")
    bc = pgtypes.to_python("0001-12-31 23:59:59.999999 BC", ts)
    assert bc == pgtypes.to_python("0001-01-01 00:00:00", ts) - 1


def test_days_from_civil_matches_python_calendar():
    for ordinal in range(1, 3_652_059, 997):
        day = datetime.date.fromordinal(ordinal)
        expected = (day - datetime.date(1970, 1, 1)).days
        assert pgtypes.days_from_civil(day.year, day.month, day.day) == expected
        # the formula branch (used outside years 1..9999) agrees with the fast branch
        shifted = pgtypes.days_from_civil(day.year + 400 * 30, day.month, day.day)
        assert shifted == expected + 146097 * 30


def test_time_24_00_is_a_whole_day():
    assert pgtypes.to_python("24:00:00", col("time")) == 86_400_000_000


def test_not_null_and_nullable_fragments():
    assert pgtypes.avro_type(None, col("int4", not_null=True)) == "int"
    assert pgtypes.avro_type(None, col("int4")) == ["null", "int"]
    assert pgtypes.avro_type(None, col("int4", not_null=True), nullable=True) == ["null", "int"]


def test_converter_is_built_once_per_column():
    column = col(NUMERIC_14_2)
    convert = pgtypes.converter(column)
    assert pgtypes.converter(column) is convert
    assert convert(None) is None
    assert convert("1.00") == Decimal("1.00")


def test_session_options_pin_the_text_forms():
    options = pgtypes.session_options()
    for setting in ("DateStyle=ISO,MDY", "IntervalStyle=postgres", "TimeZone=UTC", "bytea_output=hex",
                    "lc_monetary=C"):
        assert f"-c {setting}" in options
