"""The capture (lib/capture/stream.py) on the live stack: Kafka ends equal to the source, through kills and schema
changes.

The module sets up one slot the way notebooks 01/02 would for an empty source (publication,
topics, schemas, slot, `snapshot/<slot>` = complete) and only then loads the sample bank, so every
row reaches Kafka through the stream. Tests run in file order and share that slot.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import fastavro
import psycopg2.extensions
import pytest
import source_audit
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql
from slots import confirmed_lsn

from lib import config, control, schema_registry, source
from lib import topics as topics_lib
from lib.capture import avro_schemas, catalog, events, pgtypes, stream, stream_state
from lib.capture.pgoutput import str_to_lsn
from lib.local import sample_db, workload

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# setup: an empty-start "snapshot" for a fresh slot


@pytest.fixture(scope="module")
def cdc(live_stack, scratch_database, run_id, drop_slot):
    """conf with this run's slot/publication/prefix; schema bank created, slot made, then the sample loaded."""
    overrides = {
        "CDC__SOURCE__DATABASE": scratch_database,
        "CDC__SOURCE__SLOT": f"stream_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"stream_{run_id}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-stream",
    }
    conf = config.apply_overrides(live_stack, overrides)
    conf["env"] = overrides
    slot, publication = config.get(conf, "source.slot"), config.get(conf, "source.publication")
    names = list(config.get(conf, "source.tables"))
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    sample_db.create_schema(admin)
    pipeline = sql.Identifier(config.get(conf, "source.user"))
    with admin.cursor() as cur:
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                    .format(pipeline))
        cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(publication), sql.SQL(", ").join(sql.SQL(n) for n in names)))
    tables = catalog.describe_tables(admin, names)
    prefix = config.get(conf, "kafka.topic_prefix")
    kafka_admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    topics_lib.ensure_topics(kafka_admin, [avro_schemas.topic_name(prefix, t) for t in tables.values()],
                             partitions=config.get(conf, "kafka.partitions"))
    control.ensure(conf)
    registry = schema_registry.client(conf)
    for table in tables.values():
        key_subject, value_subject = schema_registry.subjects(avro_schemas.topic_name(prefix, table))
        schema_registry.register(registry, key_subject, avro_schemas.key_schema(table, prefix))
        schema_registry.register(registry, value_subject, avro_schemas.value_schema(table, prefix))
    consistent = create_slot(conf, slot)
    control.put(conf, f"snapshot/{slot}", {"state": "complete", "consistent_lsn": consistent, "rows": {}})
    sample_db.load(admin, customers=50)
    admin.commit()
    yield conf
    drop_slot(conf, slot)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))
        cur.execute("DROP SCHEMA IF EXISTS bank CASCADE")
        cur.execute("DROP TABLE IF EXISTS public.unpublished")
    admin.close()
    doomed = [t for t in kafka_admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    for future in kafka_admin.delete_topics(doomed).values() if doomed else []:
        with contextlib.suppress(Exception):
            future.result(30)
    for subject in registry.get_subjects():
        if subject.startswith(prefix):
            for permanent in (False, True):
                with contextlib.suppress(Exception):
                    registry.delete_subject(subject, permanent=permanent)


def create_slot(conf: dict, slot: str) -> int:
    """A pgoutput slot created with a plain replication command; its consistent point."""
    conn = source.connect(conf, replication=True)
    try:
        cursor = conn.cursor()
        cursor.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput')
        return str_to_lsn(cursor.fetchone()[1])
    finally:
        conn.close()


def admin_conn(conf):
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    return conn


def execute(conf, *statements):
    conn = admin_conn(conf)
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()



def catch_up(conf, **kwargs) -> dict:
    result = stream.run(conf, until="caught_up", max_seconds=120, heartbeat_s=2, **kwargs)
    assert result["caught_up"], result
    return result


# ---------------------------------------------------------------------------------------------
# reading the topics back


def _plain(schema):
    """The schema without logical types except decimal: ints stay ints, uuids strings (as our converters give)."""
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    if isinstance(schema, dict):
        out = {k: _plain(v) for k, v in schema.items()}
        if out.get("logicalType") not in (None, "decimal"):
            del out["logicalType"]
        return out
    return schema


class Reader:
    """Decodes Confluent-framed Avro with the writer schema each message names."""

    def __init__(self, conf):
        self.registry = schema_registry.client(conf)
        self.parsed = {}

    def decode(self, data: bytes | None):
        if data is None:
            return None, None
        assert data[0] == 0, "not Confluent wire format"
        schema_id = int.from_bytes(data[1:5], "big")
        if schema_id not in self.parsed:
            import json
            schema = json.loads(self.registry.get_schema(schema_id).schema_str)
            self.parsed[schema_id] = fastavro.parse_schema(_plain(schema))
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), self.parsed[schema_id]), schema_id


