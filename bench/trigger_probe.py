"""Probe: what one trigger of a running merge query pays as the tables it touches grow, as shipped (the records
appended undecoded to the raw log; the decode step after the burst timed apart) and as a bare Delta append.

    .venv/bin/python bench/trigger_probe.py [--small 50] [--records 20000] [--reps 3] [--tables 1 10 51]

Builds the estate of bench/tables_bench.py (``--small`` tables of 1,000 rows and ``big``) in its own database and
snapshots it into Kafka. Then, per mode, one streaming query over every table topic (the merge's Kafka options,
started at the topics' ends, a trigger every second) runs as the merge service's does: its consumers and the
decode plans stay between triggers, unlike a catch-up (bench/tables_bench.py), which is a new query each time.
Per touched-table count and rep, the probe sends ``--records`` records spread evenly over that many topics at once
(the snapshot's own records again, bytes and headers unchanged, repeated as needed) and waits until the query has
read them, so every burst carries the same work and only the tables it touches differ; a trigger's
cost is Spark's ``triggerExecution`` for the micro-batches whose offsets cover part of the burst (a burst split over
two triggers is counted as both), and after each burst the query's table must hold every record of it once. Modes:

- **shipped**: the merge's foreachBatch function (``micro_batch.process_batch``: one raw log commit, nothing
  decoded), and after each burst the decode step that turns those records into the bronze log
  (``decode_step.run``, which the service runs beside the query), timed on its own;
- **raw**: the records with their framing read (schema ids, a tombstone's position) appended to a Delta table
  as they came: the floor of an undecoded trigger.

Until 2026-12-01 the trigger decoded (one ``from_avro`` per table and writer schema); this probe measured that as
mode ``decoded`` at commit 70ccaeb (docs/benchmarks.md).

Everything it made (database, slot, topics, lake) is removed at the end.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batch_probe  # noqa: E402 - the sibling modules, found through the path set above
import bench_env  # noqa: E402
import tables_bench  # noqa: E402
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from lib import config  # noqa: E402
from lib import spark as spark_session  # noqa: E402
from lib.capture import snapshot  # noqa: E402
from lib.lake import decode_step, lake_paths, merge, micro_batch  # noqa: E402


def records(conf: dict, topics: list[str], per_table: int) -> dict[str, list]:
    """The last per_table records of each topic, as (partition, key, value, headers) to send again."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"probe-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        ends = bench_env.topic_ends(conf, topics)
        found: dict[str, list] = {}
        for topic, parts in ends.items():
            starts = [TopicPartition(topic, int(p), max(0, end - per_table // len(parts))) for p, end in parts.items()]
            want = sum(end - tp.offset for tp, end in zip(starts, parts.values(), strict=True))
            consumer.assign(starts)
            got: list = []
            while len(got) < want:
                message = consumer.poll(10)
                if message is None:
                    raise RuntimeError(f"{topic}: read {len(got)} of {want} records")
                if message.error() is None:
                    got.append((message.partition(), message.key(), message.value(), message.headers()))
            found[topic] = got
        return found
    finally:
        consumer.close()


def start(conf: dict, spark, mode: str, folder: str):
    """The streaming query of one mode, started at the topics' ends, a trigger every second."""
    options = {**merge.kafka_options(conf), "startingOffsets": "latest"}
    reader = spark.readStream.format("kafka")
    for key, value in options.items():
        reader = reader.option(key, value)
    if mode == "shipped":
        ctx = micro_batch.context(conf, f"trigger-probe-{mode}", app_id=f"trigger-probe-{mode}")

        def function(frame, batch_id):
            micro_batch.process_batch(frame, batch_id, ctx)
    else:
        ctx = None
        def function(frame, batch_id):
            batch_probe.raw_append(frame.sparkSession, frame, f"{folder}/raw", batch_id)
    query = reader.load().writeStream.queryName(f"trigger_probe_{mode}").foreachBatch(function) \
        .option("checkpointLocation", f"{folder}/checkpoints/{mode}").trigger(processingTime="1 second").start()
    query.merge_context = ctx  # the shipped batches' records (their phases: read, control, append)
    deadline = time.monotonic() + 120
    while not query.recentProgress:  # records sent before the query found the topics' ends would be skipped
        if time.monotonic() > deadline or query.exception() is not None:
            raise RuntimeError(f"the {mode} query reported no progress: {query.exception()}")
        time.sleep(0.2)
    return query


def _offsets(progress: dict, field: str) -> dict[str, dict[int, int]]:
    """A progress record's start or end offsets of the Kafka source: {topic: {partition: offset}} (partition as str, as
    bench_env.topic_ends gives them)."""
    found = progress["sources"][0].get(field) or {}
    if isinstance(found, str):  # pyspark 4 gives str() of the parsed JSON: a Python literal
        found = ast.literal_eval(found)
    found = found or {}  # a first trigger's start: None
    return {topic: {str(p): int(o) for p, o in parts.items()} for topic, parts in found.items()}


def _reads(progress: dict, before: dict, after: dict) -> bool:
    """Whether the trigger read any offset in [before, after) of the burst's partitions."""
    starts, ends = _offsets(progress, "startOffset"), _offsets(progress, "endOffset")
    return any(starts.get(t, {}).get(p, 0) < after[t][p] and ends.get(t, {}).get(p, 0) > before[t][p]
               for t in after for p in after[t] if after[t][p] > before[t][p])


def _covered(progress: list[dict], after: dict) -> bool:
    """Whether the query's newest end offsets reach after on every partition."""
    ends = _offsets(progress[-1], "endOffset") if progress else {}
    return all(ends.get(t, {}).get(p, -1) >= o for t in after for p, o in after[t].items())


def _landed(spark, path: str, columns: tuple[str, str, str], before: dict, after: dict) -> int:
    """Rows the query's table holds of the burst's offsets (checked after the burst, outside its timing)."""
    topic, partition, offset = columns
    ranges = spark.createDataFrame([(t, int(p), before[t][p], after[t][p]) for t in after for p in after[t]],
                                   f"{topic} string, {partition} int, low long, high long")
    rows = spark.read.format("delta").load(path).join(ranges, [topic, partition])
    return rows.filter((rows[offset] >= rows["low"]) & (rows[offset] < rows["high"])).count()


def burst(query, producer: Producer, saved: dict[str, list], topics: list[str], total: int, log, conf: dict,
          spark, table: str) -> dict:
    """Send total of the saved records, spread over topics, at once; the triggers that read them (seconds, rows).

    The triggers are those whose offsets cover part of the burst (Spark's numInputRows was 0 for some triggers that
    did read records, and a burst split over two triggers was once counted as one); afterwards the query's table
    must hold every record of the burst, exactly once.
    """
    before = bench_env.topic_ends(conf, topics)
    sent = 0
    for topic in topics:
        mine = saved[topic]
        for i in range(total // len(topics)):
            partition, key, value, headers = mine[i % len(mine)]
            producer.produce(topic, value=value, key=key, partition=partition, headers=headers)
            sent += 1
            if sent % 10_000 == 0:
                producer.poll(0)
    left = producer.flush(30)
    after = bench_env.topic_ends(conf, topics)
    reached = sum(after[t][p] - before[t][p] for t in after for p in after[t])
    if left or reached != sent:
        raise RuntimeError(f"sent {sent} records, {reached} reached Kafka (unflushed {left})")
    deadline = time.monotonic() + 300
    while not _covered(query.recentProgress, after):
        if time.monotonic() > deadline or query.exception() is not None:
            raise RuntimeError(f"the query did not reach the burst's end offsets; its status {query.status}, last "
                               f"progress {query.lastProgress}: {query.exception()}")
        time.sleep(0.2)
    batches = [p for p in query.recentProgress if _reads(p, before, after)]
    landed = _landed(spark, table, ("_kafka_topic", "_kafka_partition", "_kafka_offset") if query.merge_context
                     else ("topic", "partition", "offset"), before, after)
    if landed != sent:
        raise RuntimeError(f"the query moved past the burst's {sent} records and its table holds {landed} of them "
                           f"(batches {[p['batchId'] for p in batches]})")
    seconds = round(sum(p["durationMs"]["triggerExecution"] for p in batches) / 1000, 2)
    ids = {p["batchId"] for p in batches}
    history = query.merge_context.history if query.merge_context is not None else []
    phases = [b["phases"] for b in history if b["batch_id"] in ids]
    log(f"  {len(topics)} table(s), {sent:,} records: {len(batches)} trigger(s) {sorted(ids)}, {seconds} s"
        + (f"; phases {phases}" if phases else ""))
    return {"tables": len(topics), "records": sent, "triggers": len(batches), "seconds": seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=50, help="small tables (1,000 rows each)")
    parser.add_argument("--records", type=int, default=20_000, help="records in a burst, over the tables it touches")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 10, 51])
    parser.add_argument("--modes", nargs="+", default=["shipped", "raw"], choices=["shipped", "raw"])
    args = parser.parse_args(argv)
    load_before = bench_env.machine()
    print(f"machine: {load_before}")
    folder = tempfile.mkdtemp(prefix="trigger_probe_")
    conf = tables_bench.prepare(folder, types.SimpleNamespace(small=args.small, big_rows=1000), print)
    spark, rows = None, []
    try:
        spark = spark_session.from_conf(conf, catalog="in-memory")
        snapshot.run(conf, spark, log=lambda line: None)
        topics = [s.topic for s in lake_paths.table_specs(conf)]
        saved = records(conf, topics, 1000)
        producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                             "enable.idempotence": True, "linger.ms": 5})
        for mode in args.modes:
            query = start(conf, spark, mode, folder)
            table = lake_paths.raw_path(conf) if mode == "shipped" else f"{folder}/raw"
            try:
                # the first builds plans
                burst(query, producer, saved, topics[:1], 1000, lambda line: None, conf, spark, table)
                decoding = decode_step.decoding(conf)
                if mode == "shipped":
                    decode_step.run(conf, spark, decoding)  # the first builds plans
                for _ in range(args.reps):
                    for count in args.tables:
                        timed = burst(query, producer, saved, topics[:count], args.records, print, conf, spark,
                                      table)
                        row = {"mode": mode, **timed}
                        if mode == "shipped":
                            row["decode"] = decode_step.run(conf, spark, decoding).get("seconds")
                            print(f"    decode step: {row['decode']} s")
                        rows.append(row)
                        time.sleep(2)  # an idle trigger between bursts
            finally:
                query.stop()
    finally:
        bench_env.finish(conf, folder, spark, log=print)
    print(f"\nmachine before: {load_before}; after: {bench_env.machine()}\n")
    print("| mode | tables touched | records | triggers | seconds per burst (each rep) | median | against the first "
          "| decode step after it (each rep) | median | against the first |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        first = first_decode = None
        for count in args.tables:
            mine = [r for r in rows if r["mode"] == mode and r["tables"] == count]
            median = statistics.median(r["seconds"] for r in mine)
            first = median if first is None else first
            decodes = [r["decode"] for r in mine if r.get("decode") is not None]
            decode = statistics.median(decodes) if decodes else None
            first_decode = decode if first_decode is None else first_decode
            decoded = (f"{', '.join(map(str, decodes))} | {decode} | {decode / first_decode:.1f}" if decodes
                       else "- | - | -")
            print(f"| {mode} | {count} | {mine[0]['records']:,} | {', '.join(str(r['triggers']) for r in mine)} | "
                  f"{', '.join(str(r['seconds']) for r in mine)} | {median} | {median / first:.1f} | {decoded} |")


if __name__ == "__main__":
    main()
