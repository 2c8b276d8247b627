"""The capture's fast paths give exactly what the plain code gives: Avro varints and date/time converters."""

from __future__ import annotations

import random

import pytest

from lib.capture import avro_encoder, events, pgtypes
from lib.capture.catalog import Column, PgType


def reference_long(n: int) -> bytes:
    """Avro long, written out the textbook way: zig-zag, then 7 bits per byte, low first."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def test_long_matches_the_reference_encoding():
    rng = random.Random(7)
    edges = [s * (2**k) + d for k in range(64) for d in (-1, 0, 1) for s in (1, -1)]
    values = [v for v in edges if -(2**63) <= v < 2**63]
    values += [rng.randint(-(2**63), 2**63 - 1) for _ in range(20_000)]
    values += [1_763_833_774_916_462 + rng.randint(0, 10**9) for _ in range(20_000)]  # timestamps in µs
    for value in values + values:  # twice: the second pass hits the cache of high bits
        assert avro_encoder.long_bytes(value) == reference_long(value), value


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_long_refuses_values_outside_64_bits(value):
    with pytest.raises(ValueError, match="does not fit an Avro long"):
        avro_encoder.long_bytes(value)


def column(type_name: str) -> Column:
    pgtype = PgType(oid=0, schema="pg_catalog", name=type_name, kind="base", typmod=-1)
    return Column(table="s.t", name="c", attnum=1, type_name=type_name, type=pgtype, not_null=False,
                  toastable=False)


TIMESTAMPTZ = ["2024-05-27 08:27:17+00", "2024-05-27 08:27:17.5+00", "2024-05-27 08:27:17.123456+00",
               "1999-12-31 23:59:59.999999+00", "0044-03-15 12:00:00+00 BC", "12024-05-27 08:27:17+00",
               "2024-05-27 08:27:17+05:30", "2024-05-27 08:27:17.1234567+00", "infinity", "-infinity", None]
TIMESTAMP = [t.replace("+00", "") if t else t for t in TIMESTAMPTZ] + ["2024-05-27 08:27:17 BC",
                                                                       "2024-05-27 08:27:17.5 BC"]
DATE = ["2024-05-27", "2024-02-29", "0044-03-15 BC", "12024-05-27", "infinity", "-infinity", None]


def outcome(convert, text):
    try:
        return convert(text)
    except Exception as exc:  # noqa: BLE001 - the error type is part of the outcome
        return type(exc)


@pytest.mark.parametrize(("type_name", "texts"), [("timestamptz", TIMESTAMPTZ), ("timestamp", TIMESTAMP),
                                                  ("date", DATE)])
def test_fast_converters_equal_pgtypes(type_name, texts):
    fast, plain = events.fast_converter(column(type_name)), pgtypes.converter(column(type_name))
    for _ in range(2):  # the second pass goes through the caches the first one filled
        for text in texts:
            assert outcome(fast, text) == outcome(plain, text), text
