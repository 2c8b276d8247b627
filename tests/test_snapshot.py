"""Notebook 02's snapshot on the live stack: exact rows at the consistent point, partitions, restarts, bad slots.

The strongest check replays the slot's changes (everything committed after the consistent point
C, peeked without consuming) on top of what the snapshot put into Kafka: the result must equal
the source after a workload ran during the whole snapshot. That holds only if the snapshot is
exactly the source as of C, in every partition of every table.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct
import threading
import time

import fastavro
import psycopg2
import psycopg2.extensions
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from psycopg2 import sql

from lib import config, control, schema_registry, source
from lib import topics as topics_lib
from lib.capture import (
    avro_schemas,
    catalog,
    pgtypes,
    snapshot,
    snapshot_copy,
    snapshot_read,
    snapshot_slot,
    snapshot_write,
)
from lib.capture.pgoutput import UNCHANGED_TOAST, Decoder, str_to_lsn
from lib.local import sample_db, workload
from lib.operate import teardown

pytestmark = pytest.mark.stack

PARTITION_ROWS = 300  # bank.transactions (~900 rows at customers=50) is read in several partitions
SMALL_TABLES = "[bank.branches, bank.accounts]"


# ---------------------------------------------------------------------------------------------
# setup and helpers


@pytest.fixture(scope="module")
def snap_conf(live_stack, scratch_database, run_id):
    """conf for this run (slot, publication, topic prefix, scratch database) with the sample bank loaded."""
    conf = config.apply_overrides(live_stack, {
        "CDC__SOURCE__SLOT": f"snap_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"snap_{run_id}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-snap",
        "CDC__SOURCE__DATABASE": scratch_database,
        "CDC__SNAPSHOT__PARTITION_ROWS": str(PARTITION_ROWS),
        "CDC__SNAPSHOT__PROGRESS_S": "1",
    })
    publication = config.get(conf, "source.publication")
    admin = source.connect(conf, admin=True, dbname=scratch_database)
    sample_db.create_schema(admin)
    sample_db.load(admin, customers=50)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                    .format(sql.Identifier(config.get(conf, "source.user"))))
        cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(publication), sql.SQL(", ").join(sql.SQL(n) for n in config.get(conf, "source.tables"))))
    admin.commit()
    yield conf
    drop_slots(conf, f"snap_{run_id}")
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))
        cur.execute("DROP SCHEMA IF EXISTS snaptypes CASCADE")
    admin.commit()
    admin.close()
    prefix = f"cdc-test-{run_id}-snap"
    teardown.delete_prefix(conf, prefix)


def drop_slots(conf: dict, prefix: str) -> None:
    """Drop every slot whose name starts with prefix (waiting a little for closed streams to let go)."""
    pipeline = source.connect(conf)
    pipeline.autocommit = True
    for _ in range(20):
        with pipeline.cursor() as cur:
            cur.execute("SELECT slot_name FROM pg_replication_slots WHERE starts_with(slot_name, %s)", (prefix,))
            left = [r[0] for r in cur.fetchall()]
            for slot in left:
                with contextlib.suppress(psycopg2.Error):
                    cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        if not left:
            break
        time.sleep(0.5)
    pipeline.close()


def variant(conf: dict, suffix: str, tables: str | None = None) -> dict:
    """conf with its own slot and topic prefix (same database and publication)."""
    overrides = {"CDC__SOURCE__SLOT": f"{config.get(conf, 'source.slot')}_{suffix}",
                 "CDC__KAFKA__TOPIC_PREFIX": f"{config.get(conf, 'kafka.topic_prefix')}{suffix}"}
    if tables:
        overrides["CDC__SOURCE__TABLES"] = tables
    return config.apply_overrides(conf, overrides)


def prepare_topics(conf: dict) -> dict[str, catalog.Table]:
    """Notebook 01's Kafka part: the tables' compacted topics and the control topic."""
    conn = source.connect(conf)
    tables = catalog.describe_tables(conn, list(config.get(conf, "source.tables")))
    conn.close()
    prefix = config.get(conf, "kafka.topic_prefix")
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    topics_lib.ensure_topics(admin, [avro_schemas.topic_name(prefix, t) for t in tables.values()],
                             partitions=int(config.get(conf, "kafka.partitions")))
    control.ensure(conf)
    return tables


def read_topic(conf: dict, topic: str) -> list[tuple[int, bytes, bytes]]:
    """Every message of the topic: (partition, key, value)."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"snapshot-test-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        messages, remaining = [], sum(ends.values())
        deadline = time.monotonic() + 60
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                assert message.error() is None, message.error()
                if message.offset() < ends[message.partition()]:
                    messages.append((message.partition(), message.key(), message.value()))
                    remaining -= 1
        assert remaining == 0, f"{topic}: {remaining} messages not read"
        return messages
    finally:
        consumer.close()


def strip_logical(schema):
    """The schema with every logical type but decimal removed: fastavro then returns pgtypes' raw values."""
    if isinstance(schema, dict):
        return {k: strip_logical(v) for k, v in schema.items() if not (k == "logicalType" and v != "decimal")}
    if isinstance(schema, list):
        return [strip_logical(v) for v in schema]
    return schema


