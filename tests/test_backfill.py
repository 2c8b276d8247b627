"""Columns added with a value, or renamed, reach rows that never change again (issue 16, point 11)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from topic_rows import latest_rows

from lib import source
from lib.capture import stream
from lib.lake import merge, reconcile, silver_step

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


def _mixed_writes(conf: dict, table: str, stop: threading.Event, failures: list) -> None:
    """Inserts, updates, key changes and deletes of rows 1..400 and new ones, until stop."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    rng, next_id, i = random.Random(3), 100_000, 0
    try:
        with conn.cursor() as cur:
            while not stop.is_set():
                i += 1
                old = rng.randrange(1, 400)
                kind = i % 4
                if kind == 0:
                    cur.execute(f"INSERT INTO {table} (id, v) VALUES (%s, 'new')", (next_id,))
                elif kind == 1:
                    cur.execute(f"UPDATE {table} SET v = md5(v) WHERE id = %s", (old,))
                elif kind == 2:
                    cur.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (next_id, old))
                else:
                    cur.execute(f"DELETE FROM {table} WHERE id = %s", (old,))
                next_id += 1
                time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - the test fails with it
        failures.append(exc)
    finally:
        conn.close()


def test_a_backfill_while_keys_change_and_rows_go_reaches_a_running_merges_silver(small_source, spark_session,
                                                                                 tmp_path):
    src = small_source("CREATE TABLE {s}.items (id bigint PRIMARY KEY, v text); "
                       "INSERT INTO {s}.items SELECT i, md5(i::text) FROM generate_series(1, 1000) i",
                       CDC__LAKE__ROOT=str(tmp_path / "lake"), CDC__SOURCE__INCREMENTAL_CHUNK_ROWS="100",
                       CDC__SOURCE__INCREMENTAL_CHECK_S="1")
    with src.admin.cursor() as cur:  # the rows existed before the empty snapshot: stream them once
        cur.execute(f"UPDATE {src.schema}.items SET v = v")
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    # the continuous merge's way: bronze, then silver steps that keep what they learnt (the registry's versions)
    steps = silver_step.progress(src.conf)
    merge.run_until_caught_up(src.conf, spark_session, silver=False)
    silver_step.run(src.conf, spark_session, steps)  # silver exists before the column does
    stop, failures = threading.Event(), []
    writer = threading.Thread(target=_mixed_writes, args=(src.conf, f"{src.schema}.items", stop, failures))
    capture = threading.Thread(target=stream.run, args=(src.conf,), kwargs={"until": "forever", "stop_event": stop,
                                                                          "heartbeat_s": 1})
    writer.start()
    capture.start()
    time.sleep(2)
    with src.admin.cursor() as cur:
        cur.execute(f"ALTER TABLE {src.schema}.items ADD COLUMN tier text DEFAULT 'basic'")
    time.sleep(20)
    stop.set()
    writer.join(30)
    capture.join(60)
    assert not failures
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    merge.run_until_caught_up(src.conf, spark_session, silver=False)
    silver_step.run(src.conf, spark_session, steps)
    result = reconcile.reconcile(src.conf, spark_session)[0]
    assert result["equal"], {k: result[k] for k in ("source_rows", "silver_rows", "differences")}
