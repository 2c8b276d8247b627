"""Benchmark: the merge's cost as work grows, against the number of tables and of events, and under a churn.

    .venv/bin/python bench/tables_bench.py [--small 50] [--big-rows 500000] [--tables 1 10 50 51]
        [--events 20000 100000] [--churn-seconds 120] [--churn-rate 5000]

Runs in its own database, slot, publication and topic prefix (bench/bench_env.py) with the lake in a
temporary folder, all removed at the end. The database holds schema ``estate``: ``--small`` small tables
``s01``, ``s02``, ... (1,000 rows each) and one large table ``big`` (``--big-rows`` rows), all keyed by
``id``. Notebook 01's bootstrap and notebook 02's snapshot run first; the capture runs as its own process
(``python -m lib.capture.stream --until forever``) and the merge in this one.

- **initial load**: ``lib.lake.merge.run_until_caught_up`` over the snapshot (it creates every Delta table);
- **catch-up against tables and events**: for each ``--tables`` count n (the first n of the small tables,
  then ``big``: 51 is all small ones plus the large one) and each ``--events`` count, a server-side
  procedure writes that many row changes (upserts on a key space twice the table, every tenth
  transaction a delete; 100 rows per transaction) spread round-robin over the n tables; once the slot
  has confirmed them, the bronze step (``run_until_caught_up(silver=False)``) is timed, with the seconds
  of its micro-batches (what a trigger touching n tables costs), then the silver step that follows it;
- **churn**: the continuous merge (``merge.start``, processing-time trigger of 1 s, and the service's
  silver cadence beside it, lib/operate/workers.py SilverCadence) runs while the procedure writes
  ``--churn-rate`` rows/s over every table for ``--churn-seconds``; sampled each second: the messages
  Kafka holds (the capture's output) and those the bronze query's checkpoint has finished. Reported: the
  capture's and bronze's messages/s over the writes, the largest lag, the lag when the writes stop, how
  long bronze then takes to drain it, and when silver has applied everything (monitor.silver_behind).

Messages are Kafka records (a delete is an event plus a tombstone), counted from the topics' end offsets,
so both halves are counted in the same unit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402 - the sibling module, found through the path set above

from lib import config, source  # noqa: E402
from lib import spark as spark_session  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import lake_paths, merge, silver_step  # noqa: E402

SCHEMA_SQL = """
CREATE SCHEMA estate;
DO $$ BEGIN
    FOR i IN 1..{small} LOOP
        EXECUTE format('CREATE TABLE estate.s%s (id bigint PRIMARY KEY, name text, amount numeric(12,2), qty int, '
                       'updated timestamptz)', lpad(i::text, 2, '0'));
        EXECUTE format('INSERT INTO estate.s%s SELECT g, md5(g::text), g %% 1000, g %% 7, now() '
                       'FROM generate_series(1, 1000) g', lpad(i::text, 2, '0'));
    END LOOP;
END $$;
CREATE TABLE estate.big (id bigint PRIMARY KEY, name text, amount numeric(12,2), qty int, updated timestamptz,
                         note text);
INSERT INTO estate.big SELECT g, md5(g::text), g % 1000, g % 7, now(), repeat('n', 40)
FROM generate_series(1, {big_rows}) g;
CREATE OR REPLACE PROCEDURE public.bench_churn(total bigint, tx_rows int, rate float8, tables text[])
LANGUAGE plpgsql AS $p$
DECLARE
    done bigint := 0;
    n int;
    i bigint := 0;
    t text;
    keys bigint;
    started timestamptz := clock_timestamp();
BEGIN
    WHILE done < total LOOP
        n := least(tx_rows, total - done);
        t := tables[1 + i % cardinality(tables)];
        keys := CASE WHEN t = 'estate.big' THEN 2 * {big_rows} ELSE 2000 END;
        IF i % 10 = 9 THEN
            EXECUTE format('DELETE FROM %s WHERE id IN (SELECT (random() * $1)::bigint FROM generate_series(1, $2))',
                           t) USING keys, n;
        ELSE
            EXECUTE format('INSERT INTO %s (id, name, amount, qty, updated) SELECT k, md5(random()::text), '
                           'round((random() * 1000)::numeric, 2), (random() * 100)::int, clock_timestamp() '
                           'FROM (SELECT DISTINCT (random() * $1)::bigint AS k FROM generate_series(1, $2)) s '
                           'ON CONFLICT (id) DO UPDATE SET name = excluded.name, amount = excluded.amount, '
                           'qty = excluded.qty, updated = excluded.updated', t) USING keys, n;
        END IF;
        COMMIT;
        done := done + n;
        i := i + 1;
        IF rate > 0 THEN
            PERFORM pg_sleep(greatest(0, done / rate - extract(epoch FROM clock_timestamp() - started)));
        END IF;
    END LOOP;
END $p$;
"""


def table_names(small: int) -> list[str]:
    """The estate's tables: the small ones in order, then the large one."""
    return [f"estate.s{i:02d}" for i in range(1, small + 1)] + ["estate.big"]


