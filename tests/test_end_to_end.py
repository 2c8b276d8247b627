"""End to end on the live stack: snapshot + stream + merge under a concurrent workload, reconcile exact for every
table; then the merge driver killed (-9) in the middle of a micro-batch, restarted, reconcile exact again.

One scratch copy of the sample bank, and names of its own (slot, publication, topic prefix, lake root and
checkpoints in a temporary folder). The two tests run in file order and share that pipeline.

Runtime is the merge's: every micro-batch costs one append and one MERGE per table (docs/benchmarks.md,
commit -> Delta latency), 4 micro-batches over 8 tables here; 18 minutes at load average 6-10 on the two
shared cores. `pytest -s` prints each phase's time.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg2 import sql
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from lib import (
    bootstrap,
    config,
    merge,
    reconcile,
    snapshot,
    source,
    stack,
    stream,
    teardown,
    workload,
)

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[1]
CUSTOMERS = 50
WORKLOAD_RATE = 10  # business transactions per second while the snapshot and the first stream run
KILL_BATCH_OFFSETS = 300  # maxOffsetsPerTrigger of the merge that gets killed: the backlog takes several batches
MERGE_SCRIPT = ("from lib import config, merge, spark; conf = config.load('local'); "
                "print(merge.run_until_caught_up(conf, spark.from_conf(conf, catalog='in-memory')), flush=True)")


# ---------------------------------------------------------------------------------------------
# setup


@pytest.fixture(scope="module")
def e2e(live_stack, scratch_database, run_id, tmp_path_factory, drop_slot):
    """conf (and its CDC__ overrides, for a subprocess) of a pipeline over a fresh sample bank."""
    overrides = {
        "CDC__SOURCE__DATABASE": scratch_database,
        "CDC__SOURCE__SLOT": f"e2e_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"e2e_{run_id}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-e2e",
        "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("e2e_lake")),
    }
    conf = config.apply_overrides(live_stack, overrides)
    stack.sample(conf, customers=CUSTOMERS, reset=True, log=lambda line: None)  # schema bank, rows, grants
    yield conf, overrides
    drop_slot(conf, config.get(conf, "source.slot"))
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
            sql.Identifier(config.get(conf, "source.publication"))))
        cur.execute("DROP SCHEMA IF EXISTS bank CASCADE")
    admin.close()
    prefix = config.get(conf, "kafka.topic_prefix")
    teardown.delete_prefix(conf, prefix)


class Workload(threading.Thread):
    """lib.workload in a thread, one-second runs until stop(); counts committed business transactions."""

    def __init__(self, conf: dict, rate: float):
        super().__init__(daemon=True)
        self.conf, self.rate = conf, rate
        self.halt = threading.Event()
        self.transactions, self.runs, self.error = 0, 0, None

    def run(self) -> None:
        conn = source.connect(self.conf, admin=True)
        try:
            while not self.halt.is_set():
                self.runs += 1
                self.transactions += workload.run(conn, rate=self.rate, duration=1.0, seed=self.runs)["transactions"]
        except BaseException as exc:  # reported by stop()
            self.error = exc
        finally:
            conn.close()

    def stop(self) -> int:
        """Stop after the current run; the number of committed transactions."""
        self.halt.set()
        self.join(60)
        assert not self.is_alive(), "workload thread did not stop"
        assert self.error is None, f"workload failed: {self.error!r}"
        return self.transactions


def timed(label: str, began: float) -> float:
    """Print how long a phase took (shown with pytest -s); returns now."""
    now = time.monotonic()
    print(f"e2e {label}: {now - began:.1f} s", flush=True)
    return now


def catch_up(conf: dict) -> dict:
    """stream.run until caught up with the WAL position at its start."""
    result = stream.run(conf, until="caught_up", max_seconds=180, heartbeat_s=2)
    assert result["caught_up"], result
    return result


def shown(results: list[dict]) -> str:
    """reconcile() output as lines, for assertion messages."""
    return "\n".join(f"{r['table']}: source {r['source_rows']}, silver {r['silver_rows']}, equal {r['equal']}"
                     + (f", differences {r['differences']}" if r["differences"] else "") for r in results)


def assert_exact(conf: dict, spark) -> list[dict]:
    """reconcile() says equal (count and checksum) for every configured table."""
    results = reconcile.reconcile(conf, spark)
    configured = {s.qualified for s in merge.table_specs(conf)}
    assert {r["table"] for r in results} == configured, shown(results)
    assert all(r["equal"] for r in results), "silver differs from the source:\n" + shown(results)
    assert all(r["source_rows"] > 0 for r in results), shown(results)
    return results


def topic_messages(conf: dict) -> dict[str, int]:
    """Messages in each table topic (end minus start offset, summed over partitions)."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"e2e-count-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        counts = {}
        for spec in merge.table_specs(conf):
            partitions = consumer.list_topics(spec.topic, timeout=10).topics[spec.topic].partitions
            counts[spec.qualified] = sum(high - low for low, high in (
                consumer.get_watermark_offsets(TopicPartition(spec.topic, p), timeout=10) for p in partitions))
        return counts
    finally:
        consumer.close()