class Decoding:
    """Decodes Confluent-framed messages with their writer schema (from the registry, by id)."""

    def __init__(self, conf: dict):
        self.registry = schema_registry.client(conf)
        self.parsed: dict[int, dict] = {}

    def __call__(self, data: bytes) -> tuple[int, dict]:
        assert data[0] == 0, "magic byte"
        schema_id = struct.unpack(">I", data[1:5])[0]
        if schema_id not in self.parsed:
            text = self.registry.get_schema(schema_id).schema_str
            self.parsed[schema_id] = fastavro.parse_schema(strip_logical(json.loads(text)))
        return schema_id, fastavro.schemaless_reader(io.BytesIO(data[5:]), self.parsed[schema_id])


def raw_text_connection(conf: dict):
    """The pipeline role with pgoutput's session settings; every value comes back as its text form."""
    conn = source.connect(conf, options=pgtypes.session_options())
    with conn.cursor() as cur:
        cur.execute("SELECT oid FROM pg_type")
        oids = tuple(r[0] for r in cur.fetchall())
    psycopg2.extensions.register_type(psycopg2.extensions.new_type(oids, "RAWTEXT", lambda v, c: v), conn)
    conn.rollback()
    return conn


def converted(table: catalog.Table, names: list[str], values) -> dict:
    """Text values (by column name) -> {avro field: pgtypes value}."""
    fields = avro_schemas.field_names(table.columns)
    return {fields[n]: (v if v is UNCHANGED_TOAST else pgtypes.converter(table.column(n))(v))
            for n, v in zip(names, values, strict=True)}


def key_of(table: catalog.Table, row: dict) -> tuple:
    fields = avro_schemas.field_names(table.columns)
    return tuple(row[fields[c]] for c in table.primary_key)


def source_rows(conn, table: catalog.Table) -> dict[tuple, dict]:
    """The table now, converted like the stream converts pgoutput text."""
    names = [c.name for c in table.columns if not c.generated]
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(map(sql.Identifier, names)),
                                                        sql.Identifier(table.schema, table.name)))
        rows = [converted(table, names, r) for r in cur.fetchall()]
    conn.rollback()
    return {key_of(table, r): r for r in rows}


