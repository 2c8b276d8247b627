"""The pipeline's control topic: small JSON records the capture and the merge share.

One compacted topic per topic prefix, ``<topic_prefix>.__cdc_control``, keyed by a string:

- ``snapshot/<slot>``: the snapshot's state for a slot (``running`` or ``complete``, the
  slot's consistent point, rows per table). Streaming refuses to start before ``complete``.
- ``truncate/<schema.table>``: the position of the latest TRUNCATE of a table (a truncate has
  no key, so it cannot live in the table's own compacted topic).

It lives in Kafka, not in the source database, so the pipeline needs no write access there
and the state travels with the topics it describes.
"""

from __future__ import annotations

import json
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from lib import config, topics


class ControlError(RuntimeError):
    """The control topic could not be written or read."""


def topic(conf: dict) -> str:
    """Name of the control topic for this conf's topic prefix."""
    return f"{config.get(conf, 'kafka.topic_prefix')}.__cdc_control"


def ensure(conf: dict) -> str:
    """Create the control topic (compacted, one partition) if missing; returns 'created' or 'exists'."""
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    name = topic(conf)
    return topics.ensure_topics(admin, [name], partitions=1)[name]


def put(conf: dict, key: str, record: dict | None, timeout: float = 30.0) -> None:
    """Write one record (None writes a tombstone) and wait until Kafka acknowledged it."""
    producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "enable.idempotence": True, "acks": "all"})
    failures = []
    value = None if record is None else json.dumps(record, sort_keys=True).encode()
    producer.produce(topic(conf), key=key.encode(), value=value,
                     on_delivery=lambda err, msg: failures.append(err) if err else None)
    remaining = producer.flush(timeout)
    if remaining or failures:
        reason = failures[0] if failures else f"not acknowledged within {timeout:.0f} s"
        raise ControlError(f"could not write {key} to {topic(conf)}: {reason}; check that Kafka at "
                           f"{config.get(conf, 'kafka.bootstrap_servers')} is up and the topic exists (notebook 01)")


def read_all(conf: dict, timeout: float = 30.0) -> dict[str, dict]:
    """Every key's latest record (tombstoned keys left out), read from the start to the end."""
    consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                         "group.id": f"cdc-control-reader-{time.monotonic_ns()}", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    name = topic(conf)
    try:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(name, 0), timeout=timeout)
        except KafkaException as exc:
            raise ControlError(f"cannot read {name}: {exc}; run notebook 01 to create it") from exc
        records: dict[str, dict] = {}
        if high <= low:
            return records
        consumer.assign([TopicPartition(name, 0, low)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            if message.error():
                raise ControlError(f"cannot read {name}: {message.error()}")
            key = message.key().decode()
            if message.value() is None:
                records.pop(key, None)
            else:
                records[key] = json.loads(message.value())
            if message.offset() >= high - 1:
                return records
        raise ControlError(f"reading {name} did not reach offset {high} within {timeout:.0f} s")
    finally:
        consumer.close()


def snapshot_state(conf: dict, slot: str) -> dict | None:
    """The recorded snapshot state of a slot, or None when no snapshot was started."""
    return read_all(conf).get(f"snapshot/{slot}")


class Tail:
    """The control topic's latest record per key, kept current by reading only what arrived since the last look.

    For a loop that must not block (the capture answers the replication server between looks).
    """

    def __init__(self, conf: dict) -> None:
        self.name = topic(conf)
        self.records: dict[str, dict] = {}
        self._consumer = Consumer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                                   "group.id": f"cdc-control-tail-{time.monotonic_ns()}", "enable.auto.commit": False})
        self._consumer.assign([TopicPartition(self.name, 0, OFFSET_BEGINNING)])
        self._next = 0  # the offset after the last record read

    def catch_up(self, timeout: float = 30.0) -> dict[str, dict]:
        """Read up to the topic's end as of now (blocks up to timeout); the records."""
        try:
            _, high = self._consumer.get_watermark_offsets(TopicPartition(self.name, 0), timeout=timeout)
        except KafkaException as exc:
            raise ControlError(f"cannot read {self.name}: {exc}; run notebook 01 to create it") from exc
        deadline = time.monotonic() + timeout
        while self._next < high:
            if time.monotonic() >= deadline:
                raise ControlError(f"reading {self.name} did not reach offset {high} within {timeout:.0f} s")
            self.poll(min(1.0, deadline - time.monotonic()))
        return self.records

    def poll(self, budget_s: float = 0.0) -> dict[str, dict]:
        """Apply what has arrived, waiting at most budget_s; the records."""
        for message in self._consumer.consume(1000, timeout=budget_s):
            if message.error():
                raise ControlError(f"cannot read {self.name}: {message.error()}")
            key = message.key().decode()
            if message.value() is None:
                self.records.pop(key, None)
            else:
                self.records[key] = json.loads(message.value())
            self._next = message.offset() + 1
        return self.records

    def close(self) -> None:
        self._consumer.close()
