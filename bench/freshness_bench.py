"""Benchmark: commit -> the row in the fresh view, and commit -> the row in silver, with the continuous services
started as `make run` starts them (the conf's defaults: service.merge_interval, merge.silver_interval_s).

    .venv/bin/python bench/freshness_bench.py [--rate 10] [--seconds 60] [--tables 1 51]

Per --tables count n (a database of its own, bench/bench_env.py, with n tables ``fresh.t01`` ... of 1,000 rows,
bootstrapped, snapshotted, then the capture and merge services started with service.start): a writer commits
one-row transactions at --rate per second for --seconds, round-robin over the n tables (so with 51 every
trigger touches many tables). A row's commit time is when its COMMIT returned to the writer.

- **fresh**: this process queries ``<t01>_fresh`` (the masked view, built once over this run's lake, in a
  metastore of its own; or with ``--reader python``, ``lib.lake.fresh_read.rows``: silver and the topic's tail
  read without Spark, masked by the same policy) in a loop, ``SELECT id ... WHERE id >= <the oldest row not seen
  yet>``; a row's latency is the end of the first query that returned it minus its commit time, so a query's own
  duration is counted, as an analyst waits for it;
- **silver**: a thread reads t01's silver table with delta-rs (``deltalake``, outside Spark) every 0.2 s;
  latency = the end of the first read that holds the row minus its commit time.

Reported per n: p50, p90, p99 and max of both, the queries' own durations, the merge's CPU seconds, and where
a t01 row's fresh latency went: commit -> a Kafka consumer of this process got it -> the bronze log commit that
holds it (its commit time, read with delta-rs at the end) -> the fresh query that first returned it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import deltalake
from confluent_kafka import OFFSET_END
from pyspark.sql.types import VariantVal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config, kafka_client, source  # noqa: E402
from lib import spark as spark_lib  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import fresh_read, lake_paths  # noqa: E402
from lib.operate import keeper, metrics, monitor, service  # noqa: E402
from lib.views import masking  # noqa: E402


def schema_sql(n: int) -> str:
    """n tables of 1,000 rows, ids from 1; the benchmark's rows come from 1,000,001 on."""
    return "CREATE SCHEMA fresh;\n" + "\n".join(
        f"CREATE TABLE fresh.t{i:02d} (id bigint PRIMARY KEY, v text, at timestamptz DEFAULT now());\n"
        f"INSERT INTO fresh.t{i:02d} SELECT g, md5(g::text) FROM generate_series(1, 1000) g;" for i in range(1, n + 1))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]  # noqa: E731
    return {"n": len(values), "p50": pick(50), "p90": pick(90), "p99": pick(99), "max": ordered[-1],
            "mean": statistics.fmean(values)}


def table_names(n: int) -> list[str]:
    """fresh.t01 ... fresh.t<n>, the tables schema_sql makes."""
    return [f"fresh.t{i:02d}" for i in range(1, n + 1)]


def isolated(folder: str, n: int) -> dict:
    """conf of a database of its own with n tables fresh.t01 ... (schema_sql), its lake and services in folder."""
    return bench_env.isolated(table_names(n), {"CDC__LAKE__ROOT": os.path.join(folder, "lake"),
                                       "CDC__SERVICE__DIR": os.path.join(folder, "services")},
                              schema_sql=schema_sql(n), schemas=("fresh",))


def start_pipeline(conf: dict, folder: str):
    """A Spark session (its metastore in folder), the slot, the snapshot, and the capture and merge services
    started as `make run` starts them, caught up. Returns the session."""
    spark = spark_lib.from_conf(spark_lib.with_metastore(conf, os.path.join(folder, "metastore")))
    bootstrap.run(conf, log=lambda *a: None)
    snapshot.run(conf, spark, log=lambda *a: None)
    started = time.time()
    service.start(conf, log=lambda *a: None)
    monitor.wait_until_recording(conf, since=started, timeout_s=600)
    monitor.wait_until_caught_up(conf, timeout_s=900)
    return spark


