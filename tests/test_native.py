"""The compiled hot path (lib/capture/_native.pyx) writes the same Kafka key and value bytes as the Python path.

Every Insert/Update/Delete here is a raw pgoutput payload: the Python path decodes it (lib.capture.pgoutput) and
encodes it (events.encoded_events), the compiled codec takes the payload itself (events.compiled_events). Each
case checks that the compiled codec handled the message (so nothing passes by falling back) and that its
(key, value) pairs equal the Python path's byte for byte; a message the Python path refuses is left to it. The
recordings of every PostgreSQL major (tests/fixtures/pgoutput/pg13..pg18) are replayed through both as well.
No server is needed.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_pgtypes import CITEXT, CONVERSIONS, DOMAIN, ENUM, NUMERIC_14_2, array_of, builtin, numeric_typmod

from lib.capture import events, native
from lib.capture.catalog import Column, PgType, Table
from lib.capture.pgoutput import UNCHANGED_TOAST, Decoder, PgOutputError

FIXTURES = Path(__file__).parent / "fixtures" / "pgoutput"
pytestmark = pytest.mark.skipif(not native.AVAILABLE and os.environ.get("CDC_CAPTURE_COMPILED") == "0",
                                reason="CDC_CAPTURE_COMPILED=0: the compiled module is switched off")


def test_the_compiled_module_is_built():
    assert native.AVAILABLE, f"{native.REASON}: run make install (it needs Cython and a C compiler)"


def test_compiled_off_selects_the_python_path():
    code = "from lib.capture import native; print(native.AVAILABLE, native.REASON)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CDC_CAPTURE_COMPILED": "0"},
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]).stdout
    assert out.startswith("False pure Python (CDC_CAPTURE_COMPILED=0)")


def test_a_build_without_a_compiler_goes_on_without_the_module(tmp_path):
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], env={**os.environ, "CC": str(tmp_path / "no-cc")},
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert "the compiled capture (lib/capture/_native.pyx) is not built" in done.stderr
    assert "runs its pure-Python path" in done.stderr
    assert not list(tmp_path.glob("lib/**/*.so"))


# ---------------------------------------------------------------------------------------------
# payloads


def tuple_data(values) -> bytes:
    out = [struct.pack(">h", len(values))]
    for v in values:
        if v is None:
            out.append(b"n")
        elif v is UNCHANGED_TOAST:
            out.append(b"u")
        else:
            raw = v if isinstance(v, bytes) else v.encode()
            out.append(b"t" + struct.pack(">i", len(raw)) + raw)
    return b"".join(out)


def insert(new, oid=1) -> bytes:
    return b"I" + struct.pack(">I", oid) + b"N" + tuple_data(new)


def update(new, old=None, old_kind=b"K", oid=1) -> bytes:
    before = old_kind + tuple_data(old) if old is not None else b""
    return b"U" + struct.pack(">I", oid) + before + b"N" + tuple_data(new)


def delete(old, old_kind=b"K", oid=1) -> bytes:
    return b"D" + struct.pack(">I", oid) + old_kind + tuple_data(old)


def streamed(payload: bytes, xid: int = 777) -> bytes:
    """The same change inside a stream block (protocol 2 and later): the xid follows the kind byte."""
    return payload[:1] + struct.pack(">I", xid) + payload[1:]


TX = [events.Tx(0x16_B374_D848, 742, 1_700_000_000_123, None, 1_800_000_000_456),
      events.Tx(0x17_0000_0010, 743, 1_700_000_000_999, 0x16_B374_D848, 1_800_000_000_999)]


def python_path(plan, payload, lsn, tx, serial, pos=1):
    decoder = Decoder()
    decoder.in_stream = pos == 5
    return events.encoded_events(plan, decoder.decode(payload), lsn, tx, serial)


def check(plan, payload, lsn=0x16_B374_D900, tx=TX[0], serial=0, pos=1) -> int:
    """Compiled == Python for one message (the compiled codec must take it); the number of pairs."""
    expected = python_path(plan, payload, lsn, tx, serial, pos)
    got = events.compiled_events(plan, payload, pos, lsn, tx, serial)
    assert got is not None, "the compiled codec left a well-formed change to the Python path"
    assert got == expected
    return len(got[0])


def refused(plan, payload, pos=1) -> None:
    """The Python path refuses the message (naming the problem) and the compiled codec leaves it to it."""
    with pytest.raises((events.EventError, PgOutputError, ValueError, TypeError, AttributeError, KeyError,
                        OverflowError)):
        python_path(plan, payload, 5000, TX[0], 0, pos)
    assert events.compiled_events(plan, payload, pos, 5000, TX[0], 0) is None


# ---------------------------------------------------------------------------------------------
# a table with every mapped type


def column(name, pgtype, not_null=False, toastable=None, attnum=1) -> Column:
    t = builtin(pgtype) if isinstance(pgtype, str) else pgtype
    variable = t.kind == "array" or t.resolved().name in ("text", "varchar", "bpchar", "numeric", "bytea", "jsonb",
                                                          "json", "xml", "citext")
    return Column(table="bank.t", name=name, attnum=attnum, type_name=t.name, type=t, not_null=not_null,
                  toastable=variable if toastable is None else toastable)


def table_of(columns, key=("id",), identity="d", name="t") -> Table:
    numbered = tuple(Column(table=f"bank.{name}", name=c.name, attnum=i, type_name=c.type_name, type=c.type,
                            not_null=c.not_null, toastable=c.toastable) for i, c in enumerate(columns, 1))
    return Table(schema="bank", name=name, oid=1, columns=numbered, primary_key=tuple(key), replica_identity=identity)


def planned(table, unknown_types="error"):
    plan = events.plan(table, "cdc.check", "bank", unknown_types)
    plan.set_ids(11, 12)
    assert plan.codec is not None, "no compiled codec for the table"
    return plan


def type_key(pgtype) -> str:
    return pgtype if isinstance(pgtype, str) else repr(pgtype)


BY_TYPE: dict[str, tuple] = {}
for _pgtype, _text, _value, _read in CONVERSIONS:
    BY_TYPE.setdefault(type_key(_pgtype), (_pgtype, []))[1].append(_text)
EXTRA = {  # more texts per type: limits, every fraction length, forms the compiled code leaves to the converter
    "int2": ["32767", "0", "-1"], "int4": ["-2147483648", "64", "-65", "8191", "-8193"],
    "int8": ["9223372036854775807", "1099511627776", "-1099511627777"],
    "float4": ["3.4028235e+38", "-0", "NaN", "1.17549435e-38", "0.1"],
    "float8": ["NaN", "-0", "4.9e-324", "1.7976931348623157e+308", "0.30000000000000004", "123456789012345680000"],
    "date": ["2000-02-29", "1900-03-01", "9999-12-31", "0044-03-15 BC", "12345-01-01", "1582-10-04"],
    "timestamp": ["2024-01-02 03:04:05", "2024-01-02 03:04:05.1", "2024-01-02 03:04:05.12",
                  "2024-01-02 03:04:05.123", "2024-01-02 03:04:05.1234", "2024-01-02 03:04:05.12345",
                  "0001-01-01 00:00:00", "infinity", "-infinity", "0044-03-15 12:00:00 BC",
                  "1969-12-31 23:59:59.999999"],
    "timestamptz": ["2024-02-29 23:59:59.999999+00", "1970-01-01 00:00:00+00", "infinity",
                    "2024-01-02 03:04:05-03:30", "10000-01-01 00:00:00+00"],
    "time": ["24:00:00", "23:59:59.999999", "12:00:00.5"],
    "bytea": ["\\xDEADbeef", "\\x00"],
    "bool": [],
}
NUMERIC_38 = builtin("numeric", numeric_typmod(38, 4))
NUMERIC_60 = builtin("numeric", numeric_typmod(60, 10))
MORE_TYPES = [
    (NUMERIC_38, ["9999999999999999999999999999999999.9999", "-9999999999999999999999999999999999.9999", "0",
                  "-0.0001", "1", "-1", "127", "128", "-128", "-129", "32768", "-32768", "0.5", "12.3"]),
    (NUMERIC_60, ["12345678901234567890123456789012345678901234567890.0123456789", "-1.5", "0.0000000001"]),
    (NUMERIC_14_2, ["0.01", "-0.01", "100.50", "-100", "0.1", "99999999.99", "-0.00"]),
    (array_of(builtin("text", category="S")), ["{}", "{NULL}", "{a}", "{a,,b}", "{ünï,cödé}", '{"a,b",c}',
                                               '{"with \\"quote\\""}', "{NULLS,null,NULL}", "[1:2]={x,y}"]),
    (array_of(builtin("varchar", category="S")), ["{x,y}"]),
    (array_of(builtin("int8")), ["{1,NULL,-3}"]),
    (builtin("interval"), ["00:00:00", "-1 days +02:03:04.5"]),
    (builtin("timetz"), ["10:11:12.5+01"]),
    (builtin("money"), ["$12.00"]),
    (ENUM, ["pending"]), (DOMAIN, ["1.00", "-99999999.99"]), (CITEXT, ["ÀÉ"]),
]


def wide_table():
    """id bigint key, a NOT NULL timestamptz and text, then a nullable column per type; texts per column."""
    columns = [column("id", "int8", not_null=True), column("at", "timestamptz", not_null=True),
               column("label", "text", not_null=True, toastable=True)]
    texts = [None, None, None]
    kinds = [(pgtype, values + EXTRA.get(type_key(pgtype), [])) for pgtype, values in BY_TYPE.values()]
    for i, (pgtype, values) in enumerate(kinds + MORE_TYPES):
        columns.append(column(f"c{i}", pgtype))
        texts.append(values)
    return table_of(columns), texts


def rows(texts, count):
    """count rows cycling through every column's texts (and NULLs), keys 1..count."""
    out = []
    for r in range(count):
        row = [str(r + 1), f"2024-05-27 08:27:17.{r:06d}+00", f"label {r} ✓"]
        for values in texts[3:]:
            pick = r % (len(values) + 1)
            row.append(values[pick] if pick < len(values) else None)
        out.append(row)
    return out


