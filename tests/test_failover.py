"""A primary fails under a write load and its standby is promoted (issue 30, point 1), on real servers.

A PostgreSQL 18 primary and a physical standby (lib/local/stack/pg_failover.py) are set up as
docs/reliability.md "Failover" says: the pipeline's slot is a failover slot (source.failover_slot), the
standby synchronises it, the primary holds back what the standby has not confirmed. The capture streams
while a writer inserts, updates and deletes; the primary crashes (an immediate stop); the standby is
promoted and the capture pointed at it goes on from the synchronised slot: silver equals the new primary,
nothing lost, nothing twice. A second slot of the same database that is not a failover slot is missing
on the promoted standby, and its capture stops with the remedy rather than starting over silently.
The schema registry stays in the stack's own PostgreSQL, which does not fail over.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import psycopg2
import pytest
from capture_thread import CaptureThread

from lib import config, control, source
from lib.capture import bootstrap, slot_position, snapshot, snapshot_slot, stream
from lib.capture.pgoutput import lsn_to_str, str_to_lsn
from lib.capture.stream_state import StreamError
from lib.lake import merge, reconcile
from lib.local.stack import pg_failover
from lib.operate import teardown

pytestmark = pytest.mark.stack

MAJOR = int(os.environ.get("CDC_FAILOVER_MAJOR", "18"))
TABLES = pg_failover.SHOP_TABLES


@pytest.fixture
def pair(live_stack, tmp_path):
    """(conf on the primary, conf on the standby): a database of the pipeline's tables, made on the primary."""
    pg_failover.down(live_stack, MAJOR, log=lambda line: None)  # what a killed run left
    primary, standby = pg_failover.up(live_stack, MAJOR, log=lambda line: None)
    tag = uuid.uuid4().hex[:8]
    database = f"failover_{tag}"
    pg_failover.make_shop(primary, database)
    overrides = {"CDC__SOURCE__DATABASE": database, "CDC__SOURCE__SLOT": f"fo_{tag}",
                 "CDC__SOURCE__PUBLICATION": f"fo_{tag}", "CDC__SOURCE__TABLES": repr(TABLES),
                 "CDC__SOURCE__KEYS": "{}", "CDC__SOURCE__FAILOVER_SLOT": "true",
                 "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{tag}-fo", "CDC__LAKE__ROOT": str(tmp_path / "lake")}
    on_primary = config.apply_overrides(primary, overrides)
    yield on_primary, config.apply_overrides(standby, overrides)
    teardown.delete_prefix(on_primary, config.get(on_primary, "kafka.topic_prefix"))
    pg_failover.down(live_stack, MAJOR, log=lambda line: None)


def test_a_promoted_standby_continues_the_stream_from_its_failover_slot_and_silver_is_exact(pair, spark_session):
    on_primary, on_standby = pair
    slot = config.get(on_primary, "source.slot")
    _, findings = bootstrap.check(on_primary)
    assert [f.check for f in findings if not f.ok] == []
    assert "synchronized_standby_slots is set (source.failover_slot)" in [f.check for f in findings]
    bootstrap.run(on_primary, log=lambda line: None)
    done = snapshot.run(on_primary, spark_session, log=lambda line: None)
    assert done["rows"] == 2000 and pg_failover.slot_row(on_primary, slot)[0] is True  # created as a failover slot

    plain = config.apply_overrides(on_primary, {"CDC__SOURCE__SLOT": f"{slot}_plain"})  # not a failover slot
    with psycopg2.connect(source.dsn(on_primary)) as conn, conn.cursor() as cur:
        cur.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (f"{slot}_plain",))
        control.put(plain, f"snapshot/{slot}_plain", {"state": "complete", "consistent_lsn": str_to_lsn(
            cur.fetchone()[0]), "rows": {}})
    conn.close()
    stream.run(plain, until="caught_up", heartbeat_s=0)

    stop, writes = threading.Event(), []
    writer = threading.Thread(target=pg_failover.write_load, args=(on_primary, stop, writes), daemon=True)
    writer.start()
    capture = CaptureThread(on_primary, stop)
    deadline = time.monotonic() + 60
    while len(writes) < 300:
        assert time.monotonic() < deadline and writer.is_alive(), f"{len(writes)} writes"
        time.sleep(0.2)
    pg_failover.wait_synced(on_standby, slot, done["consistent_point"])
    pg_failover.crash(on_primary)  # the writer and the capture lose their server mid-flight
    writer.join(30)
    capture.join(60)
    stop.set()
    assert not capture.is_alive() and capture.failures, "the capture did not notice its server was gone"
    pg_failover.promote(on_standby)

    with pytest.raises(StreamError, match=rf"slot {slot}_plain \(source.slot\) does not exist on .*lost in a "
                                          r"failover.*Do not create it by hand"):
        stream.run(config.apply_overrides(on_standby, {"CDC__SOURCE__SLOT": f"{slot}_plain"}), until="caught_up")
    after = threading.Event()
    more = threading.Thread(target=pg_failover.write_load, args=(on_standby, after, []), daemon=True)
    more.start()  # the new primary takes writes while the capture resumes on it
    time.sleep(2)
    after.set()
    more.join(30)
    lines = []
    stream.run(on_standby, until="caught_up", log=lines.append)
    recorded = control.read_all(on_standby)[slot_position.key(slot)]
    assert recorded["timeline"] == 2, recorded
    merge.run_until_caught_up(on_standby, spark_session)
    results = reconcile.reconcile(on_standby, spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(t, True) for t in TABLES], results



