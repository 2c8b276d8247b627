"""Continuous mode: the capture (slot -> Kafka) and the merge (Kafka -> Delta) as long-running processes.

``start(conf)`` (``make run``, ``python -m lib.service start``) launches both as detached processes
and returns; ``stop(conf)`` (``make stop``) sends SIGTERM and waits: the capture flushes Kafka and
acknowledges what Kafka acknowledged, the merge stops its query between micro-batches (waiting up
to ``service.stop_grace_s`` for a running one). ``state(conf, name)`` tells
running / stopped / crashed. A notebook cell can call the same functions.

Each process runs ``python -m lib.service run capture|merge``, the same entry point the bundle's
continuous Databricks jobs call:

- **capture**: ``lib.stream.run(conf, until="forever")``;
- **merge**: ``lib.merge.start(conf, spark, trigger="processing_time", interval=service.merge_interval)``,
  started again when Spark stops the query after batches went through (see ``merge.run_until_caught_up``),
  up to ``service.merge_restarts`` times in a row without progress; a failing micro-batch stops it.

Both append a metrics record every ``service.metrics_interval_s`` to the history ``lib.monitor``
reads. Files live in ``<service.dir>/<slot>/``: ``<name>.pid``, ``<name>.log``,
``<name>.metrics.jsonl`` and ``conf.json`` (the conf the processes run with: names and secret
references only, never secret values).

**Restart after a crash resumes where it left off**: the capture from the slot's confirmed position
(at-least-once; duplicates carry their source position), the merge from its checkpoint (Delta
commits are idempotent per micro-batch). ``start`` notices a pid file whose process died and starts
it again. There is no supervisor locally: ``make status`` warns about a dead service. On Databricks
the continuous jobs restart failed runs.

**Operators: a stopped capture keeps WAL on the source until it runs again. To stop for good, run
``make teardown`` after ``make stop`` (it drops the slot).**
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from lib import config, control, monitor, runtime
from lib.stack import process

SERVICES = ("capture", "merge")
DEFAULT_MERGE_INTERVAL = "10 seconds"
DEFAULT_MERGE_RESTARTS = 3
STOP_TIMEOUT_S = 90.0
STOP_GRACE_S = 45.0  # how long the merge waits for a running micro-batch to finish before stopping
START_CHECK_S = 3.0


class ServiceError(RuntimeError):
    """A service could not be started, stopped or run; the message names the cause and the remedy."""


# ---------------------------------------------------------------------------------------------
# files and state


def files(conf: dict, name: str) -> dict[str, Path]:
    """pid file, log file and metrics history of a service."""
    _check_name(name)
    folder = monitor.service_dir(conf)
    return {"pid": folder / f"{name}.pid", "log": folder / f"{name}.log", "metrics": monitor.metrics_path(conf, name)}


def _check_name(name: str) -> None:
    if name not in SERVICES:
        raise ValueError(f"service must be one of {', '.join(SERVICES)}, not {name!r}")


def _marker(name: str) -> str:
    return f"lib.service run {name}"


def state(conf: dict, name: str) -> dict:
    """{service, state: running|stopped|crashed, pid, log, last_line}; crashed = pid file of a dead process."""
    paths = files(conf, name)
    pid = process.read_pid(paths["pid"])
    row = {"service": name, "state": "stopped", "pid": pid, "log": str(paths["log"]), "last_line": None}
    if pid is None:
        return row
    process.reap(pid)  # our own child that died would otherwise look alive (a zombie)
    if process.pid_alive(pid) and _marker(name) in process.cmdline(pid):
        row["state"] = "running"
    else:
        row["state"] = "crashed"
        lines = [line for line in process.tail(paths["log"], 30).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        row["last_line"] = (errors or lines or [None])[-1]
    return row


def status(conf: dict) -> list[dict]:
    """state() of every service."""
    return [state(conf, name) for name in SERVICES]


# ---------------------------------------------------------------------------------------------
# start and stop


def require_snapshot(conf: dict) -> dict:
    """The slot's snapshot record when it is complete; otherwise ServiceError saying to run notebooks 01 and 02."""
    slot = config.get(conf, "source.slot")
    remedy = (f"run notebook 01 (bootstrap) and 02 (snapshot) for slot {slot} first: `make demo`, or "
              f"`python -m lib.jobs --only 01 02`")
    for attempt in range(3):  # a control topic created a moment ago may not have its metadata yet
        try:
            record = control.snapshot_state(conf, slot)
            break
        except control.ControlError as exc:
            if attempt == 2:
                raise ServiceError(f"continuous mode for slot {slot}: cannot read the snapshot state ({exc}); "
                                   f"{remedy}") from exc
            time.sleep(1)
    if not record or record.get("state") != "complete":
        found = "no snapshot was taken" if not record else f"its snapshot is {record.get('state')!r}, not complete"
        raise ServiceError(f"continuous mode for slot {slot}: {found}, so the stream would miss the rows that existed "
                           f"before the slot; {remedy}")
    return record


