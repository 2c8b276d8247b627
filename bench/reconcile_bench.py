"""Benchmark: reconcile on TPC-H, its time and the bytes that pass through the driver, one code version against another.

    CDC_TARGET=cluster .venv/bin/python bench/reconcile_bench.py [--scale 0.1] [--code DIR ...]

Builds TPC-H's eight tables (bench/tpch_churn.py's SQL; sf 0.1: 866,030 rows) as a database of its own, takes the
snapshot and merges it into silver in this process, then runs ``reconcile.reconcile`` once per ``--code`` folder (a
worktree of another commit; default: this checkout), each in a process of its own with that folder first on
PYTHONPATH, in the order given. Each runs reconcile twice and measures the second run (the first loads classes and
modules, which are file reads): seconds, whether every table is equal, and the bytes the driver's processes read and
wrote meanwhile (``/proc/<pid>/io`` rchar and wchar: sockets and files alike, so an upper bound; and the bytes on
the TCP connections it holds open at the end, from ``ss``, which misses a connection opened and closed between; and
what those connections carry while the driver idles as long as the first run took) — the
notebook's Python, and the Spark driver's JVM when it is not also the executor (CDC_TARGET cluster; in local mode
the executors run inside the driver's JVM, so only the Python figure says what crossed into the driver). The JVM's
figure is also split: its py4j connections (the notebook's Python driving its own JVM) apart from the rest (executors,
the master, PostgreSQL). ``RECONCILE_BENCH_BROADCASTS=1`` also lists the broadcast pieces the driver stored during
the measured run (each job's compressed task binary; Spark's log at INFO); ``RECONCILE_BENCH_SPARK_CONF=key=value,...``
sets session settings in each child before it reconciles. ``RECONCILE_BENCH_FLOOR=silver`` measures, in place of
reconcile, only what any check of silver in Spark pays: every silver table's live rows counted and hashed in one job,
nothing read from the source (the Spark half of a reconcile whose source checksums PostgreSQL would compute, as
data-diff does). Everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above
import tpch_churn  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from lib import config  # noqa: E402
from lib import spark as spark_lib  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import lake_paths, merge, reconcile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def io_bytes(pid: int) -> int:
    """Bytes a process has read and written so far (rchar + wchar)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def socket_bytes(pid: int) -> dict[str, int]:
    """Bytes sent + received so far on each TCP connection the process holds open (`ss -tinp`), by its addresses."""
    lines = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    found = {}
    for head, info in zip(lines, lines[1:], strict=False):
        if f"pid={pid}," in head and "bytes_" in info:
            counters = dict(part.split(":", 1) for part in info.split() if part.startswith("bytes_"))
            found[" ".join(head.split()[3:5])] = int(counters.get("bytes_sent", 0)) + \
                int(counters.get("bytes_received", 0))
    return found


def py4j_share(before: dict[str, int], after: dict[str, int], port: int) -> int:
    """Of socket_delta, the bytes on the JVM's py4j connections (its local port is the gateway's): the notebook's
    Python calling its own JVM, counted on both ends."""
    return socket_delta(before, {key: n for key, n in after.items() if key.split()[0].endswith(f":{port}")})


def broadcast_kib(log: str) -> list[float]:
    """The sizes of the broadcast pieces the driver stored (Spark's MemoryStore at INFO): each job's task binary,
    compressed, which every executor that runs one of its tasks fetches from the driver."""
    return [float(m.group(1)) for m in re.finditer(r"broadcast_\d+_piece0 stored as bytes in memory \(estimated size "
                                                   r"([0-9.]+) KiB", log)]