def murmur2_partition(key: bytes, partitions: int) -> int:
    """Kafka's Java default partitioner for a keyed record (librdkafka's murmur2_random)."""
    m, h = 0x5BD1E995, 0x9747B28C ^ len(key)
    for i in range(len(key) // 4):
        k = int.from_bytes(key[4 * i:4 * i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail, rest = len(key) & ~3, len(key) % 4
    if rest == 3:
        h ^= key[tail + 2] << 16
    if rest >= 2:
        h ^= key[tail + 1] << 8
    if rest >= 1:
        h ^= key[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def slot_changes(conf: dict, tables: dict[str, catalog.Table]) -> tuple[list, list[int]]:
    """The slot's pending changes (peeked, not consumed): [(qualified, message)], commit LSNs."""
    conn = source.connect(conf, options=pgtypes.session_options())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
                    "'publication_names', %s)",
                    (config.get(conf, "source.slot"), config.get(conf, "source.publication")))
        payloads = [bytes(r[0]) for r in cur.fetchall()]
    conn.close()
    decoder, relations, changes, commits = Decoder(), {}, [], []
    for payload in payloads:
        message = decoder.decode(payload)
        if message.kind == "R":
            relations[message.relation_oid] = (f"{message.namespace}.{message.name}",
                                               [c.name for c in message.columns])
        elif message.kind in "IUD":
            changes.append((relations[message.relation_oid], message))
        elif message.kind == "C":
            commits.append(message.commit_lsn)
    return changes, commits


def replay(state: dict[str, dict], tables: dict[str, catalog.Table], changes: list) -> set:
    """Apply pgoutput changes to {table: {key: row}}; returns the (table, key) pairs inserted."""
    by_name = {t.qualified: t for t in tables.values()}
    inserted = set()
    for (qualified, names), message in changes:
        table, rows = by_name[qualified], state[qualified]
        if message.kind == "D":
            old = converted(table, names, message.old)
            del rows[key_of(table, old)]
            continue
        new = converted(table, names, message.new)
        previous = None
        if message.kind == "U":
            old_key = key_of(table, converted(table, names, message.old)) if message.old else key_of(table, new)
            previous = rows.pop(old_key)
        else:
            inserted.add((qualified, key_of(table, new)))
        rows[key_of(table, new)] = {f: (previous[f] if v is UNCHANGED_TOAST else v) for f, v in new.items()}
    return inserted


# ---------------------------------------------------------------------------------------------
# the snapshot under a concurrent workload


@pytest.fixture(scope="module")
def first_run(snap_conf, spark_session):
    """run() while the workload writes; also reads the source as of C through the exported snapshot itself.

    Three tables per Spark job, so the eight tables take three jobs (the default puts them in one)."""
    tables = prepare_topics(snap_conf)
    writer = source.connect(snap_conf, admin=True)
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(workload.run(writer, rate=60, duration=10, seed=11)))
    thread.start()
    time.sleep(0.5)
    lines: list[str] = []
    as_of_c: dict[str, dict] = {}

    def progress(line):
        lines.append(line)
        created = re.search(r"slot \S+ created at consistent point \S+, snapshot (\S+)$", line)
        if created:  # the snapshot is alive now: read every table the way the stream converts values
            conn = raw_text_connection(snap_conf)
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; "
                            f"SET TRANSACTION SNAPSHOT '{created.group(1)}'")
            as_of_c.update({t.qualified: source_rows(conn, t) for t in tables.values()})
            conn.close()

    per_job, snapshot.TABLES_PER_JOB = snapshot.TABLES_PER_JOB, 3
    try:
        report = snapshot.run(snap_conf, spark_session, log=progress)
    finally:
        snapshot.TABLES_PER_JOB = per_job
        thread.join()
        writer.close()
    return {"report": report, "lines": lines, "tables": tables, "workload": done, "as_of_c": as_of_c}


def test_every_message_is_an_r_event_at_the_consistent_point(snap_conf, first_run):
    report, tables = first_run["report"], first_run["tables"]
    consistent = report["consistent_lsn"]
    assert report["status"] == "complete" and not report["already_complete"]
    record = control.snapshot_state(snap_conf, config.get(snap_conf, "source.slot"))
    assert record["state"] == "complete" and record["consistent_lsn"] == consistent
    conn = source.connect(snap_conf)
    slot = snapshot_slot.slot_info(conn, config.get(snap_conf, "source.slot"))
    conn.close()
    assert slot["plugin"] == "pgoutput" and str_to_lsn(slot["confirmed_flush_lsn"]) == consistent
    decode, registry = Decoding(snap_conf), schema_registry.client(snap_conf)
    prefix = config.get(snap_conf, "kafka.topic_prefix")
    partitions = int(config.get(snap_conf, "kafka.partitions"))
    for name, table in tables.items():
        topic = avro_schemas.topic_name(prefix, table)
        key_id = registry.lookup_schema(f"{topic}-key", _schema(avro_schemas.key_schema(table, prefix))).schema_id
        value_id = registry.lookup_schema(f"{topic}-value",
                                          _schema(avro_schemas.value_schema(table, prefix))).schema_id
        keys, rows = set(), {}
        messages = read_topic(snap_conf, topic)
        assert len(messages) == record["tables"][name] == len(first_run["as_of_c"][table.qualified])
        for partition, key, value in messages:
            kid, k = decode(key)
            vid, v = decode(value)
            assert (kid, vid) == (key_id, value_id)
            assert v["op"] == "r" and v["before"] is None and v["unchanged_cols"] == []
            source_block = v["source"]
            assert source_block["commit_lsn"] == consistent and source_block["event_serial"] == -1
            assert source_block["snapshot"] == "true" and source_block["lsn"] == consistent
            assert (source_block["schema"], source_block["table"]) == (table.schema, table.name)
            assert tuple(k.values()) == key_of(table, v["after"])
            assert partition == murmur2_partition(key, partitions), "same partition as the stream's producer"
            keys.add(tuple(k.values()))
            rows[tuple(k.values())] = v["after"]
        # exactly the source as of C, read through the exported snapshot and converted like the stream does
        assert rows == first_run["as_of_c"][table.qualified], f"{name} differs from the source as of C"
    assert any("rows/s" in line for line in first_run["lines"])


def _schema(schema: dict) -> Schema:
    return Schema(schema_registry.canonical_json(schema), "AVRO")


def test_topics_plus_the_slots_changes_equal_the_source(snap_conf, first_run):
    """Exactly the source as of C: Kafka's snapshot + every change after C (from the slot) = the source now."""
    tables, report = first_run["tables"], first_run["report"]
    assert first_run["workload"]["transactions"] > 100
    decode = Decoding(snap_conf)
    state = {}
    for name, table in tables.items():
        rows = [decode(value)[1]["after"] for _, _, value in read_topic(snap_conf, report["stats"][name]["topic"])]
        state[table.qualified] = {key_of(table, r): r for r in rows}
    snapshot_state = {t: dict(rows) for t, rows in state.items()}
    changes, commits = slot_changes(snap_conf, tables)
    assert commits and min(commits) > report["consistent_lsn"]
    inserted = replay(state, tables, changes)
    conn = raw_text_connection(snap_conf)
    try:
        for table in tables.values():
            now = source_rows(conn, table)
            assert state[table.qualified] == now, f"{table.qualified} differs from the source"
            touched = {key_of(table, converted(table, names, m.new if m.kind != "D" else m.old))
                       for (qualified, names), m in changes if qualified == table.qualified}
            for key, row in snapshot_state[table.qualified].items():
                if key not in touched and key in now:
                    assert row == now[key]
    finally:
        conn.close()
    # rows the workload inserted after the slot was created are not in the snapshot
    assert len(inserted) > 20
    assert not [pair for pair in inserted if pair[1] in snapshot_state[pair[0]]]


def test_confluent_deserializer_reads_snapshot_messages(snap_conf, first_run):
    registry = schema_registry.client(snap_conf)
    deserializer = AvroDeserializer(registry)
    topic = first_run["report"]["stats"]["bank.transactions"]["topic"]
    for _, _, value in read_topic(snap_conf, topic)[:50]:
        event = deserializer(value, SerializationContext(topic, MessageField.VALUE))
        assert event["op"] == "r" and event["after"]["transaction_id"]
        assert event["after"]["amount"].as_tuple().exponent == -2  # decimal(14,2) as Decimal


def test_the_jdbc_reader_splits_big_tables_by_key_and_every_partition_imports_the_snapshot(snap_conf, first_run,
                                                                                         spark_session):
    tables = first_run["tables"]
    exporter = source.connect(snap_conf)
    exporter.autocommit = True
    with exporter.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT pg_export_snapshot(), pg_current_snapshot()::text")
        name, exported = cur.fetchone()
    admin = source.connect(snap_conf, admin=True)
    try:
        for qualified, split in (("bank.transactions", "predicates"), ("bank.statements", "bounds")):
            table = tables[qualified]
            plan = snapshot_read.plan_partitions(exporter, table, partition_rows=20)
            assert split in plan and plan["partitions"] > 1
            with admin.cursor() as cur:  # committed after the snapshot: must not be read
                cur.execute(sql.SQL("CREATE TEMP TABLE extra AS SELECT * FROM {} LIMIT 5").format(
                    sql.Identifier(table.schema, table.name)))
                key = table.primary_key[0]
                new_key = "gen_random_uuid()" if split == "predicates" else f"{key} + 1000000"
                cur.execute(sql.SQL("UPDATE extra SET {} = " + new_key).format(sql.Identifier(key)))
                cur.execute(sql.SQL("INSERT INTO {} SELECT * FROM extra; DROP TABLE extra").format(
                    sql.Identifier(table.schema, table.name)))
            admin.commit()
            rows, _ = snapshot_read.read_table(snap_conf, spark_session, table, name, plan)
            assert rows.count() == plan["rows"]
            assert rows.rdd.getNumPartitions() == plan["partitions"]
            probe = _probe(spark_session, snap_conf, table, name, plan)
            assert probe == {p: exported for p in range(plan["partitions"])}
    finally:
        exporter.close()
        admin.close()


def test_block_ranges_read_every_row_once_inside_the_snapshot(snap_conf, first_run, spark_session):
    table = first_run["tables"]["bank.transactions"]
    admin = source.connect(snap_conf, admin=True)
    try:
        with exported_snapshot(snap_conf) as name:
            conn = snapshot_slot.snapshot_connection(snap_conf, name)
            try:
                rows = snapshot_read.plan_partitions(conn, table, by_blocks=True)["rows"]
                ranges = snapshot_copy.block_ranges(conn, table, 4, min_blocks=1)
            finally:
                conn.close()
            assert len(ranges) == 4 and ranges[-1][2] is None
            with admin.cursor() as cur:  # committed after the snapshot, into new blocks: must not be read
                cur.execute("INSERT INTO bank.transactions SELECT gen_random_uuid(), account_id, card_id, kind, "
                            "status, amount, currency, fx_rate, 'after the snapshot', merchant, tags, counterparty, "
                            "booked_at, local_time, value_date FROM bank.transactions LIMIT 50")
            admin.commit()
            read, fields = snapshot_read.read_table(snap_conf, spark_session, table, name,
                                                    {"rows": rows, "partitions": 4, "ranges": ranges})
            assert read.rdd.getNumPartitions() == 4
            keys = [r[0] for r in read.select(fields[0]["field"]).collect()]
        assert len(keys) == len(set(keys)) == rows
    finally:
        admin.close()


def _probe(spark, conf, table, snapshot_name, plan) -> dict[int, str]:
    """Per Spark partition: the snapshot its JDBC connection saw (pg_current_snapshot)."""
    from pyspark.sql import functions as F

    query, fields = snapshot_read.select_sql(table)
    key_alias = next(f["alias"] for f in fields if f["column"] == table.primary_key[0])
    split = snapshot_read.SPLIT_COLUMN
    probe = f"(SELECT {key_alias}, {split}, pg_current_snapshot()::text AS snap FROM ({query}) q) p" \
        if "predicates" in plan else f"(SELECT {key_alias}, pg_current_snapshot()::text AS snap FROM ({query}) q) p"
    options = snapshot_read.jdbc_options(conf, snapshot_name)
    url = options.pop("url")
    if "predicates" in plan:
        df = spark.read.jdbc(url, probe, predicates=plan["predicates"], properties=options)
    else:
        df = spark.read.jdbc(url, probe, column=key_alias, lowerBound=plan["bounds"][0],
                             upperBound=plan["bounds"][1], numPartitions=plan["partitions"], properties=options)
    seen = df.select(F.spark_partition_id().alias("p"), "snap").distinct().collect()
    return {r["p"]: r["snap"] for r in seen}


# ---------------------------------------------------------------------------------------------
# every type: the snapshot's value equals the stream's


TYPES_SQL = """
CREATE SCHEMA snaptypes;
CREATE TYPE snaptypes.mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN snaptypes.posint AS int CHECK (VALUE > 0);
CREATE TABLE snaptypes.every (
  id int PRIMARY KEY, b bool, s int2, i int4, l int8, o oid, f4 float4, f8 float8,
  n52 numeric(5,2), nneg numeric(3,-2), nbig numeric(50,10), nfree numeric, m money,
  t text, vc varchar(10), ch char(5), nm name, ch1 "char", x xml, ip inet, cd cidr, mac macaddr,
  u uuid, j json, jb jsonb, by bytea, d date, ts timestamp, tstz timestamptz, tm time, ttz timetz, iv interval,
  ta text[], ia int4[], na numeric(6,2)[], tsa timestamp[], ba bytea[], cha char(3)[], ipa inet[], da date[],
  nba numeric(45,5)[], e snaptypes.mood, ea snaptypes.mood[], dom snaptypes.posint, sa int2[], iva interval[],
  nfa numeric[], f4a float4[], bla bool[], la int8[], ua uuid[], jba jsonb[], mna money[], tza timestamptz[],
  tma time[]);
INSERT INTO snaptypes.every VALUES
 (1, true, -32768, 2147483647, -9223372036854775808, 4294967295, 'NaN', 'Infinity',
  -1.28, 12300, 12345678901234567890123456789012345678.0123456789, 'NaN', '-1234.56',
  E'h\u00e9llo\\nworld ''q'' "d" \\\\ ', 'abc', 'ab', 'nm', 'c', '<a>x</a>', '192.168.1.5', '10.0.0.0/8',
  '08:00:2b:01:02:03', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"b": 1,  "a":2}', '{"b": 1,  "a":[2, null]}',
  '\\x00ff10', '0044-03-15 BC', '1582-10-04 23:59:59.999999', '2024-06-30 23:00:00+05:30', '24:00:00',
  '03:04:05.5+02', '1 year 2 mons -3 days 04:05:06.5', '{"a b","c,d",NULL,"e\\"f",""}', '{1,NULL,3}',
  '{1.5,NULL,-0.01}', '{"2020-01-01 00:00:00.000001",NULL,"infinity"}', '{"\\\\x00",NULL,"\\\\xdead"}',
  '{"a",NULL,"bc"}', '{192.168.0.1,10.0.0.0/8}', '{2000-02-29,NULL}',
  '{123456789012345678901234567890123456789.12345,NULL}', 'happy', '{sad,ok}', 5, '{1,-2}',
  '{"1 day","-00:00:01.5"}', '{NaN,1.000,-0}', '{1.1,NULL,-Infinity,NaN}', '{t,NULL,f}',
  '{-9223372036854775808,NULL}', '{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11,NULL}', ARRAY['{"a": [1, 2]}'::jsonb, NULL],
  '{"$1,234.56",NULL,"-$0.01"}', '{"2024-02-29 12:00:00.5+01",NULL,"-infinity"}',
  '{"00:00:00.000001",NULL,"24:00:00"}'),
 (2, false, 0, 0, 0, 0, '-Infinity', -0.0, 0, -100, -0.0000000001, '1.000', '0', '', '', '', '', ' ', NULL,
  '::1', '2001:db8::/32', '00:00:00:00:00:00', '00000000-0000-0000-0000-000000000000', '[]', '{}', '\\x',
  '1970-01-01', 'infinity', '-infinity', '00:00:00', '00:00:00-14:59', '0', '{}', '{}', '{}', '{}', '{}', '{}',
  '{}', '{}', '{}', 'sad', '{}', 1, '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}'),
 (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
 (4, true, 1, 1, 1, 1, 1.1, 0.1, 999.99, -99900, 1, '-Infinity', '92233720368547758.07', 'x', 'y', 'z    ', 'n',
  'q', '<?xml version="1.0"?><a/>', '1.2.3.4/24', '1.2.3.0/24', 'ff:ff:ff:ff:ff:ff',
  'ffffffff-ffff-ffff-ffff-ffffffffffff', '"s"', '"s"', '\\x41', '9999-12-31', '99999-12-31 23:59:59.999999',
  '4713-01-01 00:00:00+00 BC', '23:59:59.999999', '23:59:59.999999+1559', '-1 years -2 mons +3 days -04:05:06',
  '[0:1]={"x","y"}', '{2147483647}', '{-9999.99}', '{"1900-02-28 12:00:00"}', '{"\\\\x"}', '{"  "}',
  '{::ffff:1.2.3.4}', '{"1999-12-31"}', '{-1}', 'ok', '{}', 2, '{32767}', '{"00:00:00"}', '{1e-20}', '{0.1}',
  '{NULL}', '{0}', '{}', '{}', '{0}', '{"1970-01-01 00:00:00+00"}', '{"12:00:00"}');
CREATE TABLE snaptypes.multi (id int PRIMARY KEY, a int[]);
INSERT INTO snaptypes.multi VALUES (1, '{1}'), (2, '{{1,2},{3,4}}');
"""


@pytest.fixture(scope="module")
def every_type(snap_conf):
    admin = source.connect(snap_conf, admin=True)
    with admin.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS snaptypes CASCADE")
        cur.execute(TYPES_SQL)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA snaptypes TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA snaptypes "
                            "TO {0}").format(sql.Identifier(config.get(snap_conf, "source.user"))))
    admin.commit()
    admin.close()
    conn = source.connect(snap_conf)
    tables = catalog.describe_tables(conn, ["snaptypes.every", "snaptypes.multi"])
    conn.close()
    return tables


