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
- the bronze micro-batches of the window (count, p50 seconds, and the p50 of each of their phases: read, control,
  append, decode), the decode steps (count, p50 seconds), the silver steps' count and seconds;
- the CPU seconds of the stack and services in the window.

At the end: the seconds until the lake had caught up, then every table reconciled with its source.

``--mixed`` (``make soak``, issue 30's hour): the writer also deletes rows and changes keys (of the rows it
made), a DDL (``ADD COLUMN``) hits one table every ``--ddl-minutes`` and is timed until the lake caught up
with it, and one transaction of ``--big-rows`` rows commits at ``--big-minute``. Every minute it records each
service's resident memory (proportional set sizes summed over the keeper, the service and their children: the
merge's JVM included) and the WAL the slot retains. The report adds the memory ratio (the highest RSS in minutes 50-60
over the lowest in minutes 10-20, per service), the retained WAL outside the big transaction, the catch-up
after each DDL and after the big transaction.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
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

from lib import config, source  # noqa: E402
from lib.lake import fresh_read, lake_paths, reconcile  # noqa: E402
from lib.operate import keeper, metrics, monitor, process, service  # noqa: E402
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


def mixed_writer(conf: dict, tables: list[str], rate: float, stop: threading.Event, counts: dict) -> None:
    """One-row transactions at rate per second on the rows it inserted: 4 in 10 inserts, 3 updates, 2 key changes
    and 1 delete, round-robin over the tables; a failure ends it and is kept in counts['error']."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    rng, live, next_id = random.Random(7), {t: [] for t in tables}, 1_000_001
    begin, i = time.monotonic(), 0
    try:
        with conn.cursor() as cur:
            while not stop.is_set():
                time.sleep(max(0.0, begin + i / rate - time.monotonic()))
                table, kind, rows = tables[i % len(tables)], i % 10, live[tables[i % len(tables)]]
                if kind < 4 or not rows:
                    cur.execute(f"INSERT INTO {table} (id, v) VALUES (%s, 'soak')", (next_id,))
                    rows.append(next_id)
                    next_id += 1
                elif kind < 7:
                    cur.execute(f"UPDATE {table} SET v = md5(v) WHERE id = %s", (rng.choice(rows),))
                elif kind < 9:
                    j = rng.randrange(len(rows))
                    cur.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (next_id, rows[j]))
                    rows[j], next_id = next_id, next_id + 1
                else:
                    cur.execute(f"DELETE FROM {table} WHERE id = %s", (rows.pop(rng.randrange(len(rows))),))
                counts["transactions"] = i = i + 1
    except Exception as exc:  # noqa: BLE001 - reported with the results
        counts["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def resident_mb(conf: dict) -> dict[str, float]:
    """Per service: resident memory in MB of its keeper and every descendant (the service, a merge's JVM), each
    process counted by its proportional set size: pages shared between processes (a child the JVM forks, until it
    execs) are counted once, where a sum of VmRSS counted the JVM twice for a fork caught mid-way."""
    found = {}
    for row in service.status(conf):
        if row.get("pid"):
            found[row["service"]] = round(sum(_pss_mb(pid) for pid in process.tree(row["pid"])), 1)
    return found


def _pss_mb(pid: int) -> float:
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("Pss:")), 0.0)


def retained_wal_mb(conf: dict) -> float:
    """WAL the slot holds back (current position minus its restart_lsn), MB."""
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) FROM pg_replication_slots "
                        "WHERE slot_name = %s", (config.get(conf, "source.slot"),))
            return round(float(cur.fetchone()[0]) / 2**20, 1)
    finally:
        conn.close()


def timed_catch_up(conf: dict, statement: str) -> dict:
    """Run statement on the source, then wait until the slot, bronze and silver hold it: seconds from the commit
    until the merge's Kafka lag was back to zero (bronze, and so the fresh view, held it) and until silver did."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()
    began = time.monotonic()
    waited = monitor.wait_until_caught_up(conf, timeout_s=1800)  # its seconds count from its own start: ~ the commit
    return {"bronze_s": waited["bronze_s"], "caught_up_s": waited["silver_s"],
            "recorded_s": round(time.monotonic() - began, 1)}


def sample(conf: dict, spark, view: str, policy: dict, since_record: int, cpu_before: dict) -> dict:
    """One line's figures (see the module's docstring)."""
    bronze, raw = files(lake_paths.bronze_path(conf)), files(lake_paths.raw_path(conf))
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
    phases: dict[str, list] = {}
    for r in window:
        for batch in r.get("batch_phases") or []:
            for name, seconds in batch.items():
                phases.setdefault(name, []).append(seconds)
    decode_s = [s for r in window for s in r.get("decode_seconds") or []]
    silver_s = [r["silver_last"]["seconds"] for r in window if (r.get("silver_last") or {}).get("seconds")]
    cpu = bench_env.cpu_seconds(conf)
    return {"bronze": bronze, "raw": raw, "silver_t01": silver, "spark_query_s": round(spark_s, 2),
            "python_read_s": round(python_s, 2), "batches": len(batch_s),
            "batch_p50_s": round(statistics.median(batch_s), 2) if batch_s else None,
            "silver_steps": (max(steps) - min(steps)) if len(steps) > 1 else None, "records": len(records),
            "phase_p50_s": {name: round(statistics.median(v), 2) for name, v in sorted(phases.items())},
            "decode_steps": len(decode_s), "decode_p50_s": round(statistics.median(decode_s), 2) if decode_s else None,
            "silver_p50_s": round(statistics.median(silver_s), 2) if silver_s else None,
            "cpu_s": round(sum(cpu.values()) - sum(cpu_before.values()), 1), "cpu": cpu}


def run(args, log) -> dict:
    folder = tempfile.mkdtemp(prefix="cdc-soak-bench-")
    tables = freshness_bench.table_names(args.tables)
    conf = freshness_bench.isolated(folder, args.tables)
    spark, stop, counts, samples = None, threading.Event(), {"transactions": 0}, []
    minutes, ddls, big = [], [], {}
    try:
        spark = freshness_bench.start_pipeline(conf, folder)
        policy = {"default": "keep", "database": "soak_v", "privileged_database": "soak_p"}
        masking.create_views(conf, spark, policy, tables=["fresh.t01"])
        view = masking.view(conf, "fresh.t01", "fresh", policy)
        write = mixed_writer if args.mixed else writer
        thread = threading.Thread(target=write, args=(conf, tables, args.rate, stop, counts), daemon=True)
        begin = time.monotonic()
        thread.start()
        last_record, cpu = len(metrics.records(conf, "merge")), bench_env.cpu_seconds(conf)
        for minute in range(1, args.minutes + 1):
            time.sleep(max(0.0, begin + minute * 60 - time.monotonic()))
            if args.mixed:
                minutes.append({"minute": minute, "rss_mb": resident_mb(conf), "wal_mb": retained_wal_mb(conf)})
                log(f"soak: {minutes[-1]}")
                if minute == args.big_minute:
                    big.update(minute=minute, rows=args.big_rows, **timed_catch_up(conf, (
                        f"INSERT INTO {tables[1]} (id, v) SELECT g, 'big' FROM generate_series(50000001, "
                        f"{50_000_000 + args.big_rows}) g")))
                    big["until_minute"] = (time.monotonic() - begin) / 60
                    log(f"soak: big transaction {big}")
                elif minute % args.ddl_minutes == 0 and minute < args.minutes:
                    table = tables[(minute // args.ddl_minutes) % len(tables)]
                    ddls.append({"minute": minute, "table": table, **timed_catch_up(
                        conf, f"ALTER TABLE {table} ADD COLUMN c{minute} text DEFAULT 'added at minute {minute}'")})
                    log(f"soak: DDL {ddls[-1]}")
            if minute % args.sample_minutes and minute != args.minutes:
                continue
            wrote = counts["transactions"]
            figures = sample(conf, spark, view, policy, last_record, cpu)
            last_record, cpu = figures.pop("records"), figures.pop("cpu")
            samples.append({"minute": minute, "transactions": wrote, **figures})
            log(f"soak: {samples[-1]}")
        stop.set()
        thread.join(60)
        wrote = time.monotonic()
        monitor.wait_until_caught_up(conf, timeout_s=1800)
        caught_up_s = round(time.monotonic() - wrote, 1)
        results = reconcile.reconcile(conf, spark)
        merge_log = keeper.files(conf, "merge")["log"]
        deferred = merge_log.read_text(errors="replace").count("left to the next compaction") \
            if merge_log.exists() else None
        return {"samples": samples, "prunes_deferred": deferred, "caught_up_s": caught_up_s,
                "transactions": counts["transactions"],
                "writer_error": counts.get("error"), "minutes": minutes, "ddls": ddls, "big": big,
                "exact": {r["table"]: r["equal"] for r in results},
                "rows": {r["table"]: r["source_rows"] for r in results},
                "differences": {r["table"]: {"silver_rows": r["silver_rows"],
                                             "first": (r.get("differences") or [])[:10]}
                                for r in results if not r["equal"]}}
    finally:
        stop.set()
        service.stop(conf, log=lambda *a: None)
        if os.environ.get("SOAK_KEEP_LOGS"):  # the services' logs, for a run that did not end as it should
            shutil.copytree(os.path.join(folder, "services"), os.environ["SOAK_KEEP_LOGS"], dirs_exist_ok=True)
        bench_env.finish(conf, folder, spark, log=log)


def report(args, result: dict, before: str, after: str) -> str:
    lines = [f"soak: {args.rate:g} one-row transactions/s over {args.tables} tables for {args.minutes} min, "
             f"defaults of conf/local.yml; load before {before}, after {after}", "",
             "| minute | transactions | bronze files | bronze _delta_log entries | bronze version | raw log files | "
             "raw _delta_log entries | t01 silver files | Spark fresh query | fresh_read | bronze batches (p50) | "
             "silver steps | CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["samples"]:
        bronze = s["bronze"]
        lines.append(f"| {s['minute']} | {s['transactions']:,} | {bronze['files']} | {bronze['log_entries']} | "
                     f"{bronze['version']} | {s['raw']['files']} | {s['raw']['log_entries']} | "
                     f"{s['silver_t01']['files']} | {s['spark_query_s']} s | "
                     f"{s['python_read_s']} s | {s['batches']} ({s['batch_p50_s']} s) | {s['silver_steps']} | "
                     f"{s['cpu_s']} |")
    lines += ["", "| minute | trigger phases (p50 s) | decode steps (p50) | silver step (p50 of the last seen) |",
              "|---|---|---|---|"]
    for s in result["samples"]:
        phases = ", ".join(f"{name} {v}" for name, v in s["phase_p50_s"].items())
        lines.append(f"| {s['minute']} | {phases} | {s['decode_steps']} ({s['decode_p50_s']} s) | "
                     f"{s['silver_p50_s']} s |")
    exact = all(result["exact"].values())
    lines += ["", f"{result['transactions']:,} transactions; caught up {result['caught_up_s']} s after the writes; "
                  f"reconciled: {'every table exact' if exact else result['exact']} (rows {result['rows']}); "
                  f"raw log prunes left to the next compaction (the service log's warnings): "
                  f"{result.get('prunes_deferred')}"]
    for table, found in result["differences"].items():
        lines.append(f"{table} differs: {found}")
    if result["writer_error"]:
        lines.append(f"the writer stopped early: {result['writer_error']}")
    if args.mixed:
        lines += ["", *mixed_report(result)]
    return "\n".join(lines)


def mixed_report(result: dict) -> list[str]:
    """Memory, retained WAL, DDL and big-transaction lines of a --mixed run."""
    minutes, big = result["minutes"], result["big"]
    lines = ["| minute | " + " | ".join(f"{name} RSS MB" for name in sorted(minutes[0]["rss_mb"])) +
             " | retained WAL MB |", "|---|" + "---|" * (len(minutes[0]["rss_mb"]) + 1)]
    lines += [f"| {m['minute']} | " + " | ".join(str(m["rss_mb"].get(name)) for name in sorted(minutes[0]["rss_mb"]))
              + f" | {m['wal_mb']} |" for m in minutes]
    for name in sorted(minutes[0]["rss_mb"]):
        early = [m["rss_mb"].get(name) for m in minutes if 10 <= m["minute"] <= 20 and m["rss_mb"].get(name)]
        late = [m["rss_mb"].get(name) for m in minutes if 50 <= m["minute"] <= 60 and m["rss_mb"].get(name)]
        if early and late:
            lines.append(f"{name}: highest RSS in minutes 50-60 {max(late)} MB / lowest in minutes 10-20 "
                         f"{min(early)} MB = {max(late) / min(early):.2f}")
    outside = [m["wal_mb"] for m in minutes if not big or not big["minute"] <= m["minute"] <= big["until_minute"] + 1]
    lines.append(f"retained WAL outside the big transaction: at most {max(outside, default=0)} MB")
    lines += [f"DDL at minute {d['minute']} on {d['table']}: the merge's Kafka lag back to zero (bronze and the fresh "
              f"view hold it) {d.get('bronze_s')} s after it, silver {d['caught_up_s']} s" for d in result["ddls"]]
    if big:
        lines.append(f"one transaction of {big['rows']:,} rows at minute {big['minute']}: the merge's Kafka lag back "
                     f"to zero {big.get('bronze_s')} s after its commit, silver {big['caught_up_s']} s")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--rate", type=float, default=10.0, help="one-row transactions per second")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--sample-minutes", type=int, default=5)
    parser.add_argument("--mixed", action="store_true", help="deletes, key changes, DDL, a big transaction, memory")
    parser.add_argument("--ddl-minutes", type=int, default=10)
    parser.add_argument("--big-minute", type=int, default=30)
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    before = bench_env.machine()
    result = run(args, print)
    print(report(args, result, before, bench_env.machine()))


if __name__ == "__main__":
    main()
