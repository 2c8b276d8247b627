"""Look at what is in a table's topic: the last events, decoded, and what compaction would keep."""

from __future__ import annotations

import time

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from lib import kafka_client, schema_registry
from lib.capture import avro_schemas


def read(conf: dict, table: str, last: int | None = None, timeout: float = 30.0) -> list[dict]:
    """Decoded messages of a table's topic (all, or the last N per partition), in offset order per partition.

    Each item: partition, offset, key (dict), op, before, after, source position, or value None for a tombstone.
    """
    topic = avro_schemas.topic_for(conf, table)
    registry = schema_registry.client(conf)
    decode = AvroDeserializer(registry)
    consumer = kafka_client.consumer(conf, "cdc-peek")
    try:
        try:
            partitions = consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
        except KafkaException as exc:
            raise LookupError(f"cannot read topic {topic} of {table}: {exc}; run notebook 01") from exc
        if not partitions:
            raise LookupError(f"topic {topic} of {table} does not exist; run notebook 01")
        assignments, ends = [], {}
        for partition in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
            if high > low:
                start = low if last is None else max(low, high - last)
                assignments.append(TopicPartition(topic, partition, start))
                ends[partition] = high
        rows: list[dict] = []
        if not assignments:
            return rows
        consumer.assign(assignments)
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.error():
                continue
            key = decode(message.key(), SerializationContext(topic, MessageField.KEY))
            value = decode(message.value(), SerializationContext(topic, MessageField.VALUE)) \
                if message.value() is not None else None
            rows.append({"partition": message.partition(), "offset": message.offset(), "key": key,
                         "op": value["op"] if value else None,
                         "commit_lsn": value["source"]["commit_lsn"] if value else None,
                         "event_serial": value["source"]["event_serial"] if value else None,
                         "before": value["before"] if value else None,
                         "after": value["after"] if value else None})
            if message.offset() >= ends[message.partition()] - 1:
                ends.pop(message.partition())
        return rows
    finally:
        consumer.close()


def latest_per_key(events: list[dict]) -> dict:
    """The source table as the topic tells it: per key the row of the event with the greatest position.

    Tombstones are skipped: the 'd' event before each carries the delete and its position.
    """
    best: dict = {}
    for event in events:
        if event["op"] is None:
            continue
        key = tuple(sorted(event["key"].items()))
        position = (event["commit_lsn"], event["event_serial"])
        if key not in best or position >= best[key][0]:
            best[key] = (position, None if event["op"] == "d" else event["after"])
    return {key: row for key, (_, row) in best.items() if row is not None}
