"""Benchmark: silver MERGE rows/s against a plain Delta append of the same decoded rows (not a test).

    .venv/bin/python bench/merge_bench.py [--events 200000] [--keys 100000] [--batches 2]

Synthetic events (Confluent-framed Avro, the Debezium envelope of a 6-column table, keys drawn
from --keys) are encoded in Spark (to_avro), written once to parquet, then split into --batches
micro-batches. Each batch is decoded with lib.lake.merge (cached), then timed on the same rows: a plain
append of the decoded rows to a Delta table, the silver path (dedup per key + the one MERGE), and,
for reference, the plainest Delta MERGE of the same rows (dropDuplicates on the key, then
updateAll/insertAll, no ordering, no tombstones). The three Delta tables are created, empty, before
any timing. Needs the local stack's registry (`make up`); the lake goes to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid

from delta.tables import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import to_avro

from lib import config, schema_registry
from lib import spark as spark_session
from lib.capture import avro_schemas
from lib.capture.catalog import Column, PgType, Table
from lib.lake import decode, delta_io, lake_paths, silver_table, writer_schemas


def bench_table() -> Table:
    """bench.items: id bigint PK, name text, amount numeric(14,2), updated timestamptz, qty int, note text."""
    def pgtype(name, typmod=-1):
        return PgType(oid=0, schema="pg_catalog", name=name, kind="base", typmod=typmod)
    spec = [("id", "int8", -1, "bigint"), ("name", "text", -1, "text"),
            ("amount", "numeric", ((14 << 16) | 2) + 4, "numeric(14,2)"),
            ("updated", "timestamptz", -1, "timestamp with time zone"), ("qty", "int4", -1, "integer"),
            ("note", "text", -1, "text")]
    cols = tuple(Column(table="bench.items", name=n, attnum=i, type_name=tn, type=pgtype(t, mod), not_null=n == "id",
                        toastable=t in ("text", "numeric")) for i, (n, t, mod, tn) in enumerate(spec, start=1))
    return Table(schema="bench", name="items", oid=0, columns=cols, primary_key=("id",), replica_identity="d")


def make_input(spark, path: str, events: int, keys: int, topic: str, value_schema: dict, value_id: int,
               key_schema: dict, key_id: int) -> None:
    """Kafka-shaped rows (key, value, topic, partition, offset, timestamp) for `events` events, to parquet."""
    k = (F.pmod(F.xxhash64("id"), F.lit(keys)) + 1).cast("long")
    after = F.struct(k.alias("id"), F.concat(F.lit("name "), F.col("id").cast("string")).alias("name"),
                     (F.col("id") % 100000 / 100).cast("decimal(14,2)").alias("amount"),
                     F.timestamp_micros(F.lit(1_700_000_000_000_000) + F.col("id")).alias("updated"),
                     (F.col("id") % 1000).cast("int").alias("qty"), F.lit("a note").alias("note"))
    row_type = "struct<id:bigint,name:string,amount:decimal(14,2),updated:timestamp,qty:int,note:string>"
    source = F.struct(F.lit("bench").alias("version"), F.lit("postgresql").alias("connector"),
                      F.lit("bench").alias("name"), (F.lit(1_700_000_000_000) + F.col("id")).alias("ts_ms"),
                      F.lit("false").alias("snapshot"), F.lit("bench").alias("db"),
                      F.lit(None).cast("string").alias("sequence"), F.lit("bench").alias("schema"),
                      F.lit("items").alias("table"), F.lit(None).cast("long").alias("txId"),
                      (F.lit(1000) + F.col("id")).alias("lsn"), F.lit(None).cast("long").alias("xmin"),
                      (F.lit(1000) + F.col("id")).alias("commit_lsn"), F.lit(0).cast("long").alias("event_serial"))
    envelope = F.struct(F.lit(None).cast(row_type).alias("before"), after.alias("after"), source.alias("source"),
                        F.lit("u").alias("op"), F.lit(None).cast("long").alias("ts_ms"),
                        F.lit(None).cast("struct<id:string,total_order:bigint,data_collection_order:bigint>")
                        .alias("transaction"), F.array().cast("array<string>").alias("unchanged_cols"))

    def framed(schema_id, body):
        return F.concat(F.unhex(F.lit(f"00{schema_id:08x}")), body)

    spark.range(events).select(
        framed(key_id, to_avro(F.struct(k.alias("id")), json.dumps(key_schema))).alias("key"),
        framed(value_id, to_avro(envelope, json.dumps(value_schema))).alias("value"),
        F.lit(topic).alias("topic"), F.pmod(k, F.lit(3)).cast("int").alias("partition"), F.col("id").alias("offset"),
        F.current_timestamp().alias("timestamp")).write.mode("overwrite").parquet(path)


def main(argv=None) -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args(argv)
    lake = tempfile.mkdtemp(prefix="merge_bench_")
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    conf = config.apply_overrides(config.load("local"), {
        "CDC__KAFKA__TOPIC_PREFIX": prefix, "CDC__LAKE__ROOT": lake, "CDC__SOURCE__TABLES": "[bench.items]",
        "CDC__SPARK__SETTINGS__SPARK.UI.SHOWCONSOLEPROGRESS": "false"})
    spark = spark_session.from_conf(conf)
    spark.sparkContext.setLogLevel("ERROR")
    table = bench_table()
    registry = schema_registry.client(conf)
    spec = lake_paths.table_specs(conf)[0]
    key_subject, value_subject = schema_registry.subjects(spec.topic)
    value_schema, key_schema = avro_schemas.value_schema(table, prefix), avro_schemas.key_schema(table, prefix)
    value_id = schema_registry.register(registry, value_subject, value_schema)[0]
    key_id = schema_registry.register(registry, key_subject, key_schema)[0]
    source_path = os.path.join(lake, "_input")
    began = time.monotonic()
    make_input(spark, source_path, args.events, args.keys, spec.topic, value_schema, value_id, key_schema, key_id)
    print(f"input: {args.events} events over {args.keys} keys encoded in {time.monotonic() - began:.1f} s")
    schemas = writer_schemas.Schemas(conf, registry)
    layout = writer_schemas.table_layout(spark, schemas, spec, {value_id}, {key_id})
    raw = spark.read.parquet(source_path)
    per_batch = -(-args.events // args.batches)
    totals = {"append": 0.0, "merge": 0.0, "plain": 0.0, "rows": 0}
    append_path, silver = os.path.join(lake, "append"), lake_paths.silver_path(conf, spec)
    plain_path = os.path.join(lake, "plain_merge")
    # the three tables exist before the clock starts: creating one is a one-time cost, not rows/s
    ready = {}
    delta_io.ensure_table(spark, silver, silver_table.silver_schema(layout), ["id", *lake_paths.META_COLUMNS])
    empty = spark.createDataFrame([], layout.row)
    empty.write.format("delta").save(append_path)
    empty.write.format("delta").save(plain_path)
    for batch in range(args.batches):
        rows = raw.filter((F.col("offset") >= batch * per_batch) & (F.col("offset") < (batch + 1) * per_batch))
        decoded = decode.decode(decode.headers(rows), spark, schemas, layout, batch).persist()
        n = decoded.count()
        plain = decoded.filter(F.col("__reason").isNull()).select("__env.after.*")
        began = time.monotonic()
        plain.write.format("delta").mode("append").save(append_path)
        append_s = time.monotonic() - began
        began = time.monotonic()
        source = silver_table.merge_source(decoded, layout, None, toast=False)
        silver_table.merge_silver(spark, silver, spec, layout, source, None, batch, ready)
        merge_s = time.monotonic() - began
        began = time.monotonic()
        latest = plain.dropDuplicates(["id"])
        DeltaTable.forPath(spark, plain_path).alias("t").merge(latest.alias("s"), "t.id = s.id") \
            .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
        plain_s = time.monotonic() - began
        decoded.unpersist()
        totals["append"] += append_s
        totals["merge"] += merge_s
        totals["plain"] += plain_s
        totals["rows"] += n
        print(f"batch {batch}: {n} events  append {append_s:.1f} s ({n / append_s:,.0f} rows/s)  "
              f"silver merge {merge_s:.1f} s ({n / merge_s:,.0f} rows/s, {append_s / merge_s:.2f}x append)  "
              f"plain merge {plain_s:.1f} s ({n / plain_s:,.0f} rows/s, {append_s / plain_s:.2f}x append)")
    live = spark.read.format("delta").load(silver).count()
    print(f"total: {totals['rows']} events -> {live} silver rows; append {totals['rows'] / totals['append']:,.0f} "
          f"rows/s, silver merge {totals['rows'] / totals['merge']:,.0f} rows/s "
          f"({totals['append'] / totals['merge']:.2f}x append), plain merge {totals['rows'] / totals['plain']:,.0f} "
          f"rows/s ({totals['append'] / totals['plain']:.2f}x append); load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores")
    spark.stop()
    shutil.rmtree(lake, ignore_errors=True)


if __name__ == "__main__":
    main()
