"""A table's key changed by DDL (issue 16, point 3), on the live stack.

A compacted topic forgets a key only when a tombstone with the same bytes arrives, and the Confluent
header (the key schema's id) is part of those bytes. So a row's key bytes must never change while the
table keeps its topic: a key column type that encodes the same keeps the first key schema id, and a
changed set of key columns stops the capture with the remedy.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import topic_rows
from slots import confirmed_lsn

from lib import schema_registry
from lib.capture import avro_schemas, incremental, stream, stream_state
from lib.capture.pgoutput import str_to_lsn
from lib.capture.stream_state import StreamError
from lib.lake import lake_paths, merge, reconcile

pytestmark = pytest.mark.stack


def _run(conf: dict) -> None:
    stream.run(conf, until="caught_up", heartbeat_s=0)


def _sql(src, *statements: str) -> int:
    """Run statements in the source (autocommit); the WAL insert position before them."""
    with src.admin.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        before = str_to_lsn(cur.fetchone()[0])
        for statement in statements:
            cur.execute(statement.format(s=src.schema))
    return before



def _messages(src, table: str) -> list[tuple[bytes, dict, int]]:
    """(key bytes, decoded key, key schema id) of every message of the table's topic, in offset order."""
    decode = topic_rows.Decoder(src.conf)
    return [(key, *decode(key)) for key, _, _ in topic_rows.messages(src, table)]


def _events(src, table: str) -> list[tuple]:
    """(key, op or None for a tombstone, commit position, serial) of every message of the table's topic."""
    decode, found = topic_rows.Decoder(src.conf), []
    for key, value, _ in topic_rows.messages(src, table):
        record = decode(value)[0] if value is not None else None
        source = record["source"] if record else {}
        key = next(iter(decode(key)[0].values()))
        found.append((key, record and record["op"], source.get("commit_lsn"), source.get("event_serial")))
    return list(dict.fromkeys(found))  # at-least-once: a replay repeats a message, never changes it


def test_a_narrowed_composite_key_stops_the_capture_before_the_change(small_source):
    src = small_source("CREATE TABLE {s}.pairs (a int, b int, v text, PRIMARY KEY (a, b))")
    _sql(src, "INSERT INTO {s}.pairs VALUES (1, 1, 'x')")
    _run(src.conf)
    changed = _sql(src, "ALTER TABLE {s}.pairs DROP CONSTRAINT pairs_pkey, ADD PRIMARY KEY (a)",
                   "INSERT INTO {s}.pairs VALUES (2, 2, 'y')")
    with pytest.raises(stream_state.SchemaChangeError, match=r"primary key changed from \(a, b\) to \(a\).*new topic"
                       r".*lib\.operate\.tables rekey") as raised:
        _run(src.conf)
    assert f"{src.schema}.pairs" in str(raised.value)
    assert confirmed_lsn(src.conf) <= changed, "the slot moved past a change the capture refused"
    assert len(_messages(src, "pairs")) == 1


def test_a_key_type_change_that_encodes_the_same_keeps_every_rows_key_bytes(small_source):
    src = small_source("CREATE TABLE {s}.ids (id int PRIMARY KEY, v text); "
                       "CREATE TABLE {s}.codes (code varchar(10) PRIMARY KEY, v text)")
    _sql(src, "INSERT INTO {s}.ids VALUES (1, 'a')", "INSERT INTO {s}.codes VALUES ('x', 'a')")
    _run(src.conf)
    _sql(src, "ALTER TABLE {s}.ids ALTER id TYPE bigint", "ALTER TABLE {s}.codes ALTER code TYPE varchar(20)",
         "UPDATE {s}.ids SET v = 'b' WHERE id = 1", "INSERT INTO {s}.ids VALUES (3000000000, 'c')",
         "UPDATE {s}.codes SET v = 'b'", "DELETE FROM {s}.ids WHERE id = 1")
    _run(src.conf)
    ids = _messages(src, "ids")
    first = [m for m in ids if m[1]["id"] == 1]
    events = _events(src, "ids")
    assert [e[1] for e in events if e[0] == 1] == ["c", "u", "d", None], events  # the update after the widening
    assert len({m[0] for m in first}) == 1, "row 1's key bytes changed with the column's type: compaction keeps both"
    wide = [m for m in ids if m[1]["id"] == 3_000_000_000]
    assert wide and all(m[2] == wide[0][2] != first[0][2] for m in wide)
    wide_schema = json.loads(schema_registry.client(src.conf).get_schema(wide[0][2]).schema_str)
    assert wide_schema["fields"][0]["type"] == "long"
    codes = _messages(src, "codes")
    assert [e[1] for e in _events(src, "codes")] == ["c", "u"] and len({m[0] for m in codes}) == 1


def test_a_key_type_change_that_changes_the_bytes_stops_the_capture(small_source):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text)")
    _sql(src, "INSERT INTO {s}.items VALUES (1, 'a')")
    _run(src.conf)
    changed = _sql(src, "ALTER TABLE {s}.items ALTER id TYPE text", "UPDATE {s}.items SET v = 'b'")
    with pytest.raises(stream_state.SchemaChangeError, match=r"key column id changed type.*new topic"):
        _run(src.conf)
    assert confirmed_lsn(src.conf) <= changed


