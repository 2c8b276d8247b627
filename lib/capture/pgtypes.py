"""PostgreSQL type -> Avro type, and pgoutput text -> the Python value fastavro writes. One place.

How it works and what it guarantees: docs/types.md.
"""

from __future__ import annotations

import datetime
import functools
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from lib.capture.catalog import Column, PgType, Table, numeric_precision_scale

SESSION_SETTINGS = {
    "DateStyle": "ISO, MDY",
    "IntervalStyle": "postgres",
    "TimeZone": "UTC",
    "bytea_output": "hex",
    "lc_monetary": "C",
    "extra_float_digits": "1",
}

UNKNOWN_TYPES = ("error", "string")
LONG_MAX, LONG_MIN = 2**63 - 1, -(2**63)

JSON_TYPE = {"type": "string", "connect.name": "io.debezium.data.Json"}
INTERVAL_TYPE = {"type": "string", "connect.name": "io.debezium.time.Interval"}
MONEY_TYPE = {"type": "bytes", "logicalType": "decimal", "precision": 19, "scale": 2}

_STRING_TYPES = {"text", "varchar", "bpchar", "name", "char", "xml", "inet", "cidr", "macaddr", "macaddr8"}
_SIMPLE: dict[str, Any] = {
    "bool": "boolean", "int2": "int", "int4": "int", "int8": "long", "oid": "long",
    "float4": "float", "float8": "double", "bytea": "bytes",
    "uuid": {"type": "string", "logicalType": "uuid"},
    "json": JSON_TYPE, "jsonb": JSON_TYPE,
    "date": {"type": "int", "logicalType": "date"},
    "timestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "timestamptz": {"type": "long", "logicalType": "timestamp-micros"},
    "time": {"type": "long", "logicalType": "time-micros"},
    "timetz": "string", "interval": INTERVAL_TYPE, "money": MONEY_TYPE,
}


class UnsupportedTypeError(TypeError):
    """A column's type has no mapping (and unknown_types is 'error')."""


class ValueConversionError(ValueError):
    """A value cannot be represented in the column's Avro type."""


def session_options() -> str:
    """libpq 'options' string that pins the text forms this module parses."""
    return " ".join(f"-c {k}={v.replace(' ', '')}" for k, v in SESSION_SETTINGS.items())


# ---------------------------------------------------------------------------------------------
# Avro types


def avro_type(table: Table | None, column: Column, unknown_types: str = "error",
              nullable: bool | None = None) -> Any:
    """Avro schema fragment of a column: T when NOT NULL, else ["null", T] (nullable overrides)."""
    t = _avro_base(column, column.type, unknown_types)
    if nullable is None:
        nullable = not column.not_null
    return ["null", t] if nullable else t


def _check_unknown(unknown_types: str) -> None:
    if unknown_types not in UNKNOWN_TYPES:
        raise ValueError(f"unknown_types must be one of {', '.join(UNKNOWN_TYPES)}, not {unknown_types!r}")


def _scalar_key(t: PgType) -> str | None:
    """Mapping key of a resolved, non-array type, or None when unsupported."""
    if t.kind == "enum":
        return "enum"
    if t.kind != "base":
        return None
    if t.schema == "pg_catalog":
        if t.name == "numeric":
            return "numeric"
        if t.name in _SIMPLE or t.name in _STRING_TYPES:
            return t.name
    if t.name in ("citext",) or t.category == "S":
        return "text"
    return None


