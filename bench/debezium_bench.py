"""Benchmark: our capture and Debezium's embedded engine on the same backlog, one after the other (not a test).

    .venv/bin/python bench/debezium_bench.py [--backlog 100000] [--tx-rows 100] [--sslmode require]
        [--rounds 1] [--json-schemas]

Runs in its own database (bench/bench_env.py), with the publication of bank.transactions (15 columns) and two
slots made before the backlog is written, so both hold the same ``--backlog`` rows (one event each):

- ours: ``lib.capture.stream.run(conf, until="caught_up")`` in this process, to Kafka (Avro, the registry,
  acks=all, idempotent), as bench/capture_bench.py times it: events/s from the call to its return, and its CPU
  time (``time.process_time``: every thread, librdkafka's included) per event;
- Debezium: the PostgreSQL connector (docs/debezium.md's 3.7.0.Final, pgoutput, the publication above,
  ``snapshot.mode=no_data``) in an embedded engine in a JVM (bench/debezium/, built with Maven into
  .stack/cache/debezium-bench the first time), its events converted by Kafka's JsonConverter (schemas off unless
  ``--json-schemas``: the cheaper setting for Debezium) and handed to a consumer in the same process that counts
  them; no Kafka on its side. Timed from just before the engine is built (the JVM's own start-up left out) until
  the consumer has counted every event: wall time and the JVM's CPU time (every thread).

Both connect with PGSSLMODE / ``database.sslmode`` = ``--sslmode``; each walsender's TLS state is read from
pg_stat_ssl while it runs. Each round writes a new backlog and gives Debezium a new slot (its engine keeps
offsets in memory). Prints a table with both and the ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above
import capture_ab  # noqa: E402

from lib import config, control, secrets, source  # noqa: E402
from lib.capture import bootstrap, snapshot_slot, stream  # noqa: E402
from lib.local import stack  # noqa: E402
from lib.local.stack import fetch  # noqa: E402

TABLE = "bank.transactions"
PROJECT = Path(__file__).resolve().parent / "debezium"
MAIN = "local.cdc.bench.EmbeddedBench"


def build(conf: dict, log) -> str:
    """The harness's classpath; built with Maven into .stack/cache/debezium-bench when its sources changed."""
    cache = stack.stack_dir(conf) / "cache"
    out = cache / "debezium-bench"
    sources = [PROJECT / "pom.xml", *sorted((PROJECT / "src").rglob("*.java"))]
    stamp = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    jar = out / "debezium-embedded-bench-1.jar"
    if not (jar.is_file() and fetch.cached(out, stamp)):
        log("debezium: building bench/debezium with Maven (once; the jars go to .stack/cache)")
        fetch.maven(["-q", "-f", str(PROJECT / "pom.xml"), f"-Dbench.build.dir={out}", "package"], cache / "m2",
                    stack.stack_dir(conf) / "logs" / "debezium-bench-build.log", "the Debezium embedded harness")
        (out / fetch.DONE).write_text(stamp)
    return os.pathsep.join([str(jar), str(out / "lib" / "*")])


def prepare(log) -> dict:
    """Database, publication, topics and schemas (notebook 01's bootstrap); our slot marked as snapshotted."""
    conf = bench_env.isolated([TABLE])
    bootstrap.run(conf, log=lambda line: None)
    repl, consistent, _ = snapshot_slot.create_slot_with_snapshot(conf, log=lambda line: None)
    repl.close()  # the rows before the slot are not part of this benchmark
    control.put(conf, f"snapshot/{config.get(conf, 'source.slot')}",
                {"state": "complete", "consistent_lsn": consistent, "rows": {}})
    return conf


def debezium_slot(conf: dict, name: str) -> None:
    """A pgoutput slot of Debezium's own, made before the backlog is written (so it holds it too)."""
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    finally:
        conn.close()


def drop_slot(conf: dict, name: str) -> None:
    conn = source.connect(conf, dbname="postgres")
    conn.autocommit = True
    try:
        bench_env.drop_slot_when_free(conn, name)
    finally:
        conn.close()


def ours(conf: dict) -> dict:
    """stream.run until caught up, timed as bench/capture_bench.py does."""
    with capture_ab.SslWatch(conf) as watch:
        began, cpu = time.monotonic(), time.process_time()
        result = stream.run(conf, until="caught_up", heartbeat_s=10)
        elapsed, cpu = time.monotonic() - began, time.process_time() - cpu
    return {"events": result["events"], "seconds": elapsed, "cpu_seconds": cpu,
            "tls": watch.describe_slot(config.get(conf, "source.slot"))}


