"""Benchmark: a TPC-H database as a user's own, the continuous services as `make run` starts them, a churn over
its eight tables with kill -9 of the capture and of the merge during it; how long after the writes stop the lake
has caught up (bronze, then silver), and whether every table is exact.

    .venv/bin/python bench/tpch_churn.py [--scale 0.1] [--seconds 120] [--rate 700] [--no-kill]

A database of its own (bench/bench_env.py) holds TPC-H's eight tables at ``--scale`` (sf 0.1: 866,030 rows,
lineitem 600,000), generated in SQL with TPC-H's keys and cardinalities (not dbgen's text). Notebook 01's
bootstrap and 02's snapshot run in this process, then ``service.start`` starts the capture and merge services
with the conf's defaults (conf/local.yml: ``service.merge_interval``, ``merge.silver_interval_s``), and the
benchmark waits until the initial load is in silver. The churn is a server-side procedure: per transaction a
new order with four lineitems, an order and its lineitems deleted, a customer's balance and a partsupp's
quantity updated (about 20 Kafka messages), at ``--rate`` transactions/s for ``--seconds``. A third and two
thirds into it the benchmark kills the capture's and then the merge's process (SIGKILL; their keepers start them
again). Reported: messages written, the capture's and the lake's messages/s, the seconds from the end of the
writes until ``monitor.wait_until_caught_up`` returned (bronze and silver hold Kafka's end offsets), and
reconcile per table. Everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import source  # noqa: E402
from lib import spark as spark_lib  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import lake_paths, reconcile  # noqa: E402
from lib.operate import keeper, metrics, monitor, service  # noqa: E402

TABLES = ["tpch.region", "tpch.nation", "tpch.supplier", "tpch.customer", "tpch.part", "tpch.partsupp",
          "tpch.orders", "tpch.lineitem"]


def schema_sql(scale: float) -> str:
    """TPC-H's tables and keys, rows generated in SQL at the scale factor."""
    n = {"supplier": int(10_000 * scale), "customer": int(150_000 * scale), "part": int(200_000 * scale),
         "orders": int(1_500_000 * scale)}
    return f"""
CREATE SCHEMA tpch;
CREATE TABLE tpch.region (r_regionkey int PRIMARY KEY, r_name text, r_comment text);
CREATE TABLE tpch.nation (n_nationkey int PRIMARY KEY, n_name text, n_regionkey int, n_comment text);
CREATE TABLE tpch.supplier (s_suppkey int PRIMARY KEY, s_name text, s_address text, s_nationkey int, s_phone text,
    s_acctbal numeric(15,2), s_comment text);
CREATE TABLE tpch.customer (c_custkey int PRIMARY KEY, c_name text, c_address text, c_nationkey int, c_phone text,
    c_acctbal numeric(15,2), c_mktsegment text, c_comment text);
CREATE TABLE tpch.part (p_partkey int PRIMARY KEY, p_name text, p_mfgr text, p_brand text, p_type text, p_size int,
    p_container text, p_retailprice numeric(15,2), p_comment text);
CREATE TABLE tpch.partsupp (ps_partkey int, ps_suppkey int, ps_availqty int, ps_supplycost numeric(15,2),
    ps_comment text, PRIMARY KEY (ps_partkey, ps_suppkey));
CREATE TABLE tpch.orders (o_orderkey bigint PRIMARY KEY, o_custkey int, o_orderstatus text, o_totalprice numeric(15,2),
    o_orderdate date, o_orderpriority text, o_clerk text, o_shippriority int, o_comment text);
CREATE TABLE tpch.lineitem (l_orderkey bigint, l_linenumber int, l_partkey int, l_suppkey int,
    l_quantity numeric(15,2), l_extendedprice numeric(15,2), l_discount numeric(15,2), l_tax numeric(15,2),
    l_returnflag text, l_linestatus text, l_shipdate date, l_commitdate date, l_receiptdate date,
    l_shipinstruct text, l_shipmode text, l_comment text, PRIMARY KEY (l_orderkey, l_linenumber));
INSERT INTO tpch.region SELECT g, 'REGION ' || g, md5(g::text) FROM generate_series(0, 4) g;
INSERT INTO tpch.nation SELECT g, 'NATION ' || g, g % 5, md5(g::text) FROM generate_series(0, 24) g;
INSERT INTO tpch.supplier SELECT g, 'Supplier#' || g, md5(g::text), g % 25, '10-' || g, (g % 10000) - 999.99,
    md5((g * 7)::text) FROM generate_series(1, {n['supplier']}) g;
INSERT INTO tpch.customer SELECT g, 'Customer#' || g, md5(g::text), g % 25, '11-' || g, (g % 10000) - 999.99,
    (ARRAY['AUTOMOBILE','BUILDING','FURNITURE','HOUSEHOLD','MACHINERY'])[1 + g % 5], md5((g * 3)::text)
    FROM generate_series(1, {n['customer']}) g;
INSERT INTO tpch.part SELECT g, 'part ' || md5(g::text), 'Manufacturer#' || (1 + g % 5), 'Brand#' || (11 + g % 44),
    'STANDARD BRUSHED TIN', 1 + g % 50, 'SM BOX', 900 + (g % 1000) / 10.0, md5((g * 5)::text)
    FROM generate_series(1, {n['part']}) g;
INSERT INTO tpch.partsupp SELECT p, 1 + (p + s * ({n['supplier']} / 4 + 1)) % {n['supplier']}, 1 + (p * s) % 9999,
    1 + (p % 1000) / 10.0, md5((p * s)::text) FROM generate_series(1, {n['part']}) p, generate_series(0, 3) s;
INSERT INTO tpch.orders SELECT g, 1 + g % {n['customer']}, 'O', (g % 50000) * 3.7, DATE '1992-01-01' + g % 2400,
    '1-URGENT', 'Clerk#' || g % 1000, 0, md5(g::text) FROM generate_series(1, {n['orders']}) g;
INSERT INTO tpch.lineitem SELECT o, l, 1 + (o * l) % {n['part']}, 1 + (o + l) % {n['supplier']}, 1 + (o % 50),
    (o % 50000) * 0.93, 0.05, 0.02, 'N', 'O', DATE '1992-01-02' + o % 2400, DATE '1992-02-01' + o % 2400,
    DATE '1992-02-10' + o % 2400, 'DELIVER IN PERSON', 'TRUCK', md5((o * l)::text)
    FROM generate_series(1, {n['orders']}) o, generate_series(1, 4) l;
CREATE OR REPLACE PROCEDURE public.tpch_churn(seconds float8, rate float8)
LANGUAGE plpgsql AS $p$
DECLARE
    i bigint := 0;
    next_key bigint := {n['orders']} + 1;
    old_key bigint := 1;
    started timestamptz := clock_timestamp();
BEGIN
    WHILE extract(epoch FROM clock_timestamp() - started) < seconds LOOP
        INSERT INTO tpch.orders VALUES (next_key, 1 + next_key % {n['customer']}, 'O', 100.5, current_date,
                                        '2-HIGH', 'Clerk#1', 0, 'churn');
        INSERT INTO tpch.lineitem SELECT next_key, l, 1 + l, 1 + l, l, 10.5, 0.04, 0.02, 'N', 'O', current_date,
            current_date, current_date, 'NONE', 'MAIL', 'churn' FROM generate_series(1, 4) l;
        DELETE FROM tpch.lineitem WHERE l_orderkey = old_key;
        DELETE FROM tpch.orders WHERE o_orderkey = old_key;
        UPDATE tpch.customer SET c_acctbal = c_acctbal + 1 WHERE c_custkey = 1 + (i * 7919) % {n['customer']};
        UPDATE tpch.partsupp SET ps_availqty = ps_availqty + 1
            WHERE ps_partkey = 1 + (i * 104729) % {n['part']} AND ps_suppkey = (
                SELECT min(ps_suppkey) FROM tpch.partsupp WHERE ps_partkey = 1 + (i * 104729) % {n['part']});
        COMMIT;
        i := i + 1;
        next_key := next_key + 1;
        old_key := old_key + 1;
        IF rate > 0 THEN
            PERFORM pg_sleep(greatest(0, i / rate - extract(epoch FROM clock_timestamp() - started)));
        END IF;
    END LOOP;
    RAISE NOTICE 'tpch_churn: % transactions', i;
END $p$;
"""


