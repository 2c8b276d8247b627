"""The slot is never confirmed past what the capture acknowledged (issue 16, point 1), on the live stack.

The scenario: transaction T1 stays open with changes below logical_decoding_work_mem; T2a and T2b
commit; only T2a is acknowledged; T3 then pushes the server's decoding memory over the limit, so it
streams T1's old changes (Stream Start/Stop starting below the acknowledged position) and, waiting
for more WAL, sends a keepalive whose WAL end lies past T2b. A client that lets that keepalive move
its flush position confirms T2b although nobody acknowledged it, and T2b is never sent again.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg2 import sql
from slots import confirmed_lsn, wait_released

from lib import config, source
from lib.capture import avro_schemas, catalog, replication, stream
from lib.capture.pgoutput import Decoder, str_to_lsn

pytestmark = pytest.mark.stack

WORK_MEM = "-c logical_decoding_work_mem=64kB"
ROW_BYTES = 1000
ROWS = 40  # about 48 kB per transaction in the server's decoding memory: one alone stays below 64 kB


@pytest.fixture
def hazard(small_source):
    """One table, items(id int primary key, pad text), captured from an empty start."""
    return small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, pad text)")


def _session(conf: dict):
    conn = source.connect(conf, admin=True)
    conn.autocommit = False
    return conn


def _insert(conn, schema: str, first: int, count: int) -> None:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {}.items SELECT i, repeat(md5(i::text), %s) FROM generate_series(%s, %s) i")
                    .format(sql.Identifier(schema)), (ROW_BYTES // 32, first, first + count - 1))


def _commit_lsn(conn) -> int:
    """Commit conn's transaction; a position just below its commit record."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        before = str_to_lsn(cur.fetchone()[0])
    conn.commit()
    return before



def _read_until(read, kinds: str, timeout_s: float = 30.0) -> list:
    """Decoded messages up to and including the first whose kind is in kinds."""
    decoder, seen = Decoder(), []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = read()
        if got is None:
            time.sleep(0.05)
            continue
        message = decoder.decode(got[1]) if not decoder.in_stream or got[1][:1] in b"SEcA" else None
        kind = message.kind if message is not None else chr(got[1][0])
        seen.append((kind, got[0], message))
        if kind in kinds:
            return seen
    raise AssertionError(f"no message of kind {kinds} within {timeout_s} s; saw {[s[0] for s in seen]}")


def _scenario(conf: dict, schema: str, read, acknowledge, status, settle_s: float = 4.0) -> tuple[int, int]:
    """Run the interleaving; returns (position below T2b's commit, confirmed_flush_lsn after the keepalive)."""
    t1, t2, t3 = _session(conf), _session(conf), _session(conf)
    try:
        _insert(t1, schema, 1, ROWS)  # T1 stays open
        _insert(t2, schema, 1000, 1)
        _commit_lsn(t2)
        commit_a = [m for m in _read_until(read, "C") if m[0] == "C"][0][2]
        acknowledge(commit_a.end_lsn)
        status()
        _insert(t2, schema, 1001, 1)
        below_b = _commit_lsn(t2)
        _read_until(read, "C")  # T2b read, not acknowledged
        _insert(t3, schema, 2000, ROWS)  # T3 open: the server streams T1 to make room
        # the walsender reads every database's WAL to get there: beside the other workers' writes that took over 30 s
        # once (2026-12-02, a load average of 9)
        stream_block = _read_until(read, "E", timeout_s=90.0)
        assert stream_block[0][0] == "S", f"expected T1 streamed, saw {[s[0] for s in stream_block]}"
        # the walsender waits for WAL and sends its keepalive. Other tests write in the same scratch database
        # meanwhile, so a stream block of theirs may arrive too: read, never acknowledged, like T2b
        # A loaded machine's walsender may take seconds to send it: keep reading and reporting status until the
        # slot moves past T2b or settle_s passes
        deadline, next_status = time.monotonic() + settle_s, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if read() is None:
                time.sleep(0.1)
            if time.monotonic() >= next_status:
                status()
                next_status = time.monotonic() + 0.5
                if confirmed_lsn(conf) > below_b:
                    break
        status()
        time.sleep(1.0)
        return below_b, confirmed_lsn(conf)
    finally:
        for conn in (t1, t3, t2):
            conn.rollback()
            conn.close()


