"""Now, without Spark: a table's silver rows plus the Kafka events silver has not applied yet, read in the caller's
process (delta-rs for silver, a Kafka consumer for the topic), newest per key by position, masked by the policy.

The fresh view (``<table>_fresh``) answers in Spark from the bronze log, so it waits for the bronze step's next
commit and costs a Spark query. This reader skips both: every silver commit records the last offset of each of
the table's topic partitions it holds (silver_table.applied_record), and the reader applies the topic's messages
after those offsets to silver's rows with the silver MERGE's rule (an event applies when its position is newer
than the row's; a delete keeps a soft tombstone; TOAST-unchanged columns keep the stored value; a truncate hides
older rows). Events silver applied already may be read again; the position guard makes them change nothing.

Careful: it reads silver and the topic with the pipeline's own credentials, which see personal data; what it
returns is masked by the masking policy unless ``masked=False``. Give analysts the views; this is for processes
that need a row within a second of its commit (docs/merge.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal

import deltalake
from confluent_kafka import TopicPartition
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from lib import config, kafka_client, schema_registry, secrets
from lib.capture import events
from lib.lake import debezium, lake_paths, micro_batch, silver_table
from lib.lake.lake_paths import META_COLUMNS, MergeError
from lib.views import policy as masking_policy


def rows(conf: dict, table: str, masked: bool = True, policy: dict | None = None, keys: list[dict] | None = None,
         timeout_s: float = 30.0, stats: dict | None = None) -> list[dict]:
    """The table now: one dict per live key (silver's columns, in key order), masked by the policy unless masked=False.

    ``keys`` (dicts of the key columns): only those rows, read from silver with a filter (a lookup in a large
    table). ``stats``, when given, receives what was read: silver rows, Kafka messages, the offsets started from.
    """
    spec = lake_paths.table_spec(conf, table)
    path = config.location(lake_paths.silver_path(conf, spec))
    try:
        silver = deltalake.DeltaTable(path)
    except Exception as exc:  # noqa: BLE001 - delta-rs raises its own errors for a missing table
        raise MergeError(f"fresh read of {spec.qualified}: no silver table at {path} ({type(exc).__name__}); run the "
                         f"merge first (notebook 04, or `make run`)") from exc
    key_columns = (silver.metadata().configuration.get(silver_table.KEY_PROPERTY) or "").split(",")
    columns = [f.name for f in silver.schema().fields]
    if not key_columns[0] or any(k not in columns for k in key_columns):
        raise MergeError(f"fresh read of {spec.qualified}: silver at {path} does not name its key columns in the "
                         f"table property {silver_table.KEY_PROPERTY}; a silver step of this version writes it")
    record = silver_table.newest_record(c.get("userMetadata") for c in silver.history(silver_table.HISTORY_COMMITS))
    start = {int(p): int(o) + 1 for p, o in (record.get("offsets") or {}).items()} \
        if record.get("topic") == spec.topic else {}
    wanted = None if keys is None else {tuple(_plain(k.get(c)) for c in key_columns) for k in keys}
    filters = None if wanted is None else [[(c, "=", v) for c, v in zip(key_columns, ident, strict=True)]
                                           for ident in wanted]
    if filters == []:
        return []
    state = {tuple(r[k] for k in key_columns): r for r in silver.to_pyarrow_table(filters=filters).to_pylist()}
    messages = _tail(conf, spec, start, timeout_s)
    rule = Rule(key_columns, [c for c in columns if c not in key_columns and c not in META_COLUMNS], wanted)
    for key, value, headers in messages:
        rule.apply(state, key, value, headers)
    cut = micro_batch.truncates(conf).get(spec.qualified)
    live = [r for r in state.values() if not r.get("_deleted") and (cut is None or not _older(r, cut))]
    live.sort(key=lambda r: tuple((r[k] is None, r[k]) for k in key_columns))
    if stats is not None:
        stats.update(silver_rows=len(state) - rule.added, messages=len(messages), start=start,
                     bronze_seq=record.get("bronze_seq"))
    data = [c for c in columns if c not in META_COLUMNS]
    if not masked:
        return [{c: r.get(c) for c in data} for r in live]
    return mask(conf, spec.qualified, [{c: r.get(c) for c in data + ["_updated_at"]} for r in live], policy)


def _older(row: dict, cut: tuple) -> bool:
    return (row["_commit_lsn"], row["_event_serial"]) < (cut[0], cut[1])


def _tail(conf: dict, spec, start: dict[int, int], timeout_s: float) -> list[tuple]:
    """The topic's messages from start (per partition; else its first offset) to its end now: (key, value, headers)."""
    registry = schema_registry.client(conf)
    decode = AvroDeserializer(registry)
    consumer = kafka_client.consumer(conf, "cdc-fresh-read")
    found: list[tuple] = []
    try:
        meta = consumer.list_topics(spec.topic, timeout=timeout_s).topics.get(spec.topic)
        if meta is None or meta.error is not None:
            raise MergeError(f"fresh read of {spec.qualified}: topic {spec.topic} cannot be read "
                             f"({meta.error if meta else 'not found'}); check kafka.bootstrap_servers and the topic")
        ends, assigned = {}, []
        for partition in meta.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(spec.topic, partition), timeout=timeout_s)
            begin = max(low, start.get(partition, low))
            if begin < high:
                ends[partition] = high
                assigned.append(TopicPartition(spec.topic, partition, begin))
        consumer.assign(assigned)
        deadline = time.monotonic() + timeout_s
        checked: set[int] = set()
        while ends:
            message = consumer.poll(0.2)
            if message is None:
                if time.monotonic() > deadline:
                    raise MergeError(f"fresh read of {spec.qualified}: topic {spec.topic} did not deliver up to its "
                                     f"end offsets {ends} within {timeout_s:g} s; check that Kafka is up")
                continue
            if message.error() is not None:
                raise MergeError(f"fresh read of {spec.qualified}: {spec.topic} partition {message.partition()}: "
                                 f"{message.error()}")
            partition, offset = message.partition(), message.offset()
            if partition in ends and offset >= ends[partition] - 1:
                del ends[partition]
            context = SerializationContext(spec.topic, MessageField.VALUE)
            raw = message.value()
            try:
                if raw is not None:
                    writer = int.from_bytes(raw[1:5], "big")
                    if writer not in checked:
                        _refuse_debezium(spec, registry, writer)
                        checked.add(writer)
                key = decode(message.key(), SerializationContext(spec.topic, MessageField.KEY))
                value = decode(raw, context) if raw is not None else None
            except MergeError:
                raise
            except Exception as exc:  # noqa: BLE001 - the merge sets such a message aside as a dead letter
                raise MergeError(f"fresh read of {spec.qualified}: {spec.topic} partition {partition} offset {offset} "
                                 f"cannot be decoded ({type(exc).__name__}: {exc}); the merge sets it aside in the "
                                 f"dead-letter table; query the fresh view meanwhile") from exc
            found.append((key, value, message.headers()))
    finally:
        consumer.close()
    return found


