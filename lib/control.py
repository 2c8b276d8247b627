"""The pipeline's control topic: small JSON records the capture and the merge share.

One compacted topic per topic prefix, ``<topic_prefix>.__cdc_control``, keyed by a string:

- ``snapshot/<slot>``: the snapshot's state for a slot (``running`` or ``complete``, the
  slot's consistent point, rows per table). Streaming refuses to start before ``complete``.
- ``truncate/<schema.table>``: the position of the latest TRUNCATE of a table (a truncate has
  no key, so it cannot live in the table's own compacted topic).
- ``incremental/<slot>/<schema.table>``: an incremental snapshot's request and progress (lib.capture.incremental).
- ``position/<slot>``: the last position the capture confirmed to the slot, with the server's system
  identifier and timeline, written before the slot hears of it (lib/capture/slot_position.py).
- ``service/<slot>/capture|merge``: a lease the running continuous service renews (host, pid, valid
  until); the notebooks' capture and merge steps refuse while it is valid (one slot, one checkpoint).

A record that is not a JSON object stops its readers with the offset and the remedy when its key is
one of these (skipping a truncate would let silver keep deleted rows); other keys are not the
pipeline's and are ignored with a warning. ``python -m lib.control show|delete KEY`` inspects or
removes one record.

It lives in Kafka, not in the source database, so the pipeline needs no write access there
and the state travels with the topics it describes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Producer, TopicPartition

from lib import config, kafka_client, topics


class ControlError(RuntimeError):
    """The control topic could not be written or read."""


def topic(conf: dict) -> str:
    """Name of the control topic for this conf's topic prefix."""
    return f"{config.get(conf, 'kafka.topic_prefix')}.__cdc_control"


# The capture records its position about once a second (lib/capture/slot_position.py) and services renew their
# leases: short segments let Kafka compact those keys, so a reader from the start reads little more than one
# record per key (Kafka compacts only closed segments; its default rolls one a week).
SEGMENT_SETTINGS = {"segment.ms": 10 * 60 * 1000, "min.cleanable.dirty.ratio": 0.1}


def ensure(conf: dict) -> str:
    """Create the control topic (compacted, one partition, short segments) if missing; 'created' or 'exists'."""
    admin = kafka_client.admin(conf)
    name = topic(conf)
    result = topics.ensure_topics(admin, [name], partitions=1, config=SEGMENT_SETTINGS, **topics.durability(conf))[name]
    if result == "exists":  # made before these settings: give it them (harmless to set again)
        try:
            topics.set_configs(admin, name, SEGMENT_SETTINGS)
        except topics.TopicError as exc:  # works without them, only reads slower as the records pile up
            return f"exists (kept its segment settings: {exc})"
    return result


def put(conf: dict, key: str, record: dict | None, timeout: float = 30.0) -> None:
    """Write one record (None writes a tombstone) and wait until Kafka acknowledged it.

    Not an idempotent producer: its first send waits about 0.5 s for a producer id, and a retried
    duplicate of one record is harmless on this compacted topic (a key's last record wins; each put
    is acknowledged before the next is sent)."""
    producer = Producer(kafka_client.settings(conf, acks="all"))
    failures = []
    value = None if record is None else json.dumps(record, sort_keys=True).encode()
    producer.produce(topic(conf), key=key.encode(), value=value,
                     on_delivery=lambda err, msg: failures.append(err) if err else None)
    with kafka_client.waiting_on(conf, f"acknowledge {key} in {topic(conf)}"):
        remaining = producer.flush(timeout)
    if remaining or failures:
        reason = failures[0] if failures else f"not acknowledged within {timeout:.0f} s"
        raise ControlError(f"could not write {key} to {topic(conf)}: {reason}; check that Kafka at "
                           f"{config.get(conf, 'kafka.bootstrap_servers')} is up and the topic exists (notebook 01)")


def read_all(conf: dict, timeout: float = 30.0) -> dict[str, dict]:
    """Every key's latest record (tombstoned keys left out), read from the start to the end."""
    with kafka_client.waiting_on(conf, f"give {topic(conf)}'s records"):
        return _read_all(conf, timeout)


def _read_all(conf: dict, timeout: float) -> dict[str, dict]:
    consumer = kafka_client.consumer(conf, "cdc-control-reader", **{"auto.offset.reset": "earliest"})
    name = topic(conf)
    try:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(name, 0), timeout=timeout)
        except KafkaException as exc:
            raise ControlError(f"cannot read {name}: {exc}; run notebook 01 to create it") from exc
        records: dict[str, dict] = {}
        bad: dict[str, str] = {}
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
            _apply(records, bad, name, message)
            if message.offset() >= high - 1:
                _refuse(bad)
                return records
        raise ControlError(f"reading {name} did not reach offset {high} within {timeout:.0f} s")
    finally:
        consumer.close()


PIPELINE_KEYS = ("snapshot/", "truncate/", "incremental/", "service/", "position/")


def _apply(records: dict[str, dict], bad: dict[str, str], name: str, message) -> None:
    """Fold one control message into records; a pipeline record that is not a JSON object goes to bad."""
    raw_key = message.key()
    key = raw_key.decode(errors="replace") if raw_key is not None else ""
    bad.pop(key, None)  # a later record or tombstone replaces a malformed one
    if message.value() is None:
        records.pop(key, None)
        return
    try:
        record = json.loads(message.value())
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except ValueError as exc:
        where = f"{name} partition {message.partition()} offset {message.offset()} (key {key!r})"
        records.pop(key, None)
        if key.startswith(PIPELINE_KEYS):
            bad[key] = f"the record at {where} is not a JSON object ({exc})"
        else:
            print(f"control   ignoring {where}: not a pipeline record and not a JSON object", file=sys.stderr)
        return
    records[key] = record