def prepare(folder: str, args, log) -> dict:
    """A bench database with the estate, its conf (lake in folder), bootstrap done."""
    tables = table_names(args.small)
    conf = bench_env.isolated(tables, {"CDC__LAKE__ROOT": os.path.join(folder, "lake")},
                              schema_sql=SCHEMA_SQL.format(small=args.small, big_rows=args.big_rows),
                              schemas=["estate"])
    log(f"database {config.get(conf, 'source.database')}: {args.small} small tables of 1,000 rows, estate.big of "
        f"{args.big_rows:,} rows; topic prefix {conf['bench_prefix']}, lake {folder}/lake")
    bootstrap.run(conf, log=lambda line: None)
    return conf


def churn(conf: dict, total: int, rate: float, tables: list[str], tx_rows: int = 100) -> None:
    """Write total row changes over tables through bench_churn (rate rows/s, 0 = as fast as it goes)."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True  # the procedure commits itself
    try:
        with conn.cursor() as cur:
            cur.execute("CALL public.bench_churn(%s, %s, %s, %s)", (total, tx_rows, rate, tables))
    finally:
        conn.close()


def messages(conf: dict) -> int:
    """Records in the tables' topics so far."""
    ends = bench_env.topic_ends(conf, [s.topic for s in lake_paths.table_specs(conf)])
    return sum(sum(parts.values()) for parts in ends.values())


def caught_up(conf: dict) -> None:
    """Wait until the capture has confirmed everything written so far."""
    bench_env.wait_confirmed(conf, bench_env.wal_lsn(conf), timeout_s=900)


def timed_catch_up(conf: dict, spark, label: str, log) -> dict:
    """The bronze step to Kafka's end (timed, with its micro-batches' seconds), then the silver step, timed."""
    before = bench_env.committed_offsets(conf)
    ends = bench_env.topic_ends(conf, [s.topic for s in lake_paths.table_specs(conf)])
    pending = bench_env.behind(ends, before)
    began = time.monotonic()
    done = merge.run_until_caught_up(conf, spark, cleanup=False, silver=False)
    seconds = time.monotonic() - began
    left = bench_env.behind(ends, bench_env.committed_offsets(conf))
    if left:
        raise RuntimeError(f"{label}: the merge stopped with {left} message(s) left")
    began = time.monotonic()
    step = silver_step.run(conf, spark)
    silver_s = time.monotonic() - began
    row = {"label": label, "messages": pending, "seconds": seconds, "batches": done["batches"],
           "batch_seconds": [round(b, 2) for b in done["batch_seconds"] if b is not None],
           "rate": pending / seconds if seconds else 0.0, "silver_s": silver_s, "silver_tables": len(step["tables"])}
    log(f"{label}: bronze {pending:,} messages in {seconds:.1f} s over {done['batches']} batch(es) "
        f"{row['batch_seconds']}, {row['rate']:,.0f}/s; silver step {silver_s:.1f} s over {row['silver_tables']} "
        f"table(s); phases of each batch (s): {done.get('batch_phases')}; silver phases (s): {step.get('phases')}, "
        f"its tables (s): {sorted(t['seconds'] for t in step['tables'].values())}")
    return row


def run_churn(conf: dict, spark, tables: list[str], seconds: float, rate: float, log) -> dict:
    """The continuous merge (bronze query and silver cadence) beside a churn; sampled every second."""
    from lib.operate import monitor, workers

    topics = [s.topic for s in lake_paths.table_specs(conf)]
    start_msgs = messages(conf)
    query = merge.start(conf, spark, trigger="processing_time", interval="1 second")
    cadence = workers.SilverCadence(conf, spark, log)
    cadence.follow(query.merge_context)
    samples = []
    try:
        writer = threading.Thread(target=churn, args=(conf, int(rate * seconds), rate, tables, 20), daemon=True)
        began = time.monotonic()
        writer.start()
        wrote_until = captured_at = bronze_at = silver_at = None
        while True:
            if query.exception() is not None:
                raise RuntimeError(f"the merge query failed: {query.exception()}")
            cadence.raise_failure()
            ends = bench_env.topic_ends(conf, topics)
            lag = bench_env.behind(ends, bench_env.committed_offsets(conf))
            now = time.monotonic() - began
            samples.append((now, sum(sum(p.values()) for p in ends.values()) - start_msgs, lag))
            if wrote_until is None and not writer.is_alive():
                wrote_until = now
                caught_up(conf)
                captured_at = time.monotonic() - began
                lag_at_end = bench_env.behind(bench_env.topic_ends(conf, topics), bench_env.committed_offsets(conf))
                log(f"churn: writes ended after {wrote_until:.1f} s, captured by {captured_at:.1f} s, bronze lag "
                    f"{lag_at_end:,} messages")
            if wrote_until is not None and lag == 0 and bronze_at is None:
                bronze_at = time.monotonic() - began
            if bronze_at is not None and not monitor.silver_behind(conf):
                silver_at = time.monotonic() - began
                break
            time.sleep(1.0)
    finally:
        query.stop()
        cadence.stop()
    for batch in query.merge_context.history[-10:]:
        log(f"  batch {batch['batch_id']}: {batch_messages(batch):,} messages of {len(batch['tables'])} table(s) in "
            f"{batch.get('seconds', 0):.1f} s")
    total = samples[-1][1]
    merged_by_end = max((m - lag for t, m, lag in samples if t <= captured_at), default=0)
    return {"messages": total, "wrote_s": wrote_until, "captured_s": captured_at, "drained_s": bronze_at,
            "capture_rate": total / captured_at, "merge_rate_during": merged_by_end / captured_at,
            "merge_rate": total / bronze_at, "max_lag": max(lag for _, _, lag in samples), "lag_at_end": lag_at_end,
            "drain_after_s": bronze_at - captured_at, "silver_after_s": silver_at - captured_at,
            "silver_steps": cadence.steps, "batches": len(query.merge_context.history)}