def debezium(conf: dict, classpath: str, slot: str, events: int, sslmode: str, schemas: bool, folder: str) -> dict:
    """The embedded engine in a JVM until its consumer counted events."""
    props = {
        "name": "bench", "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "10000",
        "database.hostname": config.get(conf, "source.host"), "database.port": str(config.get(conf, "source.port")),
        "database.user": config.get(conf, "source.user"), "database.dbname": config.get(conf, "source.database"),
        "database.sslmode": sslmode, "topic.prefix": f"{conf['bench_prefix']}-dbz", "plugin.name": "pgoutput",
        "slot.name": slot, "publication.name": config.get(conf, "source.publication"),
        "publication.autocreate.mode": "disabled", "snapshot.mode": "no_data", "table.include.list": TABLE,
        "converter.schemas.enable": "true" if schemas else "false",
    }
    path = Path(folder) / "engine.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    env = {**os.environ, "DEBEZIUM_BENCH_PASSWORD": secrets.setting(conf, "source.password")}
    topic = f"{props['topic.prefix']}.{TABLE}"
    command = ["java", "-Xmx1g", "-cp", classpath, MAIN, str(path), str(events), "1200", topic]
    with capture_ab.SslWatch(conf) as watch:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"no result (exit {done.returncode})"}
    if done.returncode or "error" in result:
        raise RuntimeError(f"Debezium embedded: {result.get('error')}\n{done.stderr[-3000:]}")
    result["tls"] = watch.describe_slot(slot)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=100_000, help="rows (= events) written before each round")
    parser.add_argument("--tx-rows", type=int, default=100, help="rows per backlog transaction")
    parser.add_argument("--sslmode", default="require", help="libpq/JDBC sslmode for both: require or disable")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (backlog, ours, Debezium)")
    parser.add_argument("--json-schemas", action="store_true", help="JsonConverter with schemas (its default)")
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    os.environ["PGSSLMODE"] = args.sslmode  # every libpq connection of this process, the capture's included
    load_before = bench_env.machine()
    log(f"machine: {load_before}")
    classpath = build(config.load("local"), log)
    conf = prepare(log)
    folder = tempfile.mkdtemp(prefix="debezium_bench_")
    rows = []
    try:
        for i in range(1, args.rounds + 1):
            slot = f"{config.get(conf, 'source.slot')}_dbz{i}"
            debezium_slot(conf, slot)
            write_s = bench_env.write(conf, args.backlog, args.tx_rows, tag=f"round{i}")
            log(f"round {i}: {args.backlog:,} rows in {args.backlog // args.tx_rows:,} transactions written in "
                f"{write_s:.1f} s; held by slots {config.get(conf, 'source.slot')} and {slot}")
            a = ours(conf)
            log(f"round {i}: ours {a['events']:,} events in {a['seconds']:.1f} s = {a['events'] / a['seconds']:,.0f}"
                f"/s, {a['cpu_seconds'] / a['events'] * 1e6:.1f} µs CPU per event (walsender {a['tls']})")
            b = debezium(conf, classpath, slot, args.backlog, args.sslmode, args.json_schemas, folder)
            log(f"round {i}: Debezium {b['events']:,} events in {b['seconds']:.1f} s = "
                f"{b['events'] / b['seconds']:,.0f}/s, {b['cpu_seconds'] / b['events'] * 1e6:.1f} µs CPU per event; "
                f"from its first event (after {b['first_event_seconds']:.1f} s) "
                f"{b['events'] / b['streaming_seconds']:,.0f}/s, "
                f"{b['streaming_cpu_seconds'] / b['events'] * 1e6:.1f} µs CPU per event (walsender {b['tls']})")
            drop_slot(conf, slot)
            rows.append((i, a, b))
    finally:
        bench_env.cleanup(conf, log)
    print()
    print("| round | capture | walsender (pg_stat_ssl) | events | events/s | CPU per event |")
    print("|---|---|---|---|---|---|")
    for i, a, b in rows:
        streaming = {**b, "seconds": b["streaming_seconds"], "cpu_seconds": b["streaming_cpu_seconds"]}
        for name, r in (("ours: Python + compiled hot path, to Kafka (call to return)", a),
                        ("Debezium 3.7.0.Final embedded, JSON, counted in-process (engine built to last event)", b),
                        ("the same Debezium run, from its first event to its last (streaming alone)", streaming)):
            print(f"| {i} | {name} | {r['tls']} | {r['events']:,} | {r['events'] / r['seconds']:,.0f} | "
                  f"{r['cpu_seconds'] / r['events'] * 1e6:.1f} µs |")
    print()
    for i, a, b in rows:
        ours_rate, ours_cpu = a["events"] / a["seconds"], a["cpu_seconds"] / a["events"]
        for what, seconds, cpu in (("engine built to last event", b["seconds"], b["cpu_seconds"]),
                                   ("streaming alone", b["streaming_seconds"], b["streaming_cpu_seconds"])):
            print(f"round {i}, against Debezium's {what}: ours {ours_rate / (b['events'] / seconds):.2f}× its "
                  f"events/s; its CPU per event {cpu / b['events'] / ours_cpu:.2f}× ours")
    print(f"\nmachine before: {load_before}; after: {bench_env.machine()}; PGSSLMODE / database.sslmode="
          f"{args.sslmode}; backlog {args.backlog:,} rows in {args.tx_rows}-row transactions")


if __name__ == "__main__":
    main()