def _current(src, table: str) -> dict[str, dict]:
    """Key (JSON) -> the row a topic ends on per key, by source position (deleted keys left out)."""
    decode, latest = topic_rows.Decoder(src.conf), {}
    for key, value, offset in topic_rows.messages(src, table):
        if value is not None:
            record, _ = decode(value)
            position = (record["source"]["commit_lsn"], record["source"]["event_serial"], offset)
            name = json.dumps(decode(key)[0], sort_keys=True)
            if name not in latest or latest[name][0] < position:
                latest[name] = (position, record)
    return {name: record["after"] for name, (_, record) in latest.items() if record["op"] != "d"}


def test_a_table_rekeyed_as_the_remedy_says_moves_to_its_new_topic_and_is_read_anew(small_source, spark_session,
                                                                                     tmp_path):
    src = small_source("CREATE TABLE {s}.pairs (a int, b int, v text, PRIMARY KEY (a, b))",
                       CDC__LAKE__ROOT=str(tmp_path / "lake"))
    table = f"{src.schema}.pairs"
    _sql(src, "INSERT INTO {s}.pairs VALUES (1, 1, 'x'), (3, 1, 'z'), (4, 1, 'w')")
    _run(src.conf)
    merge.run_until_caught_up(src.conf, spark_session)  # silver built from the old topic, under the old key
    old_topic = avro_schemas.topic_for(src.conf, table)
    # one transaction: a change under the old key, the key's DDL, changes under the new key
    _sql(src, "UPDATE {s}.pairs SET v = 'before the ddl' WHERE a = 1; "
              "ALTER TABLE {s}.pairs DROP CONSTRAINT pairs_pkey, ADD PRIMARY KEY (a); "
              "INSERT INTO {s}.pairs VALUES (2, 2, 'y'); DELETE FROM {s}.pairs WHERE a = 3")
    _sql(src, "DELETE FROM {s}.pairs WHERE a = 4")
    with pytest.raises(stream_state.SchemaChangeError) as raised:
        _run(src.conf)
    new_topic = f"{old_topic}.v2"
    assert f"kafka.topics: {{{table}: {new_topic}}}" in str(raised.value)
    assert f"python -m lib.operate.tables rekey {table}" in str(raised.value)
    with pytest.raises(incremental.IncrementalError, match=r"needs a topic it never wrote before.*kafka\.topics"):
        incremental.rekey_table(src.conf, table, log=lambda *_: None)

    moved = SimpleNamespace(**{**vars(src), "conf": {**src.conf, "kafka": {**src.conf["kafka"],
                                                                          "topics": {table: new_topic}}}})
    incremental.rekey_table(moved.conf, table, log=lambda *_: None)
    with pytest.raises(StreamError, match=rf"re-keyed to topic {re.escape(new_topic)}.*restart the capture"):
        _run(src.conf)  # a capture still on the old conf refuses the re-key's snapshot
    lines = []
    stream.run(moved.conf, until="caught_up", heartbeat_s=0, log=lines.append)
    assert any(line.startswith(f"rekey     {table}: a change under the key it had") for line in lines), "\n".join(lines)

    old = [m for m in _messages(src, "pairs")]  # src.conf still names the old topic
    assert {json.dumps(m[1], sort_keys=True) for m in old} == {'{"a": 1, "b": 1}', '{"a": 3, "b": 1}',
                                                               '{"a": 4, "b": 1}'}
    assert _current(src, "pairs")['{"a": 1, "b": 1}']["v"] == "before the ddl"  # the old key's change, kept there
    new = _messages(moved, "pairs")
    assert {json.dumps(m[1], sort_keys=True) for m in new} == {'{"a": 1}', '{"a": 2}', '{"a": 3}', '{"a": 4}'}
    assert len({m[2] for m in new}) == 1, "one key schema in the new topic"
    rows = _current(moved, "pairs")
    assert sorted((r["a"], r["b"], r["v"]) for r in rows.values()) == [(1, 1, "before the ddl"), (2, 2, "y")]

    merge.run_until_caught_up(moved.conf, spark_session)  # silver emptied (built from the old topic), then rebuilt
    results = reconcile.reconcile(moved.conf, spark_session)
    assert [r["equal"] for r in results] == [True], results
    silver = spark_session.read.format("delta").load(lake_paths.silver_path(moved.conf, lake_paths.table_specs(
        moved.conf)[0]))
    assert sorted((r["a"], r["b"], r["v"]) for r in silver.filter("NOT _deleted").collect()) == \
        [(1, 1, "before the ddl"), (2, 2, "y")]

    # the old key back by DDL after the re-key: a new key again for the new topic, so the capture stops
    _sql(src, "ALTER TABLE {s}.pairs DROP CONSTRAINT pairs_pkey, ADD PRIMARY KEY (a, b)",
         "INSERT INTO {s}.pairs VALUES (5, 5, 'k')")
    with pytest.raises(stream_state.SchemaChangeError, match=re.escape(f"kafka.topics: {{{table}: {old_topic}.v3}}")):
        _run(moved.conf)
    assert len(_messages(src, "pairs")) == len(old), "a change after the re-key went to the retired topic"
