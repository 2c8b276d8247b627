"""Benchmark: the lake after hours of one-second triggers: file counts, the fresh view's speed, exactness.

    .venv/bin/python bench/soak_bench.py [--minutes 60] [--rate 10] [--tables 8] [--sample-minutes 5]

A database of its own with --tables tables ``fresh.t01`` ... of 1,000 rows (bench/freshness_bench.py's), the
capture and merge services started as `make run` starts them (conf/local.yml's defaults: a bronze trigger every
second, silver every merge.silver_interval_s, the bronze log compacted every merge.compact_interval_minutes),
and a writer committing one-row transactions (an insert, or an update of an earlier row) at --rate per second,
round-robin over the tables, for --minutes. Every --sample-minutes it prints one line:

- the bronze log's files in its current version (what a reader of the fresh view opens), the entries of its
  ``_delta_log`` folder and its version; t01's silver files;
- one query of the masked ``<t01>_fresh`` view in Spark, and one ``fresh_read.rows`` of t01 (no Spark): seconds;
- the bronze micro-batches of the window (count, p50 seconds) and the silver steps' count;
- the CPU seconds of the stack and services in the window.

At the end: the seconds until the lake had caught up, then every table reconciled with its source.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import deltalake

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above
import freshness_bench  # noqa: E402

from lib import source  # noqa: E402
from lib.lake import fresh_read, lake_paths, reconcile  # noqa: E402
from lib.operate import metrics, monitor, service  # noqa: E402
from lib.views import masking  # noqa: E402


def files(path: str) -> dict:
    """A Delta table's files in its current version, its _delta_log entries and its version (delta-rs)."""
    table = deltalake.DeltaTable(path)
    return {"files": len(table.file_uris()), "log_entries": len(os.listdir(os.path.join(path, "_delta_log"))),
            "version": table.version()}


def writer(conf: dict, tables: list[str], rate: float, stop: threading.Event, counts: dict) -> None:
    """One-row transactions at rate per second until stop: every third an update of an earlier new row."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    begin, i = time.monotonic(), 0
    with conn.cursor() as cur:
        while not stop.is_set():
            time.sleep(max(0.0, begin + i / rate - time.monotonic()))
            table, row = tables[i % len(tables)], 1_000_001 + i // len(tables)
            if i % 3 == 2 and row > 1_000_001:
                cur.execute(f"UPDATE {table} SET v = md5(v) WHERE id = %s", (row - 1,))
            else:
                cur.execute(f"INSERT INTO {table} (id, v) VALUES (%s, 'soak')", (row,))
            counts["transactions"] = i = i + 1
    conn.close()


def sample(conf: dict, spark, view: str, policy: dict, since_record: int, cpu_before: dict) -> dict:
    """One line's figures (see the module's docstring)."""
    bronze = files(lake_paths.bronze_path(conf))
    silver = files(lake_paths.silver_path(conf, lake_paths.table_spec(conf, "fresh.t01")))
    began = time.monotonic()
    spark.sql(f"SELECT count(*) FROM {view}").collect()
    spark_s = time.monotonic() - began
    began = time.monotonic()
    fresh_read.rows(conf, "fresh.t01", policy=policy)
    python_s = time.monotonic() - began
    records = metrics.records(conf, "merge")
    window = records[since_record:]
    batch_s = [s for r in window for s in r.get("batch_seconds") or []]
    steps = [r.get("silver_steps") for r in window if r.get("silver_steps") is not None]
    cpu = bench_env.cpu_seconds(conf)
    return {"bronze": bronze, "silver_t01": silver, "spark_query_s": round(spark_s, 2),
            "python_read_s": round(python_s, 2), "batches": len(batch_s),
            "batch_p50_s": round(statistics.median(batch_s), 2) if batch_s else None,
            "silver_steps": (max(steps) - min(steps)) if len(steps) > 1 else None, "records": len(records),
            "cpu_s": round(sum(cpu.values()) - sum(cpu_before.values()), 1), "cpu": cpu}


def run(args, log) -> dict:
    folder = tempfile.mkdtemp(prefix="cdc-soak-bench-")
    tables = freshness_bench.table_names(args.tables)
    conf = freshness_bench.isolated(folder, args.tables)
    spark, stop, counts, samples = None, threading.Event(), {"transactions": 0}, []
    try:
        spark = freshness_bench.start_pipeline(conf, folder)
        policy = {"default": "keep", "database": "soak_v", "privileged_database": "soak_p"}
        masking.create_views(conf, spark, policy, tables=["fresh.t01"])
        view = masking.view(conf, "fresh.t01", "fresh", policy)
        thread = threading.Thread(target=writer, args=(conf, tables, args.rate, stop, counts), daemon=True)
        begin = time.monotonic()
        thread.start()
        last_record, cpu = len(metrics.records(conf, "merge")), bench_env.cpu_seconds(conf)
        for minute in range(args.sample_minutes, args.minutes + args.sample_minutes, args.sample_minutes):
            time.sleep(max(0.0, begin + min(minute, args.minutes) * 60 - time.monotonic()))
            wrote = counts["transactions"]
            figures = sample(conf, spark, view, policy, last_record, cpu)
            last_record, cpu = figures.pop("records"), figures.pop("cpu")
            samples.append({"minute": min(minute, args.minutes), "transactions": wrote, **figures})
            log(f"soak: {samples[-1]}")
        stop.set()
        thread.join(60)
        wrote = time.monotonic()
        monitor.wait_until_caught_up(conf, timeout_s=1800)
        caught_up_s = round(time.monotonic() - wrote, 1)
        results = reconcile.reconcile(conf, spark)
        return {"samples": samples, "caught_up_s": caught_up_s, "transactions": counts["transactions"],
                "exact": {r["table"]: r["equal"] for r in results},
                "rows": {r["table"]: r["source_rows"] for r in results}}
    finally:
        stop.set()
        service.stop(conf, log=lambda *a: None)
        bench_env.finish(conf, folder, spark, log=log)


def report(args, result: dict, before: str, after: str) -> str:
    lines = [f"soak: {args.rate:g} one-row transactions/s over {args.tables} tables for {args.minutes} min, "
             f"defaults of conf/local.yml; load before {before}, after {after}", "",
             "| minute | transactions | bronze files | bronze _delta_log entries | bronze version | t01 silver files | "
             "Spark fresh query | fresh_read | bronze batches (p50) | silver steps | CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["samples"]:
        bronze = s["bronze"]
        lines.append(f"| {s['minute']} | {s['transactions']:,} | {bronze['files']} | {bronze['log_entries']} | "
                     f"{bronze['version']} | {s['silver_t01']['files']} | {s['spark_query_s']} s | "
                     f"{s['python_read_s']} s | {s['batches']} ({s['batch_p50_s']} s) | {s['silver_steps']} | "
                     f"{s['cpu_s']} |")
    exact = all(result["exact"].values())
    lines += ["", f"{result['transactions']:,} transactions; caught up {result['caught_up_s']} s after the writes; "
                  f"reconciled: {'every table exact' if exact else result['exact']} (rows {result['rows']})"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--rate", type=float, default=10.0, help="one-row transactions per second")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--sample-minutes", type=int, default=5)
    args = parser.parse_args(argv)
    before = bench_env.machine()
    result = run(args, print)
    print(report(args, result, before, bench_env.machine()))


if __name__ == "__main__":
    main()
