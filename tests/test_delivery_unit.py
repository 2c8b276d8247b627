"""The capture's own delivery timeout and the probe of partitions that cannot take writes (pure logic)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import psycopg2
import pytest

from lib import topics
from lib.capture import delivery, replication
from lib.capture.stream_state import Acks, DeliveryError, State, StreamError


def _state(timeout_s: float) -> SimpleNamespace:
    acks = Acks()
    acks.delivery_timeout_s = timeout_s
    return SimpleNamespace(acks=acks, conf={}, relations=SimpleNamespace(topics={}))


def test_the_timeout_comes_from_message_timeout_ms_and_must_be_positive():
    assert delivery.timeout_s({}) == 300.0
    assert delivery.timeout_s({"message.timeout.ms": 20000}) == 20.0
    assert delivery.timeout_s({"message.timeout.ms": "4000"}) == 4.0
    with pytest.raises(StreamError, match=r"message.timeout.ms must be a positive number .* not 0"):
        delivery.timeout_s({"message.timeout.ms": 0})


def test_the_capture_stops_when_kafka_acknowledges_nothing_of_the_oldest_transaction(monkeypatch):
    monkeypatch.setattr(delivery, "_why_stalled", lambda st: "topic t partition 0 has no leader that answers")
    st = _state(0.2)
    st.acks.acked = 100
    st.acks.inflight.append([3, None, 0, 200, None])  # three events pending, the commit not read yet
    delivery.advance(st)
    time.sleep(0.1)
    st.acks.inflight[0][0] = 2  # one acknowledged: progress, the clock starts again
    delivery.advance(st)
    time.sleep(0.15)
    delivery.advance(st)  # 0.15 s without progress: below the timeout
    time.sleep(0.1)
    with pytest.raises(DeliveryError, match=r"none of the 2 events still pending of the transaction committed at "
                                            r"0/C8 for 0 s .*partition 0 has no leader.*slot stays at 0/64"):
        delivery.advance(st)


def test_a_transaction_with_nothing_pending_is_not_a_stall():
    st = _state(0.05)
    st.acks.inflight.append([0, None, 0, 200, None])  # its events acknowledged, its commit still to come
    delivery.advance(st)
    time.sleep(0.1)
    delivery.advance(st)
    assert st.acks.progress_tx is None


def _metadata(answering_port: int, closed_port: int, isrs: list[int]):
    brokers = {1: SimpleNamespace(id=1, host="127.0.0.1", port=answering_port),
               2: SimpleNamespace(id=2, host="127.0.0.1", port=closed_port)}
    partition = SimpleNamespace(leader=1, isrs=isrs, replicas=[1, 2])
    return SimpleNamespace(brokers=brokers, topics={"p.t": SimpleNamespace(partitions={0: partition}),
                                                    "other.t": SimpleNamespace(partitions={})})


def test_a_partition_whose_in_sync_replicas_do_not_answer_cannot_take_writes(monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
    try:
        open_port, closed_port = listener.getsockname()[1], closed.getsockname()[1]
        monkeypatch.setattr(topics, "_min_insync", lambda admin, names, timeout_s: {"p.t": 2})
        stale = _metadata(open_port, closed_port, [1, 2])
        assert topics.unavailable(None, stale, "p", writes=False) is None  # the leader answers: it can be read
        why = topics.unavailable(None, stale, "p", writes=True)
        assert why == ("topic p.t partition 0 cannot take writes: 1 of its in-sync replicas answer (brokers 2 do "
                       "not), min.insync.replicas is 2: start the brokers that are down")
        monkeypatch.setattr(topics, "_min_insync", lambda admin, names, timeout_s: {"p.t": 1})
        assert topics.unavailable(None, stale, "p", writes=True) is None
        monkeypatch.setattr(topics, "_min_insync", lambda admin, names, timeout_s: {})  # the brokers did not say
        assert topics.unavailable(None, stale, "p", writes=True) == (
            "topic p.t partition 0 may not take writes: its in-sync replicas 2 do not answer, and the brokers that do "
            "did not say its min.insync.replicas: start the brokers that are down")
        leaderless = _metadata(closed_port, open_port, [1, 2])
        assert topics.unavailable(None, leaderless, "p", writes=False) == (
            "topic p.t partition 0 has no leader that answers (leader: broker 1; in-sync replicas that do not "
            "answer: 1): start the brokers that are down")
    finally:
        listener.close()
        closed.close()


def test_topic_settings_the_brokers_do_not_answer_in_time_are_unknown_not_an_error():
    """A cluster that lost its controller quorum may never answer describe_configs: the keeper's probe then goes on
    without min.insync.replicas (found by tests/test_brokers.py, whose probe raised TimeoutError)."""
    import concurrent.futures

    unanswered = concurrent.futures.Future()
    admin = SimpleNamespace(describe_configs=lambda resources, request_timeout: {r: unanswered for r in resources})
    assert topics._min_insync(admin, ["p.t"], 0.2) == {}


def test_the_capture_says_what_it_waits_for_after_ten_seconds(conf):
    st = State(conf, "forever", 10.0, 10.0, None, None, None, print)
    assert st.waiting_for() is None and st.metrics()["waiting_for"] is None
    st.acks.inflight.append([3, None, 0, 200, None])
    st.acks.progress_at = time.monotonic() - 5
    assert st.waiting_for() is None  # 5 s: not yet
    st.acks.progress_at = time.monotonic() - 12
    assert st.waiting_for() == ("Kafka to acknowledge 3 event(s) of the oldest transaction, for 12 s (it stops after "
                                "300 s)")
    st.acks.inflight.clear()
    st.cursor = SimpleNamespace(asked_at=time.monotonic() - 11, silence_s=60.0)
    assert st.metrics()["waiting_for"] == "PostgreSQL to answer, for 11 s (it stops after 60 s: source.stall_timeout_s)"


class _Reader:
    """A compiled reader's stand-in: hands out the batches given, then nothing."""

    def __init__(self, *batches):
        self.batches, self.keepalive_end, self.reply = list(batches), 0, False

    def read(self, limit):
        return (self.batches.pop(0) if self.batches else []), 0


