"""The keeper: runs one service (capture or merge) as its child and starts it again when it crashes.

``state(conf, name)`` reads what the keeper recorded: running, waiting (for a dependency that does not
answer), stopped or crashed, and how often it restarted the service. lib/operate/service.py starts and
stops keepers; docs/operations.md explains the restart budget and outage waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lib import config
from lib.operate import metrics, process

MAX_BACKOFF_S = 60.0
PR_SET_PDEATHSIG = 1


def files(conf: dict, name: str) -> dict[str, Path]:
    """pid file (the keeper's), keeper record, log file and metrics history of a service."""
    check_service_name(name)
    folder = metrics.service_dir(conf)
    return {"pid": folder / f"{name}.pid", "keeper": folder / f"{name}.keeper.json", "log": folder / f"{name}.log",
            "metrics": metrics.metrics_path(conf, name)}


def check_service_name(name: str) -> None:
    if name not in metrics.SERVICES:
        raise ValueError(f"service must be one of {', '.join(metrics.SERVICES)}, not {name!r}")


def service_marker(name: str) -> str:
    return f"lib.operate.service run {name}"


def _is_service(pid: int | None, name: str) -> bool:
    """True when pid is a live keeper of the service (or a service process started without one)."""
    if not pid or not process.pid_alive(pid):
        return False
    command = process.cmdline(pid)
    return f"lib.operate.service keep {name}" in command or service_marker(name) in command


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
        row["child"] = child if child and process.pid_alive(child) and service_marker(name) in process.cmdline(child) \
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
    """The log's last error line (an exception, `...: error: ...`), else its last line that is not a JVM
    WARN/INFO line (keeper lines left out if asked)."""
    lines = [line for line in process.tail(log_file, 60).splitlines() if line.strip()]
    if not keeper_lines:
        lines = [line for line in lines if not line.startswith("=== ")]
    chatter = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (WARN|INFO|DEBUG) |^\s+at |^\[Stage ")
    own = [line for line in lines if not chatter.search(line)]
    errors = [line for line in own if re.search(r"error|exception|traceback", line, re.IGNORECASE)]
    return (errors or own or lines or [None])[-1]


def restart_policy(conf: dict) -> dict:
    """service.max_restarts, restart_window_s, restart_backoff_s and outage_probe_max_s (with defaults)."""
    return {"max_restarts": int(config.get(conf, "service.max_restarts")),
            "window_s": float(config.get(conf, "service.restart_window_s")),
            "backoff_s": float(config.get(conf, "service.restart_backoff_s")),
            "probe_max_s": float(config.get(conf, "service.outage_probe_max_s"))}


def load_conf(target: str | None, conf_file: str | None) -> dict:
    """The conf from a conf.json written by start(), else conf/<target>.yml with CDC__ overrides."""
    if conf_file:
        return json.loads(Path(conf_file).read_text())
    return config.load(target)


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
    """Run `lib.operate.service run <name>` as a child until stopped (SIGTERM), restarting it when it crashes.

    Returns 0 when stopped or when the child exited with code 0 by itself, 1 after giving up.
    """
    check_service_name(name)
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
    command = [sys.executable, "-m", "lib.operate.service", "run", name, "--conf", conf_file]
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
                f"{last_error or 'none logged'}. Fix the cause, then {config.make(conf, 'run')} (service.start) "
                f"starts it again from where it left off")
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
    """The first dependency of a service that does not answer ('Kafka at host:port: ...'), or None.

    A refusal or a conf error (a wrong password or CA, a missing secret) is not an outage: None, so the
    service starts, fails with the setting to fix, and counts toward service.max_restarts.
    """
    from lib import kafka_client, schema_registry, secrets, source, topics

    misconfigured = (config.ConfigError, secrets.SecretError)

    if name == "capture":
        host, port = config.get(conf, "source.host"), config.get(conf, "source.port")
        try:
            source.connect(conf).close()
        except source.SourceError as exc:
            refused = ("password authentication", "does not exist", "certificate", "source.ssl", "does not support SSL")
            if not any(word in str(exc) for word in refused):  # a refusal is not an outage: the service says why
                cause = str(exc).split(": ", 1)[-1].split(";")[0].split(" failed: ", 1)[-1]
                return f"PostgreSQL at {host}:{port} ({cause})"
        except misconfigured:
            return None
    servers = config.get(conf, "kafka.bootstrap_servers")
    try:
        metadata = kafka_client.check(conf, timeout_s)
    except kafka_client.KafkaUnreachableError as exc:
        return f"Kafka at {servers} ({str(exc).split(': ', 1)[-1].split(';')[0]})"
    except (kafka_client.KafkaAccessError, *misconfigured):
        return None  # refused (login, CA, protocol): not an outage; the service fails with the reason and its remedy
    missing = topics.unavailable(kafka_client.admin(conf), metadata, config.get(conf, "kafka.topic_prefix"),
                                 writes=name == "capture", timeout_s=timeout_s)
    if missing:  # some brokers answer, but not those the pipeline's partitions need
        return f"Kafka at {servers} ({missing})"
    try:
        registry = schema_registry.client(conf, timeout_s=timeout_s, retries=0)  # a stalled registry: not minutes
    except misconfigured:
        return None
    try:
        registry.get_subjects()
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
        delay = min(delay * 2, policy["probe_max_s"])
    return False


def _write_keeper_record(path: Path, record: dict) -> None:
    """Replace the keeper record atomically (state() may read it at any moment)."""
    part = path.with_name(path.name + ".tmp")
    part.write_text(json.dumps(record))
    part.replace(path)
