"""Debezium interop: topics written by the real Debezium PostgreSQL connector (Kafka Connect, Apicurio's Avro
converter) merge into silver tables equal to the source, with our capture's column types (docs/debezium.md).

Debezium snapshots two tables while changes run, then streams updates of the same key (across and inside
transactions), interleaved transactions, deletes with tombstones, a delete and re-insert, primary key changes,
updates that leave TOASTed values unchanged (Debezium's placeholder) and a key change under REPLICA IDENTITY
FULL. The merge runs twice (after each phase); reconcile must be exact both times.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time

import fastavro
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql
from pyspark.sql import types as T

from lib import config, control, schema_registry, secrets, source
from lib import topics as kafka_topics
from lib.capture import avro_schemas, catalog, pgtypes
from lib.lake import browse, lake_paths, merge, reconcile
from lib.local.stack import connect
from lib.local.stack import stack_dir as stack_folder

pytestmark = pytest.mark.stack

TABLES = ["dbz.accounts", "dbz.events"]
BIG = "(SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 200) g)"  # ~6 kB, TOASTed
DDL = f"""
CREATE SCHEMA dbz;
CREATE TABLE dbz.accounts (
    id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(14,2), rate numeric, opened date,
    updated timestamptz, local_ts timestamp, at_time time, ref uuid, tags text[], doc jsonb, blob bytea,
    note text, flag boolean);
CREATE TABLE dbz.events (event_id uuid PRIMARY KEY, account_id bigint NOT NULL, amount numeric(12,2),
    at timestamptz NOT NULL, kind text);
INSERT INTO dbz.accounts
SELECT i, 'owner ' || i, i * 10.25,
       CASE WHEN i % 4 = 0 THEN NULL WHEN i = 5 THEN -12345678901234567890123456789012345678901234.5671
            ELSE (i * 1.01 + 0.001) * (i % 3 - 1) + 0.000001 END,  -- no trailing zeros: see docs/debezium.md
       DATE '2020-01-01' + i, TIMESTAMPTZ '2024-01-01 00:00:00.123456+00' + i * INTERVAL '1 s',
       TIMESTAMP '2024-02-03 04:05:06.789012' + i * INTERVAL '1 min', TIME '01:02:03.456789' + i * INTERVAL '1 s',
       md5(i::text)::uuid, ARRAY['t' || i, NULL],
       jsonb_build_object('n', i, 'big', CASE WHEN i % 5 = 0 THEN NULL ELSE {BIG} END),
       decode(md5(i::text), 'hex'), CASE WHEN i % 3 = 0 THEN NULL ELSE {BIG} END, i % 2 = 0
