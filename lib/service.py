"""Continuous mode: the capture (slot -> Kafka) and the merge (Kafka -> Delta) as long-running processes.

``start(conf)`` (``make run``, ``python -m lib.service start``) launches one detached *keeper* per
service and returns; ``stop(conf)`` (``make stop``) sends SIGTERM to the keepers and waits: each
forwards it to its service, the capture flushes Kafka and acknowledges what Kafka acknowledged, the
merge stops its query between micro-batches (waiting up to ``service.stop_grace_s`` for a running
one). ``state(conf, name)`` tells running / stopped / crashed and how often the keeper restarted it.
A notebook cell can call the same functions.

Each keeper (``python -m lib.service keep capture|merge``; its pid is in the pid file) runs the
service as its child, ``python -m lib.service run capture|merge``, the same entry point the bundle's
continuous Databricks jobs call:

- **capture**: ``lib.stream.run(conf, until="forever")``;
- **merge**: ``lib.merge.start(conf, spark, trigger="processing_time", interval=service.merge_interval)``,
  started again when Spark stops the query after batches went through (see ``merge.run_until_caught_up``),
  up to ``service.merge_restarts`` times in a row without progress; a failing micro-batch stops it.

**A crashed service comes back by itself.** When the child exits with a non-zero code or is killed
by a signal the keeper did not send, the keeper logs the exit and starts it again after
``service.restart_backoff_s`` (doubled for each failure within the window, at most 60 s). After more
than ``service.max_restarts`` failures within ``service.restart_window_s`` it gives up: the state is
``crashed`` and the log's last line names the last exit and the child's last error. An outage is not
a crash: when the child failed and a dependency does not answer (PostgreSQL for the capture, Kafka,
the schema registry), the keeper waits for it, probing with the same backoff, state ``waiting`` (what
and since when), and starts the child once it answers, without counting a failure. A child that
exits with code 0 by itself is not restarted. The child gets SIGTERM if its keeper dies (Linux
``PR_SET_PDEATHSIG``), so a killed keeper leaves no orphan holding the slot.

Both services append a metrics record every ``service.metrics_interval_s`` to the history ``lib.monitor``
reads. Files live in ``<service.dir>/<slot>/``: ``<name>.pid`` (the keeper), ``<name>.keeper.json``
(child pid, restarts, last exit), ``<name>.log``, ``<name>.metrics.jsonl`` and ``conf.json`` (the conf
the processes run with: names and secret references only, never secret values; a restarted child
reads it again).

**A restart resumes where it left off**: the capture from the slot's confirmed position
(at-least-once; duplicates carry their source position), the merge from its checkpoint (Delta
commits are idempotent per micro-batch). ``start`` notices a keeper that died (or gave up) and
starts it again. On Databricks the continuous jobs restart failed runs.

**Operators: a stopped capture keeps WAL on the source until it runs again. To stop for good, run
``make teardown`` after ``make stop`` (it drops the slot).**
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lib import config, control, monitor, runtime
from lib.stack import process

SERVICES = ("capture", "merge")
DEFAULT_MERGE_INTERVAL = "10 seconds"
DEFAULT_MERGE_RESTARTS = 3
DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 600.0
DEFAULT_RESTART_BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0
STOP_TIMEOUT_S = 90.0
LEASE_INTERVALS, LEASE_SLACK_S = 3, 30.0  # a service's lease outlives a few missed metrics intervals
STOP_GRACE_S = 45.0  # how long the merge waits for a running micro-batch to finish before stopping
START_CHECK_S = 3.0
PR_SET_PDEATHSIG = 1


class ServiceError(RuntimeError):
    """A service could not be started, stopped or run; the message names the cause and the remedy."""


# ---------------------------------------------------------------------------------------------
# files and state


def files(conf: dict, name: str) -> dict[str, Path]:
    """pid file (the keeper's), keeper record, log file and metrics history of a service."""
    _check_name(name)
    folder = monitor.service_dir(conf)
    return {"pid": folder / f"{name}.pid", "keeper": folder / f"{name}.keeper.json", "log": folder / f"{name}.log",
            "metrics": monitor.metrics_path(conf, name)}


def _check_name(name: str) -> None:
    if name not in SERVICES:
        raise ValueError(f"service must be one of {', '.join(SERVICES)}, not {name!r}")


def _marker(name: str) -> str:
    return f"lib.service run {name}"


def _is_service(pid: int | None, name: str) -> bool:
    """True when pid is a live keeper of the service (or a service process started without one)."""
    if not pid or not process.pid_alive(pid):
        return False
    command = process.cmdline(pid)
    return f"lib.service keep {name}" in command or _marker(name) in command


def keeper_record(conf: dict, name: str, keeper_pid: int | None = None) -> dict:
    """What the keeper last wrote (child, restarts, last_exit, last_error); {} if none or another keeper's."""
    try:
        record = json.loads(files(conf, name)["keeper"].read_text())
    except (OSError, ValueError):
        return {}
    return record if keeper_pid is None or record.get("keeper") == keeper_pid else {}


def state(conf: dict, name: str) -> dict:
    """{service, state: running|waiting|stopped|crashed, pid (keeper), child, restarts, log, last_line}.

    waiting = the keeper waits for a dependency that does not answer (last_line says which, since when);
    crashed = a pid file whose keeper died or gave up after service.max_restarts failures.
    """
    paths = files(conf, name)
    pid = process.read_pid(paths["pid"])
    row = {"service": name, "state": "stopped", "pid": pid, "child": None, "restarts": 0, "log": str(paths["log"]),
           "last_line": None}
    if pid is None:
        return row
    process.reap(pid)  # our own child that died would otherwise look alive (a zombie)
    record = keeper_record(conf, name, pid)
    row["restarts"] = int(record.get("restarts") or 0)
    if _is_service(pid, name):
        row["state"] = "running"
        child = record.get("child")
        row["child"] = child if child and process.pid_alive(child) and _marker(name) in process.cmdline(child) \
            else None
        if record.get("waiting_for") and row["child"] is None:
            row["state"] = "waiting"
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["waiting_since"]))
            row["last_line"] = f"waiting for {record['waiting_for']} since {since}"
    else:
        row["state"] = "crashed"
        row["last_line"] = _last_error_line(paths["log"])
    return row