def _refuse_debezium(spec, registry, writer: int) -> None:
    if debezium.is_debezium(json.loads(registry.get_schema(writer).schema_str)):
        raise MergeError(f"fresh read of {spec.qualified}: topic {spec.topic} was written by Debezium (schema id "
                         f"{writer}), whose value types the merge converts in Spark; query the fresh view instead")


class Rule:
    """The silver MERGE's rule (silver_table.merge_rule) applied one message at a time to rows in memory."""

    def __init__(self, keys: list[str], payload: list[str], wanted: set[tuple] | None = None):
        self.keys, self.payload, self.wanted, self.added = keys, payload, wanted, 0

    def apply(self, state: dict, key: dict | None, value: dict | None, headers) -> None:
        if key is None:
            return  # the merge sets a message without a key aside as a dead letter
        ident = tuple(_plain(key.get(k)) for k in self.keys)
        before = (value or {}).get("before")
        old = tuple(_plain(before.get(k)) for k in self.keys) if before else None
        if self.wanted is not None and ident not in self.wanted and old not in self.wanted:
            return
        if value is None:  # a tombstone: the delete it follows (our capture's header), else a live row's end
            place = events.tombstone_position(headers)
            if place is not None:
                self._delete(state, ident, place, None)
            elif ident in state and not state[ident]["_deleted"]:
                state[ident].update(_deleted=True, _op="tombstone")
            return
        source = value.get("source") or {}
        place = (int(source["commit_lsn"]), int(source["event_serial"]))
        op = value.get("op")
        if op == "u" and old is not None and None not in old and old != ident:
            self._delete(state, old, place, None)  # a key change: the old key is deleted at the update's position
        if op == "d":
            self._delete(state, ident, place, value.get("ts_ms"))
            return
        if self.wanted is not None and ident not in self.wanted:
            return
        row = state.get(ident)
        if not _newer(place, op, row):
            return
        after = value.get("after") or {}
        unchanged = set(value.get("unchanged_cols") or ())
        new = dict(zip(self.keys, ident, strict=True))
        for column in self.payload:
            new[column] = row.get(column) if (row is not None and column in unchanged) else _plain(after.get(column))
        if row is None:
            self.added += 1
        state[ident] = {**new, "_commit_lsn": place[0], "_event_serial": place[1], "_op": op, "_deleted": False,
                        "_updated_at": _when(source.get("ts_ms"))}

    def _delete(self, state: dict, ident: tuple, place: tuple[int, int], ts_ms) -> None:
        if self.wanted is not None and ident not in self.wanted:
            return
        row = state.get(ident)
        if not _newer(place, "d", row):
            return
        if row is None:
            self.added += 1
            row = {**dict(zip(self.keys, ident, strict=True)), **{c: None for c in self.payload}}
        state[ident] = {**row, "_commit_lsn": place[0], "_event_serial": place[1], "_op": "d", "_deleted": True,
                        "_updated_at": _when(ts_ms) or row.get("_updated_at")}