FROM generate_series(1, 30) i;
INSERT INTO dbz.events SELECT md5('e' || i)::uuid, i, i * -1.5, TIMESTAMPTZ '2024-05-06 07:08:09+02', 'k' || i
FROM generate_series(1, 10) i;
"""
# phase 1 runs while Debezium snapshots: every change lands in the stream, after the snapshot rows
PHASE1 = [
    "UPDATE dbz.accounts SET balance = balance + 1 WHERE id <= 5",
    "UPDATE dbz.accounts SET balance = balance + 1, owner = owner || ' again' WHERE id <= 3",
    "BEGIN; UPDATE dbz.accounts SET flag = NOT flag WHERE id = 6; UPDATE dbz.accounts SET flag = NOT flag "
    "WHERE id = 6; UPDATE dbz.accounts SET rate = -0.000001 WHERE id = 6; COMMIT",
    "DELETE FROM dbz.accounts WHERE id IN (7, 8)",
    "DELETE FROM dbz.accounts WHERE id = 9; INSERT INTO dbz.accounts (id, owner, balance) VALUES (9, 'reborn', 9.09)",
    "INSERT INTO dbz.events VALUES (md5('new')::uuid, 1, 99.99, now(), NULL)",
    "UPDATE dbz.events SET amount = 0.01, kind = NULL WHERE account_id = 2",
    "DELETE FROM dbz.events WHERE account_id = 3",
]
# phase 2 after the first merge: TOASTed values unchanged (silver must keep them), key changes, more updates
PHASE2 = [
    "UPDATE dbz.accounts SET balance = 1.23 WHERE id IN (1, 2, 10)",  # placeholders: silver keeps its values
    f"INSERT INTO dbz.accounts (id, owner, note, tags, doc) VALUES (31, 'fresh', {BIG}, ARRAY[{BIG}], "
    f"jsonb_build_object('big', {BIG}))",
    "UPDATE dbz.accounts SET owner = 'fresh, then updated' WHERE id = 31",  # placeholders: the insert's values
    "UPDATE dbz.accounts SET id = 1000 WHERE id = 30",  # a key change (row without TOASTed values)
    # a key change of a row with TOASTed values needs REPLICA IDENTITY FULL: Debezium then fills them from the
    # old row; with DEFAULT the new key would get placeholders and no stored row to keep (docs/debezium.md)
    "ALTER TABLE dbz.accounts REPLICA IDENTITY FULL",
    "UPDATE dbz.accounts SET id = 1001 WHERE id = 11",
    "UPDATE dbz.accounts SET note = 'short now', local_ts = NULL WHERE id = 12",
    "UPDATE dbz.accounts SET updated = '2024-12-31 23:59:59.999999+00', opened = '1999-12-31' WHERE id = 13",
    "DELETE FROM dbz.accounts WHERE id = 14",
]


@pytest.fixture(scope="module")
def dbz(live_stack, scratch_database, run_id, tmp_path_factory, drop_slot):
    """conf for this run (scratch database, own slot/publication/prefix/lake), tables loaded; cleaned up after."""
    prefix = f"cdc-dbz-{run_id}"  # a hyphen on purpose: Avro names need schema.name.adjustment.mode=avro
    conf = config.apply_overrides(live_stack, {
        "CDC__SOURCE__DATABASE": scratch_database, "CDC__SOURCE__TABLES": json.dumps(TABLES),
        "CDC__KAFKA__TOPIC_PREFIX": prefix, "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("debezium_lake")),
        "CDC__DEBEZIUM__NAME": f"dbz-{run_id}", "CDC__DEBEZIUM__SLOT": f"dbz_{run_id}",
        "CDC__DEBEZIUM__PUBLICATION": f"dbz_{run_id}", "CDC__MERGE__QUERY_NAME": f"merge_dbz_{run_id}"})
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    pipeline = sql.Identifier(config.get(conf, "source.user"))
    with admin.cursor() as cur:
        cur.execute(DDL)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA dbz TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA dbz TO {0}")
                    .format(pipeline))
        cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE dbz.accounts, dbz.events").format(
            sql.Identifier(f"dbz_{run_id}")))
    kafka_admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    kafka_topics.ensure_topics(kafka_admin, [avro_schemas.topic_name(prefix, t) for t in TABLES],
                               partitions=config.get(conf, "kafka.partitions"))
    control.ensure(conf)
    folder = stack_folder(conf)
    yield conf
    connect.stop(conf, folder, log=lambda line: None)
    drop_slot(conf, f"dbz_{run_id}")
    shutil.rmtree(connect.files(folder, f"dbz-{run_id}")["base"], ignore_errors=True)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(f"dbz_{run_id}")))
        cur.execute("DROP SCHEMA IF EXISTS dbz CASCADE")
    admin.close()
    doomed = [t for t in kafka_admin.list_topics(timeout=10).topics if prefix in t]
    for future in kafka_admin.delete_topics(doomed).values() if doomed else []:
        with contextlib.suppress(Exception):
            future.result(30)
    registry = schema_registry.client(conf)
    for subject in registry.get_subjects():
        if prefix in subject:
            for permanent in (False, True):
                with contextlib.suppress(Exception):
                    registry.delete_subject(subject, permanent=permanent)


def run_sql(conf: dict, statements: list[str]) -> None:
    """Each statement in its own autocommit call (BEGIN ... COMMIT inside a statement makes one transaction)."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
    conn.close()


