"""The compiled hot path (lib/capture/_native.pyx) when it is built, else None: its callers keep the Python path.

``make install`` builds it; a wheel built with CDC_PURE_PYTHON=1 (the Databricks bundle), a machine without a C
compiler, or CDC_CAPTURE_COMPILED=0 in the environment runs the pure-Python capture, which writes the same bytes
(tests/test_native.py). ``row_codec(plan)`` gives a plan's compiled encoder, or None for a table shape it leaves
to the Python path; ``copy_reader(connection, functions)`` reads the COPY stream in batches.
"""

from __future__ import annotations

import ctypes
import functools
import os

from lib import schema_registry
from lib.capture import avro_encoder, avro_schemas, pgtypes

try:
    from lib.capture import _native
    REASON = "compiled (lib/capture/_native.pyx)"
except ImportError as exc:  # not built: a pure wheel, no compiler, or a checkout before `make install`
    _native = None
    REASON = (f"pure Python (the compiled module is not built: {exc}; make install builds it with Cython and a C "
              f"compiler, e.g. apt-get install gcc python3-dev)")
if _native is not None and os.environ.get("CDC_CAPTURE_COMPILED", "1") == "0":
    _native = None
    REASON = "pure Python (CDC_CAPTURE_COMPILED=0)"

AVAILABLE = _native is not None

# column codes of _native.pyx
GENERIC, STRING, BOOL, INT, LONG, FLOAT, DOUBLE, DATE, TIMESTAMP, TIMESTAMPTZ, TIME, DECIMAL, BYTEA, TEXT_ARRAY = \
    range(14)
_LOGICAL = {("date", "int", "date"): DATE, ("timestamp", "long", "local-timestamp-micros"): TIMESTAMP,
            ("timestamptz", "long", "timestamp-micros"): TIMESTAMPTZ, ("time", "long", "time-micros"): TIME}
_TEXT_ARRAY = {"type": "array", "items": ["null", "string"]}


def _base(avro):
    """(non-null type, nullable) of a field type."""
    if isinstance(avro, list):
        return avro[1], True
    return avro, False


def column_code(column, convert, avro) -> tuple[int, int, int]:
    """(code, precision, scale) telling _native.pyx how to write a column's text; GENERIC calls convert and an
    encoder generated from avro (the field's non-null type)."""
    t = column.type.resolved()
    builtin = t.schema == "pg_catalog" and t.kind == "base"
    name = avro if isinstance(avro, str) else avro.get("type") if isinstance(avro, dict) else None
    if convert is None:
        return (STRING, 0, 0) if name == "string" else (GENERIC, 0, 0)
    if convert is int and avro in ("int", "long"):
        return (INT if avro == "int" else LONG), 0, 0
    if convert is float and avro in ("float", "double"):
        return (FLOAT if avro == "float" else DOUBLE), 0, 0
    if isinstance(convert, functools.partial):
        if (convert.func is pgtypes._parse_decimal and isinstance(avro, dict)
                and avro.get("logicalType") == "decimal" and name == "bytes"):
            return DECIMAL, int(avro["precision"]), int(avro.get("scale", 0))
        if convert.func is pgtypes._parse_array and convert.keywords.get("element") is pgtypes.text_as_is \
                and avro == _TEXT_ARRAY:
            return TEXT_ARRAY, 0, 0
        return GENERIC, 0, 0
    if not builtin:
        return GENERIC, 0, 0
    if t.name == "bool" and avro == "boolean":
        return BOOL, 0, 0
    if t.name == "bytea" and avro == "bytes":
        return BYTEA, 0, 0
    if isinstance(avro, dict):
        code = _LOGICAL.get((t.name, name, avro.get("logicalType")))
        if code is not None and set(avro) == {"type", "logicalType"}:
            return code, 0, 0
    return GENERIC, 0, 0


def row_codec(plan):
    """The compiled encoder of a plan whose ids are set, or None (not built, or a shape left to Python)."""
    if _native is None or not plan._fast or plan.key_id is None:
        return None
    value = avro_schemas.value_record(plan.value_schema)["fields"]
    key_fields = plan.key_schema["fields"]
    if len(value) != plan.ncols or tuple(f["name"] for f in key_fields) != plan.key_names:
        return None
    codes, nullable, precision, scale, encoders = [], [], [], [], []
    for field, column, convert in zip(value, plan.columns, plan.convs, strict=True):
        base, optional = _base(field["type"])
        code, p, s = column_code(column, convert, base)
        codes.append(code)
        nullable.append(optional)
        precision.append(p)
        scale.append(s)
        encoders.append(avro_encoder.encoder(base))  # also for the forms a fast code leaves to the converter
    for field, i in zip(key_fields, plan.key_index, strict=True):
        if field["type"] != _base(value[i]["type"])[0]:
            return None  # the key's bytes would not be the value's
    float_key = any(codes[i] in (FLOAT, DOUBLE) or _has_float(_base(value[i]["type"])[0]) for i in plan.key_index)
    names = [avro_encoder.string_bytes(name) for name in plan.names]
    return _native.RowCodec(codes, nullable, precision, scale, plan.convs, encoders, names, plan.key_index,
                            float_key, schema_registry.confluent_header(plan.key_id),
                            schema_registry.confluent_header(plan.value_id))


def _has_float(avro) -> bool:
    return "float" in repr(avro) or "double" in repr(avro)


def copy_reader(connection, libpq: ctypes.CDLL):
    """A batch reader of the replication connection's COPY stream through libpq's own functions, or None."""
    if _native is None:
        return None
    address = functools.partial(ctypes.cast, typ=ctypes.c_void_p)
    return _native.CopyReader(connection.pgconn_ptr, address(libpq.PQgetCopyData).value,
                              address(libpq.PQfreemem).value, address(libpq.PQconsumeInput).value)
