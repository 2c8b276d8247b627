"""The bronze log holds every table's rows side by side: a file with rows of several tables (a micro-batch's
file, or any file after OPTIMIZE) reads back per table in that table's types."""

from __future__ import annotations

import datetime
from decimal import Decimal

from pyspark.sql import functions as F
from pyspark.sql import types as T

from lib.lake import bronze_log

A_KEY = T.StructType([T.StructField("id", T.IntegerType())])
A_ROW = T.StructType([T.StructField("id", T.IntegerType()), T.StructField("name", T.StringType())])
B_KEY = T.StructType([T.StructField("code", T.StringType(), nullable=False)])  # a primary key: never null
B_ROW = T.StructType([T.StructField("code", T.StringType(), nullable=False),
                      T.StructField("amount", T.DecimalType(12, 2)), T.StructField("seen", T.TimestampType())])


def _rows(spark, table, key_type, row_type, keys, afters, seq):
    """Log rows of one table (op 'c', positions 1, 2, ...) in the log's layout."""
    frame = spark.createDataFrame([(k, a, i + 1) for i, (k, a) in enumerate(zip(keys, afters, strict=True))],
                                  T.StructType([T.StructField("k", key_type), T.StructField("a", row_type),
                                                T.StructField("lsn", T.LongType())]))
    typed = {"_table": F.lit(table), "key": F.to_variant_object("k"), "op": F.lit("c"),
             "before": F.lit(None).cast("variant"), "after": F.to_variant_object("a"),
             "source": F.struct(*[(F.col("lsn") if f.name == "commit_lsn" else F.lit(None)).cast(f.dataType)
                                  .alias(f.name) for f in bronze_log.SCHEMA["source"].dataType.fields]),
             "_tombstone": F.lit(False), "_seq": F.lit(seq).cast("long")}
    return frame.select(*[typed[f.name].cast(f.dataType).alias(f.name) if f.name in typed
                          else F.lit(None).cast(f.dataType).alias(f.name) for f in bronze_log.SCHEMA.fields])


def test_a_file_holding_two_tables_reads_back_each_in_its_own_types(spark_session, tmp_path):
    spark, path = spark_session, str(tmp_path / "bronze")
    bronze_log.ensure(spark, path)
    a = _rows(spark, "shop.a", A_KEY, A_ROW, [{"id": 1}, {"id": 2}], [{"id": 1, "name": "x"}, {"id": 2, "name": None}],
              0)
    b = _rows(spark, "shop.b", B_KEY, B_ROW, [{"code": "k1"}],
              [{"code": "k1", "amount": Decimal("12.30"), "seen": datetime.datetime(2024, 1, 2, 3, 4, 5)}], 0)
    a.union(b).coalesce(1).write.format("delta").mode("append").save(path)
    assert len(spark.read.format("delta").load(path).inputFiles()) == 1  # both tables in one file

    got_a = bronze_log.events(spark, path, "shop.a", -1, 0, A_KEY, A_ROW).orderBy("__key.id").collect()
    got_b = bronze_log.events(spark, path, "shop.b", -1, 0, B_KEY, B_ROW).collect()  # every column, before too

    assert [(r["__key"]["id"], r["__env"]["after"]["name"]) for r in got_a] == [(1, "x"), (2, None)]
    assert [(r["__key"]["code"], str(r["__env"]["after"]["amount"]), str(r["__env"]["after"]["seen"]))
            for r in got_b] == [("k1", "12.30", "2024-01-02 03:04:05")]