def read_topic(conf, topic: str, reader: Reader) -> list[dict]:
    """Every message of a topic (all partitions, from the start), decoded, in per-partition offset order."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"test-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends, assignment = {}, []
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
                assignment.append(TopicPartition(topic, p, low))
        messages = []
        if not assignment:
            return messages
        consumer.assign(assignment)
        deadline = time.monotonic() + 60
        while ends and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            assert message.error() is None, message.error()
            key, _ = reader.decode(message.key())
            value, schema_id = reader.decode(message.value())
            messages.append({"partition": message.partition(), "offset": message.offset(), "key": key,
                             "value": value, "schema_id": schema_id})
            if message.offset() >= ends[message.partition()] - 1:
                del ends[message.partition()]
        assert not ends, f"could not read {topic} to its end"
        return messages
    finally:
        consumer.close()


def latest_state(messages: list[dict]) -> dict:
    """key tuple -> row, merging events per key in (commit_lsn, event_serial) order (TOAST rule applied)."""
    per_key = defaultdict(dict)
    for m in messages:
        if m["value"] is not None:
            src = m["value"]["source"]
            per_key[tuple(m["key"].values())][(src["commit_lsn"], src["event_serial"])] = m["value"]
    state = {}
    for key, by_position in per_key.items():
        row = None
        for _, event in sorted(by_position.items()):
            if event["op"] == "d":
                row = None
                continue
            after = dict(event["after"])
            for name in event["unchanged_cols"]:
                assert after[name] is None
                after[name] = row[name] if row is not None else None
            row = after
        if row is not None:
            state[key] = row
    return state


def raw_rows(conf, table: catalog.Table, limit: int | None = None) -> list[tuple]:
    """Rows as the text pgoutput sends (each type's output function, the capture's session settings)."""
    columns = [c for c in table.columns if not c.generated]
    conn = source.connect(conf, options=pgtypes.session_options())
    query = sql.SQL("SELECT {} FROM {}.{}").format(sql.SQL(", ").join(sql.Identifier(c.name) for c in columns),
                                                   sql.Identifier(table.schema), sql.Identifier(table.name))
    try:
        with conn.cursor() as cur:
            cur.execute(query + sql.SQL(" LIMIT 0"))
            oids = tuple({d.type_code for d in cur.description})
            psycopg2.extensions.register_type(psycopg2.extensions.new_type(oids, "RAW", lambda v, c: v), cur)
            cur.execute(query + (sql.SQL(" LIMIT {}").format(sql.Literal(limit)) if limit else sql.SQL("")))
            return [tuple(r) for r in cur.fetchall()]
    finally:
        conn.close()


def source_state(conf, table: catalog.Table) -> dict:
    """key tuple -> row of the source table, through the same converters as the capture."""
    plan = events.plan(table, config.get(conf, "kafka.topic_prefix"), config.get(conf, "source.database"))
    result = {}
    for text in raw_rows(conf, table):
        values, _ = events.row(plan, text)
        result[tuple(events.key(plan, text).values())] = values
    return result


def assert_topics_equal_source(conf) -> dict:
    """Latest state per key in every table topic equals the source table; returns messages per table."""
    prefix = config.get(conf, "kafka.topic_prefix")
    conn = source.connect(conf)
    try:
        tables = catalog.describe_tables(conn, list(config.get(conf, "source.tables")))
    finally:
        conn.close()
    reader, found = Reader(conf), {}
    for name, table in tables.items():
        messages = read_topic(conf, avro_schemas.topic_name(prefix, table), reader)
        expected = source_state(conf, table)
        actual = latest_state(messages)
        missing = set(expected) - set(actual)
        extra = set(actual) - set(expected)
        assert not missing and not extra, f"{name}: missing keys {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        # events written before a column was added lack it: a reader with the new schema sees its default (null)
        # and events written before a column was dropped still carry it: only the source's columns count
        wrong = [k for k in expected if expected[k] != {c: actual[k].get(c) for c in expected[k]}]
        assert not wrong, f"{name}: {len(wrong)} rows differ, e.g. {wrong[0]}: {expected[wrong[0]]} != " \
                          f"{actual[wrong[0]]}"
        found[name] = messages
    return found


def values(messages, table=None):
    return [m["value"] for m in messages if m["value"] is not None]


# ---------------------------------------------------------------------------------------------
# tests


def test_refuses_to_start_without_a_complete_snapshot(cdc, run_id):
    conf = config.apply_overrides(cdc, {"CDC__SOURCE__SLOT": f"nosnap_{run_id}"})
    with pytest.raises(stream.SnapshotIncompleteError, match=rf"nosnap_{run_id}.*notebook 02"):
        stream.run(conf)
    control.put(conf, f"snapshot/nosnap_{run_id}", {"state": "running", "consistent_lsn": 1})
    with pytest.raises(stream.SnapshotIncompleteError, match=r"'running'.*notebook 02"):
        stream.run(conf)


def test_caught_up_after_load_and_workload_equals_source(cdc):
    conn = source.connect(cdc, admin=True)
    try:
        workload.run(conn, rate=math.inf, count=300, seed=11)
        with conn.cursor() as cur:  # COPY writes one multi-insert WAL record: many rows share one LSN
            rows = "".join(f"CPY-{i:04d}\tCopied branch {i}\tChicago\tIL\t\\N\t2020-01-01\n" for i in range(300))
            cur.copy_expert("COPY bank.branches (branch_code, name, city, region, phone, opened_on) FROM STDIN",
                            io.StringIO(rows))
        conn.commit()
    finally:
        conn.close()
    seen = []
    result = catch_up(cdc, metrics_callback=seen.append, metrics_interval_s=0.5)
    assert result["events"] > 1000 and result["lag_bytes"] is not None
    assert result["events_per_table"]["bank.branches"] >= 308
    assert confirmed_lsn(cdc) >= str_to_lsn(result["target_lsn"])
    found = assert_topics_equal_source(cdc)
    copied = [v for v in values(found["bank.branches"]) if v["after"] and v["after"]["branch_code"].startswith("CPY-")]
    by_lsn = defaultdict(list)
    for v in copied:
        by_lsn[v["source"]["lsn"]].append(v["source"]["event_serial"])
    shared = max(by_lsn.values(), key=len)
    assert len(shared) > 1 and len(set(shared)) == len(shared)  # same LSN, distinct positions
    assert len({v["source"]["commit_lsn"] for v in copied}) == 1
    first = copied[0]["source"]
    assert first["snapshot"] == "false" and first["db"] == config.get(cdc, "source.database")
    assert first["sequence"].endswith(f',"{first["lsn"]}"]') and first["txId"] > 0


def test_delete_primary_key_update_and_unchanged_toast(cdc):
    conn = admin_conn(cdc)
    with conn.cursor() as cur:
        cur.execute("SELECT statement_id, body FROM bank.statements WHERE length(body) > 3000 LIMIT 1")
        statement_id, body = cur.fetchone()
        cur.execute("INSERT INTO bank.branches VALUES ('TMP-01', 'Temporary', 'Chicago', 'IL', NULL, '2024-01-01')")
        cur.execute("UPDATE bank.branches SET branch_code = 'TMP-02', name = 'Renamed' WHERE branch_code = 'TMP-01'")
        cur.execute("DELETE FROM bank.branches WHERE branch_code = 'TMP-02'")
        cur.execute("UPDATE bank.statements SET view_count = view_count + 7 WHERE statement_id = %s", (statement_id,))
    conn.close()
    catch_up(cdc)
    found = assert_topics_equal_source(cdc)
    branches = [m for m in found["bank.branches"] if m["key"]["branch_code"] in ("TMP-01", "TMP-02")]
    ops = {code: [(m["value"] or {}).get("op", "tombstone") for m in branches if m["key"]["branch_code"] == code]
           for code in ("TMP-01", "TMP-02")}
    assert ops == {"TMP-01": ["c", "d", "tombstone"], "TMP-02": ["c", "d", "tombstone"]}
    update_d = next(m["value"] for m in branches if m["key"]["branch_code"] == "TMP-01" and m["value"]
                    and m["value"]["op"] == "d")
    update_c = next(m["value"] for m in branches if m["key"]["branch_code"] == "TMP-02" and m["value"]
                    and m["value"]["op"] == "c")
    assert update_d["source"]["commit_lsn"] == update_c["source"]["commit_lsn"]
    assert update_d["before"]["branch_code"] == "TMP-01" and update_d["after"] is None
    assert update_c["after"]["name"] == "Renamed" and update_c["before"] is None
    assert update_c["source"]["event_serial"] == update_d["source"]["event_serial"] + 1
    toast = [m["value"] for m in found["bank.statements"]
             if m["key"]["statement_id"] == statement_id and m["value"] and m["value"]["op"] == "u"][-1]
    assert toast["unchanged_cols"] == ["body"] and toast["after"]["body"] is None
    assert toast["after"]["view_count"] >= 7 and len(body) > 3000


def test_streamed_transaction_with_rolled_back_savepoint(cdc):
    conn = admin_conn(cdc)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("INSERT INTO bank.branches SELECT 'BIG-' || g, repeat('x', 100), 'Chicago', 'IL', NULL, "
                    "'2020-01-01' FROM generate_series(1, 4000) g")
        cur.execute("SAVEPOINT sp")
        cur.execute("INSERT INTO bank.branches SELECT 'GONE-' || g, 'rolled back', 'Chicago', 'IL', NULL, "
                    "'2020-01-01' FROM generate_series(1, 3000) g")
        cur.execute("UPDATE bank.branches SET name = 'rolled back too' WHERE branch_code LIKE 'BIG-1%'")
        cur.execute("ROLLBACK TO SAVEPOINT sp")
        cur.execute("UPDATE bank.branches SET name = 'kept' WHERE branch_code = 'BIG-2'")
        cur.execute("COMMIT")
    conn.close()
    result = catch_up(cdc, pg_options="-c logical_decoding_work_mem=64kB")
    assert result["streamed_transactions"] >= 1 and result["streamed_subtransaction_aborts"] >= 1
    assert result["events_per_table"]["bank.branches"] == 4001
    found = assert_topics_equal_source(cdc)
    codes = {v["after"]["branch_code"] for v in values(found["bank.branches"]) if v["after"]}
    assert not any(code.startswith("GONE-") for code in codes) and "BIG-4000" in codes


def assert_every_change_in_kafka(conf, changes: list[tuple], found: dict) -> None:
    """Each committed change (xid, table, key) has an event of that transaction and key in the table's topic."""
    in_kafka = Counter()
    for table, messages in found.items():
        seen = set()
        for m in messages:
            value = m["value"]
            if value is None or (value["source"]["commit_lsn"], value["source"]["event_serial"]) in seen:
                continue  # tombstones, and the duplicates a restart resends
            seen.add((value["source"]["commit_lsn"], value["source"]["event_serial"]))
            key = tuple(str(v) for v in m["key"].values())
            in_kafka[(value["source"]["txId"], table, key)] += 1
    source_audit.assert_all_seen(changes, in_kafka, "Kafka")