def _stream(reader) -> replication.Stream:
    stream = replication.Stream.__new__(replication.Stream)
    stream.status_interval_s, stream.silence_s, stream.last_status = 5.0, 1.0, time.monotonic()
    stream.wal_end = stream._keepalive_end = stream._failed = stream._next = 0
    stream._batch, stream._reader = [], reader
    stream.last_heard = stream.asked_at = time.monotonic() - 30  # asked 30 s ago, while the loop was busy elsewhere
    return stream


def test_a_reply_waiting_unread_after_a_long_block_is_not_silence():
    stream = _stream(_Reader([(10, b"payload", 20)]))
    assert stream.read() == (10, b"payload") and stream.asked_at is None


def test_a_read_that_finds_nothing_long_after_asking_is_a_stall():
    with pytest.raises(psycopg2.OperationalError, match=r"sent nothing for 30 s, not even the reply .* stalls"):
        _stream(_Reader()).read()


def test_a_full_producer_queue_is_marked_while_the_capture_waits_for_room(monkeypatch, conf):
    from lib import waiting

    said = []

    class _FullThenRoom:  # refuses the first three messages (queue full), then takes them
        def __init__(self):
            self.refusals, self.sent = 3, []

        def produce(self, topic, value, key, on_delivery=None, headers=None):
            if self.refusals:
                self.refusals -= 1
                raise BufferError("Local: Queue full")
            self.sent.append((topic, key, value))

        def poll(self, timeout):
            said.append(waiting.longest(0.0))

    st = State(conf, "forever", 10.0, 10.0, None, None, None, print)
    st.producer, st.tracker, st.on_delivery = _FullThenRoom(), [0, None], None
    monkeypatch.setattr(delivery, "keepalive", lambda st: None)
    plan = SimpleNamespace(topic="t", qualified="s.t")
    delivery.produce(st, plan, [(b"k1", b"v1"), (b"k2", b"v2")])
    assert st.producer.sent == [("t", b"k1", b"v1"), ("t", b"k2", b"v2")] and st.events == 2 and st.tracker[0] == 2
    assert len(said) == 3 and all(s.startswith(f"Kafka at {conf['kafka']['bootstrap_servers']} to take more messages "
                                               f"(the producer's queue is full), for ") for s in said), said
    assert waiting.longest(0.0) is None  # the mark ends with the wait


def test_a_wait_mark_names_the_oldest_wait_of_the_process_and_nested_marks_keep_the_outer():
    import threading

    from lib import waiting

    assert waiting.longest(0.0) is None
    inner_seen, release = [], threading.Event()

    def other_thread():
        with waiting.on("the registry"):
            release.wait(5)

    with waiting.on("Kafka"):
        time.sleep(0.05)
        helper = threading.Thread(target=other_thread)
        helper.start()
        time.sleep(0.05)
        with waiting.on("something inside"):
            inner_seen.append(waiting.longest(0.0))
        assert waiting.longest(60.0) is None  # not waited that long yet
        release.set()
        helper.join()
    assert inner_seen[0].startswith("Kafka, for "), inner_seen
    assert waiting.longest(0.0) is None
