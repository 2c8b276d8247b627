"""The local stack is real: PostgreSQL decodes, Kafka and the registry carry Avro, Spark reads both."""

from __future__ import annotations

import os
import select
import signal
import time
from decimal import Decimal

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from psycopg2 import sql

from lib import config, source
from lib.local import stack
from lib.local.stack import process, registry

ACCOUNT_SCHEMA = """{
  "type": "record", "name": "Account", "namespace": "cdc.test",
  "fields": [
    {"name": "id", "type": "long"},
    {"name": "holder", "type": ["null", "string"], "default": null},
    {"name": "balance", "type": {"type": "bytes", "logicalType": "decimal", "precision": 14, "scale": 2}}
  ]
}"""


@pytest.fixture(scope="module")
def kafka_admin(live_stack):
    return AdminClient({"bootstrap.servers": config.get(live_stack, "kafka.bootstrap_servers")})


@pytest.fixture
def topic(kafka_admin, run_id, request):
    """A fresh topic for one test, deleted afterwards."""
    name = f"cdc-test-{run_id}-{request.node.name[-20:].strip('_')}"
    kafka_admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(30)
    yield name
    kafka_admin.delete_topics([name])[name].result(30)


@pytest.fixture(scope="module")
def registry_client(live_stack):
    return SchemaRegistryClient({"url": config.get(live_stack, "registry.url")})


def produce_avro(conf, registry_client, topic, rows):
    serializer = AvroSerializer(registry_client, ACCOUNT_SCHEMA)
    producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "enable.idempotence": True})
    for row in rows:
        value = serializer(row, SerializationContext(topic, MessageField.VALUE))
        producer.produce(topic, key=str(row["id"]).encode(), value=value)
    assert producer.flush(30) == 0


def consume_all(conf, topic, expected, timeout=30.0):
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"{topic}-reader", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    messages, deadline = [], time.monotonic() + timeout
    while len(messages) < expected and time.monotonic() < deadline:
        message = consumer.poll(1.0)
        if message is not None and message.error() is None:
            messages.append(message)
    consumer.close()
    return messages


def test_row_written_to_postgres_is_seen_through_a_logical_slot(live_stack, scratch_database, run_id,
                                                                drop_slot):
    slot, publication = f"test_slot_{run_id}", f"test_pub_{run_id}"
    admin = source.connect(live_stack, admin=True, dbname=scratch_database)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute("CREATE TABLE canary (id int PRIMARY KEY, note text)")
        cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE canary").format(sql.Identifier(publication)))
    stream = source.connect(live_stack, dbname=scratch_database, replication=True)
    cursor = stream.cursor()
    cursor.create_replication_slot(slot, output_plugin="pgoutput")
    try:
        with admin.cursor() as cur:
            cur.execute("INSERT INTO canary VALUES (42, 'seen-through-the-slot')")
        cursor.start_replication(slot_name=slot, decode=False,
                                 options={"proto_version": "1", "publication_names": publication})
        kinds, deadline = [], time.monotonic() + 30
        while b"I" not in kinds and time.monotonic() < deadline:
            message = cursor.read_message()
            if message is None:
                select.select([cursor], [], [], 1.0)
                continue
            kinds.append(message.payload[:1])
            if message.payload[:1] == b"I":
                inserted = message.payload
        assert kinds[0] == b"B" and b"R" in kinds, kinds  # Begin, then the table's Relation message
        assert b"seen-through-the-slot" in inserted and b"42" in inserted
    finally:
        stream.close()
        drop_slot(config.apply_overrides(live_stack, {"CDC__SOURCE__DATABASE": scratch_database}), slot)
        admin.close()


def test_avro_message_round_trips_through_kafka_and_the_registry(live_stack, registry_client, topic):
    rows = [{"id": 1, "holder": "Ada Lovelace", "balance": Decimal("1234.50")},
            {"id": 2, "holder": None, "balance": Decimal("-0.01")}]
    produce_avro(live_stack, registry_client, topic, rows)

    # asked by name: the registry's subject list is paged, and the suite's other tests register many beside it
    assert registry_client.get_latest_version(f"{topic}-value").subject == f"{topic}-value"
    deserializer = AvroDeserializer(registry_client)
    messages = consume_all(live_stack, topic, len(rows))
    decoded = [deserializer(m.value(), SerializationContext(topic, MessageField.VALUE)) for m in messages]
    assert decoded == rows
    assert messages[0].value()[0] == 0  # Confluent wire format: magic byte, then the schema id
    registry_client.delete_subject(f"{topic}-value", permanent=False)


