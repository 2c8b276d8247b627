"""Benchmark: commit -> Delta (silver, and the fresh view) latency with capture and merge running continuously.

    .venv/bin/python bench/latency_bench.py [--intervals 1 5] [--rate 10] [--tx-rows 1] [--seconds 60]
        [--warmup 15]

Runs in its own database, slot, publication and topic prefix (bench/bench_env.py) with the lake in a
temporary folder, all removed at the end. The publication holds bank.transactions; notebook 01's
bootstrap and notebook 02's snapshot (lib.capture.snapshot, the sample's few hundred rows) run first, so the
merge starts from the real initial load.

- the capture runs as ``python -m lib.capture.stream --until forever`` in a subprocess (its own process, as
  in production);
- the merge runs in this process: ``lib.lake.merge.start(conf, spark, trigger="processing_time",
  interval=...)``, once per ``--intervals`` value (same checkpoint, so each phase picks up where the
  previous one stopped);
- per phase: a warm-up (the server-side writer inserts ``--rate`` rows/s in ``--tx-rows``-row
  transactions for ``--warmup`` s, then the bench waits until the merge has them all: a query's first
  micro-batch pays for starting it, the first phase's also for creating the Delta tables), then the
  measured writes, tagged, for ``--seconds`` s, and again a wait until the merge has them all.

Measured per event, afterwards and without polling (nothing competes with the merge for the two
cores while it runs): bronze keeps each event's ``source.ts_ms`` (PostgreSQL's commit time), its
Kafka CreateTime (set when the capture hands it to the producer) and its micro-batch id. The silver
append of micro-batch b is the Delta commit whose ``userMetadata`` carries b; its silver MERGE is the
last MERGE commit written before the batch body recorded it done (``seconds_by_table``). A commit
becomes visible to readers when its ``_delta_log/<version>.json`` is written, so that file's
modification time is when the change became visible in silver. latency = visible - commit. Where the
time goes: commit -> Kafka, Kafka -> start of the micro-batch (waiting for the trigger or for the
previous batch; the start is the query progress' ``timestamp``), batch start -> bronze commit
(planning, decoding, the bronze append), bronze commit -> silver commit (the MERGE). Same machine,
same clock; millisecond resolution. Inside the foreachBatch body (it runs in this process), timers
around lib.lake.merge's steps give the control-topic read, decoding with its count job, the bronze append and
the silver MERGE (plus Delta's own MERGE metrics); the rest of the body is reading the batch from Kafka
with its first job (which topics and schema ids it holds) and resolving the schemas.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from pyspark.sql import DataFrameWriter
from pyspark.sql import functions as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config  # noqa: E402
from lib import spark as spark_session  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import lake_paths, merge, micro_batch, silver_table  # noqa: E402

TABLE = "bank.transactions"
# where the foreachBatch body's steps live (lib/lake/micro_batch.py calls them by these module names)
STEPS = {(micro_batch, "truncates"): "control topic read", (micro_batch, "_counts"): "decode + count job",
         (silver_table, "merge_silver"): "silver MERGE"}
PARTS = (("capture", "commit -> Kafka"), ("wait", "Kafka -> batch start"), ("bronze", "batch start -> bronze"),
         ("silver", "bronze -> silver"), ("total", "commit -> silver"))


def prepare(folder: str, log) -> dict:
    """Isolated conf, bootstrap (publication, topics, schemas) and the snapshot."""
    conf = bench_env.isolated([TABLE], {"CDC__LAKE__ROOT": os.path.join(folder, "lake")})
    log(f"database {config.get(conf, 'source.database')}, topic prefix {conf['bench_prefix']}, lake {folder}/lake")
    bootstrap.run(conf, log=lambda line: None)
    return conf


def wait_merged(conf: dict, query, log, timeout_s: float = 900.0) -> None:
    """Wait until the merge query has finished batches up to the table topic's current end (every partition)."""
    spec = lake_paths.table_specs(conf)[0]
    ends = bench_env.topic_ends(conf, [spec.topic])[spec.topic]
    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        if query.exception() is not None:
            raise RuntimeError(f"the merge query failed: {query.exception()}")
        history = query.merge_context.history
        if len(history) > seen:
            seen = len(history)
            log(f"  waiting for the merge to catch up: batch {history[-1]['batch_id']} took "
                f"{history[-1].get('seconds')} s")
        read = bench_env.committed_offsets(conf).get(spec.topic, {})
        if all(int(read.get(p, -1)) >= end for p, end in ends.items()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the merge did not reach the end of {spec.topic} ({ends}) within {timeout_s:.0f} s")


def instrument() -> dict[str, float]:
    """Time steps of the merge's foreachBatch body (it runs in this process): seconds spent per step so far.

    Wraps the merge's step functions and DataFrameWriter.save (in the body only the bronze append saves;
    dead letters would too, and the bench has none) with timers, in this process only.
    """
    spent = {name: 0.0 for name in [*STEPS.values(), "bronze append"]}
    targets = [(owner, function, label) for (owner, function), label in STEPS.items()]
    for owner, function, label in [*targets, (DataFrameWriter, "save", "bronze append")]:
        original = getattr(owner, function)

        def timed(*args, _original=original, _label=label, **kwargs):
            began = time.monotonic()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] += time.monotonic() - began

        setattr(owner, function, timed)
    return spent


