"""Reconcile's canonical form as Spark SQL text: the values both sides are hashed in (no running service needed)."""

from __future__ import annotations

import datetime as dt

from pyspark.sql import types as T

from lib.lake import reconcile

EPOCH = dt.datetime(1970, 1, 1)


def micros(value: dt.datetime) -> int:
    """Microseconds since 1970-01-01 of a wall-clock time read as UTC."""
    delta = value - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def test_dates_timestamps_and_arrays_of_them_take_their_canonical_values(spark_session):
    day, wall = dt.date(2024, 3, 1), dt.datetime(2024, 3, 1, 12, 34, 56, 789012)
    before_epoch = dt.datetime(1969, 12, 31, 23, 59, 59, 500000)
    schema = T.StructType([T.StructField("d", T.DateType()), T.StructField("ntz", T.TimestampNTZType()),
                           T.StructField("old", T.TimestampNTZType()), T.StructField("ts", T.TimestampType()),
                           T.StructField("days", T.ArrayType(T.DateType())),
                           T.StructField("grid", T.ArrayType(T.ArrayType(T.TimestampNTZType()))),
                           T.StructField("n", T.DecimalType(12, 2))])
    frame = spark_session.createDataFrame(
        [(day, wall, before_epoch, dt.datetime(2024, 3, 1, 12, 0, tzinfo=dt.timezone.utc), [day, None],
          [[wall], [before_epoch, None]], None)], schema)
    row = frame.selectExpr(*[f"{reconcile.canonical(f.name, f.dataType)} AS {f.name}" for f in schema.fields]).first()
    days = (day - EPOCH.date()).days
    assert row.asDict() == {"d": days, "ntz": micros(wall), "old": micros(before_epoch),
                            "ts": micros(dt.datetime(2024, 3, 1, 12, 0)), "days": [days, None],
                            "grid": [[micros(wall)], [micros(before_epoch), None]], "n": None}
    assert dict(frame.selectExpr(*[f"{reconcile.canonical(f.name, f.dataType)} AS {f.name}"
                                   for f in schema.fields]).dtypes) == {
        "d": "int", "ntz": "bigint", "old": "bigint", "ts": "bigint", "days": "array<int>",
        "grid": "array<array<bigint>>", "n": "decimal(12,2)"}


def test_a_cast_names_every_type_spark_sql_reads_back_struct_fields_in_backticks(spark_session):
    dtype = T.StructType([T.StructField("odd name`", T.ArrayType(T.DecimalType(10, 3))),
                          T.StructField("m", T.MapType(T.StringType(), T.LongType()))])
    assert reconcile.type_sql(dtype) == "struct<`odd name```:array<decimal(10,3)>,`m`:map<string,bigint>>"
    cast = spark_session.sql(f"SELECT CAST(NULL AS {reconcile.type_sql(dtype)}) AS v")
    assert cast.schema["v"].dataType == dtype
