"""A/B of the capture's CPU per event: bench/capture_bench.py of two checkouts, alternating A B A B (not a test).

    .venv/bin/python bench/capture_ab.py --b ../capture-base [--a .] [--pairs 3] [--backlog 200000]
        [--sslmode require] [--python .venv/bin/python] [--env-a CDC_CAPTURE_COMPILED=0]

Each run is ``capture_bench.py --backlog N --skip concurrent latency memory`` of one checkout, in its own process
(PYTHONPATH and working directory set to that checkout, PGSSLMODE to --sslmode), so both capture the same backlog
shape into their own throwaway database. While a run captures, the walsender of its slot is looked up in
pg_stat_ssl, so the table says whether that connection really was TLS. Printed: every run, the medians, the ratio
A/B of CPU per event pair by pair, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config, source  # noqa: E402

RESULT = re.compile(r"capture: ([\d,]+) events in ([\d.]+) s = ([\d,]+) events/s, ([\d.]+) µs capture CPU per event")
WALSENDERS = ("SELECT r.slot_name, s.ssl, coalesce(s.version, '') FROM pg_replication_slots r "
              "JOIN pg_stat_ssl s ON s.pid = r.active_pid WHERE r.slot_name LIKE 'bench\\_%'")


class SslWatch:
    """Polls pg_stat_ssl for the walsenders of benchmark slots (bench_<id>) while a run goes on."""

    def __init__(self, conf: dict) -> None:
        # as the pipeline role: the walsenders are its sessions (another role sees no TLS columns without
        # pg_read_all_stats)
        self.conn = source.connect(conf, dbname="postgres")
        self.conn.autocommit = True
        self.seen: dict[str, tuple[bool, str]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with self.conn.cursor() as cur:
            while not self.stop.is_set():
                cur.execute(WALSENDERS)
                for slot, ssl, version in cur.fetchall():
                    self.seen.setdefault(slot, (ssl, version))
                self.stop.wait(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.conn.close()

    def describe_slot(self, slot: str) -> str:
        """The TLS state of one slot's walsender ('not seen' when the poll missed it)."""
        if slot not in self.seen:
            return "not seen"
        ssl, version = self.seen[slot]
        return version if ssl else "plain TCP"

    def describe(self) -> str:
        """'TLSv1.3', 'plain TCP', or 'not seen' (the run was too short to catch its walsender)."""
        if not self.seen:
            return "not seen"
        kinds = {version if ssl else "plain TCP" for ssl, version in self.seen.values()}
        return "/".join(sorted(kinds))


def run_once(checkout: Path, python: str, backlog: int, tx_rows: int, sslmode: str, conf: dict,
             extra_env: dict | None = None) -> dict:
    """One capture_bench.py backlog run of checkout; its figures and the walsender's TLS state."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "PGSSLMODE": sslmode, **(extra_env or {})}
    command = [python, str(checkout / "bench" / "capture_bench.py"), "--backlog", str(backlog), "--tx-rows",
               str(tx_rows), "--skip", "concurrent", "latency", "memory"]
    with SslWatch(conf) as watch:
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=3600)
    found = RESULT.search(done.stdout)
    if done.returncode or not found:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-2000:]}")
    return {"events": int(found[1].replace(",", "")), "seconds": float(found[2]),
            "rate": int(found[3].replace(",", "")), "cpu_us": float(found[4]), "tls": watch.describe()}


def commit_of(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, default=Path(__file__).resolve().parents[1], help="checkout A (this one)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B, e.g. a git worktree of the baseline")
    parser.add_argument("--python", default=sys.executable, help="the interpreter for both (its packages)")
    parser.add_argument("--pairs", type=int, default=3, help="A B pairs")
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--tx-rows", type=int, default=100)
    parser.add_argument("--sslmode", default="require", help="PGSSLMODE for both: require (TLS) or disable")
    parser.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for A's runs, e.g. CDC_CAPTURE_COMPILED=0 (its Python path)")
    args = parser.parse_args(argv)
    env_a = dict(item.split("=", 1) for item in args.env_a)
    conf = config.load("local")
    a, b = args.a.resolve(), args.b.resolve()
    names = {"A": f"A {commit_of(a)}" + "".join(f" {k}={v}" for k, v in env_a.items()), "B": f"B {commit_of(b)}"}
    load_before = bench_env.machine()
    print(f"machine before: {load_before}; PGSSLMODE={args.sslmode}; backlog {args.backlog:,} rows", flush=True)
    runs: list[tuple[str, dict]] = []
    for pair in range(args.pairs):
        for side, checkout in (("A", a), ("B", b)):
            result = run_once(checkout, args.python, args.backlog, args.tx_rows, args.sslmode, conf,
                              env_a if side == "A" else None)
            runs.append((side, result))
            print(f"pair {pair + 1} {names[side]}: {result['rate']:,} events/s, {result['cpu_us']:.1f} µs CPU/event, "
                  f"walsender {result['tls']} (load {os.getloadavg()[0]:.1f})", flush=True)
    print()
    print("| run | events/s | capture CPU per event | walsender (pg_stat_ssl) |")
    print("|---|---|---|---|")
    for side, r in runs:
        print(f"| {names[side]} | {r['rate']:,} | {r['cpu_us']:.1f} µs | {r['tls']} |")
    cpu = {side: [r["cpu_us"] for s, r in runs if s == side] for side in "AB"}
    rate = {side: [r["rate"] for s, r in runs if s == side] for side in "AB"}
    ratios = [x / y for x, y in zip(cpu["A"], cpu["B"], strict=True)]
    for side in "AB":
        print(f"| {names[side]} median | {statistics.median(rate[side]):,.0f} | {statistics.median(cpu[side]):.1f} µs |"
              " |")
    print(f"\nCPU per event A/B pair by pair: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    print(f"machine before: {load_before}; after: {bench_env.machine()}")


if __name__ == "__main__":
    main()