# serial: alone after make test's parallel part. Its hazard needs the last message psycopg2 read to lie below the
# acknowledged position when the keepalive comes; beside the other workers' load that failed about one run in ten
# (2026-11-29: CI's fresh clone, confirmed at the acknowledged position after 45 s)
@pytest.mark.serial
def test_psycopg2_cursor_alone_confirms_what_it_was_not_told(hazard):
    """Why lib.capture.replication exists: psycopg2's read_message moves its flush to a keepalive's WAL end."""
    schema, hazard = hazard.schema, hazard.conf
    conn = source.connect(hazard, replication=True, options=WORK_MEM)
    cursor = conn.cursor()
    cursor.start_replication(slot_name=config.get(hazard, "source.slot"), decode=False, status_interval=60,
                             options={"proto_version": "2", "streaming": "on",
                                      "publication_names": config.get(hazard, "source.publication")})

    def read():
        message = cursor.read_message()
        return None if message is None else (message.data_start, message.payload)

    try:
        below_b, confirmed = _scenario(hazard, schema, read,
                                       lambda lsn: cursor.send_feedback(flush_lsn=lsn, write_lsn=lsn),
                                       # reply: the server answers with a keepalive at once, whose WAL end
                                       # psycopg2 then confirms (without it the test waited for the walsender's
                                       # own keepalive, which a loaded machine sent after the 45 s twice)
                                       lambda: cursor.send_feedback(force=True, reply=True), settle_s=45.0)
    finally:
        conn.close()
    assert confirmed > below_b, ("psycopg2 no longer confirms past the acknowledged position on a keepalive; "
                                 "lib.capture.replication could go back to its ReplicationCursor")


def test_stream_confirms_only_what_was_acknowledged_and_the_server_resends_the_rest(hazard):
    schema, hazard = hazard.schema, hazard.conf
    conn = source.connect(hazard, replication=True, options=WORK_MEM)
    conn.cursor().start_replication(slot_name=config.get(hazard, "source.slot"), decode=False,
                                    options={"proto_version": "2", "streaming": "on",
                                             "publication_names": config.get(hazard, "source.publication")})
    wire = replication.Stream(conn, status_interval_s=60)
    try:
        below_b, confirmed = _scenario(hazard, schema, wire.read, wire.acknowledge, wire.send_status)
    finally:
        conn.close()
    assert confirmed < below_b, f"slot confirmed {confirmed:X}, past T2b ({below_b:X}), which was never acknowledged"
    # a restart resends T2b (id 1001): nothing was lost
    wait_released(hazard)
    conn = source.connect(hazard, replication=True)
    conn.cursor().start_replication(slot_name=config.get(hazard, "source.slot"), decode=False,
                                    options={"proto_version": "1",
                                             "publication_names": config.get(hazard, "source.publication")})
    again = replication.Stream(conn)
    try:
        inserts = [m[2] for m in _read_until(again.read, "C") if m[0] == "I"]
    finally:
        conn.close()
    assert [m.new[0] for m in inserts] == ["1001"]


def test_capture_never_confirms_a_transaction_kafka_has_not_acknowledged(hazard):
    """The capture with a slow Kafka (3 s linger, three of the capture's 1 s feedbacks): the slot passes T2b only once
    T2b's event is in Kafka."""
    conf = config.apply_overrides(hazard.conf, {"CDC__KAFKA__PRODUCER": "{linger.ms: 3000}"})
    schema, stop, failures = hazard.schema, threading.Event(), []
    table = catalog.describe_tables(hazard.admin, [f"{schema}.items"])[f"{schema}.items"]
    topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), table)

    def capture():
        try:
            stream.run(conf, until="forever", stop_event=stop, heartbeat_s=0, pg_options=WORK_MEM)
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"hz-{uuid.uuid4().hex[:6]}"})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions

    def in_kafka() -> int:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions)

    worker = threading.Thread(target=capture, daemon=True)
    worker.start()
    t1, t2, t3 = _session(conf), _session(conf), _session(conf)
    try:
        _insert(t1, schema, 1, ROWS)
        _insert(t2, schema, 1000, 1)
        below_a = _commit_lsn(t2)
        deadline = time.monotonic() + 60
        while confirmed_lsn(conf) <= below_a:
            assert time.monotonic() < deadline and not failures, failures or "T2a never acknowledged"
            time.sleep(0.2)
        _insert(t2, schema, 1001, 1)
        below_b = _commit_lsn(t2)
        _insert(t3, schema, 2000, ROWS)
        seen_past = False
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not seen_past:
            if confirmed_lsn(conf) > below_b:
                events = in_kafka()
                assert events >= 2, (f"slot confirmed past T2b while Kafka holds {events} event(s): T2b's event was "
                                     f"still in the producer")
                seen_past = True
            time.sleep(0.1)
        assert seen_past, "T2b was never acknowledged, even after Kafka had it"
    finally:
        for conn in (t1, t3, t2):
            conn.rollback()
            conn.close()
        stop.set()
        worker.join(60)
        consumer.close()
    assert not failures, failures
