"""Processes of the local stack: pid files, ports, readiness waits, stopping."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import time
from pathlib import Path

from lib.operate.process import cmdline, kill_now, pid_alive, read_pid, reap, start, stop, tail  # noqa: F401 (re-exported: the stack uses one process module)


class StackError(RuntimeError):
    """A local-stack step failed; the message is one line naming the cause and the fix."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def require_free_port(service: str, host: str, port: int, setting: str) -> None:
    """Fail with the remedy when the service's port is taken by another program."""
    if port_in_use(host, port):
        raise StackError(
            f"{service}: port {port} on {host} is already in use by another program; stop that "
            f"program or choose another port with {setting} in conf/local.yml "
            f"(or its CDC__ environment override)"
        )


def running_pid(service: str, pid_file: Path, marker: str) -> int | None:
    """Pid of the service if running; a pid file left by a dead process is an error."""
    pid = read_pid(pid_file)
    if pid is None:
        return None
    if pid_alive(pid) and marker in cmdline(pid):
        return pid
    raise StackError(
        f"{service}: stale pid file {pid_file} (pid {pid} is not a running {service}); the stack "
        f"was not stopped cleanly: run `make down` to clear it, then `make up`"
    )


def claim(service: str, pid_file: Path, marker: str, ports: list[tuple[str, int, str]], log=print,
          release_s: float = 15.0) -> bool:
    """False when the service already runs; otherwise True once each (host, port, setting) is free.
    A pid file whose process is gone (a machine restart, a kill) is cleared: the ports say whether it still runs.
    A process killed a moment ago may still hold its ports while its threads exit (its command line is gone first),
    so after clearing such a file each port gets ``release_s`` to become free."""
    cleared = False
    try:
        if running_pid(service, pid_file, marker):
            log(f"{service:9s} already running on port {ports[0][1]}")
            return False
    except StackError:
        log(f"{service:9s} cleared a stale pid file {pid_file} (pid {read_pid(pid_file)} no longer runs {service}: "
            f"the machine restarted or the process was killed)")
        pid_file.unlink(missing_ok=True)
        cleared = True
    for host, port, setting in ports:
        deadline = time.monotonic() + (release_s if cleared else 0)
        while port_in_use(host, port) and time.monotonic() < deadline:
            time.sleep(0.2)
        require_free_port(service, host, port, setting)
    return True


def recorded_state(service: str, pid_file: Path, marker: str) -> tuple[int | None, str]:
    """(pid, state) of a service started with a pid file, for status reports."""
    try:
        pid = running_pid(service, pid_file, marker)
    except StackError:
        return None, "stale pid file"
    return pid, "running" if pid else "stopped"


def stop_recorded(service: str, pid_file: Path, marker: str, timeout: float, log=print) -> None:
    """Stop a service started with a pid file; a stale pid file is simply removed."""
    pid = read_pid(pid_file)
    if pid and pid_alive(pid) and marker in cmdline(pid):
        stop(pid, timeout=timeout)
        log(f"{service:9s} stopped")
    pid_file.unlink(missing_ok=True)


def wait_ready(service: str, probe, timeout: float, log_file: Path, pid: int | None = None,
               pid_file: Path | None = None) -> None:
    """Poll probe() until it returns True; fail naming the timeout and the log.

    A process that exits during start-up has its pid_file removed, so the next start is not
    refused for a stale pid file it did not leave.
    """
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        if pid is not None:
            reap(pid)
            if not pid_alive(pid):
                if pid_file is not None and read_pid(pid_file) == pid:
                    pid_file.unlink(missing_ok=True)
                details = tail(log_file, 15)
                hint = (" (a port it needs was taken, perhaps briefly by another program's outgoing connection: "
                        "run make up again, or choose ports below 32768 in conf/local.yml)"
                        if "Address already in use" in tail(log_file, 200) else "")
                raise StackError(f"{service} exited during start-up{hint}; its log is {log_file}", details=details)
        try:
            if probe():
                return
        except Exception as exc:  # any probe failure means "not ready yet"
            last_error = exc
        time.sleep(0.5)
    raise StackError(
        f"{service} did not become ready within {timeout:.0f} s (last probe error: {last_error}); "
        f"see {log_file}, or raise stack.start_timeout_s in conf if the machine is slow",
        details=tail(log_file, 15),
    )




def console_log4j2(root_level: str, loggers: dict[str, str]) -> str:
    """A log4j2.properties for a stack service: the console at root_level, with {logger name: level} overrides."""
    from lib import spark

    return spark.log4j2_properties(root_level, loggers, "[%d] %p %m (%c)%n", "SYSTEM_OUT")


@contextlib.contextmanager
def stack_lock(stack_dir: Path):
    """Held while a process starts services of the stack: another one waits (roles and files are set up once)."""
    (stack_dir / "run").mkdir(parents=True, exist_ok=True)
    with open(stack_dir / "run" / "up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
