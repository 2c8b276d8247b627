"""Test helper: a table's topic read from the start, its framed Avro decoded with each message's writer schema."""

from __future__ import annotations

import io
import json
import time

import fastavro
from confluent_kafka import Consumer, TopicPartition

from lib import config, schema_registry
from lib.capture import avro_schemas, catalog


def messages(src, table: str) -> list[tuple[bytes, bytes | None, int]]:
    """(key bytes, value bytes or None, offset) of every message of a small_source table's topic."""
    conf = src.conf
    described = catalog.describe_tables(src.admin, [f"{src.schema}.{table}"])[f"{src.schema}.{table}"]
    topic = avro_schemas.topic_for(conf, described)
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"test-{time.monotonic_ns()}", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        ends = {p: high for p, high in ends.items() if high > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        found, deadline = [], time.monotonic() + 60
        while ends and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            assert message.error() is None, message.error()
            found.append((message.key(), message.value(), message.offset()))
            if message.offset() >= ends[message.partition()] - 1:
                del ends[message.partition()]
        assert not ends, f"could not read {topic} to its end"
        return found
    finally:
        consumer.close()


class Decoder:
    """Confluent-framed Avro -> (record, schema id), each writer schema fetched once."""

    def __init__(self, conf: dict):
        self.registry, self.parsed = schema_registry.client(conf), {}

    def __call__(self, framed: bytes) -> tuple[dict, int]:
        schema_id = int.from_bytes(framed[1:5], "big")
        if schema_id not in self.parsed:
            self.parsed[schema_id] = fastavro.parse_schema(json.loads(self.registry.get_schema(schema_id).schema_str))
        return fastavro.schemaless_reader(io.BytesIO(framed[5:]), self.parsed[schema_id]), schema_id


def latest_rows(src, table: str) -> dict[int, dict]:
    """id -> the latest 'after' row of the table's topic (by commit position, then offset)."""
    decode, latest = Decoder(src.conf), {}
    for _, value, offset in messages(src, table):
        if value is None:
            continue
        record, _ = decode(value)
        after, source = record["after"], record["source"]
        position = (source["commit_lsn"], source["event_serial"], offset)
        if after is not None and (after["id"] not in latest or latest[after["id"]][0] < position):
            latest[after["id"]] = (position, after)
    return {key: after for key, (_, after) in latest.items()}