def _float32(value):
    return struct.unpack("f", struct.pack("f", value))[0] if isinstance(value, float) else value


def _same(expected, got) -> bool:
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) == len(got) and all(_same(a, b) for a, b in zip(expected, got, strict=True))
    if isinstance(expected, float) and expected != expected:
        return isinstance(got, float) and got != got
    if isinstance(expected, float) and isinstance(got, float) and expected == 0:
        return got == 0 and str(expected)[0] == str(got)[0]  # -0.0 stays negative
    return expected == got and type(expected) is type(got)


@contextlib.contextmanager
def exported_snapshot(conf: dict):
    """The name of a snapshot exported by an open REPEATABLE READ transaction, kept while in use."""
    exporter = source.connect(conf)
    exporter.autocommit = True
    try:
        with exporter.cursor() as cur:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT pg_export_snapshot()")
            yield cur.fetchone()[0]
    finally:
        exporter.close()


def _one_read(conf: dict, reader: str, table: catalog.Table) -> dict:
    """A plan reading a small table in one partition with reader 'jdbc' (key ranges) or 'copy' (block ranges)."""
    if reader == "jdbc":
        return {"rows": 4, "partitions": 1}
    conn = source.connect(conf, admin=True)  # sizes need no grant; the read itself runs as the pipeline role
    try:
        return {"rows": 4, "partitions": 1, "ranges": snapshot_copy.block_ranges(conn, table, 1)}
    finally:
        conn.close()


