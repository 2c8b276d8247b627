"""Processes the pipeline starts and stops: pid files, detached starts, stopping, log tails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


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


def tree(root: int) -> set[int]:
    """root and every process descending from it (a service's keeper, the service, a merge's JVM and workers)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, StopIteration, ValueError):
                lines = Path(f"/proc/{entry}/status").read_text().splitlines()
                parents[int(entry)] = int(next(line for line in lines if line.startswith("PPid:")).split()[1])
    found, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found, grew = found | more, bool(more)
    return found


def read_pid(pid_file: Path) -> int | None:
    """The pid recorded in pid_file, or None when there is none."""
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


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


def kill_now(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL (a crash: nothing flushed) and wait until the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still runs {timeout:.0f} s after SIGKILL")


def reap(pid: int) -> None:
    """Collect a finished child so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


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
