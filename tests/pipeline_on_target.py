"""Test helper, run as a script in a process of its own: the whole pipeline on a target (issue 29).

    python tests/pipeline_on_target.py <target> [--lib-steps]

The five notebooks as a job (``continuous``, ``demo`` and the sample ``workload`` off, as the bundle's job runs them;
``--lib-steps``: the bootstrap and the snapshot from lib instead, where another test runs the job on the target), then
a write load on the sample bank (the workload's inserts, updates and deletes, and a primary key change),
the capture and the merge caught up, and every table reconciled, silver and the fresh view; then the continuous merge
service (its bronze query and silver cadence) while a second load arrives, until monitor says caught up, and
reconcile again. Between them, a dead letter set aside and replayed once its schema arrives; during the service, a
table added live (the job runs without it). Prints what it found as JSON, then tears the pipeline down (slot,
publication, topics, subjects). CDC__ overrides in the environment apply, as for any target.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import uuid

from capture_thread import CaptureThread
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.schema_registry.error import SchemaRegistryError

from lib import config, kafka_client, schema_registry, source
from lib import spark as spark_lib
from lib.capture import avro_schemas, bootstrap, snapshot, stream
from lib.lake import lake_paths, merge, reconcile
from lib.local import workload
from lib.operate import jobs, monitor, tables, teardown, workers
from lib.views import masking

ADDED = "bank.statements"  # left out of the job, added while the merge service runs


def write_load(conf: dict, tag: str) -> dict:
    """The workload's business transactions, then a branch inserted and its primary key changed."""
    conn = source.connect(conf, admin=True)
    try:
        done = workload.run(conn, rate=float("inf"), count=80, seed=29)
        code = f"E2E-{tag}"
        with conn.cursor() as cur:
            cur.execute("INSERT INTO bank.branches VALUES (%s, 'Key change', 'Chicago', 'Midwest', NULL, "
                        "'2026-01-01')", (code,))
            conn.commit()
            cur.execute("UPDATE bank.branches SET branch_code = %s WHERE branch_code = %s", (f"{code}-K", code))
            conn.commit()
        return {"transactions": done["transactions"], "key_changed": f"{code} -> {code}-K"}
    finally:
        conn.close()


def with_added(conf: dict) -> dict:
    """conf after the operator added ADDED to source.tables."""
    return config.apply_overrides(conf, {"CDC__SOURCE__TABLES": "[" + ", ".join(
        [*config.get(conf, "source.tables"), ADDED]) + "]"})


