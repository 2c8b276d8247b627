"""Avro binary encoders generated per schema (a Python function per record type, no per-value dispatch), with fastavro
for what they do not cover, and the Confluent framing in front."""

from __future__ import annotations

import io
import struct
from decimal import Context, Decimal

import fastavro

from lib import schema_registry
from lib.capture import avro_schemas

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


_LAST2 = [bytes(((i & 0x7F) | 0x80, i >> 7)) if i >= 0x80 else b"" for i in range(0x4000)]  # 2 final bytes
_MID2 = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(0x4000)]  # 14 bits, more to come
_HIGH: dict[int, bytes] = {}  # varints of z >> 28: the high bits of times and LSNs stay the same for minutes
_SMALL = [bytes([(n << 1) if n >= 0 else ((-n << 1) - 1)]) for n in range(-64, 64)]  # zig-zag of -64..63
_DECIMAL_CONTEXT = Context(prec=1000)
_MISSING = object()
OP_BYTES = {op: bytes((2,)) + op.encode() for op in avro_schemas.OPS}  # Avro string of each op
_TIME_LOGICAL = ("date", "time-millis", "time-micros", "timestamp-millis", "timestamp-micros",
                 "local-timestamp-millis", "local-timestamp-micros")
_BYTE = [bytes((i,)) for i in range(128)]
SHORT = [None] * 65536  # varints of -32768..32767 (ids, lengths, dates): one list lookup


def long_bytes(n: int) -> bytes:
    """Avro long: zig-zag varint."""
    if -64 <= n < 64:
        return _SMALL[n + 64]
    if not _LONG_MIN <= n <= _LONG_MAX:
        raise ValueError(f"a value of {n.bit_length()} bits does not fit an Avro long")
    z = (n << 1) ^ (n >> 63)
    if z < 0x4000:
        return _LAST2[z]
    if z < 0x10000000:
        high = z >> 14
        return _MID2[z & 0x3FFF] + (_LAST2[high] if high >= 0x80 else _BYTE[high])
    high = z >> 28
    tail = _HIGH.get(high)
    if tail is None:
        parts = []
        rest = high
        while rest >= 0x80:
            parts.append(bytes(((rest & 0x7F) | 0x80,)))
            rest >>= 7
        parts.append(_BYTE[rest])
        if len(_HIGH) >= 4096:
            _HIGH.clear()
        tail = _HIGH[high] = b"".join(parts)
    return _MID2[z & 0x3FFF] + _MID2[(z >> 14) & 0x3FFF] + tail


for _n in range(-32768, 32768):
    SHORT[_n + 32768] = long_bytes(_n)

def string_bytes(s: str) -> bytes:
    """Avro string."""
    b = s.encode()
    return long_bytes(len(b)) + b


def int_bytes(n: int) -> bytes:
    """Avro int: zig-zag varint, 32-bit range."""
    if not _INT_MIN <= n <= _INT_MAX:
        raise ValueError("a value outside the 32-bit range does not fit an Avro int")
    return long_bytes(n)


def boolean_bytes(v) -> bytes:
    if v is True:
        return b"\x01"
    if v is False:
        return b"\x00"
    raise ValueError(f"a {type(v).__name__} is not a boolean")