def interleaved(conf: dict) -> None:
    """Two transactions whose WAL records interleave: the one that began first commits last."""
    first, second = source.connect(conf, admin=True), source.connect(conf, admin=True)
    with first.cursor() as a, second.cursor() as b:
        a.execute("UPDATE dbz.accounts SET balance = 100 WHERE id = 15")  # first WAL record, committed last
        b.execute("UPDATE dbz.accounts SET balance = 200 WHERE id = 16")
        b.execute("UPDATE dbz.accounts SET owner = 'second' WHERE id = 17")
        second.commit()
        a.execute("UPDATE dbz.accounts SET owner = 'first', balance = 300 WHERE id = 16")  # after the other commit
        a.execute("UPDATE dbz.events SET kind = 'first' WHERE account_id = 4")
        first.commit()
    first.close()
    second.close()


def wait_for_key(conf: dict, table: str, key: dict, timeout: float = 120.0) -> None:
    """Wait until Debezium wrote an event for key (the last change of a phase), then until the topics are still."""
    prefix = config.get(conf, "kafka.topic_prefix")
    registry = schema_registry.client(conf)
    servers = config.get(conf, "kafka.bootstrap_servers")
    consumer = Consumer({"bootstrap.servers": servers, "group.id": "unused", "enable.auto.commit": False})
    topic = avro_schemas.topic_name(prefix, table)
    consumer.assign([TopicPartition(topic, p, 0) for p in range(int(config.get(conf, "kafka.partitions")))])
    parsed = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert time.monotonic() < deadline, f"no Debezium event for {table} {key} within {timeout} s; " \
                f"see {connect.status(conf, stack_folder(conf))}"
            message = consumer.poll(1.0)
            if message is None or message.error() or message.value() is None:
                continue
            schema_id = int.from_bytes(message.key()[1:5], "big")
            if schema_id not in parsed:
                parsed[schema_id] = fastavro.parse_schema(json.loads(registry.get_schema(schema_id).schema_str))
            if fastavro.schemaless_reader(io.BytesIO(message.key()[5:]), parsed[schema_id]) == key:
                break
    finally:
        consumer.close()
    names = [avro_schemas.topic_name(prefix, t) for t in TABLES]
    previous = None
    while previous != (current := end_offsets(servers, names)):
        previous = current
        time.sleep(1.5)  # the key's event was the phase's last change: what follows is already on its way


def end_offsets(servers: str, names: list[str]) -> dict:
    """High watermark of every partition of the topics."""
    consumer = Consumer({"bootstrap.servers": servers, "group.id": "unused"})
    try:
        out = {}
        for name in names:
            for p in consumer.list_topics(name, timeout=10).topics[name].partitions:
                out[(name, p)] = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1]
        return out
    finally:
        consumer.close()


def assert_exact(conf: dict, spark) -> None:
    results = reconcile.reconcile(conf, spark)
    assert all(r["equal"] for r in results), [(r["table"], r["source_rows"], r["silver_rows"], r["differences"])
                                              for r in results]