@pytest.mark.parametrize("reader", ["copy", "jdbc"])
def test_every_type_decodes_to_the_streams_value(snap_conf, every_type, spark_session, reader):
    """to_avro's bytes decode to exactly what pgtypes makes of pgoutput's text, for every mapped type."""
    table = every_type["snaptypes.every"]
    prefix = "cdc-test-types"
    key_schema, value_schema = avro_schemas.key_schema(table, prefix), avro_schemas.value_schema(table, prefix)
    with exported_snapshot(snap_conf) as name:
        rows, fields = snapshot_read.read_table(snap_conf, spark_session, table, name,
                                                _one_read(snap_conf, reader, table))
        encoded = snapshot_write.encode(rows, table, snap_conf, key_schema, value_schema, 7, 8, 12345, 1000, fields)
        messages = encoded.collect()
    conn = raw_text_connection(snap_conf)
    expected = source_rows(conn, table)
    conn.close()
    parsed_value = fastavro.parse_schema(strip_logical(value_schema))
    parsed_key = fastavro.parse_schema(strip_logical(key_schema))
    float4 = {c.name for c in table.columns
              if "float4" in (c.type.resolved().name, getattr(c.element_type, "name", ""))}
    identical = 0
    assert len(messages) == 4
    for message in messages:
        key, value = bytes(message.key), bytes(message.value)
        assert key[:5] == b"\x00\x00\x00\x00\x07" and value[:5] == b"\x00\x00\x00\x00\x08"
        k = fastavro.schemaless_reader(io.BytesIO(key[5:]), parsed_key)
        v = fastavro.schemaless_reader(io.BytesIO(value[5:]), parsed_value)
        want = expected[(k["id"],)]
        for field, value_expected in want.items():
            if field in float4:
                value_expected = [_float32(x) for x in value_expected] if isinstance(value_expected, list) \
                    else _float32(value_expected)
            assert _same(value_expected, v["after"][field]), (k["id"], field, value_expected, v["after"][field])
        # the same envelope written by fastavro (what the stream does) has the same bytes, except that Java
        # writes a negative decimal like -1.28 (unscaled -128) in one byte where fastavro uses two
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, parsed_value, {**v, "after": want})
        identical += buffer.getvalue() == value[5:]
    assert identical == 3  # row 1 holds -1.28