def run(n: int, args, log) -> dict:
    """One measurement with n tables; everything it made is removed at the end."""
    folder = tempfile.mkdtemp(prefix="cdc-fresh-bench-")
    tables = table_names(n)
    conf = isolated(folder, n)
    spark = None
    try:
        spark = start_pipeline(conf, folder)
        policy = {"default": "keep", "database": f"fresh_v_{n}", "privileged_database": f"fresh_p_{n}"}
        masking.create_views(conf, spark, policy, tables=["fresh.t01"])
        view = masking.view(conf, "fresh.t01", "fresh", policy)
        silver_path = lake_paths.silver_path(conf, lake_paths.table_spec(conf, "fresh.t01"))
        committed: dict[int, float] = {}
        seen_fresh: dict[int, float] = {}
        seen_silver: dict[int, float] = {}
        query_s: list[float] = []
        writing, stop = threading.Event(), threading.Event()

        def write() -> None:
            conn = source.connect(conf, admin=True)
            conn.autocommit = True
            begin, i = time.monotonic(), 0
            with conn.cursor() as cur:
                while time.monotonic() - begin < args.seconds:
                    due = begin + i / args.rate
                    time.sleep(max(0.0, due - time.monotonic()))
                    table = tables[i % n]
                    row = 1_000_001 + i // n
                    cur.execute(f"INSERT INTO {table} (id, v) VALUES (%s, 'bench')", (row,))
                    if table == "fresh.t01":
                        committed[row] = time.time()
                    i += 1
            conn.close()
            writing.clear()

        arrived: dict[tuple[int, int], float] = {}  # (partition, offset) of t01's topic -> when a consumer got it
        topic = lake_paths.table_spec(conf, "fresh.t01").topic

        def watch_kafka() -> None:
            from confluent_kafka import TopicPartition

            consumer = kafka_client.consumer(conf, "fresh-bench", **{"enable.auto.commit": False})
            parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in parts])
            try:
                while not stop.is_set():
                    message = consumer.poll(0.05)
                    if message is not None and message.error() is None:
                        arrived[(message.partition(), message.offset())] = time.time()
            finally:
                consumer.close()

        def watch_silver() -> None:
            while not stop.is_set():
                try:
                    ids = deltalake.DeltaTable(silver_path).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
                except Exception:  # noqa: BLE001 - a read during a commit: the next one
                    ids = []
                now = time.time()
                for row in ids:
                    if row > 1_000_000 and row not in seen_silver:
                        seen_silver[row] = now
                time.sleep(0.2)

        writing.set()
        threads = [threading.Thread(target=watch_kafka, daemon=True)]
        threads[0].start()
        time.sleep(2)  # the consumer is assigned before the first write
        threads += [threading.Thread(target=write, daemon=True), threading.Thread(target=watch_silver, daemon=True)]
        cpu_before, window_began = bench_env.cpu_seconds(conf), time.monotonic()
        for thread in threads[1:]:
            thread.start()
        deadline = time.monotonic() + args.seconds + float(config.get(conf, "merge.silver_interval_s")) + 60
        while time.monotonic() < deadline:
            waiting = [row for row in committed if row not in seen_fresh]
            if not writing.is_set() and not waiting and len(seen_silver) >= len(committed):
                break
            low = min(waiting) if waiting else 1_000_001
            began = time.time()
            if args.reader == "python":
                ids = [r["id"] for r in fresh_read.rows(conf, "fresh.t01", policy=policy) if r["id"] >= low]
            else:
                ids = [r["id"] for r in spark.sql(f"SELECT id FROM {view} WHERE id >= {low}").collect()]
            done = time.time()
            query_s.append(done - began)
            for row in ids:
                seen_fresh.setdefault(row, done)
        stop.set()
        for thread in threads:
            thread.join(60)
        cpu_after = bench_env.cpu_seconds(conf)
        window_s = time.monotonic() - window_began
        fresh = [seen_fresh[r] - committed[r] for r in committed if r in seen_fresh]
        silver = [seen_silver[r] - committed[r] for r in committed if r in seen_silver]
        legs = stages(conf, topic, committed, arrived, seen_fresh)
        records = metrics.records(conf, "merge")
        batch_s = [s for r in records for s in r.get("batch_seconds") or []]
        phase_s = {}
        for r in records:
            for phases in r.get("batch_phases") or []:
                for name, seconds in phases.items():
                    phase_s.setdefault(name, []).append(seconds)
        service_log = keeper.files(conf, "merge")["log"].read_text()
        log(f"{n} table(s): bronze batches {percentiles(batch_s)}; median per phase "
            f"{ {name: round(statistics.median(v), 3) for name, v in phase_s.items()} }; Spark's code generation "
            f"fell back {service_log.count('grows beyond 64 KB')} time(s); merge log tail:\n"
            + "\n".join(service_log.splitlines()[-15:]))
        steps = [r["silver_steps"] for r in records if r.get("silver_steps") is not None]
        result = {"tables": n, "rows_watched": len(committed), "fresh": percentiles(fresh),
                  "silver": percentiles(silver), "query_s": percentiles(query_s),
                  "missing_fresh": len(committed) - len(fresh), "missing_silver": len(committed) - len(silver),
                  "legs": {name: percentiles(values) for name, values in legs.items()},
                  "silver_steps": max(steps) - min(steps) if steps else None,
                  "cpu_s": {k: round(cpu_after.get(k, 0) - cpu_before.get(k, 0), 1) for k in cpu_after}}
        f, s = (result[part] for part in ("fresh", "silver"))
        log(f"{n} table(s): fresh p50 {f.get('p50', float('nan')):.2f} s p99 {f.get('p99', float('nan')):.2f} s; "
            f"silver p50 {s.get('p50', float('nan')):.2f} s p99 {s.get('p99', float('nan')):.2f} s; CPU s "
            f"{result['cpu_s']} over {window_s:.0f} s")
        return result
    finally:
        service.stop(conf, log=lambda *a: None)
        bench_env.finish(conf, folder, spark, log=log)


