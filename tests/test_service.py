"""Continuous mode on the live stack: kill -9 of the capture and merge processes while the workload writes,
restart, catch up, reconcile exactly; status and history along the way; then a teardown that refuses without
confirmation and leaves no slot or publication behind.

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

import pytest
from psycopg2 import sql

from lib import (
    bootstrap,
    config,
    control,
    merge,
    monitor,
    reconcile,
    sample_db,
    service,
    snapshot,
    source,
    teardown,
    workload,
)

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


def test_kill_9_and_restart_while_writing_then_silver_reconciles(pipeline, spark_session):
    conf, slot = pipeline, config.get(pipeline, "source.slot")
    done = snapshot.run(conf, spark_session, progress=quiet)
    assert done["status"] == "complete"
    lines = []
    first = service.start(conf, log=lines.append)
    assert set(first) == {"capture", "merge"} and all(row["state"] == "running" for row in service.status(conf))
    # both at work: the merge query runs (its first micro-batch, the snapshot's rows, may still be going on)
    # generous limits: on a loaded machine starting Spark alone can take minutes
    wait_for(lambda: monitor.latest(conf, "merge"), 600, "the merge query to start")
    wait_for(lambda: monitor.latest(conf, "capture"), 30, "a capture metrics record")

    writes: dict = {}
    conn = source.connect(conf, admin=True)

    def write():
        try:
            writes.update(workload.run(conn, rate=10, duration=40, seed=5))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            writes["error"] = exc

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        wait_for(lambda: (monitor.latest(conf, "capture") or {}).get("events"), 30, "streamed events")
        time.sleep(8)  # some of the workload captured and in the merge's hands, more to come
        with pytest.raises(teardown.TeardownError, match="still run: stop them first"):
            teardown.run(conf, confirm=True)
        for name in ("capture", "merge"):
            os.kill(first[name], signal.SIGKILL)
        wait_for(lambda: all(service.state(conf, n)["state"] == "crashed" for n in first), 20, "both to be dead")
        assert writer.is_alive(), "the crash must happen while the workload writes"
        assert sum("died" in w for w in monitor.status(conf)["warnings"]) == 2
        time.sleep(3)  # the workload keeps writing while nothing captures or merges
        second = service.start(conf, log=lines.append)
        assert second["capture"] != first["capture"] and second["merge"] != first["merge"]
        assert sum("was not stopped cleanly" in line for line in lines) == 2, lines
    finally:
        writer.join(120)
        conn.close()
    assert "error" not in writes and writes["transactions"] > 100, writes

    caught = monitor.wait_until_caught_up(conf, timeout_s=1200)
    assert caught["kafka_end"]
    st = monitor.status(conf)
    assert [row["state"] for row in st["services"]] == ["running", "running"]
    assert st["kafka_lag"] == 0 and st["slots"][0]["active"], st
    assert all(t["last_merged_lsn"] for t in st["tables"]), st["tables"]
    assert not any("no consumer" in w or "died" in w for w in st["warnings"]), st["warnings"]

    cli = subprocess.run([sys.executable, "-m", "lib.monitor"], env=env_of(conf), cwd=config.PROJECT_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and slot in cli.stdout and "bank.transactions" in cli.stdout, cli.stderr

    hist = monitor.history(conf)
    for name in ("capture", "merge"):
        assert hist[hist["service"] == name]["pid"].nunique() >= 2, f"{name}: one history per process run"
    assert hist["events_per_s"].max() > 0 and hist["retained_wal_bytes"].notna().any()
    fig = monitor.plot(conf)
    assert len(fig.axes) == 3

    service.stop(conf, log=quiet)
    assert [row["state"] for row in service.status(conf)] == ["stopped", "stopped"]
    stopped = monitor.status(conf)
    assert any(f"slot {slot} has no consumer attached" in w for w in stopped["warnings"]), stopped["warnings"]

    results = reconcile.reconcile(conf, spark_session)
    assert len(results) == len(config.get(conf, "source.tables"))
    assert all(r["equal"] for r in results), [(r["table"], r["source_rows"], r["silver_rows"], r["differences"])
                                              for r in results if not r["equal"]]
    merged = merge.summary(spark_session, conf).collect()
    assert sum(r["bronze_events"] for r in merged) > sum(r["source_rows"] for r in results)


def test_teardown_refuses_without_confirmation_then_leaves_nothing(pipeline):
    conf = pipeline
    slot, publication = config.get(conf, "source.slot"), config.get(conf, "source.publication")
    table_topic = merge.table_specs(conf)[0].topic

    cli = subprocess.run([sys.executable, "-m", "lib.teardown", "--topics"], env=env_of(conf),
                         cwd=config.PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    for named in (f"replication slot {slot}", f"publication {publication}", f"topic {table_topic}",
                  f"snapshot/{slot}", "Nothing was dropped", "YES=1"):
        assert named in cli.stderr, (named, cli.stderr)
    with pytest.raises(teardown.TeardownRefused, match=f"replication slot {slot}"):
        teardown.run(conf)
    assert monitor.slot_row(conf) is not None, "refused, so the slot must still be there"

    result = teardown.run(conf, topics=True, confirm=True, log=quiet)
    assert f"slot {slot}" in result["dropped"] and f"publication {publication}" in result["dropped"]
    assert monitor.slot_row(conf) is None
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_publication WHERE pubname = %s", (publication,))
            assert cur.fetchone()[0] == 0
    finally:
        conn.close()
    names = [spec.topic for spec in merge.table_specs(conf)] + [control.topic(conf)]
    wait_for(lambda: not monitor.end_offsets(conf, names), 30, "the topics to be gone")
    assert teardown.run(conf, topics=True, confirm=True, log=quiet)["dropped"] == []