def test_every_type_and_every_event_kind_gives_the_same_bytes():
    table, texts = wide_table()
    plan = planned(table)
    all_rows = rows(texts, 90)
    pairs = 0
    for r, row in enumerate(all_rows):
        other = all_rows[(r + 1) % len(all_rows)]
        key_only = [other[0]] + [None] * (len(row) - 1)
        toasted = [UNCHANGED_TOAST if i == 2 or (i > 3 and i % 5 == 0 and table.columns[i].toastable) else v
                   for i, v in enumerate(row)]
        tx, serial, lsn = TX[r % 2], r, 0x16_B374_D848 + r * 100
        for payload in (insert(row), update(row), update(toasted), update(row, key_only), update(row, other, b"O"),
                        update(toasted, [row[0]] + [None] * (len(row) - 1)), update(row, row, b"O"),
                        delete(key_only), delete(row, b"O")):
            pairs += check(plan, payload, lsn, tx, serial)
            pairs += check(plan, streamed(payload), lsn, tx, serial, pos=5)
    assert pairs > 2000


def test_values_the_python_path_refuses_are_left_to_it():
    table = table_of([column("id", "int4", not_null=True), column("d", "date"), column("n", NUMERIC_14_2),
                      column("f", "float4"), column("b", "bool"), column("t", "text", not_null=True, toastable=False)],
                     identity="f")  # t is then never null in Avro
    plan = planned(table)
    good = ["1", "2024-01-01", "1.00", "1.5", "t", "x"]
    check(plan, insert(good))
    for i, bad in ((1, "infinity"), (2, "NaN"), (2, "1.005"), (2, "1234567890123.45"), (3, "1e+39"), (4, "x"),
                   (0, "2147483648"), (0, "12a")):
        refused(plan, insert(good[:i] + [bad] + good[i + 1:]))
    refused(plan, insert([None] + good[1:]))  # a NULL key
    refused(plan, insert(good[:5] + [None]))  # NULL in a column that is never null in Avro
    refused(plan, update(good[:5] + [UNCHANGED_TOAST]))
    refused(plan, insert(good[:5] + [b"\xff\xfe"]))  # not UTF-8
    refused(plan, insert(good[:5]))  # a column short
    payload = insert(good)
    for cut in range(5, len(payload)):  # every truncation, and trailing bytes
        refused(plan, payload[:cut])
    refused(plan, payload + b"\x00")
    refused(plan, b"U" + payload[1:5] + b"X" + payload[6:])