def write_conf(conf: dict) -> Path:
    """Write the conf the services run with to <service dir>/conf.json (references only, no secret values)."""
    path = monitor.service_dir(conf) / "conf.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conf, default=str, indent=1, sort_keys=True))
    return path


def start(conf: dict, services: tuple[str, ...] = SERVICES, log=print) -> dict[str, int]:
    """Start the services that do not run (a crashed one again); returns {name: pid}. Refuses before the snapshot."""
    if runtime.on_databricks():
        raise ServiceError("on Databricks the continuous mode runs as the bundle's jobs cdc_capture and cdc_merge "
                           "(bundle.yml): `databricks bundle run -t <target> cdc_capture` and `... cdc_merge`")
    for name in services:
        _check_name(name)
    require_snapshot(conf)
    conf_file = write_conf(conf)
    started = {}
    for name in services:
        paths = files(conf, name)
        row = state(conf, name)
        if row["state"] == "running":
            log(f"{name:9s} already running (pid {row['pid']})")
            started[name] = row["pid"]
            continue
        if row["state"] == "crashed":
            log(f"{name:9s} was not stopped cleanly (pid {row['pid']} is gone; last log line: {row['last_line']}); "
                f"starting it again: it resumes where it left off")
            paths["pid"].unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "lib.service", "run", name, "--conf", str(conf_file)]
        with open(paths["log"], "a") as handle:
            handle.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {name}\n")
        started[name] = process.start(command, paths["log"], paths["pid"], env=env, cwd=config.PROJECT_ROOT)
    deadline = time.monotonic() + START_CHECK_S
    while time.monotonic() < deadline:  # a wrong setting usually fails at once: say so here, not only in the log
        time.sleep(0.25)
        dead = [state(conf, name) for name in started if state(conf, name)["state"] == "crashed"]
        if dead:
            row = dead[0]
            raise ServiceError(f"the {row['service']} service exited right after starting: {row['last_line']}; "
                               f"see {row['log']}")
    for name, pid in started.items():
        log(f"{name:9s} running (pid {pid}), log {files(conf, name)['log']}")
    return started


def stop(conf: dict, services: tuple[str, ...] = SERVICES, timeout: float = STOP_TIMEOUT_S, log=print) -> None:
    """Stop the services (capture first, so the merge sees everything it sent); a dead one's pid file is removed."""
    for name in services:
        paths = files(conf, name)
        row = state(conf, name)
        if row["state"] == "running":
            process.stop(row["pid"], timeout=timeout)
            log(f"{name:9s} stopped")
        elif row["state"] == "crashed":
            log(f"{name:9s} was not running (pid {row['pid']} had died); pid file removed")
        paths["pid"].unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# the processes themselves