def _last_error_line(log_file: Path, keeper_lines: bool = True) -> str | None:
    """The log's last line that mentions an error, else its last line (keeper lines left out if asked)."""
    lines = [line for line in process.tail(log_file, 30).splitlines() if line.strip()]
    if not keeper_lines:
        lines = [line for line in lines if not line.startswith("=== ")]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [None])[-1]


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


def restart_policy(conf: dict) -> dict:
    """service.max_restarts, restart_window_s and restart_backoff_s (with defaults)."""
    return {"max_restarts": int(config.get(conf, "service.max_restarts", DEFAULT_MAX_RESTARTS)),
            "window_s": float(config.get(conf, "service.restart_window_s", DEFAULT_RESTART_WINDOW_S)),
            "backoff_s": float(config.get(conf, "service.restart_backoff_s", DEFAULT_RESTART_BACKOFF_S))}


def start(conf: dict, services: tuple[str, ...] = SERVICES, log=print) -> dict[str, int]:
    """Start the keepers of the services that do not run (a crashed one again); returns {name: keeper pid}.

    Refuses before the snapshot. A service whose child fails within START_CHECK_S raises ServiceError
    naming its error; its keeper goes on retrying per service.max_restarts until stopped.
    """
    if runtime.on_databricks():
        raise ServiceError("on Databricks the continuous mode runs as the bundle's jobs cdc_capture and cdc_merge "
                           "(bundle.yml): `databricks bundle run -t <target> cdc_capture` and `... cdc_merge`")
    for name in services:
        _check_name(name)
    require_snapshot(conf)
    conf_file = write_conf(conf)
    started, launched = {}, []
    for name in services:
        paths = files(conf, name)
        row = state(conf, name)
        if row["state"] == "running":
            log(f"{name:9s} already running (pid {row['pid']})")
            started[name] = row["pid"]
            continue
        launched.append(name)
        if row["state"] == "crashed":
            log(f"{name:9s} was not stopped cleanly (pid {row['pid']} is gone; last log line: {row['last_line']}); "
                f"starting it again: it resumes where it left off")
            _stop_leftover_child(conf, name, row["pid"], log)
            paths["pid"].unlink(missing_ok=True)
        paths["keeper"].unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "lib.service", "keep", name, "--conf", str(conf_file)]
        with open(paths["log"], "a") as handle:
            handle.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {name}\n")
        started[name] = process.start(command, paths["log"], paths["pid"], env=env, cwd=config.PROJECT_ROOT)
    deadline = time.monotonic() + START_CHECK_S
    while time.monotonic() < deadline:  # a wrong setting usually fails at once: say so here, not only in the log
        time.sleep(0.25)
        for name in launched:
            row, record = state(conf, name), keeper_record(conf, name, started[name])
            if row["state"] == "crashed":
                raise ServiceError(f"the {name} service exited right after starting: {row['last_line']}; "
                                   f"see {row['log']}")
            if record.get("last_exit"):
                policy = restart_policy(conf)
                raise ServiceError(
                    f"the {name} service failed right after starting ({record['last_exit']}): "
                    f"{record.get('last_error') or 'no error line'}; its keeper (pid {started[name]}) starts it again "
                    f"up to service.max_restarts={policy['max_restarts']} times within service.restart_window_s="
                    f"{policy['window_s']:.0f} s, then leaves it crashed: fix the cause, then `make stop` and "
                    f"`make run`; see {row['log']}")
    for name, pid in started.items():
        log(f"{name:9s} running (keeper pid {pid}), log {files(conf, name)['log']}")
    return started