def write_and_wait(conf: dict, query, rate: float, tx_rows: int, seconds: float, tag: str, log) -> int:
    """Write tagged rows for `seconds`, then wait until Kafka and the merge have all of them; rows written."""
    stop = bench_env.background_write(conf, rate, tx_rows, tag)
    time.sleep(seconds)
    rows, _ = stop()
    bench_env.wait_confirmed(conf, bench_env.wal_lsn(conf))
    wait_merged(conf, query, log)
    return rows


def run_phase(conf: dict, spark, interval: float, args, spent: dict[str, float], log) -> dict:
    """One merge query with a processing-time trigger: a warm-up, then the measured writes; what it recorded."""
    query = merge.start(conf, spark, trigger="processing_time", interval=f"{interval:g} seconds")
    try:
        write_and_wait(conf, query, args.rate, args.tx_rows, args.warmup, f"warm{uuid.uuid4().hex[:6]}", log)
        first = len(query.merge_context.history)
        before = dict(spent)
        jobs_before = _jobs(spark, query)
        tag = f"lat{uuid.uuid4().hex[:6]}"
        rows = write_and_wait(conf, query, args.rate, args.tx_rows, args.seconds, tag, log)
        history = query.merge_context.history[first:]
        steps = {k: (spent[k] - before[k]) / max(1, len(history)) for k in spent}
        jobs = (_jobs(spark, query) - jobs_before) / max(1, len(history)) if jobs_before is not None else None
        progress = list(query.recentProgress)
    finally:
        query.stop()
    log(f"interval {interval:g} s: {rows} rows measured, {len(history)} micro-batches")
    return {"interval": interval, "tag": tag, "rows": rows, "progress": progress, "history": history,
            "steps": steps, "jobs": jobs}


def _jobs(spark, query) -> int | None:
    """Spark jobs the query's run has started so far (its job group is the run id), None if unknown."""
    try:
        return len(spark.sparkContext.statusTracker().getJobIdsForGroup(str(query.runId)))
    except Exception:  # noqa: BLE001 - a nice-to-have figure
        return None


