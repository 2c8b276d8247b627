"""A table's key changed by DDL (issue 16, point 3), on the live stack.

A compacted topic forgets a key only when a tombstone with the same bytes arrives, and the Confluent
header (the key schema's id) is part of those bytes. So a row's key bytes must never change while the
table keeps its topic: a key column type that encodes the same keeps the first key schema id, and a
changed set of key columns stops the capture with the remedy.
"""

from __future__ import annotations

import json

import pytest
import topic_rows
from slots import confirmed_lsn

from lib import schema_registry
from lib.capture import stream, stream_state
from lib.capture.pgoutput import str_to_lsn

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


def test_a_narrowed_composite_key_stops_the_capture_before_the_change(small_source):
    src = small_source("CREATE TABLE {s}.pairs (a int, b int, v text, PRIMARY KEY (a, b))")
    _sql(src, "INSERT INTO {s}.pairs VALUES (1, 1, 'x')")
    _run(src.conf)
    changed = _sql(src, "ALTER TABLE {s}.pairs DROP CONSTRAINT pairs_pkey, ADD PRIMARY KEY (a)",
                   "INSERT INTO {s}.pairs VALUES (2, 2, 'y')")
    with pytest.raises(stream_state.SchemaChangeError, match=r"primary key changed from \(a, b\) to \(a\).*new topic"
                       r".*lib\.operate\.tables remove") as raised:
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
    assert len(first) == 4  # insert, update after the widening, delete and its tombstone
    assert len({m[0] for m in first}) == 1, "row 1's key bytes changed with the column's type: compaction keeps both"
    wide = [m for m in ids if m[1]["id"] == 3_000_000_000]
    assert len(wide) == 1 and wide[0][2] != first[0][2]
    wide_schema = json.loads(schema_registry.client(src.conf).get_schema(wide[0][2]).schema_str)
    assert wide_schema["fields"][0]["type"] == "long"
    codes = _messages(src, "codes")
    assert len(codes) == 2 and codes[0][0] == codes[1][0]


def test_a_key_type_change_that_changes_the_bytes_stops_the_capture(small_source):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text)")
    _sql(src, "INSERT INTO {s}.items VALUES (1, 'a')")
    _run(src.conf)
    changed = _sql(src, "ALTER TABLE {s}.items ALTER id TYPE text", "UPDATE {s}.items SET v = 'b'")
    with pytest.raises(stream_state.SchemaChangeError, match=r"key column id changed type.*new topic"):
        _run(src.conf)
    assert confirmed_lsn(src.conf) <= changed