def _avro_base(column: Column, pgtype: PgType, unknown_types: str) -> Any:
    """Non-null Avro type of pgtype (already inside column, for messages)."""
    _check_unknown(unknown_types)
    t = pgtype.resolved()
    if t.kind == "array":
        element = t.element.resolved() if t.element is not None else None
        if element is None or element.kind == "array" or _scalar_key(element) is None:
            return _unsupported(column, unknown_types)
        return {"type": "array", "items": ["null", _avro_base(column, element, unknown_types)]}
    key = _scalar_key(t)
    if key is None:
        return _unsupported(column, unknown_types)
    if key == "numeric":
        precision, scale = numeric_precision_scale(t)
        if precision is None:
            return "string"
        precision, scale = _avro_decimal(precision, scale)
        return {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    if key == "enum" or key in _STRING_TYPES:
        return "string"
    return _SIMPLE[key]


def _avro_decimal(precision: int, scale: int) -> tuple[int, int]:
    """Avro decimal (precision, scale) holding every value of numeric(precision, scale)."""
    if scale < 0:
        return precision - scale, 0
    if scale > precision:
        return scale, scale
    return precision, scale


def _unsupported(column: Column, unknown_types: str) -> str:
    if unknown_types == "string":
        return "string"
    raise UnsupportedTypeError(
        f"column {column.qualified} has type {column.type_name}, which the pipeline cannot map to Avro; "
        f"change the column to a supported type (ALTER TABLE {column.table} ALTER COLUMN "
        f"{column.name} TYPE text USING {column.name}::text, or jsonb for structured values), "
        f"or set source.unknown_types: string in conf to carry PostgreSQL's text form as an Avro string")


def is_supported(column: Column) -> bool:
    """True when the column maps without the unknown_types opt-in."""
    try:
        _avro_base(column, column.type, "error")
    except UnsupportedTypeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# text -> Python


def to_python(text: str | None, column: Column, unknown_types: str = "error") -> Any:
    """pgoutput text of one value -> the Python value for fastavro (use converter() in loops)."""
    return converter(column, unknown_types)(text)


@functools.lru_cache(maxsize=4096)
def converter(column: Column, unknown_types: str = "error") -> Callable[[str | None], Any]:
    """A function text -> Python value for this column (None stays None), built once."""
    convert = _converter(column, column.type, unknown_types)

    def run(text: str | None, _convert=convert) -> Any:
        return None if text is None else _convert(text)

    return run


def _converter(column: Column, pgtype: PgType, unknown_types: str) -> Callable[[str], Any]:
    """Converter for a non-null text value of pgtype."""
    avro = _avro_base(column, pgtype, unknown_types)  # raises for unsupported types
    t = pgtype.resolved()
    if avro == "string" and (t.kind == "array" or _scalar_key(t) is None):
        return text_as_is  # unknown_types="string": the text form as is
    if t.kind == "array":
        element = _converter(column, t.element, unknown_types)
        return functools.partial(_parse_array, element=element, column=column)
    key = _scalar_key(t)
    if key == "numeric":
        precision, scale = numeric_precision_scale(t)
        if precision is None:
            return text_as_is
        return functools.partial(_parse_decimal, column=column, precision=precision, scale=scale)
    factory = _FACTORIES.get(key)
    return factory(column) if factory else text_as_is


def text_as_is(text: str) -> str:
    """The converter of values sent as their PostgreSQL text form."""
    return text


def _fail(column: Column, problem: str, remedy: str) -> ValueConversionError:
    return ValueConversionError(f"column {column.qualified}: {problem}; {remedy}")


def _parse_bool(column: Column) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        if text == "t":
            return True
        if text == "f":
            return False
        raise _fail(column, f"boolean text of {len(text)} character(s) is neither 't' nor 'f'", "report this as a bug")
    return parse


def _parse_decimal(text: str, column: Column, precision: int, scale: int) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise _fail(column, "numeric text is not a number", "check the session settings (SESSION_SETTINGS)") from None
    if not value.is_finite():
        word = "NaN" if value.is_nan() else text
        raise _fail(column, f"numeric {word} cannot be represented in decimal({precision},{scale})",
                    f"change the column to unconstrained numeric (carried as exact text) or "
                    f"replace the {word} value in the source")
    return value


_MONEY = re.compile(r"\d+\.\d\d")


def _parse_money(column: Column) -> Callable[[str], Decimal]:
    def parse(text: str) -> Decimal:
        s = text.strip()
        negative = False
        if s.startswith("(") and s.endswith(")"):
            negative, s = True, s[1:-1]
        if "-" in s:
            negative = True
        digits = "".join(ch for ch in s if ch.isdigit() or ch == ".")
        if not _MONEY.fullmatch(digits):
            raise _fail(column, "money text is not in the '$1,234.56' form",
                        "connect the capture with lc_monetary=C (pgtypes.SESSION_SETTINGS) or "
                        "ALTER DATABASE ... SET lc_monetary = 'C'")
        value = Decimal(digits)
        return -value if negative else value
    return parse


def _parse_bytea(column: Column) -> Callable[[str], bytes]:
    def parse(text: str) -> bytes:
        if text.startswith("\\x"):
            return bytes.fromhex(text[2:])
        return _bytea_escape(text, column)
    return parse


def _bytea_escape(text: str, column: Column) -> bytes:
    """bytea_output=escape form: printable bytes as is, '\\\\' and '\\ooo' octal."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "\\":
            out += ch.encode("latin-1")
            i += 1
        elif text[i + 1:i + 2] == "\\":
            out.append(0x5C)
            i += 2
        elif re.fullmatch(r"[0-3][0-7][0-7]", text[i + 1:i + 4]):
            out.append(int(text[i + 1:i + 4], 8))
            i += 4
        else:
            raise _fail(column, "bytea text is neither hex nor escape form", "set bytea_output=hex")
    return bytes(out)


_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()
_DATE = re.compile(r"(\d{4,})-(\d\d)-(\d\d)( BC)?")
_TIMESTAMP = re.compile(
    r"(\d{4,})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?)?( BC)?")
_TIME = re.compile(r"(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?")


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year: 1 BC = 0)."""
    if 1 <= year <= 9999:
        return datetime.date(year, month, day).toordinal() - _EPOCH_ORDINAL
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def _year(digits: str, bc: str | None) -> int:
    year = int(digits)
    return 1 - year if bc else year


def _parse_date(column: Column) -> Callable[[str], int]:
    def parse(text: str) -> int:
        m = _DATE.fullmatch(text)
        if m is None:
            if text in ("infinity", "-infinity"):
                raise _fail(column, f"date {text} cannot be represented as an Avro date",
                            "replace the infinite date in the source (or change the column to timestamp, "
                            "where ±infinity maps to Long.MAX/MIN)")
            raise _fail(column, "date text is not ISO (YYYY-MM-DD)", "connect with DateStyle=ISO (SESSION_SETTINGS)")
        return days_from_civil(_year(m[1], m[4]), int(m[2]), int(m[3]))
    return parse


def _parse_timestamp(column: Column, with_zone: bool) -> Callable[[str], int]:
    def parse(text: str) -> int:
        m = _TIMESTAMP.fullmatch(text)
        if m is None:
            if text == "infinity":
                return LONG_MAX
            if text == "-infinity":
                return LONG_MIN
            raise _fail(column, "timestamp text is not ISO", "connect with DateStyle=ISO (SESSION_SETTINGS)")
        days = days_from_civil(_year(m[1], m[12]), int(m[2]), int(m[3]))
        seconds = days * 86400 + int(m[4]) * 3600 + int(m[5]) * 60 + int(m[6])
        if m[8]:
            if not with_zone:
                raise _fail(column, "timestamp without time zone has an offset", "report this as a bug")
            offset = int(m[9]) * 3600 + int(m[10] or 0) * 60 + int(m[11] or 0)
            seconds -= offset if m[8] == "+" else -offset
        elif with_zone:
            raise _fail(column, "timestamptz text has no offset", "report this as a bug")
        micros = int(m[7].ljust(6, "0")) if m[7] else 0
        return seconds * 1_000_000 + micros
    return parse


def _parse_time(column: Column) -> Callable[[str], int]:
    def parse(text: str) -> int:
        m = _TIME.fullmatch(text)
        if m is None:
            raise _fail(column, "time text is not HH:MM:SS[.ffffff]", "report this as a bug")
        micros = int(m[4].ljust(6, "0")) if m[4] else 0
        return (int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])) * 1_000_000 + micros
    return parse