def churn(conf: dict, seconds: float, rate: float, result: dict) -> None:
    conn = source.connect(conf, admin=True)
    conn.autocommit = True  # the procedure commits itself
    try:
        with conn.cursor() as cur:
            cur.execute("CALL public.tpch_churn(%s, %s)", (seconds, rate))
        result["notices"] = list(conn.notices)
    finally:
        conn.close()


def messages(conf: dict) -> int:
    ends = bench_env.topic_ends(conf, [s.topic for s in lake_paths.table_specs(conf)])
    return sum(sum(parts.values()) for parts in ends.values())


def kill_child(conf: dict, name: str, log) -> None:
    """SIGKILL a service's process (its keeper starts it again)."""
    child = keeper.state(conf, name).get("child")
    if child:
        os.kill(child, signal.SIGKILL)
        log(f"killed {name} (pid {child})")


def work(records: list[dict]) -> dict:
    """What the merge service's metrics records say it did: bronze batches, decode steps and silver steps (the
    last one each record saw), their count and seconds."""
    batches = [s for r in records for s in r.get("batch_seconds") or []]
    decodes = [s for r in records for s in r.get("decode_seconds") or []]
    silver = {(r["silver_last"]["at"], r["silver_last"]["seconds"], r["silver_last"]["events"])
              for r in records if r.get("silver_last")}
    return {"batches": len(batches), "batch_s": round(sum(batches), 1), "decode_steps": len(decodes),
            "decode_s": round(sum(decodes), 1), "silver_steps_seen": len(silver),
            "silver_s": round(sum(s for _, s, _ in silver if s), 1),
            "silver_steps": [(s, e) for _, s, e in sorted(silver)]}