def test_kill_9_at_random_points_loses_nothing(cdc):
    stop = threading.Event()
    errors = []
    source_audit.start(cdc)

    def write():
        conn = source.connect(cdc, admin=True)
        try:
            seed = 100
            while not stop.is_set():
                workload.run(conn, rate=60, count=60, seed=seed)
                seed += 1
                with conn.cursor() as cur:
                    cur.execute("UPDATE bank.branches SET phone = %s WHERE branch_code LIKE 'CPY-0%%'",
                                (f"+1-312-555-{seed % 100:04d}",))
                    if seed % 2:  # a transaction the server streams while it runs (logical_decoding_work_mem)
                        cur.execute("UPDATE bank.transactions SET description = description || '.' "
                                    "WHERE transaction_id::text < '8'")
                conn.commit()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            conn.close()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    env = {**os.environ, **cdc["env"], "PYTHONPATH": str(REPO)}
    rng = random.Random()
    kills = 0
    try:
        for _ in range(6):
            capture = subprocess.Popen([sys.executable, "-m", "lib.capture.stream", "--target", "local", "--until",
                                        "forever", "--interval", "1",
                                        "--pg-options=-c logical_decoding_work_mem=64kB"], cwd=REPO, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started = time.monotonic()
            for line in capture.stderr:  # wait until it streams, then kill it at a random point
                if line.startswith("stream    slot") or time.monotonic() - started > 30:
                    break
            assert capture.poll() is None, f"capture exited early: {capture.stderr.read()}"
            time.sleep(rng.uniform(0.5, 2.5))
            capture.send_signal(signal.SIGKILL)
            capture.wait(10)
            capture.stderr.close()
            kills += 1
    finally:
        stop.set()
        writer.join(60)
    assert not errors, errors
    assert kills >= 5
    graceful = subprocess.Popen([sys.executable, "-m", "lib.capture.stream", "--target", "local", "--until", "forever"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in graceful.stderr:
        if line.startswith("stream    slot"):
            break
    time.sleep(1)
    graceful.send_signal(signal.SIGTERM)
    out, err = graceful.communicate(timeout=60)
    assert graceful.returncode == 0, err
    assert out.splitlines()[-1].startswith("final stream") and "stopped: signal SIGTERM" in out
    catch_up(cdc)
    changes = source_audit.finish(cdc)
    found = assert_topics_equal_source(cdc)
    assert_every_change_in_kafka(cdc, changes, found)
    conn = source.connect(cdc)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
                        (config.get(cdc, "source.slot"),))
            assert cur.fetchone()[0] > 0, "no transaction was streamed while it ran: the test lost its point"
    finally:
        conn.close()


def test_idle_slot_advances_with_writes_to_unpublished_tables_only(cdc):
    execute(cdc, "CREATE TABLE IF NOT EXISTS public.unpublished (id serial PRIMARY KEY, note text)")
    catch_up(cdc)
    before = confirmed_lsn(cdc)
    stop = threading.Event()
    outcome = {}

    def capture():
        try:
            outcome["result"] = stream.run(cdc, until="forever", stop_event=stop, heartbeat_s=0.5)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        moved = False
        while time.monotonic() < deadline and not moved:
            execute(cdc, "INSERT INTO public.unpublished (note) SELECT 'x' FROM generate_series(1, 100)")
            time.sleep(1)
            moved = confirmed_lsn(cdc) > before
    finally:
        stop.set()
        thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert moved, "confirmed_flush_lsn did not move while only unpublished tables were written"
    assert outcome["result"]["events"] == 0 and outcome["result"]["heartbeats"] >= 1
    assert outcome["result"]["stopped"] == "stop_event"


def test_schema_changes_new_version_then_refused_change_stops_without_acknowledging(cdc):
    registry = schema_registry.client(cdc)
    prefix = config.get(cdc, "kafka.topic_prefix")
    branches_subject = f"{avro_schemas.topic_name(prefix, 'bank.branches')}-value"
    versions_before = registry.get_versions(branches_subject)
    execute(cdc, "ALTER TABLE bank.branches ADD COLUMN note text",
            "INSERT INTO bank.branches (branch_code, name, city, region, opened_on, note) "
            "VALUES ('NEW-01', 'New', 'Chicago', 'IL', '2024-02-02', 'has a note')")
    result = catch_up(cdc)
    registered = [s for s in result["schemas"] if s["subject"] == branches_subject and s["status"] == "registered"]
    assert registered and "added note (text)" in registered[0]["change"]
    assert len(registry.get_versions(branches_subject)) == len(versions_before) + 1
    found = assert_topics_equal_source(cdc)
    new = [v for v in values(found["bank.branches"]) if v["after"] and v["after"]["branch_code"] == "NEW-01"]
    assert new[-1]["after"]["note"] == "has a note"

    acknowledged = confirmed_lsn(cdc)
    execute(cdc, "ALTER TABLE bank.statements ALTER COLUMN view_count TYPE text")
    conn = admin_conn(cdc)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("UPDATE bank.statements SET view_count = 'many' WHERE statement_id = "
                    "(SELECT min(statement_id) FROM bank.statements)")
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        before_commit = str_to_lsn(cur.fetchone()[0])  # the commit record starts at or after this
        cur.execute("COMMIT")
    conn.close()
    with pytest.raises(stream_state.SchemaChangeError, match=r"table bank\.statements changed \(view_count integer -> "
                       r"text\).*refused"):
        stream.run(cdc, until="caught_up", max_seconds=60, heartbeat_s=2)
    position = confirmed_lsn(cdc)
    assert acknowledged <= position <= before_commit  # the refused transaction would be resent
    with pytest.raises(stream_state.SchemaChangeError):  # a restart stops before the same transaction: nothing skipped
        stream.run(cdc, until="caught_up", max_seconds=60, heartbeat_s=2)
    # it may confirm what lies between (the DDL's empty transaction, a heartbeat), never the refused commit
    assert position <= confirmed_lsn(cdc) <= before_commit
    statements_subject = f"{avro_schemas.topic_name(prefix, 'bank.statements')}-value"
    registry.set_compatibility(subject_name=statements_subject, level="NONE")  # the documented remedy
    result = catch_up(cdc)
    assert [s["status"] for s in result["schemas"] if s["subject"] == statements_subject] == ["registered"]
    messages = read_topic(cdc, statements_subject[:-len("-value")], Reader(cdc))
    assert any(v["op"] == "u" and v["after"]["view_count"] == "many" for v in values(messages))


def test_drop_column_and_widening_type_register_new_versions_and_go_on(cdc):
    registry = schema_registry.client(cdc)
    subject = f"{avro_schemas.topic_name(config.get(cdc, 'kafka.topic_prefix'), 'bank.branches')}-value"
    execute(cdc, "ALTER TABLE bank.branches ADD COLUMN visits integer",
            "UPDATE bank.branches SET visits = 7 WHERE branch_code = 'NEW-01'")
    catch_up(cdc)
    versions = len(registry.get_versions(subject))
    execute(cdc, "ALTER TABLE bank.branches ALTER COLUMN visits TYPE bigint",
            "UPDATE bank.branches SET visits = 5000000000 WHERE branch_code = 'NEW-01'",
            "ALTER TABLE bank.branches DROP COLUMN note",
            "UPDATE bank.branches SET name = 'Renamed after drop' WHERE branch_code = 'NEW-01'")
    result = catch_up(cdc)
    changes = [s["change"] for s in result["schemas"] if s["subject"] == subject and s["status"] == "registered"]
    assert any("visits integer -> bigint" in c for c in changes), changes
    assert any("dropped note" in c for c in changes), changes
    assert len(registry.get_versions(subject)) == versions + 2
    messages = read_topic(cdc, subject[:-len("-value")], Reader(cdc))
    latest = [v for v in values(messages) if v["after"] and v["after"]["branch_code"] == "NEW-01"]
    assert latest[-1]["after"]["name"] == "Renamed after drop" and latest[-1]["after"]["visits"] == 5000000000
    assert "note" not in latest[-1]["after"] and latest[-2]["after"]["visits"] == 5000000000


# ---------------------------------------------------------------------------------------------
# the encoding fast paths give exactly what the generic paths give


def test_fast_date_and_timestamp_converters_equal_pgtypes():
    texts = ["2024-05-27", "1970-01-01", "0001-01-01", "9999-12-31", "0044-03-15 BC", "infinity", "-infinity",
             "12024-01-01"]
    stamps = ["2024-05-27 08:27:17", "2024-02-29 23:59:59.999999", "2024-02-29 23:59:59.5", "1969-12-31 23:59:59.1",
              "1900-01-01 00:00:00", "0044-03-15 12:00:00 BC", "12024-01-01 00:00:00", "infinity", "-infinity"]
    rng = random.Random(5)
    for _ in range(2000):
        day = f"{rng.randint(1000, 9999):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        texts.append(day)
        fraction = rng.choice(["", f".{rng.randint(0, 999999):06d}", f".{rng.randint(0, 99)}"])
        stamps.append(f"{day} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}{fraction}")
    zoned = [s + "+00" if s[-1].isdigit() else s for s in stamps] + ["2024-01-01 10:00:00+05:30", "2024-01-01 10:00-08"]
    for name, sql_name, samples in (("date", "date", texts), ("timestamp", "timestamp without time zone", stamps),
                                    ("timestamptz", "timestamp with time zone", zoned)):
        column = catalog.Column(table="t.t", name="c", attnum=1, type_name=sql_name, not_null=False,
                                type=catalog.PgType(oid=1, schema="pg_catalog", name=name, kind="base"))
        fast, slow = events.fast_converter(column), pgtypes.converter(column)
        for text in samples:
            try:
                expected = slow(text)
            except pgtypes.ValueConversionError:
                with pytest.raises(pgtypes.ValueConversionError):
                    fast(text)
                continue
            assert fast(text) == expected, (name, text)


def test_wire_bytes_equal_the_generic_and_fastavro_encodings(cdc):
    from lib.capture.pgoutput import UNCHANGED_TOAST, Delete, Insert, Update

    conn = source.connect(cdc)
    try:
        tables = catalog.describe_tables(conn, list(config.get(cdc, "source.tables")))
    finally:
        conn.close()
    checked = 0
    for table in tables.values():
        plan = events.plan(table, "cdc.check", "bank")
        plan.set_ids(11, 12)
        assert plan._fast
        parsed_value = fastavro.parse_schema(plan.value_schema)
        parsed_key = fastavro.parse_schema(plan.key_schema)
        plain_value = fastavro.parse_schema(_plain(plan.value_schema))
        rows = raw_rows(cdc, table, limit=60)
        toastable = [i for i, c in enumerate(plan.columns) if c.toastable and c.name not in table.primary_key]
        for i, tup in enumerate(rows):
            other = rows[(i + 1) % len(rows)]
            key_only = tuple(v if c.name in table.primary_key else None
                             for c, v in zip(plan.columns, other, strict=True))
            toasted = tuple(UNCHANGED_TOAST if j in toastable[:1] else v for j, v in enumerate(tup))
            messages = [Insert(1, tup), Update(1, None, None, toasted), Update(1, "O", other, tup),
                        Update(1, "K", key_only, tup), Delete(1, "K", key_only), Delete(1, "O", tup)]
            tx = events.Tx(10_000 + i, 700 + i, 1_700_000_000_000 + i, None if i % 2 else 9_999, 1_800_000_000_000)
            for message in messages:
                fast, next_fast = events.encoded_events(plan, message, 5_000 + i, tx, i)
                slow, next_slow = events.change_events(plan, message, 5_000 + i, tx, i)
                assert next_fast == next_slow and len(fast) == len(slow)
                previous_serial = None
                for (k_bytes, v_bytes), (k_dict, v_dict) in zip(fast, slow, strict=True):
                    assert k_bytes == plan.encode_key(k_dict)
                    reference = io.BytesIO()
                    fastavro.schemaless_writer(reference, parsed_key, k_dict)
                    assert k_bytes[5:] == reference.getvalue()
                    if v_dict is None:
                        assert events.tombstone_position(v_bytes) == (tx.commit_lsn, previous_serial)
                        continue
                    previous_serial = v_dict["source"]["event_serial"]
                    assert v_bytes == plan.encode_value(v_dict), (table.qualified, message.kind)
                    reference = io.BytesIO()
                    fastavro.schemaless_writer(reference, parsed_value, v_dict)
                    assert v_bytes[5:] == reference.getvalue()
                    assert fastavro.schemaless_reader(io.BytesIO(v_bytes[5:]), plain_value) == v_dict
                    checked += 1
    assert checked > 1000


def test_truncate_is_recorded_in_the_control_topic_not_the_table_topic(cdc):
    topic = avro_schemas.topic_name(config.get(cdc, "kafka.topic_prefix"), "bank.statements")
    before = len(read_topic(cdc, topic, Reader(cdc)))
    execute(cdc, "TRUNCATE bank.statements")
    result = catch_up(cdc)
    assert result["truncates"] == {"bank.statements": 1} and result["events"] == 0
    record = control.read_all(cdc)["truncate/bank.statements"]
    assert record["commit_lsn"] > 0 and record["event_serial"] == 0 and record["ts_ms"] > 1_600_000_000_000
    assert len(read_topic(cdc, topic, Reader(cdc))) == before


def test_failed_delivery_stops_without_acknowledging(cdc):
    """Last: it deletes a topic under the running capture (the slot stays stuck at that change)."""
    conf = config.apply_overrides(cdc, {"CDC__KAFKA__PRODUCER": "{message.timeout.ms: 4000}"})
    topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), "bank.branches")
    catch_up(conf)
    acknowledged = confirmed_lsn(conf)
    outcome = {}

    def capture():
        try:
            stream.run(conf, until="forever", max_seconds=60, heartbeat_s=1)
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome["error"] = exc

    thread = threading.Thread(target=capture)
    thread.start()
    time.sleep(2)
    kafka_admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    kafka_admin.delete_topics([topic])[topic].result(30)
    conn = admin_conn(conf)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("INSERT INTO bank.branches VALUES ('LOST-1', 'Never', 'Chicago', 'IL', NULL, '2024-01-01')")
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        before_commit = str_to_lsn(cur.fetchone()[0])
        cur.execute("COMMIT")
    conn.close()
    thread.join(60)
    error = outcome.get("error")
    assert isinstance(error, stream.DeliveryError), error
    assert topic in str(error) and "slot stays at" in str(error)
    assert acknowledged <= confirmed_lsn(conf) <= before_commit
