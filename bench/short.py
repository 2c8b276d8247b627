"""The short benchmarks in one table (make bench): capture backlog over TLS and plain TCP, snapshot, merge catch-up.

    .venv/bin/python bench/short.py [--backlog 100000] [--snapshot-rows 100000] [--merge-events 20000]

A guard against silent regressions, not a test: each benchmark runs as its own process with small sizes
(bench/capture_bench.py backlog only, bench/snapshot_bench.py one round with the JDBC reader,
bench/tables_bench.py the initial load and one catch-up of one table), together in a few minutes. The figure
to compare from one run to the next is the capture's CPU per event: it moves least with what else the machine
runs; the walsender's TLS state is read from pg_stat_ssl during the run. docs/benchmarks.md keeps a dated line
of it for every change to lib/capture. The load average before and after says how busy the machine was.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above
import capture_ab  # noqa: E402

from lib import config  # noqa: E402

HERE = Path(__file__).resolve().parent
SNAPSHOT = re.compile(r"round 1: snapshot \((\w+)\) ([\d,]+) rows in ([\d.]+) s \(([\d,]+) rows/s\)")
COPY = re.compile(r"round 1: COPY ([\d,]+) rows in ([\d.]+) s \(([\d,]+) rows/s\)")
CATCH_UP = re.compile(r"^(.+?): bronze ([\d,]+) messages in ([\d.]+) s over (\d+) batch\(es\) \[[^\]]*\], ([\d,]+)/s; "
                      r"silver step ([\d.]+) s over (\d+) table\(s\)", re.M)


def run(script: str, *args: str) -> str:
    """One benchmark script's output (it fails loudly with its own output)."""
    command = [sys.executable, str(HERE / script), *args]
    done = subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=100_000, help="capture backlog rows (= events)")
    parser.add_argument("--snapshot-rows", type=int, default=100_000, help="rows in bank.transactions")
    parser.add_argument("--merge-events", type=int, default=20_000, help="row changes in the merge catch-up")
    args = parser.parse_args(argv)
    conf = config.load("local")
    load_before, began = bench_env.machine(), time.monotonic()
    print(f"machine before: {load_before}", flush=True)
    rows = []
    for mode, label in (("require", "TLS"), ("disable", "plain TCP")):
        r = capture_ab.run_once(HERE.parent, sys.executable, args.backlog, 100, mode, conf)
        rows.append((f"capture backlog, {label} (PGSSLMODE={mode}; walsender: {r['tls']})",
                     f"{r['events']:,} events", f"**{r['cpu_us']:.1f} µs CPU/event**, {r['rate']:,} events/s",
                     r["seconds"]))
        print(f"capture {label}: {r['rate']:,} events/s, {r['cpu_us']:.1f} µs CPU per event", flush=True)
    out = run("snapshot_bench.py", "--rows", str(args.snapshot_rows), "--rounds", "1", "--readers", "jdbc")
    copy, snap = COPY.search(out), SNAPSHOT.search(out)
    rows.append(("snapshot, JDBC reader, cold JVM (lib.capture.snapshot.run)", f"{snap[2]} rows",
                 f"{snap[4]} rows/s (COPY TO STDOUT: {copy[3]} rows/s)", float(snap[3])))
    print(f"snapshot: {snap[4]} rows/s", flush=True)
    out = run("tables_bench.py", "--small", "2", "--big-rows", "10000", "--tables", "1", "--events",
              str(args.merge_events))
    found = CATCH_UP.findall(out)
    if not found:  # a table without the merge's rows would read as a complete run
        raise SystemExit(f"bench/tables_bench.py printed no catch-up line this script can read:\n{out[-2000:]}")
    for label, messages, seconds, batches, rate, silver_s, tables in found:
        rows.append((f"merge catch-up: {label}", f"{messages} messages",
                     f"bronze {rate} messages/s ({batches} batch(es)); then the silver step {silver_s} s over "
                     f"{tables} table(s)", float(seconds)))
        print(f"merge {label}: bronze {rate} messages/s, silver step {silver_s} s", flush=True)
    print()
    print("| benchmark | size | result | seconds |")
    print("|---|---|---|---|")
    for label, size, result, seconds in rows:
        print(f"| {label} | {size} | {result} | {seconds:.1f} |")
    print(f"\nmachine before: {load_before}; after: {bench_env.machine()}; "
          f"all of it in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
