"""Probe: what one bronze micro-batch pays per table, outside the streaming engine.

    .venv/bin/python bench/batch_probe.py [--small 50] [--reps 3] [--per-table 400]

Builds the estate of bench/tables_bench.py (``--small`` tables of 1,000 rows and ``big``) in its own
database, snapshots it into Kafka, then in one Spark driver:

- **Kafka read**: counts every table topic's records with a batch read, with Kafka's default
  ``fetch.max.wait.ms`` (500 ms) and with the merge's (10 ms), ``--reps`` times each, alternating;
- **micro-batch**: calls the merge's foreachBatch function (``micro_batch.process_batch``) on a batch
  read of the last ``--per-table`` records of 1 table and of every table, ``--reps`` times each, and
  prints each batch's phases (read, control, plan, decode, append). The first batch of a process builds
  the decode plans; later ones reuse them;
- **raw** (``--raw``): after each such batch, the same records appended to a Delta table as they come from Kafka
  (bytes, schema ids, coordinates; no decode): what a trigger that leaves the decode to a later step would pay.

Everything it made (database, slot, topics, lake) is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above
import tables_bench  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from lib import spark as spark_session  # noqa: E402
from lib.capture import snapshot  # noqa: E402
from lib.lake import decode, lake_paths, merge, micro_batch  # noqa: E402

DEFAULT_WAIT = {"kafka.fetch.max.wait.ms": "500"}  # Kafka's own default


def reader(spark, options: dict):
    """A batch Kafka reader with options."""
    read = spark.read.format("kafka")
    for key, value in options.items():
        read = read.option(key, value)
    return read


def kafka_options(conf: dict, specs, starts: dict | None = None, ends: dict | None = None) -> dict:
    """The merge's Kafka options as a batch read of specs' topics (all of them, or from starts to ends)."""
    options = {k: v for k, v in merge.kafka_options(conf).items()
               if k not in ("subscribe", "startingOffsets", "maxOffsetsPerTrigger")}
    options["subscribe"] = ",".join(s.topic for s in specs)
    if starts is not None:
        options.pop("subscribe")
        options["assign"] = json.dumps({t: [int(p) for p in parts] for t, parts in starts.items()})
        options["startingOffsets"], options["endingOffsets"] = json.dumps(starts), json.dumps(ends)
    return options


def time_reads(conf: dict, spark, reps: int, log) -> dict:
    """Seconds of counting every table topic, Kafka's default fetch wait against the merge's."""
    specs = lake_paths.table_specs(conf)
    seconds = {"500 ms (Kafka's default)": [], "10 ms (the merge's)": []}
    for _ in range(reps):
        for label, extra in (("500 ms (Kafka's default)", DEFAULT_WAIT), ("10 ms (the merge's)", {})):
            began = time.monotonic()
            count = reader(spark, {**kafka_options(conf, specs), **extra}).load().count()
            seconds[label].append(round(time.monotonic() - began, 2))
            log(f"read {count:,} records of {len(specs)} topics, fetch wait {label}: {seconds[label][-1]} s")
    return seconds


def raw_append(spark, frame, path: str, batch_id: int) -> dict:
    """The batch's Kafka records appended to a Delta table undecoded, as a trigger without decode would: seconds."""
    began = time.monotonic()
    cores = spark_session.cores(spark)
    raw = decode.headers(frame.coalesce(cores) if cores else frame).persist()
    try:
        raw.groupBy("topic").agg(F.collect_set("__vid"), F.collect_set("__kid")).collect()  # as process_batch asks
        read = time.monotonic()
        raw.select("topic", "partition", "offset", "timestamp", "__k", "__v", "__kid", "__vid", "__tlsn",
                   "__tserial", F.lit(batch_id).cast("long").alias("batch")) \
            .write.format("delta").mode("append").option("userMetadata", json.dumps({"batch": batch_id})).save(path)
        return {"raw_read": round(read - began, 2), "raw_append": round(time.monotonic() - read, 2),
                "raw_seconds": round(time.monotonic() - began, 2)}
    finally:
        raw.unpersist()


def time_batches(conf: dict, spark, tables: int, per_table: int, reps: int, log,
                 raw_path: str | None = None) -> list[dict]:
    """process_batch on the last per_table records of the first `tables` tables, reps times (and undecoded)."""
    specs = lake_paths.table_specs(conf)[:tables]
    ends = bench_env.topic_ends(conf, [s.topic for s in specs])
    parts = {t: len(p) for t, p in ends.items()}
    starts = {t: {p: max(0, e - per_table // parts[t]) for p, e in offsets.items()} for t, offsets in ends.items()}
    ctx = micro_batch.context(conf, app_id=f"batch-probe-{tables}")
    rows = []
    for rep in range(reps):
        frame = reader(spark, kafka_options(conf, specs, starts, ends)).load()
        began = time.monotonic()
        stats = micro_batch.process_batch(frame, rep, ctx)
        events = sum(c.get("events", 0) + c.get("tombstones", 0) for c in stats["tables"].values())
        rows.append({"tables": tables, "rep": rep, "seconds": round(time.monotonic() - began, 2), "events": events,
                     **stats["phases"]})
        log(f"micro-batch of {tables} table(s), {events:,} events: {rows[-1]['seconds']} s {stats['phases']}")
        if raw_path:
            frame = reader(spark, kafka_options(conf, specs, starts, ends)).load()
            rows[-1].update(raw_append(spark, frame, raw_path, 1000 * tables + rep))
            log(f"  the same records undecoded: {rows[-1]['raw_seconds']} s")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=50, help="small tables (1,000 rows each)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--per-table", type=int, default=400, help="records per table in a micro-batch")
    parser.add_argument("--raw", action="store_true", help="also append each batch's records undecoded")
    args = parser.parse_args(argv)
    load_before = bench_env.machine()
    print(f"machine: {load_before}")
    folder = tempfile.mkdtemp(prefix="batch_probe_")
    conf = tables_bench.prepare(folder, types.SimpleNamespace(small=args.small, big_rows=1000), print)
    spark = None
    try:
        spark = spark_session.from_conf(conf, catalog="in-memory")
        snapshot.run(conf, spark, log=lambda line: None)
        reads = time_reads(conf, spark, args.reps, print)
        raw_path = f"{folder}/raw" if args.raw else None
        batches = time_batches(conf, spark, 1, 1000, args.reps, print, raw_path)
        batches += time_batches(conf, spark, args.small + 1, args.per_table, args.reps, print, raw_path)
    finally:
        bench_env.finish(conf, folder, spark, log=print)
    print(f"\nmachine before: {load_before}; after: {bench_env.machine()}\n")
    print("| Kafka fetch wait | seconds to count every table topic |\n|---|---|")
    for label, values in reads.items():
        print(f"| {label} | {', '.join(f'{v} s' for v in values)} |")
    print("\n| tables | batch | events | seconds | read | control | plan | decode | append | undecoded: seconds "
          "(read / append) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in batches:
        undecoded = f"{row['raw_seconds']} ({row['raw_read']} / {row['raw_append']})" if "raw_seconds" in row else ""
        print(f"| {row['tables']} | {row['rep']} | {row['events']:,} | {row['seconds']} | {row.get('read')} | "
              f"{row.get('control')} | {row.get('plan')} | {row.get('decode')} | {row.get('append')} | {undecoded} |")


if __name__ == "__main__":
    main()
