"""The capture's link to PostgreSQL stalls, and is cut mid-transfer (issue 30, network faults), on the live stack.

The capture reaches PostgreSQL through a link (lib/local/stack/links.py) that a test can stall (no byte moves,
no connection is refused) or cut. A stall longer than the server's wal_sender_timeout (4 s here, through the
replication connection's options) ends the walsender on the server's side, and the capture, which hears
nothing, not even the reply to a status message that asks for one, stops after source.stall_timeout_s (8 s
here) instead of waiting for ever; the keeper's probe then names PostgreSQL. With the link back the capture
resumes from the slot, and the topic ends on every row of the table.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import pytest
import topic_rows
from capture_thread import CaptureThread
from psycopg2 import sql
from waiting import until

from lib import config, source
from lib.capture import stream
from lib.capture.stream_state import StreamError
from lib.local.stack.links import Link
from lib.operate import keeper, metrics, workers

pytestmark = pytest.mark.stack

WAL_SENDER_TIMEOUT = "-c wal_sender_timeout=4s"


@pytest.fixture
def linked(small_source):
    """(source, link): a table whose capture reaches PostgreSQL through a link."""
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text)")
    link = Link((config.get(src.conf, "source.host"), int(config.get(src.conf, "source.port")))).start()
    src.conf = config.apply_overrides(src.conf, {"CDC__SOURCE__PORT": str(link.port),
                                                 "CDC__SOURCE__STALL_TIMEOUT_S": "8"})
    yield src, link
    link.close()


def test_a_stall_past_wal_sender_timeout_stops_the_capture_which_resumes_exact_from_the_slot(linked):
    src, link = linked
    capture = _streaming(src, 200)

    link.stall()
    stalled = time.monotonic()
    _write(src, range(201, 401))  # straight to the server: only the capture's link stalls
    until(lambda: not _walsender_runs(src, link), 30, "the server to end the walsender (wal_sender_timeout)")
    capture.join(60)
    assert not capture.is_alive(), "the capture still waits on a link that sends nothing"
    assert isinstance(capture.failures[0], StreamError), capture.failures
    assert "sent nothing for" in str(capture.failures[0]) and "stalls" in str(capture.failures[0]), capture.failures
    assert time.monotonic() - stalled < 30
    waiting_for = keeper.unreachable(src.conf, "capture")
    assert waiting_for and waiting_for.startswith(f"PostgreSQL at 127.0.0.1:{link.port}"), waiting_for

    link.resume()
    assert keeper.unreachable(src.conf, "capture") is None
    stream.run(src.conf, until="caught_up", pg_options=WAL_SENDER_TIMEOUT)
    assert _source_rows(src) == topic_rows.latest_rows(src, "items")


def test_a_link_cut_mid_transfer_stops_the_capture_without_acknowledging_and_a_restart_ends_exact(linked):
    src, link = linked
    capture = _streaming(src, 100)
    link.stall()  # the next transaction's bytes are held on the way: the cut comes mid-transfer
    _write(src, range(101, 20001))
    time.sleep(1)
    assert link.drop() >= 2
    link.resume()
    capture.join(60)
    assert not capture.is_alive() and isinstance(capture.failures[0], StreamError), capture.failures
    stream.run(src.conf, until="caught_up", pg_options=WAL_SENDER_TIMEOUT)
    assert _source_rows(src) == topic_rows.latest_rows(src, "items")


def test_a_capture_inside_a_stalled_registry_call_says_so_in_its_records_and_goes_on_when_the_link_returns(
        small_source, tmp_path):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text)")
    url = urlparse(config.get(src.conf, "registry.url"))
    link = Link((url.hostname, url.port)).start()
    src.conf = config.apply_overrides(src.conf, {
        "CDC__REGISTRY__URL": url._replace(netloc=f"{url.hostname}:{link.port}").geturl(),
        "CDC__SERVICE__DIR": str(tmp_path), "CDC__SERVICE__METRICS_INTERVAL_S": "1"})
    stop = threading.Event()
    service = threading.Thread(target=workers.run_capture, args=(src.conf, stop), kwargs={"log": lambda line: None},
                               daemon=True)
    service.start()
    try:
        _write(src, range(1, 51))
        until(lambda: len(topic_rows.latest_rows(src, "items")) == 50, 60, "the first 50 rows in the topic")
        link.stall()
        with src.admin.cursor() as cur:  # a new column: the capture registers the table's next schema version
            cur.execute(sql.SQL("ALTER TABLE {0}.items ADD COLUMN note text; INSERT INTO {0}.items VALUES "
                                "(51, 'v51', 'after the DDL')").format(sql.Identifier(src.schema)))
        said = until(lambda: next((r["waiting_for"] for r in metrics.records(src.conf, "capture")[-3:]
                                   if r.get("waiting_for")), None), 30, "a record naming what the capture waits for")
        assert said.startswith(f"the schema registry at http://{url.hostname}:{link.port}/") and ".items-" in said, said
        link.resume()
        until(lambda: len(topic_rows.latest_rows(src, "items")) == 51, 90, "row 51 in the topic")
        assert topic_rows.latest_rows(src, "items")[51]["note"] == "after the DDL"
        assert service.is_alive(), "the capture stopped instead of waiting for the registry"
        assert not metrics.records(src.conf, "capture", last=1)[0].get("waiting_for")
    finally:
        link.resume()
        stop.set()
        service.join(60)
        link.close()


def _streaming(src, rows: int) -> CaptureThread:
    """The capture running, rows 1..rows written and in the topic."""
    capture = CaptureThread(src.conf, pg_options=WAL_SENDER_TIMEOUT)
    _write(src, range(1, rows + 1))
    until(lambda: len(topic_rows.latest_rows(src, "items")) == rows, 60, f"the first {rows} rows in the topic")
    return capture


def _write(src, ids) -> None:
    with src.admin.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {}.items SELECT g, 'v' || g FROM unnest(%s::int[]) g").format(
            sql.Identifier(src.schema)), (list(ids),))


def _source_rows(src) -> dict[int, dict]:
    with src.admin.cursor() as cur:
        cur.execute(sql.SQL("SELECT id, v FROM {}.items").format(sql.Identifier(src.schema)))
        return {row[0]: {"id": row[0], "v": row[1]} for row in cur.fetchall()}


def _walsender_runs(src, link: Link) -> bool:
    slot = config.get(src.conf, "source.slot")
    conn = source.connect(config.apply_overrides(src.conf, {"CDC__SOURCE__PORT": str(link.target[1])}), admin=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            return bool(cur.fetchone()[0])
    finally:
        conn.close()