class _StopFlag:
    """Set by SIGTERM/SIGINT (main thread only) or by a caller's threading.Event."""

    def __init__(self, event=None):
        self.event = event or threading.Event()
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, lambda signum, frame: self.event.set())

    def __call__(self) -> bool:
        return self.event.is_set()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_capture(conf: dict, stop_event=None, max_seconds: float | None = None, log=print) -> dict:
    """The capture in this process until stopped (SIGTERM, stop_event, max_seconds); appends metrics records."""
    from lib import source, stream

    interval = monitor.metrics_interval_s(conf)
    previous: dict = {}
    conn = source.connect(conf)
    conn.autocommit = True

    def on_metrics(m: dict) -> None:
        log(stream.summary(m))
        monitor.record(conf, "capture", capture_record(conf, m, previous, conn))

    try:
        result = stream.run(conf, until="forever", stop_event=stop_event, max_seconds=max_seconds,
                            metrics_callback=on_metrics, metrics_interval_s=interval,
                            heartbeat_s=float(config.get(conf, "service.heartbeat_s", 10)),
                            log=log)
        on_metrics(result)
    finally:
        conn.close()
    return result


def capture_record(conf: dict, m: dict, previous: dict, conn=None) -> dict:
    """A history record from stream metrics: rates per table since the previous record, slot WAL figures."""
    now = time.monotonic()
    per_table = dict(m.get("events_per_table") or {})
    before = previous.get("per_table", {})
    interval = now - previous["at"] if "at" in previous else float(m.get("elapsed_s") or 1.0)
    out = {key: m.get(key) for key in ("slot", "events", "tombstones", "transactions", "heartbeats", "acked_lsn",
                                       "server_lsn", "lag_bytes", "lag_s", "in_flight_transactions", "stopped",
                                       "caught_up")}
    out.update({"events_per_table": per_table, "interval_s": round(interval, 3),
                "interval_events_per_table": {t: n - before.get(t, 0) for t, n in per_table.items()},
                "interval_events_per_s": m.get("interval_events_per_s", m.get("events_per_s")),
                "truncates": sum((m.get("truncates") or {}).values())})
    try:
        row = monitor.slot_row(conf, conn)
        if row:
            out.update({"retained_wal_bytes": row["retained_wal_bytes"], "wal_status": row["wal_status"],
                        "slot_lag_bytes": row["lag_bytes"]})
    except Exception as exc:  # noqa: BLE001 - a monitoring query must not stop the capture
        out["slot_error"] = str(exc)
    previous.update({"at": now, "per_table": per_table})
    return out


