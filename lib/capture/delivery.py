"""Kafka delivery and the slot's acknowledgements: a transaction's end position is acknowledged only once Kafka
acknowledged every message of it and of every earlier transaction."""

from __future__ import annotations

import time

import psycopg2
import psycopg2.errors
from confluent_kafka import KafkaError, KafkaException

from lib import config
from lib.capture import events, slot_position
from lib.capture.pgoutput import lsn_to_str
from lib.capture.stream_state import DeliveryError, State, StreamError

KEEPALIVE_S = 5.0  # while blocked (full producer queue, long replay) a status message goes out this often
FLUSH_TIMEOUT_S = 30.0


def begin(st: State, commit_lsn: int, xid: int, commit_ts) -> None:
    if st.tx is not None:
        raise StreamError(f"transaction {xid} began before transaction {st.tx.txid} ended (protocol error); restart "
                          f"the capture (it resumes from {lsn_to_str(st.acks.acked)})")
    commit_ms = int(commit_ts.timestamp() * 1000)
    st.tx = events.Tx(commit_lsn, xid, commit_ms, st.prev_commit, int(time.time() * 1000))
    st.serial = 0
    tracker = [0, None, commit_ms, commit_lsn, None]
    errors = st.acks.delivery_errors

    def delivered(err, msg, _t=tracker):
        _t[0] -= 1
        if err is not None:
            _t[4] = err
            errors.append((msg.topic(), msg.partition(), err))

    st.acks.inflight.append(tracker)
    st.tracker, st.on_delivery = tracker, delivered


def commit(st: State, commit_lsn: int, end_lsn: int) -> None:
    st.tracker[1] = end_lsn
    st.tx = st.tracker = st.on_delivery = None
    st.prev_commit = commit_lsn
    st.transactions += 1


def produce(st: State, plan: events.Plan, pairs: list) -> None:
    """Produce wire-format (key, value) pairs; a full producer queue waits, keeping the slot alive."""
    tracker, delivered, produce = st.tracker, st.on_delivery, st.producer.produce
    topic = plan.topic
    chunk = st.chunks.current
    if chunk is not None and chunk["table"] == plan.qualified:  # streamed changes of the table being snapshotted
        commit_lsn = st.tx.commit_lsn
        chunk["changed"].extend((commit_lsn, k[5:]) for k, _ in pairs)
    for k, v in pairs:
        tracker[0] += 1
        while True:
            try:
                if v.__class__ is list:  # a tombstone, with the position of its delete in the headers
                    produce(topic, None, k, on_delivery=delivered, headers=v)
                else:
                    produce(topic, v, k, on_delivery=delivered)
                break
            except BufferError:  # queue full: let librdkafka deliver
                st.producer.poll(0.05)
                advance(st)
                keepalive(st)
            except KafkaException as exc:
                tracker[0] -= 1
                raise DeliveryError(f"cannot produce to topic {topic} (table {plan.qualified}): "
                                    f"{exc.args[0].str()}{_size_remedy(exc.args[0], topic, len(k) + len(v))}; the "
                                    f"slot stays at {lsn_to_str(st.acks.acked)}") from exc
        if v.__class__ is list:
            st.tombstones += 1
        else:
            st.events += 1
            st.per_table[plan.qualified] += 1


def advance(st: State) -> None:
    """Acknowledge the end of every leading transaction whose messages Kafka all acknowledged."""
    inflight = st.acks.inflight
    moved = False
    while inflight:
        t = inflight[0]
        if t[0] or t[1] is None or t[4] is not None:
            break
        inflight.popleft()
        st.acks.acked = max(st.acks.acked, t[1])
        st.acks.last_commit_ms = t[2]
        moved = True
    if moved:
        slot_position.release(st)
    if st.acks.delivery_errors:
        topic, partition, err = st.acks.delivery_errors[0]
        raise DeliveryError(
            f"Kafka did not accept an event for topic {topic} partition {partition}: {err.str()} ({err.name()})"
            f"{_size_remedy(err, topic)}, "
            f"after the producer's retries (message.timeout.ms); the capture stopped without acknowledging it: "
            f"the slot stays at {lsn_to_str(st.acks.acked)} and a restart resends everything after that. Check the "
            f"brokers at {config.get(st.conf, 'kafka.bootstrap_servers')} and the topic (notebook 01)")


def _size_remedy(err: KafkaError, topic: str, size: int | None = None) -> str:
    """For a message too large for Kafka: which settings bound it and how to raise them."""
    if err.code() != KafkaError.MSG_SIZE_TOO_LARGE:
        return ""
    return (f" (the event{f' is {size:,} bytes' if size else ''}; an event holds a whole row, before and after). "
            f"Raise the limits together: the topic's max.message.bytes (kafka-configs --alter --entity-type topics "
            f"--entity-name {topic} --add-config max.message.bytes=N), the producer's message.max.bytes "
            f"(kafka.producer in conf), and for the merge the consumer's max.partition.fetch.bytes; or keep such "
            f"values out of the published columns. The capture never skips the row")


def ack(st: State, lsn: int) -> None:
    if lsn > st.acks.acked:
        st.acks.acked = lsn
        slot_position.release(st)


def keepalive(st: State, quiet: bool = False) -> None:
    """Send a status message now and then while the loop is blocked (wal_sender_timeout)."""
    now = time.monotonic()
    if now - st.acks.last_feedback < KEEPALIVE_S or st.cursor is None:
        return
    st.acks.last_feedback = now
    try:
        st.cursor.send_status()
    except psycopg2.Error:
        if not quiet:
            raise