def continuous(conf: dict, spark) -> dict:
    """The merge service in a thread while a second load is captured; ADDED added meanwhile (the service started
    again with the new conf, as tables.update_services does for a local one), until the lake has caught up."""
    outcome = {}

    def serve(with_conf: dict, stop: threading.Event) -> threading.Thread:
        def loop():
            try:
                totals = workers.run_merge(with_conf, spark, stop_event=stop,
                                           log=lambda line: print(line, file=sys.stderr))
                outcome["totals"] = {"batches": outcome.get("totals", {}).get("batches", 0) + totals["batches"]}
            except Exception as exc:  # noqa: BLE001 - reported in the result
                outcome["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=loop, name="merge-service")
        thread.start()
        return thread

    stop = threading.Event()
    thread = serve(conf, stop)
    added = with_added(conf)
    outcome["stopped"] = []  # per stop of the service: whether its thread ended within 180 s
    try:
        outcome["load"] = write_load(conf, uuid.uuid4().hex[:6])
        outcome["added"] = tables.add_table(added, ADDED, log=lambda line: print(line, file=sys.stderr))["state"]
        stop.set()
        thread.join(180)
        outcome["stopped"].append(not thread.is_alive())
        stop = threading.Event()
        thread = serve(added, stop)
        stream.run(added, until="caught_up", heartbeat_s=0)  # the added table's chunked snapshot included
        # the capture keeps running, as its service would, while the lake catches up: the wait asks the slot for the
        # server's WAL position of now, which other databases on the server move on (the other target's run)
        capture = CaptureThread(added)
        try:
            outcome["caught_up_s"] = monitor.wait_until_caught_up(added, timeout_s=600, spark=spark)["seconds"]
        finally:
            capture.stop.set()
            capture.join(60)
    finally:
        stop.set()
        thread.join(180)
        outcome["stopped"].append(not thread.is_alive())
    return outcome


def dead_letter_replay(conf: dict, spark, tag: str) -> dict:
    """The newest event of bank.branches sent again, framed with a schema id the registry does not have yet: the
    merge sets it aside; once that id is registered (the same fields, another doc) a replay merges it (the position
    silver holds already: no row changes) and the dead-letter table is empty again."""
    letters = config.apply_overrides(conf, {"CDC__MERGE__UNKNOWN_SCHEMA_IDS": "dead_letter",
                                            "CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "0"})
    registry = schema_registry.client(conf)
    key, value, topic = _newest_event(conf, "bank.branches")
    writer = json.loads(registry.get_schema(int.from_bytes(value[1:5], "big")).schema_str)
    probe_subject, replay_subject = scratch_subjects(tag)
    probe = {"type": "record", "name": "Probe", "fields": [{"name": f"p{tag}", "type": "int"}]}
    late_id = schema_registry.register(registry, probe_subject, probe)[0] + 1  # Apicurio counts up
    producer = Producer(kafka_client.settings(conf, acks="all"))
    producer.produce(topic, key=key, value=schema_registry.confluent_header(late_id) + value[5:])
    assert producer.flush(30) == 0, f"Kafka did not take the re-framed event of {topic}"
    merge.run_until_caught_up(letters, spark)
    path = lake_paths.dead_letter_path(conf)
    found = {"set_aside": [r["reason"] for r in spark.read.format("delta").load(path).collect()]}
    found["registered_id"] = schema_registry.register(registry, replay_subject, {**writer, "doc": f"replay {tag}"})[0]
    found["late_id"] = late_id
    found["replay"] = merge.replay_dead_letters(conf, spark)
    found["left"] = spark.read.format("delta").load(path).count()
    return found


def scratch_subjects(tag: str) -> list[str]:
    """The registry subjects dead_letter_replay makes beside the pipeline's (deleted at the end of the run, not
    before: bronze holds an event framed with the replay subject's id)."""
    return [f"cdc-e2e-probe-{tag}", f"cdc-e2e-replay-{tag}-value"]


def _forget_subjects(conf: dict, tag: str) -> None:
    """Delete the run's scratch subjects (one left behind, or never made, harms nothing: not a failure)."""
    registry = schema_registry.client(conf)
    for name in scratch_subjects(tag):
        with contextlib.suppress(SchemaRegistryError):
            registry.delete_subject(name)
            registry.delete_subject(name, permanent=True)


def _newest_event(conf: dict, table: str) -> tuple[bytes, bytes, str]:
    """The key, value and topic of the last message of table's topic that is not a tombstone."""
    topic = avro_schemas.topic_for(conf, table)
    consumer = kafka_client.consumer(conf, "cdc-e2e-newest")
    try:
        for partition in consumer.list_topics(topic, timeout=30).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, partition, high - 1)])
            message = consumer.poll(30)
            if message is not None and not message.error() and message.value() is not None:
                return message.key(), message.value(), topic
        raise AssertionError(f"no event found at the end of any partition of {topic}")
    finally:
        consumer.close()


def run(target: str, tag: str, job: bool = True) -> dict:
    """The job (without ADDED; job False: the steps of its notebooks 01 and 02 from lib), the load, the catch-up and
    the checks on target; what each gave."""
    every = config.load(target)  # the job's notebooks inherit these two: ADDED neither captured nor in the policy
    captured = [t for t in config.get(every, "source.tables") if t != ADDED]
    os.environ["CDC__SOURCE__TABLES"] = "[" + ", ".join(captured) + "]"
    os.environ["CDC__MASKING__TABLES"] = json.dumps({t: columns for t, columns in config.get(every, "masking.tables")
                                                     .items() if t != ADDED})
    facts, conf = {"seconds": {}}, config.load(target)
    with _phase(facts["seconds"], "job" if job else "bootstrap_and_snapshot"):
        if job:
            ran = jobs.run(target, parameters={"continuous": False, "demo": False, "workload": 0},  # as the bundle's
                           log=lambda line: print(line, file=sys.stderr))
            facts["job"] = {r["notebook"]: r["ok"] if r["ok"] else r["error"] for r in ran}
            if not all(r["ok"] for r in ran):
                return facts
        else:
            bootstrap.run(conf, log=lambda line: print(line, file=sys.stderr))
            facts["snapshot"] = snapshot.run(conf, spark_lib.from_conf(conf))["status"]
    with _phase(facts["seconds"], "load_and_capture"):
        facts["load"] = write_load(conf, uuid.uuid4().hex[:6])
        facts["stream"] = stream.run(conf, until="caught_up", heartbeat_s=0).get("events")
    with _phase(facts["seconds"], "session"):
        spark = spark_lib.from_conf(conf)
        facts["remote"] = spark_lib.is_remote(spark)
        facts["master"] = spark.conf.get("spark.master")
    with _phase(facts["seconds"], "merge"):
        caught = merge.run_until_caught_up(conf, spark)
        facts["merge"] = {"batches": caught["batches"], "silver_tables": caught["silver_tables"],
                          "batch_seconds": caught["batch_seconds"], "silver_s": caught["silver_s"]}
        print(f"e2e       merge result: {facts['merge']}", file=sys.stderr, flush=True)
    with _phase(facts["seconds"], "reconcile"):
        facts["silver"] = {r["table"]: [r["equal"], r["source_rows"]] for r in reconcile.reconcile(conf, spark)}
    with _phase(facts["seconds"], "views"):
        tag = uuid.uuid4().hex[:6]  # views that keep every column, so that they compare with the source
        keep = {"database": f"e2e_v_{tag}", "privileged_database": f"e2e_p_{tag}", "default": "keep"}
        masking.create_views(conf, spark, keep)
        fresh = {table: spark.table(masking.view(conf, table, "fresh", keep)) for table in facts["silver"]}
        facts["fresh"] = {r["table"]: r["equal"] for r in reconcile.reconcile(conf, spark, against=fresh)}
    with _phase(facts["seconds"], "dead_letter"):
        facts["dead_letter"] = dead_letter_replay(conf, spark, tag)
    with _phase(facts["seconds"], "service"):
        facts["service"] = continuous(conf, spark)
    with _phase(facts["seconds"], "after_service"):
        facts["after_service"] = {r["table"]: r["equal"] for r in reconcile.reconcile(with_added(conf), spark)}
    with _phase(facts["seconds"], "one_run"):
        # the service's conf, with the added table: a conf without it is refused by Spark's Kafka source (the
        # checkpoint holds that topic's partitions: "have been deleted", failOnDataLoss)
        facts["one_run"] = one_query_per_checkpoint(with_added(conf), spark)
    with _phase(facts["seconds"], "drift"):
        facts["drift"] = drift(conf, spark)
    return facts