def test_debezium_topics_merge_into_exact_silver(dbz, spark_session):
    conf, spark, folder = dbz, spark_session, stack_folder(dbz)
    connect.start(conf, folder, log=lambda line: None)
    connect.wait_running(conf, folder)
    run_sql(conf, PHASE1)  # while Debezium snapshots: these land in the stream, after the snapshot rows
    interleaved(conf)
    run_sql(conf, ["INSERT INTO dbz.accounts (id, owner) VALUES (9001, 'end of phase 1')"])
    wait_for_key(conf, "dbz.accounts", {"id": 9001})

    first = merge.run_until_caught_up(conf, spark)
    assert first["events"] > 40 and first["dead_letters"] == 0, first
    assert_exact(conf, spark)

    run_sql(conf, PHASE2)
    run_sql(conf, ["INSERT INTO dbz.accounts (id, owner) VALUES (9002, 'end of phase 2')"])
    wait_for_key(conf, "dbz.accounts", {"id": 9002})
    second = merge.run_until_caught_up(conf, spark)
    assert second["events"] >= 10 and second["dead_letters"] == 0, second
    assert_exact(conf, spark)

    # silver has the column types our own capture gives (not Debezium's ints, longs, ISO strings and structs)
    conn = source.connect(conf, options=pgtypes.session_options())
    described = catalog.describe_tables(conn, TABLES)
    conn.close()
    for name in TABLES:
        expected = reconcile.source_types(spark, described[name], conf)
        have = browse.silver(conf, spark, name).schema
        assert [(f.name, f.dataType) for f in have.fields if not f.name.startswith("_")] == \
            [(f.name, f.dataType) for f in expected.fields], name
    assert isinstance(browse.silver(conf, spark, "dbz.accounts").schema["updated"].dataType, T.TimestampType)

    accounts = {r["id"]: r for r in browse.silver(conf, spark, "dbz.accounts", include_deleted=True).collect()}
    assert accounts[7]["_deleted"] and accounts[11]["_deleted"] and accounts[30]["_deleted"]
    assert not accounts[1000]["_deleted"] and accounts[1001]["note"] is not None and accounts[1001]["doc"]
    assert accounts[9]["owner"] == "reborn" and not accounts[9]["_deleted"]
    assert accounts[1]["note"] is not None and accounts[1]["_unknown_cols"] is None  # TOAST kept from the snapshot
    assert accounts[20]["_event_serial"] == -1 and accounts[1]["_event_serial"] > 0  # snapshot row vs stream

    bronze = browse.bronze(conf, spark, lake_paths.table_specs(conf)[0].qualified)
    toasted = [r for r in bronze.filter("op = 'u' AND key.id = 1").collect() if r["unchanged_cols"]]
    assert toasted and set(toasted[-1]["unchanged_cols"]) >= {"note", "doc"}, "no TOAST placeholder reached bronze"
    snapshot = bronze.filter("op = 'r'").select("source.commit_lsn", "source.event_serial").distinct().collect()
    assert len(snapshot) == 1 and snapshot[0]["event_serial"] == -1

    connect.stop(conf, folder, log=lambda line: None)
    assert connect.status(conf, folder)["state"] == "stopped"

    # reconcile names the column of a one-value change (the merge has not seen it yet): a microsecond, a digit
    run_sql(conf, ["UPDATE dbz.accounts SET rate = rate + 0.000001 WHERE id = 2",
                   "UPDATE dbz.accounts SET updated = updated + INTERVAL '1 microsecond' WHERE id = 3"])
    drift = reconcile.reconcile(conf, spark, tables=["dbz.accounts"])[0]
    assert not drift["equal"] and drift["differences"] == [
        {"id": 2, "kind": "different", "columns": ["rate"]}, {"id": 3, "kind": "different", "columns": ["updated"]}]


def test_connector_config_keeps_the_password_out_of_files(dbz):
    props = connect.connector_config(dbz)
    assert props["database.password"] == "${env:" + connect.PASSWORD_ENV + "}"
    assert props["value.converter.apicurio.registry.use-id"] == "contentId"
    assert props["table.include.list"] == r"dbz\.accounts,dbz\.events"
    assert props["decimal.handling.mode"] == "precise" and props["tombstones.on.delete"] == "true"
    where = connect.files(stack_folder(dbz), connect.settings(dbz)["name"])
    password = secrets.setting(dbz, "source.password")
    assert where["connector"].exists(), "the worker's files are checked after it ran (first test)"
    for path in (where["worker"], where["connector"]):
        assert password not in path.read_text()