def run_merge(conf: dict, spark=None, stop_event=None, max_seconds: float | None = None, log=print) -> dict:
    """The merge query (processing-time trigger) in this process until stopped; appends metrics records."""
    from pyspark.errors import StreamingQueryException

    from lib import merge
    from lib import spark as spark_lib

    if spark is None:
        settings = dict(config.get(conf, "spark.settings", {}) or {})
        settings.setdefault("spark.ui.showConsoleProgress", "false")  # progress bars would fill the log
        # the merge only uses Delta paths: an in-memory catalog leaves a local (one-driver) metastore free
        options = {"catalog": "in-memory"} if "catalog" in inspect.signature(spark_lib.from_conf).parameters else {}
        spark = spark_lib.from_conf({**conf, "spark": {**conf.get("spark", {}), "settings": settings}}, **options)
    interval = str(config.get(conf, "service.merge_interval", DEFAULT_MERGE_INTERVAL))
    budget = int(config.get(conf, "service.merge_restarts", DEFAULT_MERGE_RESTARTS))
    every = monitor.metrics_interval_s(conf)
    stop = _StopFlag(stop_event)
    deadline = time.monotonic() + max_seconds if max_seconds else None
    tally = _MergeTally(conf, spark)
    failures = 0
    try:
        while True:
            query = merge.start(conf, spark, "processing_time", interval)
            ctx = query.merge_context
            log(f"merge     query {query.name} ({query.id}) started, trigger every {interval}")
            last = time.monotonic()
            try:
                while query.isActive and not stop():
                    if deadline is not None and time.monotonic() >= deadline:
                        stop.event.set()
                        break
                    try:
                        query.awaitTermination(1)
                    except StreamingQueryException:
                        break
                    if time.monotonic() - last >= every:
                        last = time.monotonic()
                        monitor.record(conf, "merge", tally.tick(ctx, log))
            finally:
                _stop_query(query, float(config.get(conf, "service.stop_grace_s", STOP_GRACE_S)), log)
            monitor.record(conf, "merge", tally.tick(ctx, log))
            if stop():
                return tally.totals()
            if ctx.failure is not None:
                batch_id, cause = ctx.failure
                raise merge.MergeError(
                    f"merge query {ctx.query} stopped in micro-batch {batch_id}: {type(cause).__name__}: {cause}. The "
                    f"checkpoint keeps the batch; fix the cause and start the merge again (the batch is retried, its "
                    f"Delta commits are idempotent)") from cause
            failures = 0 if ctx.history else failures + 1
            error = str(query.exception()).splitlines()[0][:300]
            if failures > budget:
                raise merge.MergeError(f"merge query {ctx.query} was stopped by Spark {failures} times in a row "
                                       f"without a micro-batch (last: {error}); see the log, fix the cause and start "
                                       f"it again")
            log(f"merge     query stopped by Spark after {len(ctx.history)} batch(es) ({error}); starting it again "
                f"from the checkpoint")
    finally:
        stop.restore()


def _stop_query(query, grace_s: float, log) -> None:
    """Stop the query between micro-batches when one finishes within grace_s (else interrupt it: it is retried)."""
    deadline = time.monotonic() + grace_s
    while query.isActive and time.monotonic() < deadline:
        try:
            if not query.status["isTriggerActive"]:
                break
        except Exception:  # noqa: BLE001 - the query just ended
            break
        time.sleep(0.2)
    if query.isActive:
        if time.monotonic() >= deadline:
            log(f"merge     micro-batch still running after {grace_s:.0f} s: interrupting it (it runs again on the "
                f"next start; its Delta commits are idempotent)")
        query.stop()


class _MergeTally:
    """Counts of the merge service's batches since it started, per table, for the metrics history."""

    def __init__(self, conf: dict, spark):
        from lib import merge

        self.conf, self.spark = conf, spark
        self.specs = merge.table_specs(conf)
        self.events = {s.qualified: 0 for s in self.specs}
        by_topic = {row["topic"]: row["n"] for row in merge.dead_letter_counts(spark, conf)
                    .groupBy("topic").agg({"messages": "sum"}).withColumnRenamed("sum(messages)", "n").collect()}
        self.dead = {s.qualified: int(by_topic.get(s.topic) or 0) for s in self.specs}
        self.batches = 0
        self.last: dict[int, int] = {}  # id(merge context) -> last batch id counted (each query start has its own)
        self.positions: dict[str, int | None] = {}
        self.at = time.monotonic()

    def tick(self, ctx, log) -> dict:
        """One history record: the batches finished since the last tick, Kafka lag, positions when they moved."""
        now = time.monotonic()
        interval = max(now - self.at, 1e-9)
        self.at = now
        fresh = [b for b in ctx.history if b["batch_id"] > self.last.get(id(ctx), -1)]
        per_table = {s.qualified: 0 for s in self.specs}
        for batch in fresh:
            self.last[id(ctx)] = batch["batch_id"]
            self.batches += 1
            for table, counts in batch["tables"].items():
                n = int(counts.get("events", 0)) + int(counts.get("tombstones", 0))
                per_table[table] = per_table.get(table, 0) + n
                self.events[table] = self.events.get(table, 0) + n
                self.dead[table] = self.dead.get(table, 0) + int(counts.get("dead_letters", 0))
        if fresh or not self.positions:
            try:
                self.positions = monitor.merged_positions(self.spark, self.conf)
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop the merge
                log(f"merge     positions unknown: {exc}")
        record = {"batches": self.batches, "last_batch_id": fresh[-1]["batch_id"] if fresh else None,
                  "interval_s": round(interval, 3), "interval_events_per_table": per_table,
                  "events_per_table": dict(self.events),
                  "interval_events_per_s": round(sum(per_table.values()) / interval, 1),
                  "dead_letters": dict(self.dead), "positions": dict(self.positions)}
        try:
            lag = monitor.kafka_lag(self.conf)
            record["kafka_lag"] = sum(v["lag"] or 0 for v in lag.values())
            record["kafka_lag_per_topic"] = {t: v["lag"] for t, v in lag.items()}
        except Exception as exc:  # noqa: BLE001
            record["kafka_error"] = str(exc)
        if fresh:
            log(f"merge     {len(fresh)} batch(es), {sum(per_table.values())} events, Kafka lag "
                f"{record.get('kafka_lag', '?')}")
        return record

    def totals(self) -> dict:
        """What the service merged since it started."""
        return {"batches": self.batches, "events_per_table": dict(self.events), "dead_letters": dict(self.dead)}


