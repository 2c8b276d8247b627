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
import threading
import time
import uuid

import psycopg2
import pytest
from capture_thread import CaptureThread

from lib import config, control, source
from lib.capture import bootstrap, slot_position, snapshot, stream
from lib.capture.pgoutput import str_to_lsn
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

