"""Benchmark: snapshot rows/s against COPY ... TO STDOUT of the same tables, in the same run (not a test).

    .venv/bin/python bench/snapshot_bench.py [--rows 1000000] [--rounds 2] [--breakdown] [--readers jdbc,copy]

Runs in its own database (bench/bench_env.py): the sample bank's keyed tables (conf's
source.tables), bank.transactions grown to ``--rows`` rows, then VACUUM ANALYZE. Each round:

1. COPY: ``COPY (SELECT * FROM <table>) TO STDOUT`` of every table, one after the other on one
   psycopg2 connection, into a sink that only counts bytes (text format).
2. snapshot, once per ``--readers`` value (``snapshot.reader``: jdbc, copy): a new slot and topic
   prefix, prepared by notebook 01's ``lib.capture.bootstrap.run``, then ``lib.capture.snapshot.run(conf,
   spark)`` timed from the call to its return (slot creation, planning, every table read by Spark's
   tasks, encoded to Avro and written to Kafka, offsets checked, control record written).

The Spark session (conf's, local[2]) is started before round 1, so JVM start-up is in neither
number; round 1's first reader still pays the first read, Avro and Kafka use in the JVM and the
first Python workers (cold), the rest run warm. ``--breakdown`` then reads bank.transactions three
more ways on its own exported snapshot with the first of ``--readers``, each to Spark's no-op sink unless
said: the read alone, read + Avro encoding,
read + encoding + Kafka write, to show where the snapshot's time goes; and COPY of the
snapshot's own SELECT (the per-column transforms PostgreSQL computes), on one connection.

Every COPY and snapshot run also reports the CPU seconds that PostgreSQL, Spark (this process, its
JVM and Python workers), Kafka and the registry used during it (bench_env.cpu_seconds), and how many
cores that kept busy: on a machine whose cores are all busy, the ratio of CPU work bounds the ratio
of speeds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config, schema_registry, source  # noqa: E402
from lib import spark as spark_session  # noqa: E402
from lib.capture import (  # noqa: E402
    avro_schemas,
    bootstrap,
    catalog,
    snapshot,
    snapshot_read,
    snapshot_slot,
    snapshot_write,
)

BIG_TABLE = "bank.transactions"


class NullSink:
    """A file-like sink for copy_expert that keeps only the byte count."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data) -> int:
        self.bytes += len(data)
        return len(data)


def load(conf: dict, rows: int, log) -> dict[str, int]:
    """Grow bank.transactions to `rows` rows, VACUUM ANALYZE; rows per configured table."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {BIG_TABLE}")
            have = cur.fetchone()[0]
        seconds = bench_env.write(conf, max(0, rows - have), 100_000, tag="load")
        with conn.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
            counts = {}
            for name in config.get(conf, "source.tables"):
                cur.execute(f"SELECT count(*) FROM {name}")
                counts[name] = cur.fetchone()[0]
            cur.execute("SELECT pg_size_pretty(sum(pg_table_size(c.oid))) FROM pg_class c JOIN pg_namespace n "
                        "ON n.oid = c.relnamespace WHERE n.nspname = 'bank' AND c.relkind = 'r'")
            size = cur.fetchone()[0]
    finally:
        conn.close()
    log(f"load: {sum(counts.values()):,} rows in {len(counts)} tables ({size} on disk; {rows - have:,} "
        f"transactions written in {seconds:.1f} s)")
    return counts


def copy_out(conf: dict, tables: list[str], queries: dict[str, str] | None = None) -> dict:
    """COPY every table (SELECT *, or queries[table]) to a null sink; seconds and bytes per table and in total."""
    conn = source.connect(conf)
    conn.autocommit = True
    out = {"tables": {}, "bytes": 0}
    try:
        with conn.cursor() as cur:
            began = time.monotonic()
            for name in tables:
                sink = NullSink()
                start = time.monotonic()
                query = (queries or {}).get(name, f"SELECT * FROM {name}")
                cur.copy_expert(f"COPY ({query}) TO STDOUT", sink)
                out["tables"][name] = time.monotonic() - start
                out["bytes"] += sink.bytes
            out["seconds"] = time.monotonic() - began
    finally:
        conn.close()
    return out


def round_conf(conf: dict, label: str, reader: str = "copy") -> dict:
    """conf with this round's own slot and topic prefix (the publication is shared) and snapshot.reader."""
    database = config.get(conf, "source.database")
    overrides = {"CDC__SOURCE__SLOT": f"{database}_{label}",
                 "CDC__KAFKA__TOPIC_PREFIX": f"{conf['bench_prefix']}-{label}", "CDC__SNAPSHOT__READER": reader}
    result = config.apply_overrides(conf, overrides)
    result["env"] = {**conf["env"], **overrides}
    return result


def snapshot_round(conf: dict, spark, label: str, reader: str, log) -> dict:
    """bootstrap (publication, topics, schemas) for a new prefix, then the timed snapshot; drops its slot after."""
    conf = round_conf(conf, label, reader)
    bootstrap.run(conf, log=lambda line: None)
    began = time.monotonic()
    result = snapshot.run(conf, spark, log=lambda line: log(f"  {line}"))
    seconds = time.monotonic() - began
    drop_slot(conf)
    return {"seconds": seconds, "rows": result["rows"], "elapsed_s": result["elapsed_s"]}


