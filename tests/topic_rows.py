"""Test helper: the latest row per key of a table's topic, decoded with each message's writer schema."""

from __future__ import annotations

import io
import json
import time

import fastavro
from confluent_kafka import Consumer, TopicPartition

from lib import avro_schemas, catalog, config, schema_registry


def latest_rows(src, table: str) -> dict[int, dict]:
    """id -> the latest 'after' row of the table's topic (by commit position, then offset)."""
    conf = src.conf
    described = catalog.describe_tables(src.admin, [f"{src.schema}.{table}"])[f"{src.schema}.{table}"]
    topic = avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"), described)
    registry, parsed = schema_registry.client(conf), {}
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"test-{time.monotonic_ns()}", "enable.auto.commit": False})
    latest: dict[int, tuple] = {}
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        ends = {p: high for p, high in ends.items() if high > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        deadline = time.monotonic() + 60
        while ends and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            if message.value() is not None:
                schema_id = int.from_bytes(message.value()[1:5], "big")
                if schema_id not in parsed:
                    parsed[schema_id] = fastavro.parse_schema(json.loads(registry.get_schema(schema_id).schema_str))
                value = fastavro.schemaless_reader(io.BytesIO(message.value()[5:]), parsed[schema_id])
                after, source = value["after"], value["source"]
                position = (source["commit_lsn"], source["event_serial"], message.offset())
                if after is not None and (after["id"] not in latest or latest[after["id"]][0] < position):
                    latest[after["id"]] = (position, after)
            if message.offset() >= ends[message.partition()] - 1:
                del ends[message.partition()]
        return {key: after for key, (_, after) in latest.items()}
    finally:
        consumer.close()
