"""Errors name table, column and position, never the value (issue 16, point 15): they reach logs and notebooks."""

from __future__ import annotations

from decimal import Decimal

import pytest

from lib.capture import avro_encoder, pgtypes
from lib.capture.catalog import Column, PgType

CANARY = "4929123456789012"  # looks like a card number: it must not appear in any message


def _column(name: str, type_name: str) -> Column:
    pgtype = PgType(oid=0, schema="pg_catalog", name=type_name, kind="base", category="U", typmod=-1)
    return Column(table="shop.payments", name=name, attnum=1, type_name=type_name, type=pgtype, not_null=False)


@pytest.mark.parametrize("type_name, text", [("money", f"{CANARY} EUR"), ("bool", f"x{CANARY}")])
def test_a_value_that_does_not_convert_is_named_by_column_not_by_value(type_name, text):
    convert = pgtypes.converter(_column("card", type_name))
    with pytest.raises(pgtypes.ValueConversionError) as raised:
        convert(text)
    assert "column shop.payments.card" in str(raised.value)
    assert CANARY not in str(raised.value)


@pytest.mark.parametrize("encode, value", [
    (avro_encoder.int_bytes, int(CANARY)), (avro_encoder.long_bytes, int(CANARY + "0000")),
    (avro_encoder.boolean_bytes, CANARY), (avro_encoder.decimal_encoder(14, 2), Decimal(CANARY + ".5")),
    (avro_encoder.decimal_encoder(20, 2), Decimal(CANARY + ".125"))])
def test_an_avro_encoding_error_does_not_quote_the_value(encode, value):
    with pytest.raises(ValueError) as raised:
        encode(value)
    assert CANARY not in str(raised.value)