def _newer(place: tuple[int, int], op: str, row: dict | None) -> bool:
    if row is None:
        return True
    stored = (row["_commit_lsn"], row["_event_serial"])
    return place > stored or (place == stored and row["_op"] == "tombstone" and op != "d")


def _plain(value):
    """A decoded Avro value as silver holds it (a uuid as its text)."""
    return str(value) if isinstance(value, uuid.UUID) else value


def _when(ts_ms):
    return datetime.fromtimestamp(ts_ms / 1000, tz=timezone.utc) if ts_ms is not None else None


def mask(conf: dict, table: str, found: list[dict], policy: dict | None = None) -> list[dict]:
    """Rows masked as the clean view masks them (lib/views/policy.py's rules; hash and partial for the value
    kinds whose text Spark and Python spell alike, else an error naming the column)."""
    chosen = masking_policy.load_policy(conf, policy)
    key = None
    if masking_policy.uses_hash(chosen):
        key = masking_policy.derive_key(secrets.resolve(chosen.get("salt"), setting="masking.salt"))
    out = []
    for row in found:
        masked = {}
        for column, value in row.items():
            rule = "keep" if column == "_updated_at" else masking_policy.rule_for(chosen, table, column)
            if rule != "drop":
                masked[column] = _masked(rule, value, key, f"{table}.{column}")
        out.append(masked)
    return out


def _masked(rule: str, value, key: str | None, where: str):
    if rule == "keep" or value is None:
        return value
    if rule == "null":
        return None
    if rule == "redact":
        return masking_policy.REDACTED if isinstance(value, str) else None
    if rule == "hash":
        return hashlib.sha256((key + _text(value, where)).encode()).hexdigest()
    if rule == "partial":
        if isinstance(value, str):
            digits = re.sub(r"[^0-9]", "", value)
            if re.search(masking_policy.EMAIL_RE, value):
                return "***@" + value.rsplit("@", 1)[1]
            if re.search(masking_policy.PHONE_RE, value) and len(digits) >= 7:
                return "***" + digits[-4:]
            return value[:1] + "***"
        if isinstance(value, datetime):
            return value.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
        if isinstance(value, date):
            return value.replace(month=1, day=1)
    raise masking_policy.MaskingError(f"{where}: the fresh reader cannot mask a {type(value).__name__} by "
                                      f"{rule!r} as Spark does; query the fresh view for this column")


def _text(value, where: str) -> str:
    """A value's text as Spark's CAST(... AS STRING) spells it, for the kinds where Python agrees."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, date) and not isinstance(value, datetime):
        return value.isoformat()
    raise masking_policy.MaskingError(f"{where}: the fresh reader hashes strings, integers, decimals and dates, not "
                                      f"{type(value).__name__}; query the fresh view for this column")