@contextlib.contextmanager
def _phase(seconds: dict, name: str):
    """The block's wall seconds into seconds[name], and a line on stderr."""
    start = time.monotonic()
    try:
        yield
    finally:
        seconds[name] = round(time.monotonic() - start, 1)
        print(f"e2e       {name}: {seconds[name]} s", file=sys.stderr, flush=True)


def one_query_per_checkpoint(conf: dict, spark) -> dict:
    """The merge query started again from a second session while the first runs (a service restarted while its
    query still ran on the server): Spark stops the first run, and stopping the second leaves no run behind."""
    from pyspark.sql import SparkSession

    other = SparkSession.builder.remote(config.get(conf, "spark.remote")).create() if spark_lib.is_remote(spark) \
        else spark.newSession()
    first = merge.start(conf, spark, "processing_time", "2 seconds")
    second = merge.start(conf, other, "processing_time", "2 seconds")
    found = {"first_active": first.isActive, "second_active": second.isActive, "name": merge.query_name(conf),
             "active": sorted(q.name for q in other.streams.active)}
    second.stop()
    found["after_stop"] = sorted(q.name for session in (spark, other) for q in session.streams.active)
    _KEPT.append(other)  # never collected while this process runs: see _KEPT
    return found


# Sessions kept to the end of the process. pyspark 4.1.1's Connect client shuts down one thread pool shared by every
# session when a session is stopped or collected (SparkSession.__del__ -> client.close); collected in the middle of
# another session's call, it deadlocks that call (seen twice here, in reconcile's collect after this test's session
# went out of scope).
_KEPT: list = []


def drift(conf: dict, spark) -> list[dict]:
    """One value changed at the source behind the pipeline's back: what reconcile says about it."""
    conn = source.connect(conf, admin=True)
    try:
        with conn.cursor() as cur:
            cur.execute("UPDATE bank.branches SET city = city || ' (moved)' WHERE branch_code = "
                        "(SELECT min(branch_code) FROM bank.branches) RETURNING branch_code")
            code = cur.fetchone()[0]
        conn.commit()
    finally:
        conn.close()
    return [{"expected": code}] + reconcile.reconcile(conf, spark, tables=["bank.branches"])[0]["differences"]


EXIT_BOUND_S = 90
DONE = "e2e       done;"  # the line after the result and the teardown


if __name__ == "__main__":
    name, with_job = sys.argv[1], "--lib-steps" not in sys.argv[2:]
    # A hang anywhere (CI once saw this process outlive the test's 1200 s after printing its result): every thread's
    # stack on stderr and exit 1 before the test gives up, so the failure says where it waited.
    faulthandler.dump_traceback_later(int(os.environ.get("CDC_E2E_WATCHDOG_S", "1100")), exit=True)
    every_table, run_tag = config.load(name), uuid.uuid4().hex[:8]
    try:
        print("PIPELINE " + json.dumps(run(name, run_tag, with_job), default=str), flush=True)
    finally:
        teardown.run(every_table, topics=True, confirm=True, log=lambda line: print(line, file=sys.stderr))
        _forget_subjects(every_table, run_tag)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    print(f"{DONE} threads Python waits for at exit: {left or 'none'}", file=sys.stderr, flush=True)
    # What is left is pyspark's: at exit its Connect client joins its release threads (the ThreadPoolExecutor ones)
    # and sends each session a cleanup call, every call retried for up to 10 minutes while the server answers
    # "unavailable" (upstream since: SPARK-55406, SPARK-55326). Bounded: after EXIT_BOUND_S every thread's stack goes
    # to stderr and the process exits 1; the test tells that apart from a failed run.
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(EXIT_BOUND_S, exit=True)