def run(args, log) -> dict:
    folder = tempfile.mkdtemp(prefix="cdc-tpch-churn-")
    conf = bench_env.isolated(TABLES, {"CDC__LAKE__ROOT": os.path.join(folder, "lake"),
                                       "CDC__SERVICE__DIR": os.path.join(folder, "services")},
                              schema_sql=schema_sql(args.scale), schemas=("tpch",))
    spark = None
    try:
        spark = spark_lib.from_conf(spark_lib.with_metastore(conf, os.path.join(folder, "metastore")))
        bootstrap.run(conf, log=lambda *a: None)
        began = time.monotonic()
        snapshot.run(conf, spark, log=lambda *a: None)
        rows = messages(conf)
        log(f"snapshot: {rows:,} messages in {time.monotonic() - began:.1f} s")
        started = time.time()
        service.start(conf, log=lambda *a: None)
        monitor.wait_until_recording(conf, since=started, timeout_s=900)
        began = time.monotonic()
        monitor.wait_until_caught_up(conf, timeout_s=3600)
        log(f"initial load in silver {time.monotonic() - began:.1f} s after the services reported")
        before = messages(conf)
        since_record = len(metrics.records(conf, "merge"))
        result: dict = {}
        writer = threading.Thread(target=churn, args=(conf, args.seconds, args.rate, result), daemon=True)
        began = time.monotonic()
        writer.start()
        if args.kill:
            time.sleep(args.seconds / 3)
            kill_child(conf, "capture", log)
            time.sleep(args.seconds / 3)
            kill_child(conf, "merge", log)
        writer.join()
        wrote = time.monotonic() - began
        log(f"churn: {result.get('notices')} in {wrote:.1f} s")
        waited = monitor.wait_until_caught_up(conf, timeout_s=3600)  # its seconds count from the end of the writes
        after_writes = time.monotonic() - began - wrote
        total = messages(conf) - before
        log(f"merge from the churn's start: {work(metrics.records(conf, 'merge')[since_record:])}")
        results = reconcile.reconcile(conf, spark)
        exact = {r["table"]: r["equal"] for r in results}
        report = {"messages": total, "wrote_s": wrote, "caught_up_after_s": after_writes,
                  "bronze_after_s": waited.get("bronze_s"),
                  "lake_rate": total / (wrote + after_writes), "exact": exact, "initial_rows": rows}
        log(f"lake caught up {after_writes:.1f} s after the writes stopped; {total:,} messages; exact: {exact}")
        return report
    finally:
        service.stop(conf, log=lambda *a: None)
        bench_env.finish(conf, folder, spark, log=log)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1, help="TPC-H scale factor (0.1: 866,030 rows)")
    parser.add_argument("--seconds", type=float, default=120.0, help="seconds of churn")
    parser.add_argument("--rate", type=float, default=700.0, help="churn transactions/s (0: as fast as it goes)")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="no kill -9 during the churn")
    args = parser.parse_args(argv)
    load_before = bench_env.machine()
    r = run(args, print)
    print(f"machine before: {load_before}; after: {bench_env.machine()}")
    print("| scale | churn | messages | lake messages/s | caught up after the writes: bronze, silver | exact |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.scale:g} ({r['initial_rows']:,} rows) | {args.seconds:g} s at {args.rate:g} tx/s"
          f"{', kill -9 of capture and merge' if args.kill else ''} | {r['messages']:,} | {r['lake_rate']:,.0f} | "
          f"{r['bronze_after_s']} s, {r['caught_up_after_s']:.1f} s | {all(r['exact'].values())} "
          f"({len(r['exact'])} tables) |")


if __name__ == "__main__":
    main()