def bronze_counts(conf: dict, spark) -> dict[str, tuple[int, int]]:
    """Per table: (bronze rows, distinct Kafka coordinates (topic, partition, offset)), in one Spark job."""
    frames = [spark.read.format("delta").load(merge.bronze_path(conf, spec)).select(
        F.lit(spec.qualified).alias("t"), F.struct("_kafka_topic", "_kafka_partition", "_kafka_offset").alias("at"))
        for spec in merge.table_specs(conf)]
    rows = functools.reduce(DataFrame.unionByName, frames).groupBy("t").agg(
        F.count(F.lit(1)).alias("n"), F.countDistinct("at").alias("distinct")).collect()
    return {r["t"]: (r["n"], r["distinct"]) for r in rows}


def assert_bronze_complete(conf: dict, spark) -> None:
    """Bronze holds every Kafka message of every table topic exactly once; nothing was dead-lettered."""
    dead = merge.dead_letter_counts(spark, conf).collect()
    assert not dead, f"dead letters: {[r.asDict() for r in dead]}"
    in_kafka, in_bronze = topic_messages(conf), bronze_counts(conf, spark)
    duplicated = {t: c for t, c in in_bronze.items() if c[0] != c[1]}
    assert not duplicated, f"bronze rows vs distinct (topic, partition, offset) per table: {duplicated}"
    assert {t: c[0] for t, c in in_bronze.items()} == in_kafka, f"bronze {in_bronze} vs Kafka {in_kafka}"


# ---------------------------------------------------------------------------------------------
# the checkpoint and Delta logs seen from outside the merge process


def _ids(folder: Path) -> set[int]:
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else set()


def batches(conf: dict) -> tuple[set[int], set[int]]:
    """Batch ids the merge checkpoint has planned (offsets/) and finished (commits/)."""
    folder = Path(merge.checkpoint_path(conf, merge.query_name(conf)))
    return _ids(folder / "offsets"), _ids(folder / "commits")


def delta_commits(conf: dict) -> set[str]:
    """Every Delta commit file of every bronze and silver table."""
    lake = Path(config.location(config.get(conf, "lake.root")))
    return {str(p) for layer in ("bronze", "silver") for p in lake.glob(f"{layer}/*/*/_delta_log/*.json")}


