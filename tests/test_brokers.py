"""Three Kafka brokers lose the leader of the busiest partition, then a second broker, under a write load (issue 30).

The pipeline's topics live on three KRaft brokers (lib/local/stack/kafka_brokers.py) at replication factor 3
and min.insync.replicas 2. While a writer commits small transactions and the capture streams them, the leader
of the partition with the most events is killed (-9); the capture goes on through the new leader. Then a
second broker is killed: the controller quorum is lost and no partition can take a write, so the capture
waits, and after its delivery timeout (kafka.producer's message.timeout.ms, 20 s here) it stops without
acknowledging anything: the keeper's probe names the partition and the brokers that do not answer. With the
brokers back the capture resumes from the slot; the topics hold each key's events in order (a resent one
repeats what came before, nothing is out of order), and silver equals the source. Before the capture applied
the timeout itself, librdkafka's own timeout let later events of a key in before earlier ones (a gap filled
by the resend): this test found it.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid

import fastavro
import pytest
from capture_thread import CaptureThread
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import ConfigResource
from psycopg2 import sql
from waiting import until

from lib import config, kafka_client, schema_registry, topics
from lib.capture import bootstrap, snapshot, stream
from lib.capture.stream_state import DeliveryError
from lib.lake import merge, reconcile
from lib.local.stack import kafka_brokers, pg_failover
from lib.operate import keeper, teardown

pytestmark = pytest.mark.stack

TABLES = pg_failover.SHOP_TABLES


@pytest.fixture
def on_three(live_stack, tmp_path):
    """conf of a shop database on the stack's PostgreSQL whose topics live on the three brokers."""
    three = kafka_brokers.up(live_stack, log=lambda line: None)
    tag = uuid.uuid4().hex[:8]
    database = f"brokers_{tag}"
    pg_failover.make_shop(live_stack, database)
    conf = config.apply_overrides(three, {
        "CDC__SOURCE__DATABASE": database, "CDC__SOURCE__SLOT": f"br_{tag}", "CDC__SOURCE__PUBLICATION": f"br_{tag}",
        "CDC__SOURCE__TABLES": repr(TABLES), "CDC__SOURCE__KEYS": "{}", "CDC__KAFKA__PARTITIONS": "3",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{tag}-br", "CDC__LAKE__ROOT": str(tmp_path / "lake"),
        "CDC__KAFKA__PRODUCER": '{"message.timeout.ms": 20000}'})
    yield conf
    kafka_brokers.up(live_stack, log=lambda line: None)  # a failed run may have left nodes down
    teardown.run(conf, topics=True, confirm=True, log=lambda line: None)
    root = pg_failover.superuser(live_stack)
    with root.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    root.close()
    kafka_brokers.down(live_stack, log=lambda line: None)  # three JVMs the rest of the run does not need