def drop_slot(conf: dict) -> None:
    """Drop the conf's slot (a finished snapshot's slot would retain WAL until cleanup)."""
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        snapshot_slot.drop_slot(conn, config.get(conf, "source.slot"))
    finally:
        conn.close()


def breakdown(conf: dict, spark, log, reader: str) -> dict:
    """bank.transactions read (no-op sink), read + encode (no-op sink), read + encode + Kafka; seconds each."""
    conf = round_conf(conf, "parts")
    bootstrap.run(conf, log=lambda line: None)
    unknown_types = config.get(conf, "source.unknown_types", "error")
    prefix = config.get(conf, "kafka.topic_prefix")
    conn = source.connect(conf)
    try:
        table = catalog.describe_tables(conn, [BIG_TABLE])[BIG_TABLE]
    finally:
        conn.close()
    topic = avro_schemas.topic_name(prefix, table)
    registry = schema_registry.client(conf)
    key_subject, value_subject = schema_registry.subjects(topic)
    key_schema = avro_schemas.key_schema(table, prefix, unknown_types)
    value_schema = avro_schemas.value_schema(table, prefix, unknown_types)
    key_id = schema_registry.register(registry, key_subject, key_schema)[0]
    value_id = schema_registry.register(registry, value_subject, value_schema)[0]
    repl, consistent, name = snapshot_slot.create_slot_with_snapshot(conf, log=lambda line: None)
    out = {}
    try:
        planner = snapshot_slot.snapshot_connection(conf, name)
        try:
            plan = snapshot_read.plan_partitions(planner, table, int(config.get(conf, "snapshot.partition_rows")),
                                                 int(config.get(conf, "snapshot.max_partitions")),
                                                 spark_session.cores(spark) or 2, by_blocks=reader == "copy")
        finally:
            planner.close()
        out["rows"], out["partitions"], out["reader"] = plan["rows"], plan["partitions"], reader

        def frames():
            rows, fields = snapshot_read.read_table(conf, spark, table, name, plan, unknown_types)
            encoded = snapshot_write.encode(rows, table, conf, key_schema, value_schema, key_id, value_id,
                                            consistent, int(time.time() * 1000), fields)
            return rows, encoded

        query = snapshot_read.select_sql(table, unknown_types)[0]
        out["copy_select"] = copy_out(conf, [BIG_TABLE], {BIG_TABLE: query})["seconds"]
        log(f"breakdown: COPY of the snapshot's SELECT: {plan['rows']:,} rows in {out['copy_select']:.1f} s")
        for step in ("read", "read+encode", "read+encode+kafka"):
            rows, encoded = frames()
            cpu = bench_env.cpu_seconds(conf)
            began = time.monotonic()
            if step == "read":
                rows.write.format("noop").mode("overwrite").save()
            elif step == "read+encode":
                encoded.write.format("noop").mode("overwrite").save()
            else:
                snapshot_write.write(encoded, conf, topic)
            out[step] = time.monotonic() - began
            out[f"{step} cpu"] = used_since(conf, cpu)
            log(f"breakdown: {step}: {plan['rows']:,} rows in {out[step]:.1f} s ({plan['rows'] / out[step]:,.0f} "
                f"rows/s, {plan['partitions']} partitions)")
    finally:
        repl.close()
        drop_slot(conf)
    return out


def used_since(conf: dict, before: dict[str, float]) -> dict[str, float]:
    """CPU seconds per part of the stack since ``before`` (bench_env.cpu_seconds)."""
    return {part: seconds - before.get(part, 0.0) for part, seconds in bench_env.cpu_seconds(conf).items()}


def cpu_cell(cpu: dict[str, float]) -> str:
    """postgres / spark / kafka CPU seconds of one step (the whole step, not the increment)."""
    return " / ".join(f"{cpu.get(part, 0.0):.1f}" for part in ("postgres", "spark", "kafka"))


def cpu_table(rounds: list[dict]) -> list[str]:
    """Where the CPU went in each run: seconds per part of the stack, and how many of the cores were busy."""
    parts = ("postgres", "spark", "kafka", "registry")
    lines = ["", "CPU seconds per run (user + system; spark is this process with its JVM and Python workers):", "",
             "| round | run | wall s | " + " | ".join(parts) + " | total CPU s | cores busy |",
             "|---|---|---|" + "---|" * len(parts) + "---|---|"]
    for i, r in enumerate(rounds, 1):
        runs = [("COPY TO STDOUT", r["copy_s"], r["copy_cpu"])]
        runs += [(f"snapshot ({reader})", r["snapshots"][reader], r["cpu"][reader]) for reader in r["snapshots"]]
        for label, wall, cpu in runs:
            total = sum(cpu.get(p, 0.0) for p in parts)
            lines.append(f"| {i} | {label} | {wall:.1f} | " + " | ".join(f"{cpu.get(p, 0.0):.1f}" for p in parts)
                         + f" | {total:.1f} | {total / wall:.1f} |")
    return lines