@pytest.mark.parametrize("reader", ["copy", "jdbc"])
def test_multi_dimensional_array_fails_naming_the_column(snap_conf, every_type, spark_session, reader):
    with exported_snapshot(snap_conf) as name:
        rows, _ = snapshot_read.read_table(snap_conf, spark_session, every_type["snaptypes.multi"], name,
                                           {**_one_read(snap_conf, reader, every_type["snaptypes.multi"]), "rows": 2})
        with pytest.raises(Exception) as failure:
            rows.collect()
    error = snapshot._read_failed(every_type["snaptypes.multi"], failure.value)
    assert "snaptypes.multi.a holds a multi-dimensional array" in str(error)


# ---------------------------------------------------------------------------------------------
# restarts and bad slots


def test_failed_snapshot_restarts_cleanly_and_a_complete_one_is_not_repeated(snap_conf, spark_session):
    conf = variant(snap_conf, "_d", SMALL_TABLES)
    slot = config.get(conf, "source.slot")
    tables = prepare_topics(conf)
    topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), tables["bank.accounts"])
    # a snapshot killed after it created the slot and said 'running'
    repl, aborted_lsn, _ = snapshot_slot.create_slot_with_snapshot(conf)
    control.put(conf, f"snapshot/{slot}", {"state": "running", "consistent_lsn": aborted_lsn})
    repl.close()
    lines: list[str] = []
    report = snapshot.run(conf, spark_session, log=lines.append)
    assert report["status"] == "complete" and report["consistent_lsn"] > aborted_lsn
    assert any("dropping it and taking a new snapshot" in line for line in lines)
    assert control.snapshot_state(conf, slot)["state"] == "complete"
    messages = len(read_topic(conf, topic))
    assert messages == report["tables"]["bank.accounts"] > 0

    again = snapshot.run(conf, spark_session, log=lines.append)
    assert again["already_complete"] and again["consistent_lsn"] == report["consistent_lsn"]
    assert len(read_topic(conf, topic)) == messages

    # a snapshot that fails in the middle drops its new slot and stays 'running'; the next run completes
    def fail_on_accounts(line):
        if "bank.accounts" in line:
            raise RuntimeError("simulated failure")

    with pytest.raises(RuntimeError, match="simulated failure"):
        snapshot.run(conf, spark_session, log=fail_on_accounts, resnapshot=True)
    state = control.snapshot_state(conf, slot)
    assert state["state"] == "running" and "simulated failure" in state["error"]
    conn = source.connect(conf)
    assert snapshot_slot.slot_info(conn, slot) is None
    conn.close()
    final = snapshot.run(conf, spark_session, log=lines.append)
    assert final["status"] == "complete" and final["consistent_lsn"] > report["consistent_lsn"]
    assert control.snapshot_state(conf, slot)["state"] == "complete"


