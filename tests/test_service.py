"""Continuous mode on the live stack: kill -9 of the capture and merge processes while the workload writes, their
keepers start them again by themselves, kill -9 of a keeper and start() again, catch up, reconcile exactly; status
and history along the way; a service that keeps failing ends crashed after service.max_restarts; then a teardown
that refuses without confirmation and leaves no slot or publication behind.

Everything is this run's own: a database loaded with the sample bank, slot, publication, topic prefix,
lake root (checkpoints included) and service folder. Tests run in file order and share the pipeline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import source_audit
from confluent_kafka import Consumer, TopicPartition
from psycopg2 import sql
from pyspark.sql import functions as F

from lib import config, control, schema_registry, source
from lib.capture import bootstrap, snapshot
from lib.lake import browse, lake_paths, reconcile
from lib.local import sample_db, workload
from lib.local.stack import process
from lib.operate import keeper, metrics, monitor, service, teardown

pytestmark = pytest.mark.stack


def quiet(*_args, **_kwargs):
    return None


@pytest.fixture(scope="module")
def pipeline(live_stack, run_id, tmp_path_factory, drop_slot):
    """conf of a bootstrapped pipeline (publication, topics, schemas) on its own database; removed afterwards."""
    database = f"cdc_svc_{run_id}"
    root = tmp_path_factory.mktemp("service")
    overrides = {
        "CDC__SOURCE__DATABASE": database,
        "CDC__SOURCE__SLOT": f"svc_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"svc_{run_id}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-svc",
        "CDC__KAFKA__PARTITIONS": "2",
        "CDC__LAKE__ROOT": str(root / "lake"),
        "CDC__SERVICE__DIR": str(root / "services"),
        "CDC__SERVICE__MERGE_INTERVAL": "2 seconds",
        "CDC__SERVICE__METRICS_INTERVAL_S": "2",
        "CDC__SERVICE__HEARTBEAT_S": "2",
        "CDC__SERVICE__RESTART_BACKOFF_S": "1",
        "CDC__SPARK__APP_NAME": f"cdc-test-svc-{run_id}",
        # three of the bank's tables keep the merge's micro-batches short on a 2-core machine; they cover numeric
        # money, uuid, jsonb, arrays, enums, a composite key, and the workload's inserts, updates and deletes
        "CDC__SOURCE__TABLES": "[bank.customers, bank.account_holders, bank.transactions]",
    }
    conf = config.apply_overrides(live_stack, overrides)
    conf["env"] = overrides
    postgres = source.connect(conf, admin=True, dbname="postgres")
    postgres.autocommit = True
    with postgres.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    sample_db.create_schema(admin)
    sample_db.load(admin, customers=40, seed=11)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                    .format(sql.Identifier(config.get(conf, "source.user"))))
    admin.close()
    bootstrap.run(conf, log=quiet)
    yield conf
    with contextlib.suppress(Exception):
        service.stop(conf, timeout=20, log=quiet)
    drop_slot(conf, config.get(conf, "source.slot"))
    prefix = config.get(conf, "kafka.topic_prefix")
    teardown.delete_prefix(conf, prefix)
    with postgres.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    postgres.close()


def env_of(conf: dict) -> dict:
    """The environment a CLI run needs to see this test's pipeline."""
    return {**os.environ, **conf["env"]}