def test_a_primary_key_change_is_a_delete_a_tombstone_and_a_create():
    table = table_of([column("id", "int4", not_null=True), column("region", "text", not_null=True, toastable=False),
                      column("v", "text")], key=("region", "id"))
    plan = planned(table)
    assert check(plan, update(["2", "eu", "x"], ["1", "eu", None])) == 3
    assert check(plan, update(["1", "us", UNCHANGED_TOAST], ["1", "eu", None], b"O")) == 3
    assert check(plan, update(["1", "eu", "y"], ["1", "eu", None])) == 1
    assert check(plan, delete(["7", "eu", None])) == 2


def test_float_keys_leave_key_comparisons_to_the_python_path():
    plan = planned(table_of([column("id", "float8", not_null=True), column("v", "text")]))
    check(plan, insert(["-0", "a"]))
    check(plan, delete(["0", None]))
    assert events.compiled_events(plan, update(["-0", "b"], ["0", None]), 1, 5000, TX[0], 0) is None


def test_plans_the_codec_does_not_take():
    table, _ = wide_table()
    plan = events.plan(table, "cdc.check", "bank")
    plan.set_ids(11, 12, 13, (0,))  # a widened key: two key schema ids
    assert plan.codec is None
    point = table_of([column("id", "int4", not_null=True), column("p", builtin("point", category="G"))])
    plan = planned(point, unknown_types="string")
    check(plan, insert(["1", "(1,2)"]))