def test_keys_deleted_since_an_earlier_attempt_are_retracted(snap_conf, spark_session):
    """Rows an earlier (failed) attempt sent whose key is gone by the new snapshot get a 'd' event and a tombstone."""
    conf = variant(snap_conf, "_r", "[bank.branches]")
    slot = config.get(conf, "source.slot")
    tables = prepare_topics(conf)
    table = tables["bank.branches"]
    topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), table)
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute("INSERT INTO bank.branches VALUES ('ZZ-01', 'Gone', 'Nowhere', 'NA', NULL, '2020-01-01')")

    def fail_after_branches(line):
        if "bank.branches: " in line and " rows in " in line and "partition" not in line:
            raise RuntimeError("simulated failure after the rows were written")

    with pytest.raises(RuntimeError, match="simulated failure"):
        snapshot.run(conf, spark_session, log=fail_after_branches)
    earlier = read_topic(conf, topic)
    with admin.cursor() as cur:
        cur.execute("DELETE FROM bank.branches WHERE branch_code = 'ZZ-01'")
    admin.close()
    report = snapshot.run(conf, spark_session, log=lambda line: None)
    assert report["stats"]["bank.branches"]["retracted"] == 1
    assert control.snapshot_state(conf, slot)["state"] == "complete"

    decode, state = Decoding(conf), {}
    messages = read_topic(conf, topic)
    assert len(messages) == 2 * len(earlier) + 1  # the failed attempt's rows, the new ones, 'd' + tombstone
    last = {}
    for _, key, value in messages:
        k = decode(key)[1]["branch_code"]
        if value is None:
            state.pop(k, None)
        else:
            event = decode(value)[1]
            if event["op"] == "d":
                assert event["before"]["branch_code"] == k == "ZZ-01" and event["after"] is None
                assert event["source"]["commit_lsn"] == report["consistent_lsn"]
                state.pop(k, None)
            else:
                state[k] = event["after"]
        last[k] = value
    assert last["ZZ-01"] is None  # the tombstone comes last, so compaction drops the key
    conn = raw_text_connection(conf)
    assert {(k,): v for k, v in state.items()} == source_rows(conn, table)
    conn.close()


def test_slot_with_another_plugin_is_refused_naming_it(snap_conf, spark_session):
    conf = variant(snap_conf, "_td", SMALL_TABLES)
    slot = config.get(conf, "source.slot")
    prepare_topics(conf)
    conn = source.connect(conf)
    conn.autocommit = True
    expected = f"slot {slot} exists with plugin test_decoding on database {config.get(conf, 'source.database')}"
    with conn.cursor() as cur:
        try:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
        except psycopg2.errors.UndefinedFile:
            # test_decoding.so does not load when the installed packages are newer than the running server
            # (a restarted stack fixes it); a physical slot under the name exercises the same refusal
            cur.execute("SELECT pg_create_physical_replication_slot(%s)", (slot,))
            expected = f"slot {slot} exists as a physical slot"
    try:
        with pytest.raises(snapshot_slot.SnapshotError, match=expected):
            snapshot.run(conf, spark_session, log=lambda line: None)
    finally:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.close()


def test_active_slot_of_an_unfinished_snapshot_is_not_dropped(snap_conf, spark_session):
    conf = variant(snap_conf, "_act", SMALL_TABLES)
    slot = config.get(conf, "source.slot")
    prepare_topics(conf)
    repl, _, _ = snapshot_slot.create_slot_with_snapshot(conf)
    repl.close()
    stream = source.connect(conf, replication=True)
    with stream.cursor() as cur:
        cur.start_replication(slot_name=slot, decode=False, options={
            "proto_version": "1", "publication_names": config.get(conf, "source.publication")})
        try:
            with pytest.raises(snapshot_slot.SnapshotError, match=f"replication slot {slot} is in use by process"):
                snapshot.run(conf, spark_session, log=lambda line: None)
        finally:
            stream.close()