# ---------------------------------------------------------------------------------------------
# command line


def load_conf(target: str | None, conf_file: str | None) -> dict:
    """The conf from a conf.json written by start(), else conf/<target>.yml with CDC__ overrides."""
    if conf_file:
        return json.loads(Path(conf_file).read_text())
    return config.load(target)


def parser() -> argparse.ArgumentParser:
    """The command line (also parsed by the bundle test for the Databricks jobs' parameters)."""
    cli = argparse.ArgumentParser(prog="python -m lib.service", description=__doc__.splitlines()[0])
    cli.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    commands = cli.add_subparsers(dest="command", required=True)
    for name, text in (("start", "start the services in the background (make run)"),
                       ("stop", "stop them (make stop)"), ("status", "state of each service")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("services", nargs="*", metavar="SERVICE", help=f"{' and/or '.join(SERVICES)} (default: both)")
    run = commands.add_parser("run", help="run one service in the foreground (what start launches; Databricks jobs)")
    run.add_argument("service", choices=SERVICES)
    run.add_argument("--target", dest="run_target", default=None, help="conf/<target>.yml")
    run.add_argument("--conf", default=None, help="a conf.json written by start (instead of --target)")
    run.add_argument("--max-seconds", type=float, default=None, help="stop after this long (default: never)")
    return cli


def main(argv: list[str] | None = None) -> int:
    """python -m lib.service {start,stop,status,run} ...; errors are one line with the cause and the remedy."""
    cli = parser()
    args = cli.parse_args(argv)
    unknown = [name for name in getattr(args, "services", []) if name not in SERVICES]
    if unknown:
        cli.error(f"unknown service {unknown[0]!r}: choose from {', '.join(SERVICES)}")
    try:
        if args.command == "run":
            conf = load_conf(args.run_target or args.target, args.conf)
            log = lambda line: print(line, flush=True)  # noqa: E731
            if args.service == "capture":
                from lib import stream

                result = run_capture(conf, max_seconds=args.max_seconds, log=log)
                log("final " + stream.summary(result))
            else:
                result = run_merge(conf, max_seconds=args.max_seconds, log=log)
                log(f"merge     stopped: {result}")
            return 0
        conf = config.load(args.target)
        chosen = tuple(args.services) or SERVICES
        if args.command == "start":
            start(conf, chosen)
            print("next      `make status` shows lag and throughput; `make stop` stops both")
        elif args.command == "stop":
            stop(conf, chosen)
        else:
            for row in status(conf):
                if row["service"] in chosen:
                    print(f"{row['service']:9s} {row['state']:9s} pid {str(row['pid'] or '-'):>7s}  log {row['log']}"
                          + (f"\n          last line: {row['last_line']}" if row["last_line"] else ""))
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"{cli.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
