"""Benchmark: capture events/s, commit->Kafka latency and capture memory on a huge transaction (not a test).

    .venv/bin/python bench/capture_bench.py [--backlog 200000] [--tx-rows 100] [--writer-rate 5000]
        [--latency-rate 2000] [--latency-seconds 30] [--big-tx 1000000] [--profile 0] [--skip ...]

Runs in its own database, slot, publication and topic prefix (bench/bench_env.py), all removed
at the end. The publication holds bank.transactions (15 columns); every row is one Kafka event.
The slot is created and marked snapshotted with nothing in it, so everything measured is streamed.

- throughput: ``--backlog`` rows are written first (``--tx-rows`` per transaction), then
  ``lib.capture.stream.run(conf, until="caught_up")`` runs in this process and is timed: events / wall
  time from the call to its return (connecting, registry lookups and the final flush included),
  and the steady rate between the first and last one-second metrics callbacks; also the capture's
  CPU time per event (``time.process_time``: all its threads, librdkafka's included), which
  depends less on what else the machine runs. Then the same again while a server-side writer
  inserts ``--writer-rate`` rows/s in 50-row transactions (CPU taken from the same two cores;
  the rate it achieved is reported).
- latency: the capture runs as ``python -m lib.capture.stream --until forever`` in a subprocess, caught
  up; the writer inserts ``--latency-rate`` rows/s in ``--latency-tx-rows``-row transactions
  for ``--latency-seconds``, and a consumer in this process reads every event. Per event:
  commit -> consumer = wall time when the consumer received it minus the transaction's commit
  time (``source.ts_ms``, PostgreSQL's commit timestamp), i.e. commit to readable by a consumer;
  commit -> produce = the message's Kafka CreateTime (set when the capture hands it to the
  producer) minus the same commit time. Same machine, same clock; millisecond resolution.
- memory: a fresh capture subprocess (``--until forever``) is caught up, then one transaction
  inserts ``--big-tx`` rows; the capture's VmRSS is sampled every 0.25 s and its VmHWM (peak
  resident set) read from /proc/<pid>/status once the slot has confirmed the transaction.
- ``--profile N``: one more backlog is captured under cProfile; prints the N functions with the
  most own time and the own time per module (the profiled rate is slower than the real one).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import fastavro
from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config, control, schema_registry  # noqa: E402
from lib.capture import avro_schemas, bootstrap, snapshot_slot, stream  # noqa: E402

TABLE = "bank.transactions"
PHASES = ("backlog", "concurrent", "latency", "memory")
AFTER_S = 15  # resident memory measured this long after the big transaction was acknowledged


def prepare(log) -> dict:
    """Database, publication, topics, schemas (notebook 01's bootstrap) and a slot marked as snapshotted."""
    conf = bench_env.isolated([TABLE])
    bootstrap.run(conf, log=lambda line: None)
    slot = config.get(conf, "source.slot")
    repl, consistent, _ = snapshot_slot.create_slot_with_snapshot(conf, log=lambda line: None)
    repl.close()  # nothing to read: the rows before the slot are not part of this benchmark
    control.put(conf, f"snapshot/{slot}", {"state": "complete", "consistent_lsn": consistent, "rows": {}})
    log(f"setup: database {config.get(conf, 'source.database')}, slot {slot}, topic "
        f"{avro_schemas.topic_name(config.get(conf, 'kafka.topic_prefix'), TABLE)}")
    return conf


def throughput(conf: dict, backlog: int, tx_rows: int, writer_rate: float, log) -> dict:
    """Write the backlog, then time stream.run(until='caught_up'), optionally beside a paced writer."""
    write_s = bench_env.write(conf, backlog, tx_rows, tag="backlog")
    log(f"backlog: {backlog:,} rows in {backlog // tx_rows:,} transactions written in {write_s:.1f} s")
    ticks: list[tuple[float, int]] = []
    stop_writer = bench_env.background_write(conf, writer_rate, 50, "writer") if writer_rate else None
    began, cpu = time.monotonic(), time.process_time()
    result = stream.run(conf, until="caught_up", heartbeat_s=10, metrics_interval_s=1.0,
                        metrics_callback=lambda m: ticks.append((time.monotonic(), m["events"])))
    elapsed, cpu = time.monotonic() - began, time.process_time() - cpu
    out = {"events": result["events"], "elapsed_s": elapsed, "rate": result["events"] / elapsed,
           "cpu_us": cpu / max(result["events"], 1) * 1e6,
           "transactions": result["transactions"], "write_s": write_s, "writer_rate": None,
           "steady": (ticks[-1][1] - ticks[0][1]) / (ticks[-1][0] - ticks[0][0]) if len(ticks) >= 2 else None}
    if stop_writer is not None:
        rows, seconds = stop_writer()
        out["writer_rate"] = rows / seconds
        leftover = bench_env.wal_lsn(conf)  # the writer's rows after the target: the next phase must start clean
        stream.run(conf, until="caught_up", heartbeat_s=10)
        bench_env.wait_confirmed(conf, leftover)
    log(f"capture: {result['events']:,} events in {elapsed:.1f} s = {out['rate']:,.0f} events/s, "
        f"{out['cpu_us']:.1f} µs capture CPU per event (all its threads)"
        + (f" (steady {out['steady']:,.0f}/s)" if out["steady"] else "")
        + (f"; writer achieved {out['writer_rate']:,.0f} rows/s" if out["writer_rate"] else ""))
    return out


def profile(conf: dict, backlog: int, tx_rows: int, top: int, log) -> str:
    """Capture a backlog under cProfile; the top functions by own time and the own time per module."""
    bench_env.write(conf, backlog, tx_rows, tag="profile")
    profiler = cProfile.Profile()
    began = time.monotonic()
    profiler.enable()
    result = stream.run(conf, until="caught_up", heartbeat_s=10)
    profiler.disable()
    elapsed = time.monotonic() - began
    stats = pstats.Stats(profiler)
    total = sum(v[2] for v in stats.stats.values())
    per_module: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in stats.stats.items():
        module = Path(path).name if path not in ("~", "") else name.split(" ")[0].strip("<{")
        per_module[module] = per_module.get(module, 0.0) + own
    lines = [f"profiled: {result['events']:,} events in {elapsed:.1f} s ({result['events'] / elapsed:,.0f}/s under "
             f"cProfile), {total / max(result['events'], 1) * 1e6:.0f} µs own time per event", "",
             "| module (own time) | share |", "|---|---|"]
    for module, own in sorted(per_module.items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"| {module} | {own / total:.0%} |")
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(top)
    text = "\n".join(lines) + "\n\n" + buffer.getvalue()
    log(text)
    return text


def _plain(schema):
    """The schema without logical types (the consumer only needs source.ts_ms; no datetime/Decimal objects)."""
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    return schema


def consume(conf: dict, topic: str, expected: int, started: threading.Event, done: threading.Event,
            out: list) -> None:
    """Read the topic from its current end; per event (receive ms, CreateTime ms, commit ms) into out."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"bench-latency-{time.monotonic_ns()}", "enable.auto.commit": False})
    registry, parsed = schema_registry.client(conf), {}
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                                                 timeout=10)[1])
                         for p in partitions])
        started.set()
        quiet_since = None
        while len(out) < expected:
            batch = consumer.consume(1000, 0)  # what has arrived, at once (a timeout would wait for 1000)
            if not batch:
                first = consumer.poll(0.05)
                batch = [first] if first is not None else []
            received = time.time() * 1000
            if not batch:
                if done.is_set():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 20:
                        break
                continue
            quiet_since = None
            for message in batch:
                value = message.value()
                if message.error() or value is None:
                    continue
                schema_id = int.from_bytes(value[1:5], "big")
                if schema_id not in parsed:
                    parsed[schema_id] = fastavro.parse_schema(_plain(json.loads(
                        registry.get_schema(schema_id).schema_str)))
                event = fastavro.schemaless_reader(io.BytesIO(value[5:]), parsed[schema_id])
                out.append((received, message.timestamp()[1], event["source"]["ts_ms"]))
    finally:
        consumer.close()


def latency(conf: dict, folder: str, rate: float, seconds: float, tx_rows: int, log) -> dict:
    """Commit -> consumer and commit -> produce percentiles while the writer runs at rate rows/s."""
    process = bench_env.start_capture(conf, folder, "latency")
    try:
        topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), TABLE)
        expected = int(rate * seconds)
        samples: list[tuple] = []
        started, done = threading.Event(), threading.Event()
        reader = threading.Thread(target=consume, args=(conf, topic, expected, started, done, samples), daemon=True)
        reader.start()
        started.wait(30)
        write_s = bench_env.write(conf, expected, tx_rows, rate, tag="latency")
        done.set()
        reader.join(120)
        final = bench_env.stop_capture(process, folder, "latency")
    except BaseException:
        process.kill()
        raise
    if len(samples) < expected:
        raise RuntimeError(f"latency: the consumer saw {len(samples)} of {expected} events; capture: {final}")
    to_consumer = sorted(r - c for r, _, c in samples)
    to_produce = sorted(p - c for _, p, c in samples)
    out = {"events": len(samples), "rate": expected / write_s, "tx_rows": tx_rows,
           "consumer": _percentiles(to_consumer), "produce": _percentiles(to_produce)}
    log(f"latency: {len(samples):,} events at {out['rate']:,.0f} rows/s; commit->consumer p50 "
        f"{out['consumer']['p50']:.0f} ms p99 {out['consumer']['p99']:.0f} ms max {out['consumer']['max']:.0f} ms; "
        f"commit->produce p50 {out['produce']['p50']:.0f} ms p99 {out['produce']['p99']:.0f} ms")
    return out


def _percentiles(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p99": q[98], "max": values[-1]}


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in kB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0])
    return fields


def memory(conf: dict, folder: str, rows: int, log) -> dict:
    """Peak resident memory of a capture process while one transaction of `rows` rows is written and streamed."""
    process = bench_env.start_capture(conf, folder, "memory")
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                samples.append(_status(process.pid)["VmRSS"])
            except (OSError, KeyError):
                return
            stop.wait(0.25)

    try:
        idle = _status(process.pid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        write_s = bench_env.write(conf, rows, rows, tag="bigtx")
        committed = time.monotonic()
        log(f"memory: one transaction of {rows:,} rows committed after {write_s:.1f} s")
        bench_env.wait_confirmed(conf, bench_env.wal_lsn(conf), timeout_s=1800)
        replay_s = time.monotonic() - committed
        peak = _status(process.pid)
        stop.set()
        sampler.join()
        time.sleep(AFTER_S)  # the capture's metrics ticks (every 5 s here) trim the heap once nothing is in flight
        after = _status(process.pid)
        final = bench_env.stop_capture(process, folder, "memory")
    except BaseException:
        stop.set()
        process.kill()
        raise
    events = int(re.search(r": (\d+) events", final)[1])
    out = {"rows": rows, "events": events, "idle_mb": idle["VmRSS"] / 1024, "hwm_mb": peak["VmHWM"] / 1024,
           "max_sampled_mb": max(samples) / 1024 if samples else None, "after_mb": after["VmRSS"] / 1024,
           "write_s": write_s, "replay_s": replay_s,
           "replay_rate": rows / replay_s}
    log(f"memory: idle {out['idle_mb']:.0f} MB, peak (VmHWM) {out['hwm_mb']:.0f} MB, {AFTER_S} s after "
        f"{out['after_mb']:.0f} MB; streamed transaction sent in "
        f"{replay_s:.1f} s after its commit ({out['replay_rate']:,.0f} events/s)")
    return out


def report(args, results: dict, load_before: str, load_after: str) -> str:
    """The results as a markdown table."""
    rows = ["| measurement | result | target |", "|---|---|---|"]
    for phase, label in (("backlog", f"capture of a {args.backlog:,}-event backlog ({args.tx_rows}-row transactions)"),
                         ("concurrent", "the same beside a writer at {writer_rate:,.0f} rows/s (asked "
                                        f"{args.writer_rate:,.0f})")):
        if phase in results:
            r = results[phase]
            label = label.format(writer_rate=r["writer_rate"] or 0)
            steady = f", steady {r['steady']:,.0f}" if r["steady"] else ""
            met = "met" if r["rate"] >= 20_000 else "missed"
            rows.append(f"| {label} | {r['rate']:,.0f} events/s ({r['events']:,} events in {r['elapsed_s']:.1f} s"
                        f"{steady}; {r['cpu_us']:.1f} µs CPU/event) | ≥ 20,000 events/s ({met}) |")
    if "latency" in results:
        r = results["latency"]
        rows.append(f"| commit → consumer, writer at {r['rate']:,.0f} rows/s in {r['tx_rows']}-row transactions "
                    f"({r['events']:,} events) | p50 {r['consumer']['p50']:.0f} ms, p99 {r['consumer']['p99']:.0f} ms, "
                    f"max {r['consumer']['max']:.0f} ms | — |")
        rows.append(f"| commit → produce (Kafka CreateTime), same run | p50 {r['produce']['p50']:.0f} ms, p99 "
                    f"{r['produce']['p99']:.0f} ms | — |")
    if "memory" in results:
        r = results["memory"]
        met = "met" if r["hwm_mb"] <= 200 else "missed"
        rows.append(f"| capture peak RSS (VmHWM), one {r['rows']:,}-row transaction | {r['hwm_mb']:.0f} MB (idle "
                    f"{r['idle_mb']:.0f} MB; sent {r['replay_s']:.0f} s after commit, {r['replay_rate']:,.0f} "
                    f"events/s) | ≤ 200 MB ({met}) |")
        rows.append(f"| capture RSS {AFTER_S} s after that transaction was acknowledged | {r['after_mb']:.0f} MB (idle "
                    f"{r['idle_mb']:.0f} MB) | ≤ 1.1 × idle (issue 30's soak) |")
    return "\n".join(rows) + f"\n\nmachine before: {load_before}; after: {load_after}"


def main(argv=None) -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=200_000, help="rows (= events) written before the capture")
    parser.add_argument("--tx-rows", type=int, default=100, help="rows per backlog transaction")
    parser.add_argument("--writer-rate", type=float, default=5_000, help="concurrent writer, rows/s")
    parser.add_argument("--latency-rate", type=float, default=2_000, help="writer rows/s during the latency run")
    parser.add_argument("--latency-tx-rows", type=int, default=10, help="rows per transaction in the latency run")
    parser.add_argument("--latency-seconds", type=float, default=30)
    parser.add_argument("--big-tx", type=int, default=1_000_000, help="rows in the one transaction of the memory run")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also profile a backlog; show N functions")
    parser.add_argument("--skip", nargs="*", default=[], choices=PHASES)
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    load_before = bench_env.machine()
    log(f"machine: {load_before}")
    conf = prepare(log)
    results: dict = {}
    folder = tempfile.mkdtemp(prefix="capture_bench_")
    try:
        if "backlog" not in args.skip:
            results["backlog"] = throughput(conf, args.backlog, args.tx_rows, 0, log)
        if "concurrent" not in args.skip:
            results["concurrent"] = throughput(conf, args.backlog, args.tx_rows, args.writer_rate, log)
        if args.profile:
            results["profile"] = profile(conf, args.backlog, args.tx_rows, args.profile, log)
        if "latency" not in args.skip:
            results["latency"] = latency(conf, folder, args.latency_rate, args.latency_seconds, args.latency_tx_rows,
                                         log)
        if "memory" not in args.skip:
            results["memory"] = memory(conf, folder, args.big_tx, log)
    except BaseException:
        log(f"the capture subprocesses' output stays in {folder}")
        raise
    else:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        bench_env.cleanup(conf, log)
    print()
    print(report(args, results, load_before, bench_env.machine()))


if __name__ == "__main__":
    main()