def wait_for(predicate, timeout: float, what: str, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_start_refuses_before_the_snapshot(pipeline):
    slot = config.get(pipeline, "source.slot")
    with pytest.raises(service.ServiceError, match=rf"slot {slot}: no snapshot was taken.*notebook 01.*02"):
        service.start(pipeline, log=quiet)
    assert [row["state"] for row in service.status(pipeline)] == ["stopped", "stopped"]


def test_a_service_that_keeps_failing_ends_crashed_after_the_limit(pipeline):
    slot = f"{config.get(pipeline, 'source.slot')}_gone"
    conf = config.apply_overrides(pipeline, {"CDC__SOURCE__SLOT": slot, "CDC__SERVICE__MAX_RESTARTS": "2",
                                             "CDC__SERVICE__RESTART_BACKOFF_S": "0.5"})
    control.put(conf, f"snapshot/{slot}", {"state": "complete"})  # start() checks it; the slot itself does not exist
    try:
        try:
            service.start(conf, ("capture",), log=quiet)
        except service.ServiceError as exc:  # when the first run fails within service.START_CHECK_S
            assert "failed right after starting (exit code 1)" in str(exc) and "max_restarts=2" in str(exc), exc
        row = wait_for(lambda: (lambda r: r if r["state"] == "crashed" else None)(keeper.state(conf, "capture")),
                       90, "the keeper to give up")
        assert row["restarts"] == 2 and row["child"] is None, row
        assert "failed 3 times within service.restart_window_s=600 s (service.max_restarts=2), giving up" \
            in row["last_line"], row
        assert "last exit: exit code 1" in row["last_line"] and f"replication slot {slot}" in row["last_line"], row
        log_text = keeper.files(conf, "capture")["log"].read_text()
        assert log_text.count("ended with exit code 1; restart") == 2, log_text[-3000:]
        assert any(f"capture service died (pid {row['pid']}" in w for w in monitor.status(conf)["warnings"])
    finally:
        service.stop(conf, log=quiet)
        control.put(conf, f"snapshot/{slot}", None)
    assert keeper.state(conf, "capture")["state"] == "stopped"


def restarted(conf: dict, before: dict[str, int]) -> dict | None:
    """Every service's state once its keeper runs a new child (not the pid in before), else None."""
    rows = {name: keeper.state(conf, name) for name in before}
    fresh = all(r["state"] == "running" and r["child"] and r["child"] != before[r["service"]] for r in rows.values())
    return rows if fresh else None


def test_kill_9_restarts_by_itself_while_writing_then_silver_reconciles(pipeline, spark_session):
    conf, slot = pipeline, config.get(pipeline, "source.slot")
    done = snapshot.run(conf, spark_session, log=quiet)
    assert done["status"] == "complete"
    lines = []
    first = service.start(conf, log=lines.append)
    assert set(first) == {"capture", "merge"} and all(row["state"] == "running" for row in service.status(conf))
    # both at work: the merge query runs (its first micro-batch, the snapshot's rows, may still be going on)
    # generous limits: on a loaded machine starting Spark alone can take minutes
    wait_for(lambda: metrics.latest(conf, "merge"), 600, "the merge query to start")
    wait_for(lambda: metrics.latest(conf, "capture"), 30, "a capture metrics record")
    assert control.running_service(conf, "capture") and control.running_service(conf, "merge")  # notebooks refuse

    writes: dict = {"transactions": 0}
    conn = source.connect(conf, admin=True)
    source_audit.start(conf)  # every committed change from here on, recorded beside the pipeline
    enough = threading.Event()  # set once the keepers were killed and started again: the writes may end

    def write():
        try:  # 3 s runs at 10 tx/s until the crashes are over and more than 100 transactions were written
            for seed in range(5, 1000):
                writes["transactions"] += workload.run(conn, rate=10, duration=3, seed=seed)["transactions"]
                if enough.is_set() and writes["transactions"] > 100:
                    break
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            writes["error"] = exc

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        before = int((metrics.latest(conf, "capture") or {}).get("events") or 0)
        merged = int((metrics.latest(conf, "merge") or {}).get("batches") or 0)
        # some of the workload captured and in the merge's hands, more to come
        wait_for(lambda: int((metrics.latest(conf, "capture") or {}).get("events") or 0) > before + 50, 60,
                 "streamed events")
        wait_for(lambda: int((metrics.latest(conf, "merge") or {}).get("batches") or 0) > merged, 60,
                 "a merge batch after the writes began")
        with pytest.raises(teardown.TeardownError, match="still run: stop them first"):
            teardown.run(conf, confirm=True)
        children = {name: keeper.state(conf, name)["child"] for name in first}
        assert all(children.values()), children
        for name in first:
            os.kill(children[name], signal.SIGKILL)
        assert writer.is_alive(), "the crash must happen while the workload writes"
        # no start(): the keepers notice and start both again, from the slot's position and the checkpoint
        rows = wait_for(lambda: restarted(conf, children), 60, "the keepers to start both again")
        assert {n: r["pid"] for n, r in rows.items()} == first and all(r["restarts"] >= 1 for r in rows.values())
        for name in first:
            assert f"keeper: {name} (pid {children[name]}) ended with signal 9 (SIGKILL); restart 1" \
                in keeper.files(conf, name)["log"].read_text()

        # a keeper killed in turn: its child gets SIGTERM and stops; the service is crashed until start()
        orphan = rows["capture"]["child"]
        os.kill(first["capture"], signal.SIGKILL)
        wait_for(lambda: keeper.state(conf, "capture")["state"] == "crashed", 20, "the capture keeper to be dead")
        assert sum("died" in w for w in monitor.status(conf)["warnings"]) == 1
        wait_for(lambda: "lib.operate.service run capture" not in process.cmdline(orphan), 60,
                 "the capture without its keeper to stop (PR_SET_PDEATHSIG)")
        wait_for(lambda: not (monitor.slot_row(conf) or {}).get("active"), 30, "the slot to be released")
        second = service.start(conf, log=lines.append)
        assert second["capture"] != first["capture"] and second["merge"] == first["merge"]
        assert sum("was not stopped cleanly" in line for line in lines) == 1, lines
        assert any(line.startswith("merge     already running") for line in lines), lines
    finally:
        enough.set()
        writer.join(120)
        conn.close()
    assert "error" not in writes and writes["transactions"] > 100, writes

    caught = monitor.wait_until_caught_up(conf, timeout_s=1200)
    assert caught["kafka_end"]
    # the history ends on the caught-up state (what notebook 04 plots): silver's commits are visible before its step
    # has returned (each table's MERGE commits as it ends), so a record written meanwhile may still count them pending
    def settled():
        record = metrics.latest(conf, "merge")
        return (record["kafka_lag"], record["silver_pending_events"]) == (0, 0)

    wait_for(settled, 60, "a metrics record with Kafka lag 0 and nothing pending")
    last = metrics.latest(conf, "merge")
    assert (last["kafka_lag"], last["silver_pending_events"]) == (0, 0), last
    st = monitor.status(conf)
    assert [row["state"] for row in st["services"]] == ["running", "running"]
    assert st["kafka_lag"] == 0 and st["slots"][0]["active"], st
    assert all(t["last_merged_lsn"] for t in st["tables"]), st["tables"]
    assert not any("no consumer" in w or "died" in w for w in st["warnings"]), st["warnings"]

    cli = subprocess.run([sys.executable, "-m", "lib.operate.monitor"], env=env_of(conf), cwd=config.PROJECT_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and slot in cli.stdout and "bank.transactions" in cli.stdout, cli.stderr

    hist = metrics.history(conf)
    for name in ("capture", "merge"):
        assert hist[hist["service"] == name]["pid"].nunique() >= 2, f"{name}: one history per process run"
    assert hist["events_per_s"].max() > 0 and hist["retained_wal_bytes"].notna().any()
    fig = monitor.plot(conf)
    assert len(fig.axes) == 3

    service.stop(conf, log=quiet)
    assert [row["state"] for row in service.status(conf)] == ["stopped", "stopped"]
    assert control.running_service(conf, "capture") is None and control.running_service(conf, "merge") is None
    stopped = monitor.status(conf)
    assert any(f"slot {slot} has no consumer attached" in w for w in stopped["warnings"]), stopped["warnings"]

    results = reconcile.reconcile(conf, spark_session)
    assert len(results) == len(config.get(conf, "source.tables"))
    assert all(r["equal"] for r in results), [(r["table"], r["source_rows"], r["silver_rows"], r["differences"])
                                              for r in results if not r["equal"]]
    merged = browse.summary(conf, spark_session).collect()
    assert sum(r["bronze_events"] for r in merged) > sum(r["source_rows"] for r in results)
    assert_bronze_complete(conf, spark_session)
    changes = source_audit.finish(conf)
    assert len(changes) > 100, len(changes)
    source_audit.assert_all_seen(changes, bronze_changes(conf, spark_session), "bronze")


def bronze_changes(conf: dict, spark) -> Counter:
    """(xid, table, key as text) of every bronze event, duplicates of one source position counted once."""
    seen = Counter()
    for spec in lake_paths.table_specs(conf):
        bronze = browse.bronze(conf, spark, spec.qualified).filter(~F.col("_tombstone"))
        keys = [f.name for f in bronze.schema["key"].dataType.fields]
        rows = bronze.select(F.col("source.txId").alias("xid"), F.col("source.commit_lsn").alias("lsn"),
                             F.col("source.event_serial").alias("serial"),
                             *[F.col("key")[k].cast("string").alias(f"k{i}") for i, k in enumerate(keys)]) \
            .dropDuplicates(["lsn", "serial"]).collect()
        for row in rows:
            seen[(row["xid"], spec.qualified, tuple(row[f"k{i}"] for i in range(len(keys))))] += 1
    return seen


def topic_messages(conf: dict) -> dict[str, int]:
    """Messages in each table topic (end minus start offset, summed over partitions)."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"svc-count-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        counts = {}
        for spec in lake_paths.table_specs(conf):
            partitions = consumer.list_topics(spec.topic, timeout=10).topics[spec.topic].partitions
            counts[spec.qualified] = sum(high - low for low, high in (
                consumer.get_watermark_offsets(TopicPartition(spec.topic, p), timeout=10) for p in partitions))
        return counts
    finally:
        consumer.close()


def assert_bronze_complete(conf: dict, spark) -> None:
    """Bronze holds every Kafka message of every table topic exactly once (a killed merge's retried batch added
    none twice); nothing was dead-lettered."""
    dead = browse.dead_letter_counts(conf, spark).collect()
    assert not dead, f"dead letters: {[r.asDict() for r in dead]}"
    log = spark.read.format("delta").load(lake_paths.bronze_path(conf)).filter(F.col("_kafka_topic").isNotNull())
    rows = log.select(F.col("_table").alias("t"), F.struct("_kafka_topic", "_kafka_partition", "_kafka_offset")
                      .alias("at")).groupBy("t").agg(
        F.count(F.lit(1)).alias("n"), F.countDistinct("at").alias("distinct")).collect()
    in_bronze = {r["t"]: (r["n"], r["distinct"]) for r in rows}
    duplicated = {t: c for t, c in in_bronze.items() if c[0] != c[1]}
    assert not duplicated, f"bronze rows vs distinct (topic, partition, offset) per table: {duplicated}"
    assert {t: c[0] for t, c in in_bronze.items()} == topic_messages(conf), in_bronze


def test_teardown_refuses_without_confirmation_then_leaves_nothing(pipeline):
    conf = pipeline
    slot, publication = config.get(conf, "source.slot"), config.get(conf, "source.publication")
    table_topic = lake_paths.table_specs(conf)[0].topic

    cli = subprocess.run([sys.executable, "-m", "lib.operate.teardown", "--topics"], env=env_of(conf),
                         cwd=config.PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    for named in (f"replication slot {slot}", f"publication {publication}", f"topic {table_topic}",
                  f"snapshot/{slot}", "Nothing was dropped", "YES=1"):
        assert named in cli.stderr, (named, cli.stderr)
    with pytest.raises(teardown.TeardownRefused, match=f"replication slot {slot}"):
        teardown.run(conf)
    assert monitor.slot_row(conf) is not None, "refused, so the slot must still be there"

    registry = schema_registry.client(conf)
    subjects = [s for spec in lake_paths.table_specs(conf) for s in schema_registry.subjects(spec.topic)]
    assert schema_registry.existing(registry, subjects) == subjects  # asked by name, however many the registry holds
    result = teardown.run(conf, topics=True, confirm=True, log=quiet)
    assert f"slot {slot}" in result["dropped"] and f"publication {publication}" in result["dropped"]
    assert f"{len(subjects)} registry subject(s)" in result["dropped"] and not schema_registry.existing(registry,
                                                                                                      subjects)
    assert monitor.slot_row(conf) is None
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_publication WHERE pubname = %s", (publication,))
            assert cur.fetchone()[0] == 0
    finally:
        conn.close()
    names = [spec.topic for spec in lake_paths.table_specs(conf)] + [control.topic(conf)]
    wait_for(lambda: not monitor.end_offsets(conf, names), 30, "the topics to be gone")
    assert teardown.run(conf, topics=True, confirm=True, log=quiet)["dropped"] == []