def report(rounds: list[dict], parts: dict | None, copy_big: float | None, load_before: str, load_after: str) -> str:
    """The results as markdown tables."""
    lines = ["| round | COPY TO STDOUT | snapshot.reader | snapshot (lib.capture.snapshot.run) | ratio | target |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        copy_rate = r["rows"] / r["copy_s"]
        for n, (reader, seconds) in enumerate(r["snapshots"].items()):
            snap_rate = r["rows"] / seconds
            ratio, target = snap_rate / copy_rate, 0.3 if i == 1 and n == 0 else 0.5
            state = "cold JVM" if i == 1 and n == 0 else "warm JVM"
            lines.append(f"| {i} ({state}) | {copy_rate:,.0f} rows/s ({r['copy_s']:.1f} s, {r['copy_mb']:.0f} MB) | "
                         f"{reader} | {snap_rate:,.0f} rows/s ({seconds:.1f} s) | {ratio:.2f}× | ≥ {target}× "
                         f"({'met' if ratio >= target else 'missed'}) |")
    lines += cpu_table(rounds)
    if parts:
        n = parts["rows"]
        read, encode, kafka = parts["read"], parts["read+encode"], parts["read+encode+kafka"]
        lines += ["", f"Where the time goes, {BIG_TABLE} ({n:,} rows, {parts['partitions']} partitions):", "",
                  "| step | seconds | rows/s | share of the full path | CPU s (postgres / spark / kafka) |",
                  "|---|---|---|---|---|",
                  f"| COPY TO STDOUT of the table (one connection) | {copy_big:.1f} | {n / copy_big:,.0f} | — | — |",
                  f"| COPY TO STDOUT of the snapshot's SELECT (its column transforms, one connection) | "
                  f"{parts['copy_select']:.1f} | {n / parts['copy_select']:,.0f} | — | — |",
                  f"| read in Spark tasks (snapshot.reader {parts['reader']}) + column transforms (no-op sink) | "
                  f"{read:.1f} | {n / read:,.0f} | {read / kafka:.0%} | {cpu_cell(parts['read cpu'])} |",
                  f"| + Avro encoding (to_avro, envelope) | +{encode - read:.1f} | {n / encode:,.0f} | "
                  f"{(encode - read) / kafka:.0%} | {cpu_cell(parts['read+encode cpu'])} |",
                  f"| + Kafka write (Spark's Kafka sink) | +{kafka - encode:.1f} | {n / kafka:,.0f} | "
                  f"{(kafka - encode) / kafka:.0%} | {cpu_cell(parts['read+encode+kafka cpu'])} |"]
    return "\n".join(lines) + f"\n\nmachine before: {load_before}; after: {load_after}"


def main(argv=None) -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in bank.transactions")
    parser.add_argument("--rounds", type=int, default=2, help="COPY + snapshot rounds (the first is JVM-cold)")
    parser.add_argument("--breakdown", action="store_true", help="also time read / encode / Kafka separately")
    parser.add_argument("--readers", default="jdbc,copy", help="snapshot.reader values, each run every round")
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    load_before = bench_env.machine()
    log(f"machine: {load_before}")
    conf = bench_env.isolated()
    spark = None
    try:
        counts = load(conf, args.rows, log)
        tables, total = list(counts), sum(counts.values())
        spark = spark_session.from_conf(conf)
        if not spark_session.is_remote(spark):  # a Spark Connect session has no SparkContext
            spark.sparkContext.setLogLevel("ERROR")
        rounds = []
        for i in range(1, args.rounds + 1):
            cpu = bench_env.cpu_seconds(conf)
            copied = copy_out(conf, tables)
            copied["cpu"] = used_since(conf, cpu)
            log(f"round {i}: COPY {total:,} rows in {copied['seconds']:.1f} s "
                f"({total / copied['seconds']:,.0f} rows/s)")
            snapshots, cpus = {}, {}
            for reader in args.readers.split(","):
                cpu = bench_env.cpu_seconds(conf)
                snap = snapshot_round(conf, spark, f"r{i}{reader}", reader, log)
                snapshots[reader], cpus[reader] = snap["seconds"], used_since(conf, cpu)
                log(f"round {i}: snapshot ({reader}) {snap['rows']:,} rows in {snap['seconds']:.1f} s "
                    f"({snap['rows'] / snap['seconds']:,.0f} rows/s)")
            rounds.append({"rows": total, "copy_s": copied["seconds"], "copy_mb": copied["bytes"] / 2**20,
                           "snapshots": snapshots, "copy_cpu": copied["cpu"], "cpu": cpus})
        parts = copy_big = None
        if args.breakdown:
            copy_big = copy_out(conf, [BIG_TABLE])["seconds"]
            parts = breakdown(conf, spark, log, args.readers.split(",")[0])
    finally:
        if spark is not None:
            spark.stop()
        bench_env.cleanup(conf, log)
    print()
    print(report(rounds, parts, copy_big, load_before, bench_env.machine()))


if __name__ == "__main__":
    main()