_INTERVAL_PART = re.compile(r"([+-]?\d+) (year|mon|day)s?")
_INTERVAL_TIME = re.compile(r"([+-])?(\d+):(\d\d):(\d\d)(?:\.(\d+))?")


def interval_to_iso(text: str) -> str | None:
    """PostgreSQL 'postgres' IntervalStyle text -> ISO-8601 duration (iso_8601 style); None if not that form."""
    if text.startswith("P"):
        return text  # already iso_8601
    parts = {"year": 0, "mon": 0, "day": 0}
    hours = minutes = seconds = 0
    fraction, negative_time = "", False
    for token in re.split(r" (?=[+-]?\d)", text):
        m = _INTERVAL_PART.fullmatch(token)
        if m:
            parts[m[2]] = int(m[1])
            continue
        m = _INTERVAL_TIME.fullmatch(token)
        if m is None:
            return None
        negative_time = m[1] == "-"
        hours, minutes, seconds = int(m[2]), int(m[3]), int(m[4])
        fraction = (m[5] or "").rstrip("0")
    sign = "-" if negative_time else ""
    out = ["P"]
    for value, unit in ((parts["year"], "Y"), (parts["mon"], "M"), (parts["day"], "D")):
        if value:
            out.append(f"{value}{unit}")
    if hours or minutes or seconds or fraction:
        out.append("T")
        if hours:
            out.append(f"{sign}{hours}H")
        if minutes:
            out.append(f"{sign}{minutes}M")
        if seconds or fraction:
            out.append(f"{sign}{seconds}{'.' + fraction if fraction else ''}S")
    return "PT0S" if len(out) == 1 else "".join(out)


