"""Kafka delivery and the slot's acknowledgements: a transaction's end position is acknowledged only once Kafka
acknowledged every message of it and of every earlier transaction."""

from __future__ import annotations

import time

import psycopg2
import psycopg2.errors
from confluent_kafka import KafkaError, KafkaException, Producer

from lib import config, kafka_client, topics
from lib.capture import events, slot_position
from lib.capture.pgoutput import lsn_to_str
from lib.capture.stream_state import DeliveryError, State, StreamError

PRODUCER_DEFAULTS = {
    "enable.idempotence": True,  # per-partition order and no duplicates from producer retries
    "acks": "all",
    "partitioner": "murmur2_random",  # Java's default: the same key lands where Spark/Kafka Connect put it
    "linger.ms": 20,
    "compression.type": "lz4",
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 65_536,
}
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
        try:
            if v.__class__ is list:  # a tombstone, with the position of its delete in the headers
                produce(topic, None, k, on_delivery=delivered, headers=v)
            else:
                produce(topic, v, k, on_delivery=delivered)
        except BufferError:  # queue full: let librdkafka deliver
            _produce_when_room(st, plan, k, v)
        except KafkaException as exc:
            tracker[0] -= 1
            raise _produce_error(st, plan, k, v, exc) from exc
        if v.__class__ is list:
            st.tombstones += 1
        else:
            st.events += 1
            st.per_table[plan.qualified] += 1


def _produce_when_room(st: State, plan: events.Plan, k: bytes, v) -> None:
    """Produce one message once the producer's queue has room, keeping the slot alive meanwhile; the wait is marked
    (lib/waiting.py) so that the service's metrics name it while it lasts."""
    with kafka_client.waiting_on(st.conf, "take more messages (the producer's queue is full)"):
        while True:
            st.producer.poll(0.05)
            advance(st)
            keepalive(st)
            try:
                if v.__class__ is list:
                    st.producer.produce(plan.topic, None, k, on_delivery=st.on_delivery, headers=v)
                else:
                    st.producer.produce(plan.topic, v, k, on_delivery=st.on_delivery)
                return
            except BufferError:
                continue
            except KafkaException as exc:
                st.tracker[0] -= 1
                raise _produce_error(st, plan, k, v, exc) from exc


def _produce_error(st: State, plan: events.Plan, k: bytes, v, exc: KafkaException) -> DeliveryError:
    size = len(k) + (len(v) if v.__class__ is not list else 0)
    return DeliveryError(f"cannot produce to topic {plan.topic} (table {plan.qualified}): {exc.args[0].str()}"
                         f"{_size_remedy(exc.args[0], plan.topic, size)}; the slot stays at "
                         f"{lsn_to_str(st.acks.acked)}")


def producer(conf: dict, slot: str) -> tuple[Producer, float]:
    """The capture's producer (PRODUCER_DEFAULTS under kafka.producer) and its delivery timeout in seconds."""
    settings = {**PRODUCER_DEFAULTS, **(config.get(conf, "kafka.producer") or {})}
    return (Producer(kafka_client.settings(conf, **{**settings, "message.timeout.ms": 0,
                                                   "client.id": f"cdc-stream-{slot}"})), timeout_s(settings))


def timeout_s(producer_settings: dict) -> float:
    """How long the capture waits for Kafka to acknowledge anything of its oldest transaction: message.timeout.ms of
    kafka.producer (librdkafka's default, 300 s, if unset).

    The capture applies it itself and gives librdkafka no timeout: a message librdkafka times out leaves a gap that
    later messages of the same key fill, out of order, once the brokers take writes again."""
    value = producer_settings.get("message.timeout.ms", 300_000)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or value <= 0:
        raise StreamError(f"kafka.producer message.timeout.ms must be a positive number of milliseconds (how long the "
                          f"capture waits for Kafka before it stops and resumes from the slot), not {value!r}")
    return value / 1000


def advance(st: State) -> None:
    """Acknowledge the end of every leading transaction whose messages Kafka all acknowledged."""
    acks = st.acks
    inflight = acks.inflight
    moved = False
    while inflight:
        t = inflight[0]
        if t[0] or t[1] is None or t[4] is not None:
            break
        inflight.popleft()
        acks.acked = max(acks.acked, t[1])
        acks.last_commit_ms = t[2]
        moved = True
    if moved:
        slot_position.release(st)
    if inflight and inflight[0][0]:  # Kafka owes acknowledgements of the oldest transaction
        oldest = inflight[0]
        if oldest is not acks.progress_tx or oldest[0] != acks.progress_pending:
            acks.progress_tx, acks.progress_pending, acks.progress_at = oldest, oldest[0], time.monotonic()
        elif time.monotonic() - acks.progress_at > acks.delivery_timeout_s:
            _stalled(st)
    else:
        acks.progress_tx = None
    if st.acks.delivery_errors:
        topic, partition, err = st.acks.delivery_errors[0]
        raise DeliveryError(
            f"Kafka did not accept an event for topic {topic} partition {partition}: {err.str()} ({err.name()})"
            f"{_size_remedy(err, topic)}, "
            f"after the producer's retries (message.timeout.ms); the capture stopped without acknowledging it: "
            f"the slot stays at {lsn_to_str(st.acks.acked)} and a restart resends everything after that. Check the "
            f"brokers at {config.get(st.conf, 'kafka.bootstrap_servers')} and the topic (notebook 01)")


def _stalled(st: State) -> None:
    """Stop: Kafka acknowledged nothing of the oldest transaction for delivery_timeout_s."""
    t = st.acks.inflight[0]
    raise DeliveryError(
        f"Kafka acknowledged none of the {t[0]} events still pending of the transaction committed at "
        f"{lsn_to_str(t[3])} for {st.acks.delivery_timeout_s:.0f} s (message.timeout.ms of kafka.producer): "
        f"{_why_stalled(st)}. The capture stopped without acknowledging them: the slot stays at "
        f"{lsn_to_str(st.acks.acked)} and a restart resends everything after that, in order")


def _why_stalled(st: State) -> str:
    """What the cluster's metadata says of the capture's topics: one missing, a partition without a leader or
    with too few in-sync replicas that answer, or the brokers not answering."""
    servers = config.get(st.conf, "kafka.bootstrap_servers")
    try:
        metadata = kafka_client.check(st.conf, 5.0)
        missing = [f"{topic} (table {table})" for table, topic in st.relations.topics.items()
                   if topic not in metadata.topics]
        if missing:
            return f"topic {', '.join(missing)} no longer exists; run notebook 01 (bootstrap) to create it"
        return (topics.unavailable(kafka_client.admin(st.conf), metadata, config.get(st.conf, "kafka.topic_prefix"),
                                   writes=True)
                or f"the brokers at {servers} answer and list leaders and in-sync replicas for every partition, "
                   f"yet acknowledged nothing; see the brokers' logs")
    except Exception as exc:  # noqa: BLE001 - the stop is reported either way; this only explains it
        return f"the brokers at {servers} do not answer ({' '.join(str(exc).split())[:200]})"


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