def _stop_leftover_child(conf: dict, name: str, keeper_pid: int | None, log) -> None:
    """Stop a child whose keeper died, so two captures never share a slot (nor two merges a checkpoint)."""
    child = keeper_record(conf, name, keeper_pid).get("child")
    if child and process.pid_alive(child) and _marker(name) in process.cmdline(child):
        log(f"{name:9s} the previous process (pid {child}) still runs without its keeper: stopping it first")
        process.stop(child, timeout=STOP_TIMEOUT_S)


def stop(conf: dict, services: tuple[str, ...] = SERVICES, timeout: float = STOP_TIMEOUT_S, log=print) -> None:
    """Stop the services (capture first, so the merge sees everything it sent); a dead one's pid file is removed."""
    for name in services:
        paths = files(conf, name)
        row = state(conf, name)
        if row["state"] == "running":
            process.stop(row["pid"], timeout, group=True)  # the keeper forwards SIGTERM to its child
            log(f"{name:9s} stopped")
        elif row["state"] == "crashed":
            _stop_leftover_child(conf, name, row["pid"], log)
            log(f"{name:9s} was not running (pid {row['pid']} had died); pid file removed")
        paths["pid"].unlink(missing_ok=True)


def restart(conf: dict, name: str, log=print) -> int | None:
    """Stop and start one service when it runs (e.g. so the merge subscribes to a table added to conf); else None."""
    if state(conf, name)["state"] != "running":
        return None
    stop(conf, (name,), log=log)
    return start(conf, (name,), log=log)[name]


# ---------------------------------------------------------------------------------------------
# the keeper: runs one service as its child and starts it again when it crashes


