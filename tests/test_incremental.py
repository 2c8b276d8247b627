"""Adding a table to a running pipeline: the capture snapshots it in chunks while the workload writes to it
and to the other tables; the merge, which ran on the initial tables before, runs again on the same checkpoint
with the conf that lists the added table, and every table (the added one included) reconciles exactly."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from confluent_kafka import Producer
from psycopg2 import sql

from lib import config, source
from lib.capture import bootstrap, catalog, incremental, snapshot, stream
from lib.lake import browse, lake_paths, merge, reconcile
from lib.local import sample_db, workload
from lib.operate import tables, teardown

pytestmark = pytest.mark.stack

ADDED = "bank.transactions"


@pytest.fixture(scope="module")
def incr(live_stack, run_id, drop_slot, tmp_path_factory):
    """conf (three sample tables, not bank.transactions) on a database of its own, bootstrapped and snapshotted."""
    database = f"cdc_incr_{run_id}"
    admin = source.connect(live_stack, admin=True, dbname="postgres")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    # three tables the workload writes besides the one added: the merge and reconcile stay small
    tables = ["bank.customers", "bank.accounts", "bank.account_holders"]
    overrides = {
        "CDC__SOURCE__DATABASE": database,
        "CDC__SOURCE__SLOT": f"incr_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"incr_{run_id}",
        "CDC__SOURCE__TABLES": "[" + ", ".join(tables) + "]",
        "CDC__SOURCE__INCREMENTAL_CHUNK_ROWS": "150",
        "CDC__SOURCE__INCREMENTAL_CHECK_S": "1",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-incr",
        "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("incremental")),
    }
    conf = config.apply_overrides(live_stack, overrides)
    owner = source.connect(conf, admin=True)
    sample_db.create_schema(owner)
    with owner.cursor() as cur:
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                    .format(sql.Identifier(config.get(conf, "source.user"))))
    sample_db.load(owner, customers=60)
    owner.commit()
    bootstrap.run(conf, log=lambda line: None)
    yield conf
    drop_slot(conf, config.get(conf, "source.slot"))
    owner.close()
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    admin.close()
    prefix = config.get(conf, "kafka.topic_prefix")
    teardown.delete_prefix(conf, prefix)


def with_added(conf: dict) -> dict:
    """conf after the operator added bank.transactions to source.tables."""
    tables = list(config.get(conf, "source.tables")) + [ADDED]
    return config.apply_overrides(conf, {"CDC__SOURCE__TABLES": "[" + ", ".join(tables) + "]"})


def test_adding_a_table_not_in_conf_is_refused_with_the_remedy(incr):
    with pytest.raises(incremental.IncrementalError, match=r"bank.transactions is not in source.tables .*add it there"):
        incremental.add_table(incr, ADDED)


def test_chunk_query_reads_after_the_last_key_in_key_order(incr):
    conn = source.connect(incr)
    try:
        table = catalog.describe_tables(conn, ["bank.account_holders"])["bank.account_holders"]
        query = incremental.chunk_query(table, list(table.columns), True, 5).as_string(conn)
        with conn.cursor() as cur:
            cur.execute("SELECT account_id::text, customer_id::text FROM bank.account_holders "
                        "ORDER BY account_id, customer_id LIMIT 3")
            first = cur.fetchall()
            rows = incremental.fetch_text(cur, incremental.chunk_query(table, list(table.columns), True, 5),
                                          list(first[-1]))
            cur.execute("SELECT account_id::text, customer_id::text FROM bank.account_holders "
                        "ORDER BY account_id, customer_id OFFSET 3 LIMIT 5")
            expected = cur.fetchall()
    finally:
        conn.close()
    assert "WHERE (\"account_id\", \"customer_id\") > (%s::bigint, %s::bigint)" in query
    width = len(table.columns)
    assert [tuple(r[width:]) for r in rows] == expected
    assert all(isinstance(v, str) for r in rows for v in r if v is not None)


def test_table_added_while_streaming_and_writing_reconciles_exactly(incr, spark_session):
    snapshot.run(incr, spark_session, log=lambda line: None)
    before = merge.run_until_caught_up(incr, spark_session)  # the initial tables: the checkpoint knows their topics
    assert before["batches"] >= 1
    assert {r["table"] for r in browse.summary(incr, spark_session).collect()} == set(config.get(incr, "source.tables"))
    lines: list[str] = []
    stop = threading.Event()
    capture: dict = {}
    thread = threading.Thread(target=lambda: capture.update(metrics=stream.run(
        incr, until="forever", stop_event=stop, heartbeat_s=1, metrics_interval_s=1, log=lines.append)))
    thread.start()
    writer = source.connect(incr, admin=True)
    written: dict = {"inserts": {}}
    enough = threading.Event()  # set once the added table's snapshot is complete: the writes may end

    def write():  # 2 s runs at 40 tx/s, before, during and after the table's chunks, until told to stop
        for seed in range(5, 1000):
            for table, n in workload.run(writer, rate=40, duration=2, seed=seed)["inserts"].items():
                written["inserts"][table] = written["inserts"].get(table, 0) + n
            if enough.is_set():
                break

    load = threading.Thread(target=write)
    load.start()
    state = None
    try:
        wait_until = time.monotonic() + 30  # the capture streams the workload's changes before the table is added
        while not any(line.startswith("stream ") for line in lines) and time.monotonic() < wait_until:
            time.sleep(0.2)
        time.sleep(1)
        added = with_added(incr)
        record = tables.add_table(added, ADDED, log=lines.append)
        assert record["state"] == "ready" and record["key_columns"] == ["transaction_id"]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and thread.is_alive():
            state = {r["table"]: r for r in incremental.progress(added)}.get(ADDED)
            if state and state["state"] == "complete":
                break
            time.sleep(1)
    finally:
        enough.set()
        load.join()
        writer.close()
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and "metrics" in capture, "\n".join(lines[-20:])
    assert state and state["state"] == "complete", (state, "\n".join(lines[-20:]))
    assert state["chunks"] >= 2, state
    assert any(line.startswith(f"incremental {ADDED}: chunk") for line in lines)

    assert any(line.startswith(f"incremental {ADDED}: no merge service runs here") for line in lines), lines[-20:]

    stream.run(added, until="caught_up")  # what the workload wrote last, with the conf that lists the table
    assert lake_paths.query_name(added) == lake_paths.query_name(incr)  # same root and checkpoint: a restarted merge
    after = merge.run_until_caught_up(added, spark_session)
    assert after["batches"] >= 1
    results = reconcile.reconcile(added, spark_session)
    unequal = [r for r in results if not r["equal"]]
    assert not unequal, unequal
    assert {r["table"] for r in results} == set(config.get(added, "source.tables"))
    counts = {r["table"]: r["source_rows"] for r in results}
    assert counts[ADDED] > 300 and written["inserts"][ADDED] > 0


def test_remove_table_drops_it_from_the_publication(incr):
    added = with_added(incr)
    result = incremental.remove_table(added, ADDED, log=lambda line: None)
    assert result == {"table": ADDED, "was_published": True}
    conn = source.connect(incr)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tablename FROM pg_publication_tables WHERE pubname = %s",
                        (config.get(incr, "source.publication"),))
            published = {r[0] for r in cur.fetchall()}
    finally:
        conn.close()
    assert "transactions" not in published and "customers" in published
    assert ADDED not in {r["table"] for r in incremental.progress(added)}
    with pytest.raises(incremental.IncrementalError, match="not found"):
        incremental.remove_table(added, "bank.nope", log=lambda line: None)


def test_a_table_taken_out_of_source_tables_is_read_and_skipped_and_the_merge_starts_on_its_checkpoint(
        incr, spark_session, caplog):
    """After test_remove_table: conf without bank.transactions, the merge's checkpoint holding its topic."""
    added = with_added(incr)
    gone = lake_paths.table_spec(added, ADDED).topic
    checkpoint = lake_paths.checkpoint_path(incr, lake_paths.query_name(incr))
    held = merge.checkpoint_topics(spark_session, checkpoint)
    assert gone in held and merge.checkpoint_topics_read(spark_session, checkpoint) == held  # both ways agree
    assert merge.removed_topics(incr, spark_session, checkpoint) == [gone]
    producer = Producer({"bootstrap.servers": config.get(incr, "kafka.bootstrap_servers")})
    producer.produce(gone, key=b"\x07not avro", value=b"\x07not avro")  # no table decodes it now: skipped, not lost
    producer.flush(30)
    writer = source.connect(incr, admin=True)
    try:
        workload.run(writer, rate=20, duration=2, seed=77)
    finally:
        writer.close()
    stream.run(incr, until="caught_up")
    with caplog.at_level(logging.WARNING, logger="lib.lake.merge"):
        after = merge.run_until_caught_up(incr, spark_session)  # Spark refused the checkpoint before: data loss
    assert after["batches"] >= 1 and after["dead_letters"] == 0
    assert any(f"holds topic {gone}, which no table of source.tables writes now" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    results = reconcile.reconcile(incr, spark_session)
    assert {r["table"] for r in results} == set(config.get(incr, "source.tables"))
    assert all(r["equal"] for r in results), [r for r in results if not r["equal"]]
