"""Benchmark: a PostgreSQL failover under a write load, timed (issue 30, point 1).

    .venv/bin/python bench/failover_bench.py [--major 18] [--writes 2000]

The drill of tests/test_failover.py, with clocks: a primary and its standby with failover slots
(lib/local/stack/pg_failover.py), the snapshot, the capture streaming while small transactions commit, the
primary crashed once the standby's copy of the slot is synchronised, the standby promoted, the capture
pointed at it. Prints the time to promote, the time until the capture is caught up on the new primary, how
many events it sent again (the synchronised copy lags what the capture confirmed), the merge's catch-up and
whether reconcile is exact, with the load average before and after. Everything it made is removed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config  # noqa: E402
from lib import spark as spark_lib  # noqa: E402
from lib.capture import bootstrap, snapshot, stream  # noqa: E402
from lib.lake import merge, reconcile  # noqa: E402
from lib.local.stack import pg_failover  # noqa: E402
from lib.operate import teardown  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--writes", type=int, default=2000, help="transactions committed before the crash")
    args = parser.parse_args()
    print(f"before: {bench_env.machine()}", flush=True)
    base = config.load("local")
    pg_failover.down(base, args.major, log=lambda line: None)
    primary, standby = pg_failover.up(base, args.major, log=lambda line: None)
    tag = uuid.uuid4().hex[:8]
    pg_failover.make_shop(primary, f"failover_{tag}")
    folder = tempfile.mkdtemp(prefix="failover-bench-")
    overrides = {"CDC__SOURCE__DATABASE": f"failover_{tag}", "CDC__SOURCE__SLOT": f"fo_{tag}",
                 "CDC__SOURCE__PUBLICATION": f"fo_{tag}", "CDC__SOURCE__TABLES": repr(pg_failover.SHOP_TABLES),
                 "CDC__SOURCE__KEYS": "{}", "CDC__SOURCE__FAILOVER_SLOT": "true",
                 "CDC__KAFKA__TOPIC_PREFIX": f"bench-{tag}-fo", "CDC__LAKE__ROOT": f"{folder}/lake"}
    on_primary, on_standby = config.apply_overrides(primary, overrides), config.apply_overrides(standby, overrides)
    spark = spark_lib.from_conf(on_primary, catalog="in-memory")
    try:
        bootstrap.run(on_primary, log=lambda line: None)
        done = snapshot.run(on_primary, spark, log=lambda line: None)
        stop, writes, failures = threading.Event(), [], []
        writer = threading.Thread(target=pg_failover.write_load, args=(on_primary, stop, writes), daemon=True)

        def capture():
            try:
                stream.run(on_primary, until="forever", stop_event=stop, heartbeat_s=1)
            except Exception as exc:  # the crash
                failures.append(exc)

        streaming = threading.Thread(target=capture, daemon=True)
        writer.start()
        streaming.start()
        while len(writes) < args.writes and writer.is_alive():
            time.sleep(0.1)
        pg_failover.wait_synced(on_standby, config.get(on_primary, "source.slot"), done["consistent_point"])
        committed = len(writes)
        crashed = time.monotonic()
        pg_failover.crash(on_primary)
        writer.join(30)
        streaming.join(60)
        stop.set()
        pg_failover.promote(on_standby)
        promoted = time.monotonic()
        metrics = stream.run(on_standby, until="caught_up")
        resumed = time.monotonic()
        caught = merge.run_until_caught_up(on_standby, spark)
        merged = time.monotonic()
        results = reconcile.reconcile(on_standby, spark)
        exact = all(r["equal"] for r in results)
        print(f"writes committed before the crash (as the writer saw them): {committed}")
        print(f"capture stopped by the crash: {type(failures[0]).__name__ if failures else 'no'}")
        print(f"crash -> standby promoted: {promoted - crashed:.1f} s")
        print(f"promoted -> capture caught up on the new primary: {resumed - promoted:.1f} s "
              f"({metrics['events']} events sent from the synchronised copy's position; nothing was written after "
              f"the promotion, so each committed before the crash, and those the crashed run had delivered are "
              f"sent again)")
        print(f"merge from nothing after that (the snapshot and every change): {merged - resumed:.1f} s "
              f"({caught.get('batches')} batch(es))")
        print(f"reconcile: {'exact' if exact else results}")
        print(f"after: {bench_env.machine()}", flush=True)
        return 0 if exact else 1
    finally:
        spark.stop()
        teardown.delete_prefix(on_primary, config.get(on_primary, "kafka.topic_prefix"))
        pg_failover.down(base, args.major, log=lambda line: None)


if __name__ == "__main__":
    sys.exit(main())