def kill_mid_batch(conf: dict, process: subprocess.Popen, after: int, timeout: float = 600.0) -> tuple[int, str]:
    """SIGKILL the merge's process group once a micro-batch later than `after` has written some but not all of
    its Delta commits; returns (batch id, the Delta commit it had written)."""
    watching: tuple[int, set[str]] | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the merge ended (exit {process.returncode}) before it could be killed"
        planned, done = batches(conf)
        running = [b for b in planned - done if b > after]
        if running:
            batch = max(running)
            if watching is None or watching[0] != batch:
                watching = (batch, delta_commits(conf))
            else:
                new = delta_commits(conf) - watching[1]
                if new:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(30)
                    return batch, sorted(new)[0]
        time.sleep(0.05)
    raise AssertionError(f"no micro-batch after {after} was caught in progress within {timeout} s")


# ---------------------------------------------------------------------------------------------
# the tests


def test_snapshot_stream_merge_under_workload_is_exact(e2e, spark_session):
    conf, _ = e2e
    began = time.monotonic()
    bootstrap.run(conf, log=lambda line: None)
    writer = Workload(conf, WORKLOAD_RATE)
    writer.start()
    try:
        time.sleep(1.0)
        began = timed("bootstrap", began)
        report = snapshot.run(conf, spark_session, progress=lambda line: None)
        during_snapshot = writer.transactions
        began = timed(f"snapshot ({during_snapshot} workload transactions meanwhile)", began)
        streamed = catch_up(conf)  # while the workload goes on
    finally:
        total = writer.stop()
    final = catch_up(conf)
    began = timed(f"stream ({streamed['events']} + {final['events']} events, {total} transactions in all)", began)
    assert report["status"] == "complete" and not report["already_complete"], report
    assert during_snapshot > 0 and total > during_snapshot, (during_snapshot, total)
    assert streamed["events"] > 0, (streamed, final)

    merged = merge.run_until_caught_up(conf, spark_session)
    began = timed(f"merge {merged}", began)
    assert merged["batches"] >= 1 and merged.get("dead_letters", 0) == 0, merged
    assert_exact(conf, spark_session)
    began = timed("reconcile", began)
    assert_bronze_complete(conf, spark_session)
    timed("bronze check", began)


def test_merge_driver_killed_mid_batch_then_restarted_is_exact(e2e, spark_session):
    conf, overrides = e2e
    began = time.monotonic()
    planned, done = batches(conf)
    assert planned and planned == done, "the first test leaves a checkpoint with every batch finished"
    writer = source.connect(conf, admin=True)
    try:
        changed = workload.run(writer, rate=float("inf"), count=200, seed=99)
    finally:
        writer.close()
    assert changed["transactions"] == 200
    assert catch_up(conf)["events"] > KILL_BATCH_OFFSETS
    began = timed("workload and stream", began)

    env = {**os.environ, **overrides, "CDC__MERGE__MAX_OFFSETS_PER_TRIGGER": str(KILL_BATCH_OFFSETS),
           "CDC__SPARK__APP_NAME": "cdc-e2e-killed-merge", "PYTHONUNBUFFERED": "1"}
    log_path = Path(config.location(config.get(conf, "lake.root"))) / "killed_merge.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", MERGE_SCRIPT], cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # kill in the subprocess's first batch once it has written some of its Delta commits
            killed, written = kill_mid_batch(conf, process, after=max(done))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
    began = timed(f"merge subprocess killed in batch {killed}", began)
    planned, done = batches(conf)
    assert killed in planned and killed not in done, (killed, sorted(planned), sorted(done))
    assert re.search(r"/(bronze|silver)/bank/\w+/_delta_log/\d+\.json$", written), written

    # in this process, without the small batch limit: the killed batch again (its offsets are in the
    # checkpoint; Delta skips the commits it had made), then the rest of the backlog
    restarted = merge.run_until_caught_up(conf, spark_session)
    began = timed(f"merge restarted {restarted}", began)
    assert restarted["batches"] >= 2, restarted
    planned, done = batches(conf)
    assert killed in done and planned == done, (killed, sorted(planned), sorted(done))
    assert_exact(conf, spark_session)
    assert_bronze_complete(conf, spark_session)
    timed("reconcile and bronze check", began)