def test_a_promoted_standby_that_missed_what_the_capture_delivered_is_refused_with_the_remedy(pair):
    """Without synchronized_standby_slots the primary streams the capture WAL its standby has not received: here the
    standby's WAL receiver is stopped (SIGSTOP) while the capture delivers, then killed with the bytes it held, and
    the primary crashes. The promoted standby's timeline forks below what the capture confirmed: it must stop."""
    on_primary, on_standby = pair
    slot = config.get(on_primary, "source.slot")
    bootstrap.run(on_primary, log=lambda line: None)
    repl, consistent, _ = snapshot_slot.create_slot_with_snapshot(on_primary, log=lambda line: None)
    repl.close()  # a failover slot (source.failover_slot); the tables' rows before it are not this test's subject
    control.put(on_primary, f"snapshot/{slot}", {"state": "complete", "consistent_lsn": consistent, "rows": {}})
    stop, writes = threading.Event(), []
    writer = threading.Thread(target=pg_failover.write_load, args=(on_primary, stop, writes), daemon=True)
    writer.start()
    capture = CaptureThread(on_primary, stop)
    _until_recorded_past(on_primary, slot, consistent, capture)
    pg_failover.wait_synced(on_standby, slot, lsn_to_str(consistent))  # the standby's copy follows, for now

    _sql(on_primary, "ALTER SYSTEM SET synchronized_standby_slots = ''", "SELECT pg_reload_conf()")  # left out
    receiver = _sql(on_standby, "SELECT pid FROM pg_stat_wal_receiver")
    os.kill(receiver, signal.SIGSTOP)  # the standby receives nothing more: it lags behind the primary
    try:
        received = str_to_lsn(_sql(on_standby, "SELECT pg_last_wal_receive_lsn()::text"))
        _until_recorded_past(on_primary, slot, received, capture)  # delivered, and recorded, past the standby
    finally:
        os.kill(receiver, signal.SIGKILL)  # what it held unread goes with it
    pg_failover.crash(on_primary)
    writer.join(30)
    capture.join(60)
    stop.set()
    pg_failover.promote(on_standby)

    with pytest.raises(StreamError, match=rf"slot {slot} on .* is on timeline 2 \(a promoted standby\) and its history "
                                          r"forked from timeline 1 at .*, but the capture confirmed .* on timeline 1.*"
                                          r"Set synchronized_standby_slots on the primary"):
        stream.run(on_standby, until="caught_up")


def _until_recorded_past(conf: dict, slot: str, lsn: int, capture: CaptureThread) -> None:
    """Until the capture's position record (what it confirms to the slot next) is past lsn."""
    deadline = time.monotonic() + 60
    while str_to_lsn((control.read_all(conf).get(slot_position.key(slot)) or {}).get("lsn", "0/0")) <= lsn:
        assert time.monotonic() < deadline and capture.is_alive(), (lsn_to_str(lsn), capture.failures)
        time.sleep(0.2)


def _sql(server: dict, *statements: str):
    """Run statements as the server's superuser; the first column of the last one's first row."""
    conn = pg_failover.superuser(server)
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
            return cur.fetchone()[0]
    finally:
        conn.close()