def _refuse(bad: dict[str, str]) -> None:
    """Raise ControlError for the first malformed pipeline record that is still the latest of its key."""
    if not bad:
        return
    key, problem = next(iter(bad.items()))
    raise ControlError(f"{problem}. The capture and merge cannot tell what it should say, so they stop rather than "
                       f"guess. Look at it with python -m lib.control show {key!r}; if it was written by hand or by "
                       f"mistake, remove it with python -m lib.control delete {key!r} (add --target <target>), then "
                       f"restart; a truncate/ or snapshot/ record may need its table re-snapshotted "
                       f"(lib.operate.tables resnapshot)")


def lease_key(conf: dict, service: str) -> str:
    """The control key under which a running continuous service of conf's slot says so."""
    return f"service/{config.get(conf, 'source.slot')}/{service}"


def renew_lease(conf: dict, service: str, valid_s: float, timeout: float = 5.0) -> None:
    """Record that this process runs the service for the next valid_s seconds (any machine can read it).

    Waits at most timeout seconds for Kafka, so a slow broker cannot stall the loop that renews."""
    put(conf, lease_key(conf, service), {"host": socket.gethostname(), "pid": os.getpid(),
                                         "until_ms": int((time.time() + valid_s) * 1000)}, timeout=timeout)


def running_service(conf: dict, service: str, records: dict | None = None) -> dict | None:
    """The lease of a continuous service of conf's slot that is still valid, or None."""
    record = (read_all(conf) if records is None else records).get(lease_key(conf, service))
    if record is None or record.get("until_ms", 0) <= time.time() * 1000:
        return None
    return record


def describe_lease(record: dict) -> str:
    until = time.strftime("%H:%M:%S", time.localtime(record["until_ms"] / 1000))
    return f"pid {record.get('pid')} on {record.get('host')}, renewed until {until}"


def snapshot_state(conf: dict, slot: str) -> dict | None:
    """The recorded snapshot state of a slot, or None when no snapshot was started."""
    return read_all(conf).get(f"snapshot/{slot}")


class Tail:
    """The control topic's latest record per key, kept current by reading only what arrived since the last look.

    For a loop that must not block (the capture answers the replication server between looks).
    """

    def __init__(self, conf: dict) -> None:
        self.name, self.conf = topic(conf), conf
        self.records: dict[str, dict] = {}
        self._bad: dict[str, str] = {}
        self._consumer = kafka_client.consumer(conf, "cdc-control-tail")
        self._consumer.assign([TopicPartition(self.name, 0, OFFSET_BEGINNING)])
        self._next = 0  # the offset after the last record read

    def catch_up(self, timeout: float = 30.0) -> dict[str, dict]:
        """Read up to the topic's end as of now (blocks up to timeout); the records."""
        with kafka_client.waiting_on(self.conf, f"give {self.name}'s records up to its end"):
            return self._catch_up(timeout)

    def _catch_up(self, timeout: float) -> dict[str, dict]:
        try:
            _, high = self._consumer.get_watermark_offsets(TopicPartition(self.name, 0), timeout=timeout)
        except KafkaException as exc:
            raise ControlError(f"cannot read {self.name}: {exc}; run notebook 01 to create it") from exc
        deadline = time.monotonic() + timeout
        while self._next < high:
            if time.monotonic() >= deadline:
                raise ControlError(f"reading {self.name} did not reach offset {high} within {timeout:.0f} s")
            self._read(min(1.0, deadline - time.monotonic()))
        _refuse(self._bad)
        return self.records

    def poll(self, budget_s: float = 0.0) -> dict[str, dict]:
        """Apply what has arrived, waiting at most budget_s; the records."""
        self._read(budget_s)
        _refuse(self._bad)
        return self.records

    def _read(self, budget_s: float) -> None:
        for message in self._consumer.consume(1000, timeout=budget_s):
            if message.error():
                raise ControlError(f"cannot read {self.name}: {message.error()}")
            _apply(self.records, self._bad, self.name, message)
            self._next = message.offset() + 1

    def close(self) -> None:
        self._consumer.close()


def main(argv: list[str] | None = None) -> int:
    """python -m lib.control show|delete KEY [--target T]: one control record, as JSON, or its removal."""
    parser = argparse.ArgumentParser(prog="python -m lib.control", description=main.__doc__)
    parser.add_argument("action", choices=("show", "delete"))
    parser.add_argument("key")
    parser.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    args = parser.parse_args(argv)
    conf = config.load(args.target)
    name = topic(conf)
    if args.action == "delete":
        put(conf, args.key, None)
        print(f"control   wrote a tombstone for {args.key!r} to {name}")
        return 0
    consumer = kafka_client.consumer(conf, "cdc-control-show")
    try:
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(name, 0), timeout=30)
        except KafkaException as exc:
            print(f"control   cannot read {name}: {exc.args[0].str()}")
            return 1
        consumer.assign([TopicPartition(name, 0, OFFSET_BEGINNING)])
        latest = None
        while high > 0:
            message = consumer.poll(5.0)
            if message is None or message.error():
                break
            if message.key() is not None and message.key().decode(errors="replace") == args.key:
                latest = message
            if message.offset() >= high - 1:
                break
    finally:
        consumer.close()
    if latest is None:
        print(f"control   no record with key {args.key!r} in {name}")
        return 1
    value = latest.value()
    print(f"offset {latest.offset()}: " + ("tombstone" if value is None else value.decode(errors="replace")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
