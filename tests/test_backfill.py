"""Columns added with a value, or renamed, reach rows that never change again (issue 16, point 11)."""

from __future__ import annotations

import pytest
from topic_rows import latest_rows

from lib.capture import stream

pytestmark = pytest.mark.stack


def test_a_column_added_with_a_default_and_a_rename_reach_rows_that_do_not_change(small_source):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text); "
                       "INSERT INTO {s}.items SELECT i, 'v' || i FROM generate_series(1, 5) i")
    with src.admin.cursor() as cur:  # the rows existed before the empty snapshot: stream them once
        cur.execute(f"UPDATE {src.schema}.items SET v = v")
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    with src.admin.cursor() as cur:
        cur.execute(f"ALTER TABLE {src.schema}.items ADD COLUMN tier text NOT NULL DEFAULT 'basic'")
        cur.execute(f"ALTER TABLE {src.schema}.items RENAME COLUMN v TO label")
        cur.execute(f"UPDATE {src.schema}.items SET tier = 'gold' WHERE id = 1")  # the only row that changes
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    rows = latest_rows(src, "items")
    assert {k: (r.get("label"), r.get("tier")) for k, r in rows.items()} == {
        1: ("v1", "gold"), 2: ("v2", "basic"), 3: ("v3", "basic"), 4: ("v4", "basic"), 5: ("v5", "basic")}


def test_a_nullable_column_without_a_default_needs_no_second_read(small_source):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text); "
                       "INSERT INTO {s}.items SELECT i, 'v' || i FROM generate_series(1, 3) i")
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    with src.admin.cursor() as cur:
        cur.execute(f"ALTER TABLE {src.schema}.items ADD COLUMN note text")
        cur.execute(f"UPDATE {src.schema}.items SET note = 'n' WHERE id = 1")
    lines = []
    stream.run(src.conf, until="caught_up", heartbeat_s=0, log=lines.append)
    assert not [line for line in lines if "reading the table again" in line]
    assert latest_rows(src, "items") == {1: {"id": 1, "v": "v1", "note": "n"}}