def test_the_copy_reader_reads_a_partitioned_tables_leaves_and_names_a_missing_grant(snap_conf, spark_session):
    admin = source.connect(snap_conf, admin=True)
    user = sql.Identifier(config.get(snap_conf, "source.user"))
    with admin.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS snapparts CASCADE; CREATE SCHEMA snapparts; "
                    "CREATE TABLE snapparts.events (id int, region text, v text, PRIMARY KEY (id, region)) "
                    "PARTITION BY LIST (region); "
                    "CREATE TABLE snapparts.events_eu PARTITION OF snapparts.events FOR VALUES IN ('eu'); "
                    "CREATE TABLE snapparts.events_us PARTITION OF snapparts.events FOR VALUES IN ('us') "
                    "PARTITION BY RANGE (id); "
                    "CREATE TABLE snapparts.events_us_low PARTITION OF snapparts.events_us "
                    "FOR VALUES FROM (0) TO (500); "
                    "CREATE TABLE snapparts.events_us_high PARTITION OF snapparts.events_us "
                    "FOR VALUES FROM (500) TO (MAXVALUE); "
                    "INSERT INTO snapparts.events SELECT i, CASE WHEN i % 3 = 0 THEN 'eu' ELSE 'us' END, 'v' || i "
                    "FROM generate_series(1, 1000) i; "
                    "CREATE TABLE snapparts.secret (id int PRIMARY KEY); INSERT INTO snapparts.secret VALUES (1)")
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA snapparts TO {0}; GRANT SELECT ON snapparts.events TO {0}")
                    .format(user))
    admin.commit()
    try:
        tables = catalog.describe_tables(admin, ["snapparts.events", "snapparts.secret"])
        with exported_snapshot(snap_conf) as name:
            planner = snapshot_slot.snapshot_connection(snap_conf, name)
            plan = snapshot_read.plan_partitions(planner, tables["snapparts.events"], by_blocks=True)
            planner.close()
            assert plan["partitioned"] and plan["rows"] == 1000
            # the leaves were granted nothing: the parent's SELECT is enough, as for a query
            rows, _ = snapshot_read.read_table(snap_conf, spark_session, tables["snapparts.events"], name,
                                               {**plan, "ranges": snapshot_copy.block_ranges(admin, tables[
                                                   "snapparts.events"], 3, min_blocks=1)})
            assert sorted((r["id"], r["region"], r["v"]) for r in rows.collect()) == [
                (i, "eu" if i % 3 == 0 else "us", f"v{i}") for i in range(1, 1001)]
            secret, _ = snapshot_read.read_table(snap_conf, spark_session, tables["snapparts.secret"], name,
                                                 _one_read(snap_conf, "copy", tables["snapparts.secret"]))
            with pytest.raises(Exception) as failure:
                secret.collect()
        error = str(snapshot._read_failed(tables["snapparts.secret"], failure.value))
        assert "permission denied for table secret" in error and "GRANT SELECT ON snapparts.secret" in error
    finally:
        with admin.cursor() as cur:
            cur.execute("DROP SCHEMA snapparts CASCADE")
        admin.commit()
        admin.close()


@pytest.mark.parametrize("tables_per_job", [100, 2])
def test_a_failing_table_in_the_one_job_is_named_with_its_own_columns(snap_conf, spark_session, monkeypatch,
                                                                      tables_per_job):
    """All tables are one Spark job (or several, past TABLES_PER_JOB); a value that fails the read names its table
    (found by the failed task's partition), and the remedy lists that table's columns, not another's."""
    monkeypatch.setattr(snapshot, "TABLES_PER_JOB", tables_per_job)
    conf = variant(snap_conf, f"_nan{tables_per_job}", "[bank.branches, snapnan.fine, snapnan.broken]")
    slot = config.get(conf, "source.slot")
    admin = source.connect(conf, admin=True)
    with admin.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS snapnan CASCADE; CREATE SCHEMA snapnan; "
                    "CREATE TABLE snapnan.fine (id int PRIMARY KEY, amount numeric(6,2)); "
                    "CREATE TABLE snapnan.broken (id int PRIMARY KEY, price numeric(6,2)); "
                    "INSERT INTO snapnan.fine SELECT i, i FROM generate_series(1, 3) i; "
                    "INSERT INTO snapnan.broken SELECT i, CASE WHEN i = 40 THEN 'NaN'::numeric ELSE i END "
                    "FROM generate_series(1, 50) i")
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA snapnan TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA snapnan "
                            "TO {0}; ALTER PUBLICATION {1} ADD TABLE snapnan.fine, snapnan.broken").format(
            sql.Identifier(config.get(conf, "source.user")), sql.Identifier(config.get(conf, "source.publication"))))
    admin.commit()
    try:
        prepare_topics(conf)
        with pytest.raises(snapshot_slot.SnapshotError) as failure:
            snapshot.run(conf, spark_session, log=lambda line: None)
        message = str(failure.value)
        assert message.startswith("snapshot of table snapnan.broken failed: Bad value for type BigDecimal : NaN; ")
        assert "a numeric(p,s) column (price) holds NaN" in message
        assert "amount" not in message and "snapnan.fine" not in message
        pipeline = source.connect(conf)
        assert snapshot_slot.slot_info(pipeline, slot) is None  # the failed snapshot dropped its slot again
        pipeline.close()
    finally:
        with admin.cursor() as cur:
            cur.execute("DROP SCHEMA snapnan CASCADE")
        admin.commit()
        admin.close()


def test_progress_lines_count_each_tables_rows_in_its_topic_until_all_arrived(snap_conf, first_run):
    """While the job runs, a line per table from its topic's end offsets; a table all of whose rows arrived gets
    one last line and then no more."""
    stats = first_run["report"]["stats"]["bank.accounts"]
    lines: list[str] = []
    reporter = snapshot._Progress(snap_conf, 0.2, lines.append)
    reporter.track("bank.accounts", stats["topic"], 0, stats["messages"])
    reporter.track("bank.missing_rows", stats["topic"], 0, stats["messages"] + 5)
    reporter.start()
    time.sleep(1.5)
    reporter.stop.set()
    reporter.join()
    done = f"snapshot bank.accounts: {stats['messages']:,}/{stats['messages']:,} rows (100%)"
    assert sum(line.startswith(done) for line in lines) == 1, lines
    behind = [line for line in lines if line.startswith("snapshot bank.missing_rows: ")]
    assert len(behind) >= 3 and all(f"/{stats['messages'] + 5:,} rows" in line for line in behind), lines