def _describe_exit(code: int) -> str:
    """'exit code 1' or 'signal 9 (SIGKILL)' from a Popen return code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def _parent_death_signal():
    """A preexec_fn that has the kernel SIGTERM the child when the keeper dies (Linux); None elsewhere."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def keep(name: str, conf_file: str, log=print) -> int:
    """Run `lib.service run <name>` as a child until stopped (SIGTERM), restarting it when it crashes.

    Returns 0 when stopped or when the child exited with code 0 by itself, 1 after giving up.
    """
    _check_name(name)
    conf = load_conf(None, conf_file)
    paths, policy = files(conf, name), restart_policy(conf)
    stopping = threading.Event()
    child: list[subprocess.Popen] = []

    def forward(*_args) -> None:
        stopping.set()
        if child and child[0].returncode is None:  # not reaped yet, so the pid is still the child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0].pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    command = [sys.executable, "-m", "lib.service", "run", name, "--conf", conf_file]
    failures: list[float] = []
    restarts, last_exit, last_error = 0, None, None
    preexec = _parent_death_signal()
    stamp = lambda: time.strftime("%Y-%m-%d %H:%M:%S")  # noqa: E731
    while not stopping.is_set():
        child[:] = [subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=preexec, cwd=config.PROJECT_ROOT)]
        if stopping.is_set():  # SIGTERM came while starting it
            forward()
        _write_keeper_record(paths["keeper"], {"keeper": os.getpid(), "child": child[0].pid, "restarts": restarts,
                                               "last_exit": last_exit, "last_error": last_error})
        if restarts:
            log(f"=== {stamp()} keeper: {name} started again (pid {child[0].pid}, restart {restarts})")
        code = child[0].wait()
        if stopping.is_set():
            log(f"=== {stamp()} keeper: {name} stopped ({_describe_exit(code)})")
            return 0
        if code == 0:
            log(f"=== {stamp()} keeper: {name} (pid {child[0].pid}) exited with code 0 by itself; not restarted")
            if process.read_pid(paths["pid"]) == os.getpid():
                paths["pid"].unlink(missing_ok=True)
            return 0
        last_exit, last_error = _describe_exit(code), _last_error_line(paths["log"], keeper_lines=False)
        down = unreachable(conf, name)
        if down is not None:  # an outage: wait for it without spending the restart budget
            restarts += 1
            if not _wait_for(conf, name, down, paths, stopping, policy, log,
                             {"keeper": os.getpid(), "child": None, "restarts": restarts, "last_exit": last_exit,
                              "last_error": last_error}):
                break
            continue
        now = time.monotonic()
        failures = [t for t in failures if now - t < policy["window_s"]] + [now]
        _write_keeper_record(paths["keeper"], {"keeper": os.getpid(), "child": None, "restarts": restarts,
                                               "last_exit": last_exit, "last_error": last_error})
        if len(failures) > policy["max_restarts"]:
            log(f"=== {stamp()} keeper: error: {name} failed {len(failures)} times within "
                f"service.restart_window_s={policy['window_s']:.0f} s (service.max_restarts="
                f"{policy['max_restarts']}), giving up; last exit: {last_exit}; last error: "
                f"{last_error or 'none logged'}. Fix the cause, then `make run` (service.start) starts it again "
                f"from where it left off")
            return 1
        delay = min(policy["backoff_s"] * 2 ** (len(failures) - 1), MAX_BACKOFF_S)
        restarts += 1
        log(f"=== {stamp()} keeper: {name} (pid {child[0].pid}) ended with {last_exit}; restart {restarts} "
            f"({len(failures)} of {policy['max_restarts']} within {policy['window_s']:.0f} s) in {delay:.1f} s")
        deadline = time.monotonic() + delay
        while not stopping.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    log(f"=== {stamp()} keeper: {name} stopped")
    return 0