def _parse_interval(column: Column) -> Callable[[str], str]:
    def parse(text: str) -> str:
        iso = interval_to_iso(text)
        if iso is None:
            raise _fail(column, "interval text is not in the 'postgres' IntervalStyle",
                        "connect with IntervalStyle=postgres (SESSION_SETTINGS)")
        return iso
    return parse


def _parse_array(text: str, element: Callable[[str], Any], column: Column) -> list:
    """'{a,b,NULL,"x y"}' -> ['a', 'b', None, 'x y'] with element() applied; 1-D only."""
    if text.startswith("["):  # explicit bounds '[0:1]={...}'
        bounds, _, text = text.partition("=")
        if bounds.count("[") > 1:
            raise _multidim(column)
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        raise _fail(column, "array text is not in {...} form", "report this as a bug")
    body = text[1:-1]
    if not body:
        return []
    if body[0] == "{":
        raise _multidim(column)
    if '"' not in body and "\\" not in body:  # fast path: no quoting anywhere
        return [None if item == "NULL" else element(item) for item in body.split(",")]
    items: list = []
    i, n = 0, len(body)
    while True:
        if body[i] == '"':
            buf, i = [], i + 1
            while body[i] != '"':
                if body[i] == "\\":
                    i += 1
                buf.append(body[i])
                i += 1
            i += 1
            items.append(element("".join(buf)))
        else:
            buf, raw = [], True
            while i < n and body[i] != ",":
                if body[i] == "\\":
                    i += 1
                    raw = False
                buf.append(body[i])
                i += 1
            token = "".join(buf).strip()
            items.append(None if raw and token == "NULL" else element(token))
        if i >= n:
            return items
        if body[i] != ",":
            raise _fail(column, "array text is malformed", "report this as a bug")
        i += 1


def _multidim(column: Column) -> ValueConversionError:
    return _fail(column, "multi-dimensional arrays are not supported (only one dimension maps to an Avro array)",
                 "store the value as jsonb or a one-dimensional array")


def _parse_int(column: Column) -> Callable[[str], int]:
    return int


def _parse_float(column: Column) -> Callable[[str], float]:
    return float


_FACTORIES: dict[str, Callable[[Column], Callable[[str], Any]]] = {
    "bool": _parse_bool, "int2": _parse_int, "int4": _parse_int, "int8": _parse_int, "oid": _parse_int,
    "float4": _parse_float, "float8": _parse_float, "money": _parse_money, "bytea": _parse_bytea,
    "date": _parse_date, "timestamp": functools.partial(_parse_timestamp, with_zone=False),
    "timestamptz": functools.partial(_parse_timestamp, with_zone=True), "time": _parse_time,
    "interval": _parse_interval,
}