def batch_messages(batch: dict) -> int:
    """Kafka records a micro-batch took (events, tombstones, dead letters)."""
    return sum(c.get("events", 0) + c.get("tombstones", 0) + c.get("dead_letters", 0) for c in batch["tables"].values())


def report(args, rows: list[dict], churned: dict | None, load_before: str, load_after: str) -> str:
    """The results as Markdown for docs/benchmarks.md."""
    lines = [f"machine before: {load_before}; after: {load_after}", "",
             "| run | messages | bronze catch-up | micro-batches (s each) | messages/s | silver step | tables |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['messages']:,} | {r['seconds']:.1f} s | {r['batches']} "
                     f"({', '.join(f'{b:.1f}' for b in r['batch_seconds'])}) | {r['rate']:,.0f} | "
                     f"{r['silver_s']:.1f} s | {r['silver_tables']} |")
    if churned:
        c = churned
        head = f"churn over {args.small + 1} tables at {args.churn_rate:,.0f} rows/s for {args.churn_seconds:g} s:"
        lines += ["", head, "",
                  "| messages | capture messages/s | bronze messages/s during the writes | largest lag | "
                  "lag when captured | bronze drained after | silver caught up after | micro-batches | silver steps |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {c['messages']:,} | {c['capture_rate']:,.0f} | {c['merge_rate_during']:,.0f} "
                  f"({c['merge_rate_during'] / c['capture_rate']:.2f}×) | {c['max_lag']:,} | "
                  f"{c['lag_at_end']:,} | {c['drain_after_s']:.1f} s | {c['silver_after_s']:.1f} s | {c['batches']} | "
                  f"{c['silver_steps']} |"]
    return "\n".join(lines)


def main(argv=None) -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=50, help="small tables (1,000 rows each)")
    parser.add_argument("--big-rows", type=int, default=500_000, help="rows of estate.big")
    parser.add_argument("--tables", type=int, nargs="*", default=[1, 10, 50, 51],
                        help="tables written per catch-up run (the small ones first, then big)")
    parser.add_argument("--events", type=int, nargs="*", default=[20_000], help="row changes per catch-up run")
    parser.add_argument("--churn-seconds", type=float, default=0.0, help="seconds of churn (0: no churn run)")
    parser.add_argument("--churn-rate", type=float, default=5000.0, help="rows/s written during the churn")
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    load_before = bench_env.machine()
    log(f"machine: {load_before}")
    folder = tempfile.mkdtemp(prefix="tables_bench_")
    conf = prepare(folder, args, log)
    spark, capture, rows, churned = None, None, [], None
    names = table_names(args.small)
    try:
        spark = spark_session.from_conf(conf, catalog="in-memory")
        if not spark_session.is_remote(spark):  # a Spark Connect session has no SparkContext
            spark.sparkContext.setLogLevel("ERROR")
        began = time.monotonic()
        done = snapshot.run(conf, spark, log=lambda line: None)
        log(f"snapshot: {done['rows']:,} rows in {time.monotonic() - began:.1f} s")
        capture = bench_env.start_capture(conf, folder)
        rows.append(timed_catch_up(conf, spark, "initial load (snapshot)", log))
        for events in args.events:
            for n in args.tables:
                written = names[:n] if n <= args.small else names
                churn(conf, events, 0.0, written)
                caught_up(conf)
                rows.append(timed_catch_up(conf, spark, f"{events:,} changes over {len(written)} table(s)", log))
        if args.churn_seconds > 0:
            churned = run_churn(conf, spark, names, args.churn_seconds, args.churn_rate, log)
        log(bench_env.stop_capture(capture, folder))
        capture = None
    finally:
        bench_env.finish(conf, folder, spark, capture, log)
    print()
    print(report(args, rows, churned, load_before, bench_env.machine()))


if __name__ == "__main__":
    main()
