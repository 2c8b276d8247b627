"""Processes of the local stack: pid files, ports, readiness waits, stopping."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


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


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmdline(pid: int) -> str:
    """The process's command line, or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def read_pid(pid_file: Path) -> int | None:
    """The pid recorded in pid_file, or None when there is none."""
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


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


def claim(service: str, pid_file: Path, marker: str, ports: list[tuple[str, int, str]], log=print) -> bool:
    """False when the service already runs; otherwise True once each (host, port, setting) is free."""
    if running_pid(service, pid_file, marker):
        log(f"{service:9s} already running on port {ports[0][1]}")
        return False
    for host, port, setting in ports:
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


def start(command: list[str], log_file: Path, pid_file: Path, env: dict | None = None,
          cwd: Path | None = None) -> int:
    """Start a detached process writing to log_file; record and return its pid."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )
    pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def stop(pid: int, timeout: float = 30.0, group: bool = False) -> None:
    """SIGTERM, wait, then SIGKILL if it is still there (to its whole process group when group is set)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:  # a process started in its own session: its children too
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    reap(pid)


def reap(pid: int) -> None:
    """Collect a finished child so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


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


def tail(path: Path, lines: int = 20) -> str:
    """Last lines of a text file, or a note that it does not exist."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return f"({path} does not exist)"
    return "\n".join(text.splitlines()[-lines:])


def console_log4j2(root_level: str, loggers: dict[str, str]) -> str:
    """A log4j2.properties that prints to the console at root_level, with {logger name: level} overrides."""
    lines = ["status = warn", "appender.console.type = Console", "appender.console.name = console",
             "appender.console.layout.type = PatternLayout", "appender.console.layout.pattern = [%d] %p %m (%c)%n",
             f"rootLogger.level = {root_level}", "rootLogger.appenderRef.console.ref = console"]
    for i, (name, level) in enumerate(loggers.items()):
        lines += [f"logger.l{i}.name = {name}", f"logger.l{i}.level = {level}"]
    return "\n".join(lines) + "\n"