def delta_commits(table_path: str) -> list[dict]:
    """Every commit of a Delta table, oldest first: {'ms': modification time of its commit file (written when
    the commit becomes visible to readers), 'operation', 'metrics' (operationMetrics), 'batch' (the micro-batch
    id a bronze append carries in userMetadata, else None)}."""
    commits = []
    for path in sorted(Path(table_path, "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in path.read_text().splitlines()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        try:
            batch = json.loads(info.get("userMetadata") or "{}").get("batch")
        except ValueError:
            batch = None
        commits.append({"ms": path.stat().st_mtime * 1000, "operation": info.get("operation"),
                        "metrics": info.get("operationMetrics") or {}, "batch": batch})
    return commits


def silver_commits(table_path: str, history: list[dict], table: str) -> dict[int, dict]:
    """Micro-batch id -> its silver MERGE commit: the last MERGE commit written before the batch's
    foreachBatch body recorded the MERGE as done (``seconds_by_table[table]['silver_at']``)."""
    merges = [c for c in delta_commits(table_path) if c["operation"] == "MERGE"]
    found = {}
    for batch in history:
        done = batch.get("seconds_by_table", {}).get(table, {}).get("silver_at")
        before = [c for c in merges if done is not None and c["ms"] <= done * 1000 + 50]
        if before:
            found[batch["batch_id"]] = before[-1]
    return found


def batch_starts(progress: list[dict]) -> dict[int, float]:
    """Micro-batch id -> trigger start (ms since the epoch) from the query's progress reports."""
    starts = {}
    for report in progress:
        if report.get("numInputRows", 0) > 0:
            stamp = datetime.fromisoformat(report["timestamp"].replace("Z", "+00:00"))
            starts[int(report["batchId"])] = stamp.timestamp() * 1000
    return starts


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def measure(conf: dict, spark, phase: dict) -> dict:
    """Per measured event: the latency and its parts, in seconds; per micro-batch: where its time went."""
    spec = lake_paths.table_specs(conf)[0]
    bronze = spark.read.format("delta").load(lake_paths.bronze_path(conf, spec))
    events = bronze.filter(~F.col("_tombstone") & F.array_contains(F.col("after.tags"), phase["tag"])).select(
        F.col("source.ts_ms").alias("commit"), F.unix_millis("_kafka_timestamp").alias("kafka"),
        F.col("_batch_id").alias("batch")).collect()
    silver = silver_commits(lake_paths.silver_path(conf, spec), phase["history"], spec.qualified)
    bronze_at = {c["batch"]: c for c in delta_commits(lake_paths.bronze_path(conf, spec)) if c["batch"] is not None}
    starts = batch_starts(phase["progress"])
    parts: dict[str, list[float]] = {name: [] for name, _ in PARTS} | {"fresh": []}
    for e in events:
        b = e["batch"]
        points = (e["commit"], e["kafka"], starts.get(b), bronze_at[b]["ms"], silver[b]["ms"])
        for (name, _), a, z in zip(PARTS[:-1], points[:-1], points[1:], strict=True):
            if a is not None and z is not None:
                parts[name].append((z - a) / 1000)
        parts["total"].append((silver[b]["ms"] - e["commit"]) / 1000)
        parts["fresh"].append((bronze_at[b]["ms"] - e["commit"]) / 1000)  # the fresh view shows bronze's newest batch
    batches = sorted({e["batch"] for e in events})
    stats = {name: {"p50": percentile(v, 50), "p99": percentile(v, 99), "mean": sum(v) / len(v)}
             for name, v in parts.items() if v}
    durations = [r["durationMs"] for r in phase["progress"] if int(r["batchId"]) in batches]
    steps = ("latestOffset", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "triggerExecution")
    per_batch = {k: sum(d.get(k, 0) for d in durations) / max(1, len(durations)) / 1000 for k in steps}
    merge_metrics = ("executionTimeMs", "materializeSourceTimeMs", "scanTimeMs", "rewriteTimeMs")
    in_merge = {k: sum(int(silver[b]["metrics"].get(k, 0)) for b in batches) / max(1, len(batches)) / 1000
                for k in merge_metrics}
    body = [h["seconds"] for h in phase["history"] if "seconds" in h]
    return {"events": len(parts["total"]), "batches": len(batches), "stats": stats, "per_batch": per_batch,
            "merge_metrics": in_merge, "body_s": sum(body) / len(body) if body else None,
            "missing_starts": sum(1 for b in batches if b not in starts)}


def report(args, phases: list[dict], load_before: str, load_after: str) -> str:
    """Markdown for docs/benchmarks.md."""
    lines = [f"rate {args.rate:g} rows/s in {args.tx_rows}-row transactions, {args.seconds:g} s measured per "
             f"interval after a {args.warmup:g} s warm-up; machine before: {load_before}; after: {load_after}", "",
             "| trigger interval | events | micro-batches | commit -> silver p50 | p99 | "
             "commit -> fresh view p50 | p99 | "
             + " | ".join(f"{label} p50" for _, label in PARTS[:-1]) + " |", "|---" * (7 + len(PARTS) - 1) + "|"]
    for phase in phases:
        m, s = phase["result"], phase["result"]["stats"]
        lines.append(f"| {phase['interval']:g} s | {m['events']} | {m['batches']} | {s['total']['p50']:.2f} s | "
                     f"{s['total']['p99']:.2f} s | {s['fresh']['p50']:.2f} s | {s['fresh']['p99']:.2f} s | "
                     + " | ".join(f"{s[name]['p50']:.2f} s" if name in s else "?" for name, _ in PARTS[:-1]) + " |")
    lines.append("")
    for phase in phases:
        m = phase["result"]
        lines.append(
            f"- {phase['interval']:g} s trigger, mean per micro-batch: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in m["per_batch"].items())
            + (f"; foreachBatch body {m['body_s']:.2f} s" if m["body_s"] else "") + " = "
            + ", ".join(f"{k} {v:.2f} s" for k, v in phase["steps"].items())
            + (f", the rest {m['body_s'] - sum(phase['steps'].values()):.2f} s" if m["body_s"] else "")
            + "; in the MERGE (Delta's metrics): " + ", ".join(f"{k} {v:.2f} s" for k, v in m["merge_metrics"].items())
            + (f"; {phase['jobs']:.0f} Spark jobs" if phase["jobs"] else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=float, nargs="+", default=[1.0, 5.0], help="trigger intervals, seconds")
    parser.add_argument("--rate", type=float, default=10.0, help="rows/s written during each phase")
    parser.add_argument("--tx-rows", type=int, default=1, help="rows per transaction")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per interval")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds written but not measured per interval")
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    load_before = bench_env.machine()
    log(f"machine: {load_before}")
    folder = tempfile.mkdtemp(prefix="latency_bench_")
    conf = prepare(folder, log)
    spark, capture, phases = None, None, []
    try:
        spark = spark_session.from_conf(conf, catalog="in-memory")
        spark.sparkContext.setLogLevel("ERROR")
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "10000")
        began = time.monotonic()
        done = snapshot.run(conf, spark, log=lambda line: None)
        log(f"snapshot: {done['rows']} rows in {time.monotonic() - began:.1f} s")
        capture = bench_env.start_capture(conf, folder, interval=10)
        spent = instrument()
        for interval in args.intervals:
            phase = run_phase(conf, spark, interval, args, spent, log)
            phase["result"] = measure(conf, spark, phase)
            s = phase["result"]["stats"]["total"]
            fresh = phase["result"]["stats"]["fresh"]
            log(f"interval {interval:g} s: {phase['result']['events']} events, commit -> silver p50 {s['p50']:.2f} s, "
                f"p99 {s['p99']:.2f} s; commit -> fresh view p50 {fresh['p50']:.2f} s, p99 {fresh['p99']:.2f} s")
            phases.append(phase)
        log(bench_env.stop_capture(capture, folder))
        capture = None
    finally:
        bench_env.finish(conf, folder, spark, capture, log)
    print()
    print(report(args, phases, load_before, bench_env.machine()))


if __name__ == "__main__":
    main()
