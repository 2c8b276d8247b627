"""Count the processes a command starts, by kind: Spark drivers, other JVMs, notebook kernels, services.

    python bench/suite_census.py -- make test

Polls /proc every 0.2 s while the command runs (a JVM or a kernel lives seconds at least, so none is
missed), prints the command's exit status, wall time, CPU seconds of the whole machine and one line per
kind, then per kind the test modules that started them (a child inherits PYTEST_CURRENT_TEST from the test
that runs it), and the CPU seconds the started processes used, by test module and by kind. docs/testing.md
keeps its figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

KINDS = [  # (kind, a string of the command line that names it), first match wins
    # each pytest worker's own Spark session lives through every module the worker runs: a kind of its own
    ("tests' shared spark session (one per worker)", "popen-gw"),
    # spark-submit first runs Spark's launcher, a short JVM whose command line also names SparkSubmit
    ("spark launcher (one per driver start)", "org.apache.spark.launcher.Main"),
    ("spark driver", "org.apache.spark.deploy.SparkSubmit"),
    ("kafka connect (debezium)", "ConnectDistributed"),
    ("kafka broker", "kafka.Kafka "),
    ("registry", "apicurio-registry"),
    ("other jvm", "/bin/java"),
    ("notebook kernel", "ipykernel_launcher"),
    ("capture or merge service", "lib.operate.service run"),
    ("postgres (server or initdb)", "postgres -D"),
]


def kind_of(cmdline: str) -> str | None:
    """The kind of a process from its command line, or None when it is none of KINDS."""
    return next((kind for kind, marker in KINDS if marker in cmdline), None)


def cmdlines() -> dict[int, str]:
    """pid -> command line of every process now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return found


def started_by(pid: int) -> str:
    """The test module whose run started pid (from PYTEST_CURRENT_TEST in its environment), or '-'."""
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return "-"
    for entry in environ:
        if entry.startswith(b"PYTEST_CURRENT_TEST="):
            return entry.split(b"=", 1)[1].decode(errors="replace").split("::", 1)[0]
    return "-"


def cpu_ticks(pid: int) -> int | None:
    """User and system CPU of pid so far, in clock ticks (None once it is gone)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def machine_cpu_s() -> float:
    """CPU seconds every core spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    seen, counts, by_test = set(cmdlines()), Counter(), Counter()
    labels: dict[int, tuple[str, str]] = {}  # pid -> (kind or "other", test module) of what the command started
    ticks: dict[int, int] = {}  # pid -> its CPU ticks when last seen (a process gone between polls loses < 0.2 s)
    print("load average before:", " ".join(f"{v:.2f}" for v in os.getloadavg()), flush=True)
    cpu0, t0 = machine_cpu_s(), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        for pid, cmdline in cmdlines().items():
            if pid not in seen:
                seen.add(pid)
                kind = kind_of(cmdline)
                labels[pid] = (kind or "other", started_by(pid))
                if kind:
                    counts[kind] += 1
                    by_test[kind, labels[pid][1]] += 1
            if pid in labels:
                ticks[pid] = cpu_ticks(pid) or ticks.get(pid, 0)
        time.sleep(0.2)
    wall, cpu = time.monotonic() - t0, machine_cpu_s() - cpu0
    print("load average after: ", " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"exit {child.returncode}, wall {wall:.0f} s, machine CPU {cpu:.0f} s ({cpu / wall:.2f} cores busy)")
    for kind, _ in KINDS:
        print(f"  {kind:38s} {counts[kind]:4d} started")
    for kind, _ in KINDS:
        tests = sorted(((n, test) for (k, test), n in by_test.items() if k == kind), reverse=True)
        if tests:
            print(f"{kind}, by test module: " + ", ".join(f"{test} {n}" for n, test in tests))
    hz = os.sysconf("SC_CLK_TCK")
    for index, title in ((1, "test module (what its processes used, not the pytest worker itself)"), (0, "kind")):
        spent = Counter()
        for pid, label in labels.items():
            spent[label[index]] += ticks.get(pid, 0) / hz
        print(f"CPU seconds by {title}: " + ", ".join(f"{name} {s:.0f}" for name, s in spent.most_common(25)))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