def socket_delta(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes moved on connections open at the end (a connection opened and closed in between is not counted)."""
    return sum(n - before.get(key, 0) for key, n in after.items())


def silver_floor(conf: dict, spark) -> list[dict]:
    """Every silver table's live rows counted and hashed over all their columns in one job, as reconcile's silver side
    is (no source read): reconcile's result shape, ``equal`` meaning only that the job ran."""
    frames = []
    for spec in lake_paths.table_specs(conf):
        silver = spark.read.format("delta").load(lake_paths.silver_path(conf, spec)).filter("NOT _deleted")
        columns = ", ".join(lake_paths.quote(c) for c in silver.columns if c not in lake_paths.META_COLUMNS)
        frames.append(silver.selectExpr(f"'{spec.qualified}' AS __t", f"xxhash64({columns}) AS __h"))
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    counted = union.coalesce(spark_lib.cores(spark) or 2).groupBy("__t").agg(
        F.count(F.lit(1)).alias("n"), F.sum(F.col("__h").cast("decimal(38,0)")).alias("checksum")).collect()
    return [{"table": r["__t"], "source_rows": r["n"], "equal": True} for r in counted]


def measure(overrides: dict) -> dict:
    """One reconcile of every table with the conf the benchmark prepared: seconds, equal, driver bytes."""
    conf = config.apply_overrides(config.load(None), overrides)
    spark = spark_lib.from_conf(conf, catalog="in-memory")
    for pair in filter(None, os.environ.get("RECONCILE_BENCH_SPARK_CONF", "").split(",")):
        spark.conf.set(*pair.split("=", 1))  # a session setting to try, as key=value[,key=value]
    check = silver_floor if os.environ.get("RECONCILE_BENCH_FLOOR") == "silver" else reconcile.reconcile
    try:
        jvm = None if spark_lib.is_remote(spark) or str(spark.conf.get("spark.master")).startswith("local") else \
            int(spark._jvm.java.lang.ProcessHandle.current().pid())
        began = time.monotonic()
        check(conf, spark)  # the first run loads classes and modules (file reads): not counted
        first = time.monotonic() - began
        idle = {pid: socket_bytes(pid) for pid in (os.getpid(), jvm) if pid}
        time.sleep(first)  # as long as a run, doing nothing: what the driver's connections carry anyway
        idle = {pid: socket_delta(before, socket_bytes(pid)) for pid, before in idle.items()}
        if jvm and os.environ.get("RECONCILE_BENCH_BROADCASTS"):
            spark.sparkContext.setLogLevel("INFO")  # the measured run's broadcasts on stderr, for broadcast_kib
        python_before, jvm_before = io_bytes(os.getpid()), io_bytes(jvm) if jvm else None
        sockets_before = {pid: socket_bytes(pid) for pid in (os.getpid(), jvm) if pid}
        began = time.monotonic()
        results = check(conf, spark)
        seconds = time.monotonic() - began
        out = {"first_seconds": round(first, 1), "seconds": round(seconds, 1),
               "equal": all(r["equal"] for r in results), "tables": len(results),
               "rows": sum(r["source_rows"] for r in results),
               "python_mb": round((io_bytes(os.getpid()) - python_before) / 1e6, 2),
               "python_socket_mb": round(socket_delta(sockets_before[os.getpid()], socket_bytes(os.getpid())) / 1e6, 3),
               "idle_s": round(first, 1), "python_idle_mb": round(idle[os.getpid()] / 1e6, 3)}
        if jvm:
            out["jvm_mb"] = round((io_bytes(jvm) - jvm_before) / 1e6, 2)
            after = socket_bytes(jvm)
            out["jvm_socket_mb"] = round(socket_delta(sockets_before[jvm], after) / 1e6, 3)
            out["jvm_py4j_mb"] = round(py4j_share(sockets_before[jvm], after,
                                                  spark.sparkContext._gateway.gateway_parameters.port) / 1e6, 3)
            out["jvm_idle_mb"] = round(idle[jvm] / 1e6, 3)
        return out
    finally:
        spark.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1, help="TPC-H scale factor (0.1: 866,030 rows)")
    parser.add_argument("--code", action="append", help="a checkout whose lib/ runs the reconcile (repeatable)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child: conf overrides as JSON
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return
    load_before = bench_env.machine()
    folder = tempfile.mkdtemp(prefix="cdc-reconcile-")
    conf = bench_env.isolated(tpch_churn.TABLES, {"CDC__LAKE__ROOT": os.path.join(folder, "lake")},
                              schema_sql=tpch_churn.schema_sql(args.scale), schemas=("tpch",))
    spark, rows = None, []
    try:
        spark = spark_lib.from_conf(conf, catalog="in-memory")
        bootstrap.run(conf, log=lambda *a: None)
        snapshot.run(conf, spark, log=lambda *a: None)
        merge.run_until_caught_up(conf, spark)
        spark.stop()
        spark = None
        for code in args.code or [str(ROOT)]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(code)}
            done = subprocess.run([sys.executable, __file__, "--measure", json.dumps(conf["env"])], env=env,
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise SystemExit(f"reconcile with {code} failed:\n{done.stderr[-4000:]}")
            rows.append({"code": code, **json.loads(done.stdout.strip().splitlines()[-1])})
            if os.environ.get("RECONCILE_BENCH_BROADCASTS"):
                pieces = broadcast_kib(done.stderr)
                rows[-1]["broadcasts_kib"] = [round(k, 1) for k in pieces]
            print(rows[-1], flush=True)
    finally:
        bench_env.finish(conf, folder, spark, log=print)
    target = os.environ.get("CDC_TARGET", "local")
    print(f"machine before: {load_before}; after: {bench_env.machine()}; target {target}")
    print("| code | tables | rows | equal | seconds (first run) | notebook's Python: read + written (on its open "
          "connections; idle as long) | driver JVM: read + written (on its open connections; idle as long) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        jvm = f"{r['jvm_mb']} MB ({r['jvm_socket_mb']} MB, of it py4j {r['jvm_py4j_mb']} MB; " \
              f"{r.get('jvm_idle_mb')} MB)" if "jvm_mb" in r else \
            "(executors in the same JVM)"
        print(f"| {r['code']} | {r['tables']} | {r['rows']:,} | {r['equal']} | {r['seconds']} ({r['first_seconds']}) | "
              f"{r['python_mb']} MB ({r['python_socket_mb']} MB; {r.get('python_idle_mb')} MB) | {jvm} |")


if __name__ == "__main__":
    main()