def _commit_times(path: str) -> dict[int, float]:
    """{seq: when the commit recording it was made} of a log's commits (delta-rs reads the history)."""
    found = {}
    for commit in deltalake.DeltaTable(path).history():
        try:
            meta = json.loads(commit.get("userMetadata") or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and "seq" in meta:
            found[int(meta["seq"])] = commit["timestamp"] / 1000
    return found


def stages(conf: dict, topic: str, committed: dict, arrived: dict, seen_fresh: dict) -> dict[str, list[float]]:
    """Where each row's latency went: commit -> a Kafka consumer got it -> the trigger's raw log commit -> the decode
    step's bronze log commit -> a fresh query returned it (the logs read once at the end with delta-rs; a commit's
    time from its history; a decode step covers every raw commit up to the one it records)."""
    at_raw = _commit_times(lake_paths.raw_path(conf))
    decoded = sorted(_commit_times(lake_paths.bronze_path(conf)).items())
    reached = [seq for seq, _ in decoded]
    rows = deltalake.DeltaTable(lake_paths.bronze_path(conf)).to_pyarrow_table(
        columns=["_kafka_topic", "_kafka_partition", "_kafka_offset", "_seq", "key"])
    raw_at, logged, key_of = {}, {}, {}
    for r in rows.to_pylist():
        if r["_kafka_topic"] != topic:
            continue
        place = (r["_kafka_partition"], r["_kafka_offset"])
        step = bisect.bisect_left(reached, r["_seq"])
        if r["_seq"] in at_raw and step < len(decoded):
            raw_at[place], logged[place] = at_raw[r["_seq"]], decoded[step][1]
        if r["key"] is not None:  # the row's id, from the VARIANT key (value and metadata bytes)
            key_of[place] = VariantVal(r["key"]["value"], r["key"]["metadata"]).toPython()["id"]
    legs: dict[str, list[float]] = {"commit -> Kafka": [], "Kafka -> raw commit": [], "raw -> bronze commit": [],
                                    "bronze commit -> query": [], "Kafka -> query": []}
    for place, row in key_of.items():
        if row not in committed or place not in arrived or place not in logged or row not in seen_fresh:
            continue
        legs["commit -> Kafka"].append(arrived[place] - committed[row])
        legs["Kafka -> raw commit"].append(raw_at[place] - arrived[place])
        legs["raw -> bronze commit"].append(logged[place] - raw_at[place])
        legs["bronze commit -> query"].append(seen_fresh[row] - logged[place])
        legs["Kafka -> query"].append(seen_fresh[row] - arrived[place])
    return legs


def report(args, results: list[dict], before: str, after: str) -> str:
    lines = [f"freshness ({args.reader} reader): {args.rate:g} one-row transactions/s for {args.seconds:g} s, "
             f"defaults of conf/local.yml; "
             f"load before {before}, after {after}", "",
             "| tables written | fresh p50 | fresh p90 | fresh p99 | fresh max | silver p50 | silver p90 | "
             "silver p99 | fresh query p50 | rows | silver steps | CPU s (stack and services) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, s, q = r["fresh"], r["silver"], r["query_s"]
        lines.append(f"| {r['tables']} | {f.get('p50', 0):.2f} s | {f.get('p90', 0):.2f} s | {f.get('p99', 0):.2f} s | "
                     f"{f.get('max', 0):.2f} s | {s.get('p50', 0):.2f} s | {s.get('p90', 0):.2f} s | "
                     f"{s.get('p99', 0):.2f} s | {q.get('p50', 0):.2f} s | {r['rows_watched']} | {r['silver_steps']} | "
                     f"{sum(r['cpu_s'].values()):.0f} |")
    for r in results:
        lines += ["", f"{r['tables']} table(s), where a row's fresh latency went (seconds):", "",
                  "| leg | rows | p50 | p90 | p99 |", "|---|---|---|---|---|"]
        for name, p in r["legs"].items():
            lines.append(f"| {name} | {p['n']} | {p.get('p50', 0):.2f} | {p.get('p90', 0):.2f} | "
                         f"{p.get('p99', 0):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="one-row transactions per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 51])
    parser.add_argument("--reader", choices=["spark", "python"], default="spark",
                        help="spark: query the masked <t01>_fresh view; python: lib.lake.fresh_read.rows (no Spark)")
    args = parser.parse_args(argv)
    before = bench_env.machine()
    results = [run(n, args, print) for n in args.tables]
    print(report(args, results, before, bench_env.machine()))


if __name__ == "__main__":
    main()