@pytest.mark.serial  # restarts the stack's registry
def test_registry_keeps_schemas_across_a_restart(live_stack, registry_client, run_id):
    subject = f"cdc-test-{run_id}-restart-value"
    schema_id = registry_client.register_schema(subject, Schema(ACCOUNT_SCHEMA, "AVRO"))
    folder = stack.stack_dir(live_stack)
    registry.stop(folder, log=lambda line: None)
    stack.up(live_stack, log=lambda line: None)
    fresh = SchemaRegistryClient({"url": config.get(live_stack, "registry.url")})
    assert '"Account"' in fresh.get_schema(schema_id).schema_str
    assert fresh.get_latest_version(subject).schema_id == schema_id
    fresh.delete_subject(subject, permanent=False)


@pytest.mark.serial  # kills the stack's registry
def test_up_after_a_kill_9_clears_the_stale_pid_file_and_starts_that_service_alone(live_stack, registry_client,
                                                                                   run_id):
    subject = f"cdc-test-{run_id}-killed-value"
    schema_id = registry_client.register_schema(subject, Schema(ACCOUNT_SCHEMA, "AVRO"))
    folder = stack.stack_dir(live_stack)
    pid = process.read_pid(registry.files(folder)["pid"])
    os.kill(pid, signal.SIGKILL)  # as the OOM killer or a crash would: the pid file stays behind
    deadline = time.monotonic() + 30
    while registry.status(live_stack, folder)["state"] != "stale pid file":
        assert time.monotonic() < deadline, registry.status(live_stack, folder)
        time.sleep(0.2)
    lines: list[str] = []
    stack.up(live_stack, log=lines.append)
    said = "\n".join(lines)
    assert f"registry  cleared a stale pid file {registry.files(folder)['pid']} (pid {pid} no longer runs registry" \
        in said, said
    assert "postgres  already running" in said and "kafka     already running" in said, said  # only the dead one
    assert registry.status(live_stack, folder)["state"] == "running"
    fresh = SchemaRegistryClient({"url": config.get(live_stack, "registry.url")})
    assert fresh.get_latest_version(subject).schema_id == schema_id  # its storage survived the kill
    fresh.delete_subject(subject, permanent=False)


def test_spark_writes_and_reads_a_delta_table_and_merges(spark_session, tmp_path):
    path = str(tmp_path / "accounts")
    spark_session.createDataFrame([(1, "a"), (2, "b")], "id long, name string").write.format("delta").save(path)
    spark_session.createDataFrame([(2, "B"), (3, "c")], "id long, name string").createOrReplaceTempView("changes")
    spark_session.sql(f"MERGE INTO delta.`{path}` t USING changes s ON t.id = s.id "
                      "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *")
    rows = spark_session.read.format("delta").load(path).orderBy("id").collect()
    assert [(r.id, r.name) for r in rows] == [(1, "a"), (2, "B"), (3, "c")]
    history = spark_session.sql(f"DESCRIBE HISTORY delta.`{path}`").select("operation").collect()
    assert [h.operation for h in history] == ["MERGE", "WRITE"]


def test_spark_reads_a_kafka_topic_and_decodes_avro(live_stack, spark_session, registry_client, topic):
    from pyspark.sql.avro.functions import from_avro
    from pyspark.sql.functions import col, expr

    rows = [{"id": i, "holder": f"holder-{i}", "balance": Decimal(f"{i}.25")} for i in range(5)]
    produce_avro(live_stack, registry_client, topic, rows)
    frame = (spark_session.read.format("kafka")
             .option("kafka.bootstrap.servers", config.get(live_stack, "kafka.bootstrap_servers"))
             .option("subscribe", topic).option("startingOffsets", "earliest").load())
    # Confluent framing: 1 magic byte + 4-byte schema id, then the Avro body
    decoded = frame.select(from_avro(expr("substring(value, 6)"), ACCOUNT_SCHEMA).alias("row"))
    got = sorted((r.id, r.holder, r.balance) for r in decoded.select(col("row.*")).collect())
    assert got == [(r["id"], r["holder"], r["balance"]) for r in rows]
    registry_client.delete_subject(f"{topic}-value", permanent=False)