def decimal_encoder(precision: int, scale: int):
    """Encoder of a Decimal as Avro bytes decimal(precision, scale) (two's complement, big-endian)."""
    def encode(d) -> bytes:
        if not isinstance(d, Decimal):
            return long_bytes(len(d)) + bytes(d)
        sign, digits, exp = d.as_tuple()
        if len(digits) > precision:
            raise ValueError(f"a value of {len(digits)} digits has more than decimal({precision},{scale}) allows")
        if exp + scale < 0:
            raise ValueError(f"a value of {-exp} fraction digits has more than decimal({precision},{scale}) allows")
        n = int(d.scaleb(scale, _DECIMAL_CONTEXT))
        raw = n.to_bytes((abs(n).bit_length() + 8) // 8, "big", signed=True)
        return SHORT[len(raw) + 32768] + raw if len(raw) < 32768 else long_bytes(len(raw)) + raw
    return encode


def _logical(kind: str):
    """datetime/date/time/UUID values -> what the base type writes (fastavro's own conversions)."""
    from fastavro._logical_writers_py import LOGICAL_WRITERS

    prepare = LOGICAL_WRITERS[kind]
    return lambda value: prepare(value, {})


def _null(value) -> None:
    if value is not None:
        raise ValueError(f"{value!r} is not null")


class _Unsupported(Exception):
    """A schema shape the generator leaves to fastavro."""


class _Codegen:
    """Generates `def _rN(r, a)` per record type; `a` appends bytes to the output."""

    def __init__(self) -> None:
        self.scope: dict = {"_S": SHORT, "long_bytes": long_bytes, "int_bytes": int_bytes, "_bool": boolean_bytes,
                            "_null": _null, "_MISSING": _MISSING, "_pd": struct.Struct("<d").pack,
                            "_pf": struct.Struct("<f").pack}
        self.named: dict[str, tuple[str, str]] = {}  # full name -> (kind, python name)
        self.sources: list[str] = []
        self.count = 0

    def const(self, value) -> str:
        name = f"_k{self.count}"
        self.count += 1
        self.scope[name] = value
        return name

    def full_name(self, name: str, namespace: str | None) -> str:
        return name if "." in name or not namespace else f"{namespace}.{name}"

    def record(self, schema: dict, namespace: str | None, by_index: bool = False) -> str:
        """Define the record's function; by_index reads fields from a sequence in field order, not a dict."""
        full = self.full_name(schema["name"], schema.get("namespace", namespace))
        fname = f"_r{len(self.sources)}_{len(self.named)}"
        self.named[full] = ("record", fname)
        ns = full.rsplit(".", 1)[0] if "." in full else None
        # locals are faster than globals
        lines = [f"def {fname}(r, a, _S=_S, long_bytes=long_bytes, int_bytes=int_bytes):"]
        for index, field in enumerate(schema["fields"]):
            name = self.const(field["name"])
            if by_index:
                lines.append(f"    v0 = r[{index}]")
            elif "default" in field:
                lines.append(f"    v0 = r.get({name}, {self.const(field['default'])})")
            else:
                lines.append(f"    v0 = r.get({name}, _MISSING)")
                lines.append("    if v0 is _MISSING:")
                lines.append(f"        raise ValueError('record {full}: field ' + {name} + ' is missing')")
            self.emit(field["type"], ns, "v0", 1, 1, lines)
        if len(lines) == 1:
            lines.append("    pass")
        self.sources.append("\n".join(lines))
        return fname

    def emit(self, schema, namespace: str | None, var: str, depth: int, indent: int, lines: list[str]) -> None:
        """Append statements writing `var` (of type schema) to lines."""
        pad = "    " * indent
        if isinstance(schema, list):
            if len(schema) != 2 or "null" not in schema:
                raise _Unsupported("union other than [null, T]")
            null_index = schema.index("null")
            lines.append(f"{pad}if {var} is None:")
            lines.append(f"{pad}    a({_SMALL[64 + null_index]!r})")
            lines.append(f"{pad}else:")
            lines.append(f"{pad}    a({_SMALL[64 + 1 - null_index]!r})")
            self.emit(schema[1 - null_index], namespace, var, depth, indent + 1, lines)
            return
        if isinstance(schema, str):
            kind, logical, schema_dict = schema, None, None
        else:
            kind, logical, schema_dict = schema["type"], schema.get("logicalType"), schema
        if isinstance(kind, (dict, list)):
            self.emit(kind, namespace, var, depth, indent, lines)
            return
        if kind == "null":
            lines.append(f"{pad}_null({var})")
        elif kind == "boolean":
            lines.append(f"{pad}a(_bool({var}))")
        elif kind in ("int", "long"):
            if logical in _TIME_LOGICAL:
                convert = self.const(_logical(f"{kind}-{logical}"))
                lines.append(f"{pad}if {var}.__class__ is not int:")
                lines.append(f"{pad}    {var} = {convert}({var})")
            slow = "long_bytes" if kind == "long" else "int_bytes"
            lines.append(f"{pad}a(_S[{var} + 32768] if -32768 <= {var} < 32768 else {slow}({var}))")
        elif kind == "float":
            lines.append(f"{pad}a(_pf({var}))")
        elif kind == "double":
            lines.append(f"{pad}a(_pd({var}))")
        elif kind == "string":
            if logical == "uuid":
                lines.append(f"{pad}if {var}.__class__ is not str:")
                lines.append(f"{pad}    {var} = str({var})")
            lines.append(f"{pad}b = {var}.encode()")
            lines.append(f"{pad}n = len(b)")
            lines.append(f"{pad}a(_S[n + 32768] if n < 32768 else long_bytes(n))")
            lines.append(f"{pad}a(b)")
        elif kind == "bytes":
            if logical == "decimal":
                encode = self.const(decimal_encoder(schema_dict["precision"], schema_dict.get("scale", 0)))
                lines.append(f"{pad}a({encode}({var}))")
            else:
                lines.append(f"{pad}n = len({var})")
                lines.append(f"{pad}a(_S[n + 32768] if n < 32768 else long_bytes(n))")
                lines.append(f"{pad}a(bytes({var}))")
        elif kind == "array":
            item = f"v{depth}"
            lines.append(f"{pad}if {var}:")
            lines.append(f"{pad}    n = len({var})")
            lines.append(f"{pad}    a(_S[n + 32768] if n < 32768 else long_bytes(n))")
            lines.append(f"{pad}    for {item} in {var}:")
            self.emit(schema_dict["items"], namespace, item, depth + 1, indent + 2, lines)
            lines.append(f"{pad}a(b'\\x00')")
        elif kind == "map":
            item = f"v{depth}"
            lines.append(f"{pad}if {var}:")
            lines.append(f"{pad}    a(long_bytes(len({var})))")
            lines.append(f"{pad}    for k, {item} in {var}.items():")
            lines.append(f"{pad}        b = k.encode()")
            lines.append(f"{pad}        a(long_bytes(len(b)))")
            lines.append(f"{pad}        a(b)")
            self.emit(schema_dict["values"], namespace, item, depth + 1, indent + 2, lines)
            lines.append(f"{pad}a(b'\\x00')")
        elif kind == "record":
            fname = self.record(schema_dict, namespace)
            lines.append(f"{pad}{fname}({var}, a)")
        elif kind == "enum":
            symbols = self.const({s: long_bytes(i) for i, s in enumerate(schema_dict["symbols"])})
            self.named[self.full_name(schema_dict["name"], schema_dict.get("namespace", namespace))] = ("enum",
                                                                                                        symbols)
            lines.append(f"{pad}a({symbols}[{var}])")
        elif kind == "fixed":
            raise _Unsupported("fixed")
        else:  # a named type
            found = self.named.get(self.full_name(kind, namespace)) or self.named.get(kind)
            if found is None:
                raise _Unsupported(f"unknown type {kind}")
            what, name = found
            lines.append(f"{pad}{name}({var}, a)" if what == "record" else f"{pad}a({name}[{var}])")

    def compile(self, schema, by_index: bool = False):
        """The root writer function (value, append); by_index: a record given as a sequence in field order."""
        lines = ["def _root(v0, a):"]
        if by_index:
            if not isinstance(schema, dict) or schema.get("type") != "record":
                raise ValueError("by_index needs a record schema")
            lines.append(f"    {self.record(schema, None, by_index=True)}(v0, a)")
        else:
            self.emit(schema, None, "v0", 1, 1, lines)
        self.sources.append("\n".join(lines))
        exec(compile("\n\n".join(self.sources), "<avro encoder>", "exec"), self.scope)  # noqa: S102 - our own code
        return self.scope["_root"]


def widened_key(narrow, wide, positions: tuple):
    """Key encoder that frames a key with the first key schema's id while its widened fields fit in an int."""
    def encode(values, _narrow=narrow, _wide=wide, _positions=positions) -> bytes:
        for i in _positions:
            if not -2_147_483_648 <= values[i] <= 2_147_483_647:
                return _wide(values)
        return _narrow(values)
    return encode


def encoder(schema, schema_id: int | None = None, by_index: bool = False):
    """A function record -> bytes: Confluent framing (when schema_id is given) + Avro binary of schema.

    by_index: the (record) value is a sequence of field values in field order instead of a dict.
    """
    prefix = b"" if schema_id is None else schema_registry.confluent_header(schema_id)
    try:
        root = _Codegen().compile(schema, by_index)
    except _Unsupported:
        if by_index:
            names = [f["name"] for f in schema["fields"]]
            generic = encoder(schema, schema_id)
            return lambda values: generic(dict(zip(names, values, strict=True)))
        parsed = fastavro.parse_schema(schema)

        def generic(record) -> bytes:
            out = io.BytesIO()
            out.write(prefix)
            fastavro.schemaless_writer(out, parsed, record)
            return out.getvalue()
        return generic

    def encode(record, _root=root, _prefix=prefix) -> bytes:
        out = [_prefix]
        _root(record, out.append)
        return b"".join(out)
    return encode