def test_losing_a_leader_and_then_the_quorum_waits_resumes_from_the_slot_and_ends_exact(on_three, live_stack,
                                                                                         spark_session):
    conf = on_three
    bootstrap.run(conf, log=lambda line: None)
    snapshot.run(conf, spark_session, log=lambda line: None)
    prefix = config.get(conf, "kafka.topic_prefix")
    owned = [t for t in _admin(conf).list_topics(timeout=10).topics if t.startswith(prefix)]
    assert len(owned) == len(TABLES) + 1  # the tables' topics and the control topic
    assert _durability(conf, owned) == {name: (3, "2") for name in owned}

    stop, writes = threading.Event(), []
    writer = threading.Thread(target=pg_failover.write_load, args=(conf, stop, writes), daemon=True)
    writer.start()
    capture = CaptureThread(conf, stop)
    until(lambda: len(writes) >= 300, 60, "300 writes")

    busiest, leader = kafka_brokers.busiest_partition(conf, [t for t in owned if not t.endswith("__cdc_control")])
    kafka_brokers.kill(live_stack, leader)
    kafka_brokers.wait_new_leader(live_stack, busiest, leader, 60)
    streamed = len(writes)
    until(lambda: len(writes) >= streamed + 200, 60, "200 more writes after the leader's loss")
    assert capture.is_alive() and not capture.failures, capture.failures  # a new leader took over: nothing to do

    second = next(n for n in kafka_brokers.NODES if n != leader)
    kafka_brokers.kill(live_stack, second)  # two of three controllers gone: nothing can be written
    probe = keeper.unreachable(conf, "capture")
    assert probe and "do not" in probe and "start the brokers that are down" in probe, probe
    capture.join(90)  # the capture's delivery timeout (20 s) and the capture's stop
    assert not capture.is_alive() and isinstance(capture.failures[0], DeliveryError), capture.failures
    assert "the slot stays at" in str(capture.failures[0])

    kafka_brokers.up(live_stack, log=lambda line: None)
    until(lambda: keeper.unreachable(conf, "capture") is None, 60, "the partitions to take writes again")
    stop.set()
    writer.join(30)
    stream.run(conf, until="caught_up")

    out_of_order = _out_of_order(conf, [t for t in owned if not t.endswith("__cdc_control")])
    assert out_of_order == [], out_of_order[:5]
    merge.run_until_caught_up(conf, spark_session)
    results = reconcile.reconcile(conf, spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(t, True) for t in TABLES], results



def _admin(conf: dict):
    return kafka_client.admin(conf)


def _durability(conf: dict, names: list[str]) -> dict[str, tuple[int, str]]:
    """Topic -> (fewest replicas of a partition, min.insync.replicas)."""
    admin = _admin(conf)
    metadata = admin.list_topics(timeout=10).topics
    described = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names])
    insync = {resource.name: future.result(10)["min.insync.replicas"].value for resource, future in described.items()}
    return {n: (min(len(p.replicas) for p in metadata[n].partitions.values()), insync[n]) for n in names}


def _out_of_order(conf: dict, names: list[str]) -> list[str]:
    """Events of a key that came after a later one of the same key without repeating an earlier one: [] when
    every partition holds each key's changes in order (a resend from the slot repeats, it does not reorder)."""
    registry, parsed, problems = schema_registry.client(conf), {}, []
    ends = topics.end_offsets(_admin(conf), names)
    consumer = Consumer(kafka_client.settings(conf, **{"group.id": f"test-{uuid.uuid4().hex}",
                                                       "enable.auto.commit": False}))
    try:
        wanted = {(t, p): end for t, parts in ends.items() for p, end in parts.items() if end}
        consumer.assign([TopicPartition(t, p, 0) for t, p in wanted])
        seen: dict[tuple, list] = {}
        deadline = time.monotonic() + 120
        while wanted and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.value() is None:
                if message is not None and message.offset() >= wanted.get((message.topic(), message.partition()),
                                                                          0) - 1:
                    wanted.pop((message.topic(), message.partition()), None)
                continue
            assert message.error() is None, message.error()
            framed = message.value()
            schema_id = int.from_bytes(framed[1:5], "big")
            if schema_id not in parsed:
                parsed[schema_id] = fastavro.parse_schema(json.loads(registry.get_schema(schema_id).schema_str))
            record = fastavro.schemaless_reader(io.BytesIO(framed[5:]), parsed[schema_id])
            position = (record["source"]["commit_lsn"], record["source"]["event_serial"])
            earlier = seen.setdefault((message.topic(), message.key()), [])
            if earlier and position < earlier[-1][0] and position not in [e[0] for e in earlier]:
                problems.append(f"{message.topic()}[{message.partition()}]@{message.offset()}: {position} after "
                                f"{earlier[-1][0]} (offset {earlier[-1][1]}) of key {message.key()!r}")
            earlier.append((position, message.offset()))
            if message.offset() >= wanted[(message.topic(), message.partition())] - 1:
                del wanted[(message.topic(), message.partition())]
        assert not wanted, f"could not read {sorted(wanted)} to the end"
    finally:
        consumer.close()
    return problems