# ---------------------------------------------------------------------------------------------
# every major's recordings


OIDS = {20: builtin("int8"), 23: builtin("int4"), 25: builtin("text", category="S"),
        1082: builtin("date"), 1042: builtin("bpchar", category="S")}


def _pgtype(rc, types) -> PgType:
    if rc.type_oid == 1700:
        return builtin("numeric", rc.type_modifier)
    if rc.type_oid == 1015:
        return array_of(builtin("varchar", rc.type_modifier, category="S"))
    if rc.type_oid in types:
        return PgType(oid=rc.type_oid, schema="rec", name=types[rc.type_oid], kind="enum", labels=("ok", "sad"))
    return OIDS[rc.type_oid]


@pytest.mark.parametrize("folder", ["", "pg13", "pg14", "pg15", "pg16", "pg17", "pg18"])
def test_every_major_recording_gives_the_same_bytes(folder):
    checked = 0
    for path in sorted((FIXTURES / folder).glob("*.jsonl")):
        decoder, plans, types, tx, serial = Decoder(), {}, {}, TX[0], 0
        for line in path.read_text().splitlines()[1:]:
            record = json.loads(line)
            payload = base64.b64decode(record["payload"])
            in_stream = decoder.in_stream
            m = decoder.decode(payload)
            if m.kind == "Y":
                types[m.type_oid] = m.name
            elif m.kind == "R":
                columns = [column(rc.name, _pgtype(rc, types), not_null=rc.name in ("id", "entry"))
                           for rc in m.columns]
                plans[m.relation_oid] = planned(table_of(columns, key=(m.columns[0].name,),
                                                         identity=m.replica_identity, name=m.name))
            elif m.kind in "IUD" and m.relation_oid in plans:  # (else its Relation was sent before the recording)
                checked += check(plans[m.relation_oid], payload, record["data_start"] or 1, tx, serial,
                                 pos=5 if in_stream else 1)
                serial += 1
    assert checked >= 10