def unreachable(conf: dict, name: str, timeout_s: float = 5.0) -> str | None:
    """The first dependency of a service that does not answer ('Kafka at host:port: ...'), or None."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from lib import schema_registry, source

    if name == "capture":
        host, port = config.get(conf, "source.host"), config.get(conf, "source.port")
        try:
            source.connect(conf).close()
        except source.SourceError as exc:
            if not any(word in str(exc) for word in ("password authentication", "does not exist")):
                return f"PostgreSQL at {host}:{port} ({str(exc).split(': ', 1)[-1].split(';')[0]})"
    servers = config.get(conf, "kafka.bootstrap_servers")
    try:
        AdminClient({"bootstrap.servers": servers, "socket.connection.setup.timeout.ms": int(timeout_s * 1000)}) \
            .list_topics(timeout=timeout_s)
    except KafkaException as exc:
        return f"Kafka at {servers} ({exc.args[0].str()})"
    try:
        schema_registry.client(conf).get_subjects()
    except Exception as exc:  # noqa: BLE001 - any failure to answer counts as not answering
        return f"the schema registry at {config.get(conf, 'registry.url')} ({type(exc).__name__})"
    return None


def _wait_for(conf: dict, name: str, down: str, paths: dict, stopping, policy: dict, log, record: dict) -> bool:
    """Probe the missing dependency with capped backoff until it answers (True) or the keeper stops (False).

    The keeper record says what the service waits for and since when (``make status`` shows it).
    """
    stamp = lambda: time.strftime("%Y-%m-%d %H:%M:%S")  # noqa: E731
    since = time.time()
    _write_keeper_record(paths["keeper"], {**record, "waiting_for": down, "waiting_since": since})
    log(f"=== {stamp()} keeper: {name} ended with {record['last_exit']}; {down} does not answer: waiting for it "
        f"(an outage does not count toward service.max_restarts)")
    delay = policy["backoff_s"]
    while not stopping.is_set():
        deadline = time.monotonic() + delay
        while not stopping.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        if stopping.is_set():
            return False
        still = unreachable(conf, name)
        if still is None:
            log(f"=== {stamp()} keeper: {down.split(' (')[0]} answers again after {time.time() - since:.0f} s; "
                f"starting {name}")
            return True
        if still != down:
            down = still
            _write_keeper_record(paths["keeper"], {**record, "waiting_for": down, "waiting_since": since})
        delay = min(delay * 2, MAX_BACKOFF_S)
    return False


def _write_keeper_record(path: Path, record: dict) -> None:
    """Replace the keeper record atomically (state() may read it at any moment)."""
    part = path.with_name(path.name + ".tmp")
    part.write_text(json.dumps(record))
    part.replace(path)


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


def _renew_lease(conf: dict, name: str, log) -> None:
    """Tell the notebooks, on any machine, that this service runs (control.running_service)."""
    try:
        control.renew_lease(conf, name, LEASE_INTERVALS * monitor.metrics_interval_s(conf) + LEASE_SLACK_S)
    except control.ControlError as exc:
        log(f"{name:<9} cannot renew its lease in the control topic: {exc}")


def _drop_lease(conf: dict, name: str) -> None:
    with contextlib.suppress(control.ControlError):
        control.put(conf, control.lease_key(conf, name), None)


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
        _renew_lease(conf, "capture", log)

    _renew_lease(conf, "capture", log)
    try:
        result = stream.run(conf, until="forever", stop_event=stop_event, max_seconds=max_seconds,
                            metrics_callback=on_metrics, metrics_interval_s=interval,
                            heartbeat_s=float(config.get(conf, "service.heartbeat_s", 10)),
                            log=log)
        on_metrics(result)
        _drop_lease(conf, "capture")  # a clean stop; after a crash the keeper starts it again, the lease stays
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
    _renew_lease(conf, "merge", log)
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
                        _renew_lease(conf, "merge", log)
            finally:
                _stop_query(query, float(config.get(conf, "service.stop_grace_s", STOP_GRACE_S)), log)
            monitor.record(conf, "merge", tally.tick(ctx, log))
            if stop():
                _drop_lease(conf, "merge")
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
    keeper = commands.add_parser("keep", help="run one service as a child, restarting it when it crashes (what "
                                              "start launches)")
    keeper.add_argument("service", choices=SERVICES)
    keeper.add_argument("--conf", required=True, help="a conf.json written by start")
    run = commands.add_parser("run", help="run one service in the foreground (what the keeper runs; Databricks jobs)")
    run.add_argument("service", choices=SERVICES)
    run.add_argument("--target", dest="run_target", default=None, help="conf/<target>.yml")
    run.add_argument("--conf", default=None, help="a conf.json written by start (instead of --target)")
    run.add_argument("--max-seconds", type=float, default=None, help="stop after this long (default: never)")
    return cli


def main(argv: list[str] | None = None) -> int:
    """python -m lib.service {start,stop,status,keep,run} ...; errors are one line with the cause and the remedy."""
    cli = parser()
    args = cli.parse_args(argv)
    unknown = [name for name in getattr(args, "services", []) if name not in SERVICES]
    if unknown:
        cli.error(f"unknown service {unknown[0]!r}: choose from {', '.join(SERVICES)}")
    try:
        if args.command == "keep":
            return keep(args.service, args.conf, log=lambda line: print(line, flush=True))
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
                    print(f"{row['service']:9s} {row['state']:9s} pid {str(row['pid'] or '-'):>7s}  "
                          f"restarts {row['restarts']}  log {row['log']}"
                          + (f"\n          last line: {row['last_line']}" if row["last_line"] else ""))
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"{cli.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
