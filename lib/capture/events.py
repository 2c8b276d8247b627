"""Change events: Kafka key and Debezium-compatible envelope from decoded pgoutput tuples (docs/events.md).

``plan(table, topic_prefix, database)`` is built once per table version (field names, a
converter per column, key positions, the constant parts of the source block).
``change_events(plan, message, lsn, tx, serial)`` turns one decoded Insert/Update/Delete into
``(key, value)`` dicts, value None being the tombstone after a delete;
``encoded_events(...)`` gives the same events as Confluent wire-format bytes (what the capture
sends; built without the intermediate dicts, and checked against the dict path when a plan is
given its schema ids). The rules (docs/events.md):

- insert: ``c``; update: ``u`` (``before`` only with REPLICA IDENTITY FULL); delete: ``d``
  then a tombstone; an update that changes the primary key: ``d`` + tombstone for the old key
  and ``c`` for the new key (as Debezium does).
- every event carries ``source.commit_lsn`` and ``source.event_serial`` (its position among the
  transaction's events, from 0; a tombstone shares its ``d``'s): several changes at one LSN stay
  distinct and ordered.
- an unchanged TOASTed column is listed in ``unchanged_cols`` and its ``after`` field is None.

``encoder(schema, schema_id)`` compiles an Avro schema into a function record -> Confluent
wire-format bytes (magic 0, 4-byte big-endian schema id, Avro binary). It generates Python
code per record type and is several times faster than fastavro's generic writer on our
envelopes; it falls back to fastavro for schema shapes it does not compile.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from importlib import metadata

from lib import schema_registry
from lib.capture import avro_encoder, avro_schemas, native, pgtypes
from lib.capture.avro_encoder import OP_BYTES, SHORT, long_bytes, string_bytes, widened_key
from lib.capture.catalog import Column, Table
from lib.capture.pgoutput import UNCHANGED_TOAST

try:
    VERSION = metadata.version("cdc-pipeline")
except metadata.PackageNotFoundError:  # running from a checkout without `pip install -e .`
    VERSION = "0.1.0"

ENVELOPE_FIELDS = ("before", "after", "source", "op", "ts_ms", "transaction", "unchanged_cols")
SOURCE_FIELDS = ("version", "connector", "name", "ts_ms", "snapshot", "db", "sequence", "schema", "table", "txId",
                 "lsn", "xmin", "commit_lsn", "event_serial")


class EventError(ValueError):
    """A change cannot be turned into an event (conversion error, malformed tuple); names table and column."""


@dataclass(slots=True, eq=False)
class Tx:
    """The transaction an event belongs to: commit position and time, xid, previous commit, capture time."""

    commit_lsn: int
    txid: int | None
    commit_ms: int
    prev_commit_lsn: int | None
    now_ms: int


class Plan:
    """Everything needed to turn one table version's tuples into events, computed once."""

    __slots__ = ("table", "qualified", "topic", "prefix", "database", "names", "columns", "convs", "ncols",
                 "key_names", "key_index", "key_schema", "value_schema", "key_id", "value_id", "encode_key",
                 "encode_value", "_key_list", "_value_list", "_value_prefix", "_tx", "_tx_parts", "_fast", "codec")

    def __init__(self, table: Table, topic_prefix: str, database: str, unknown_types: str = "error",
                 topic: str | None = None) -> None:
        names = avro_schemas.field_names(table.columns)
        columns = [c for c in table.columns if not c.generated]  # pgoutput (PostgreSQL <= 17) does not send them
        self.table = table
        self.qualified = table.qualified
        self.topic = topic or avro_schemas.topic_name(topic_prefix, table)
        self.prefix = topic_prefix
        self.database = database
        self.columns = tuple(columns)
        self.names = tuple(names[c.name] for c in columns)
        self.convs = tuple(_inner(fast_converter(c, unknown_types)) for c in columns)
        self.ncols = len(columns)
        position = {c.name: i for i, c in enumerate(columns)}
        missing = [k for k in table.primary_key if k not in position]
        if missing:
            raise EventError(f"table {table.qualified}: primary key column(s) {', '.join(missing)} are generated "
                             f"columns, which pgoutput does not send; use a plain key column")
        self.key_names = tuple(names[k] for k in table.primary_key)
        self.key_index = tuple(position[k] for k in table.primary_key)
        self.key_schema = avro_schemas.key_schema(table, topic_prefix, unknown_types)
        self.value_schema = avro_schemas.value_schema(table, topic_prefix, unknown_types)
        self.key_id = self.value_id = None
        self.encode_key = self.encode_value = None  # dict -> wire bytes, once set_ids() ran
        self._tx = self._tx_parts = None
        self._fast = False
        self.codec = None  # the compiled encoder (lib/capture/native.py), once set_ids() ran and when it is built

    def set_ids(self, key_id: int, value_id: int, wide_key_id: int | None = None, widened: tuple = ()) -> None:
        """Attach the registry ids and compile the wire-format encoders (checked against each other).

        widened: positions of key fields that were int in the topic's first key schema (key_id) and are long
        now; a key whose values there all fit in 32 bits keeps key_id (its bytes never change), wider ones
        use wide_key_id.
        """
        self.key_id, self.value_id = key_id, value_id
        self.encode_key = avro_encoder.encoder(self.key_schema, key_id)
        self.encode_value = avro_encoder.encoder(self.value_schema, value_id)
        key_fields = tuple(f["name"] for f in self.key_schema["fields"])
        if key_fields == self.key_names:
            self._key_list = avro_encoder.encoder(self.key_schema, key_id, by_index=True)
        else:  # not expected: avro_schemas names key fields like value fields
            self._key_list = lambda key_vals: self.encode_key(dict(zip(self.key_names, key_vals, strict=True)))
        if widened:
            wide = avro_encoder.encoder(self.key_schema, wide_key_id, by_index=True)
            self._key_list = widened_key(self._key_list, wide, tuple(widened))
        self._value_prefix = schema_registry.confluent_header(value_id)
        self._fast = False
        if _envelope_layout_ok(self.value_schema, self.names):
            record = avro_schemas.value_record(self.value_schema)
            self._value_list = avro_encoder._Codegen().compile(record, by_index=True)
            self._fast = self._self_check()
        self.codec = None if widened else native.row_codec(self)

    def _self_check(self) -> bool:
        """The direct envelope bytes equal the generic encoder's for sample events."""
        self._fast = True
        tx = Tx(123456789, 42, 1_700_000_000_123, None, 1_700_000_000_456)
        try:
            for prev, unchanged in ((None, []), (987654321, ["x", "y"])):
                tx.prev_commit_lsn = prev
                self._tx = None
                direct = self.value_bytes("u", None, None, unchanged, tx, 123456000, 7)
                generic = self.encode_value(envelope(self, "u", None, None, unchanged, tx, 123456000, 7))
                if direct != generic:
                    return False
        except Exception:  # noqa: BLE001 - any surprise means: use the generic path
            return False
        finally:
            self._tx = None
        return True

    def key_bytes(self, values: list) -> bytes:
        """Wire-format key from the row's converted values (in column order)."""
        return self._key_list([values[i] for i in self.key_index])

    def value_bytes(self, op: str, before: list | None, after: list | None, unchanged: list[str], tx: Tx, lsn: int,
                    serial: int) -> bytes:
        """Wire-format envelope straight from converted row values (same bytes as encode_value(envelope(...)))."""
        if not self._fast:
            return self.encode_value(envelope(self, op, self.as_dict(before), self.as_dict(after), unchanged, tx,
                                              lsn, serial))
        if self._tx is not tx:
            self._tx_parts = self._source_parts(tx)
            self._tx = tx
        head, middle, tail, rest = self._tx_parts
        out = [self._value_prefix]
        a = out.append
        if before is None:
            a(b"\x00")
        else:
            a(b"\x02")
            self._value_list(before, a)
        if after is None:
            a(b"\x00")
        else:
            a(b"\x02")
            self._value_list(after, a)
        a(head)
        prev = tx.prev_commit_lsn
        sequence = (f'["{prev}","{lsn}"]' if prev is not None else f'[null,"{lsn}"]').encode()
        a(b"\x02")
        a(SHORT[len(sequence) + 32768])  # a few dozen bytes
        a(sequence)
        a(middle)
        a(b"\x02")
        a(long_bytes(lsn))
        a(tail)
        a(SHORT[serial + 32768] if serial < 32768 else long_bytes(serial))
        a(OP_BYTES[op])
        a(rest)
        if unchanged:
            a(long_bytes(len(unchanged)))
            for name in unchanged:
                a(string_bytes(name))
        a(b"\x00")
        return b"".join(out)

    def tx_parts(self, tx: Tx) -> tuple[bytes, bytes, bytes, bytes]:
        """The source block's parts for tx (cached for the transaction being sent)."""
        if self._tx is not tx:
            self._tx_parts = self._source_parts(tx)
            self._tx = tx
        return self._tx_parts

    def _source_parts(self, tx: Tx) -> tuple[bytes, bytes, bytes, bytes]:
        """The source block's bytes that stay the same for a table within one transaction."""
        head = b"".join((string_bytes(VERSION), string_bytes(avro_schemas.CONNECTOR), string_bytes(self.prefix),
                         long_bytes(tx.commit_ms), string_bytes("false"), string_bytes(self.database)))
        middle = b"".join((string_bytes(self.table.schema), string_bytes(self.table.name),
                           b"\x00" if tx.txid is None else b"\x02" + long_bytes(tx.txid)))
        tail = b"\x00" + long_bytes(tx.commit_lsn)  # xmin null, commit_lsn
        rest = b"\x02" + long_bytes(tx.now_ms) + b"\x00"  # ts_ms, transaction null (op is written before it)
        return head, middle, tail, rest

    def as_dict(self, values: list | None) -> dict | None:
        """Field name -> value for a row's converted values."""
        return None if values is None else dict(zip(self.names, values, strict=True))


def plan(table: Table, topic_prefix: str, database: str, unknown_types: str = "error",
         topic: str | None = None) -> Plan:
    """The event plan of a table (its columns as pgoutput sends them: every non-generated column in order)."""
    return Plan(table, topic_prefix, database, unknown_types, topic)


def _envelope_layout_ok(schema: dict, names: tuple[str, ...]) -> bool:
    """The envelope has exactly the layout value_bytes() writes, its Value record the plan's fields in order."""
    fields = schema.get("fields", [])
    if tuple(f["name"] for f in fields) != ENVELOPE_FIELDS:
        return False
    source, before = fields[2]["type"], fields[0]["type"]
    return (isinstance(source, dict) and tuple(f["name"] for f in source["fields"]) == SOURCE_FIELDS
            and isinstance(before, list) and len(before) == 2 and isinstance(before[1], dict)
            and tuple(f["name"] for f in before[1]["fields"]) == names)


def _inner(convert):
    """The converter without its None check, or None for text passed through unchanged (fewer calls per value)."""
    defaults = getattr(convert, "__defaults__", None) or ()
    inner = defaults[0] if len(defaults) == 1 and callable(defaults[0]) else convert
    return None if inner is pgtypes.text_as_is else inner


# ---------------------------------------------------------------------------------------------
# rows, keys, envelopes


def _bad_tuple(plan: Plan, tup: tuple) -> EventError:
    return EventError(
        f"table {plan.qualified}: a change carries {len(tup)} columns but the table's Relation message has "
        f"{plan.ncols} ({', '.join(plan.names)}); the capture's view of the table is out of date: restart the capture "
        f"(it resumes from the last acknowledged transaction)")


def _conversion_error(plan: Plan, tup: tuple, exc: Exception) -> EventError:
    """An EventError naming the column whose value failed (never the value itself: it may be personal data)."""
    for name, conv, value, column in zip(plan.names, plan.convs, tup, plan.columns, strict=False):
        if value is UNCHANGED_TOAST or value is None or conv is None:
            continue
        try:
            conv(value)
        except Exception as inner:  # noqa: BLE001 - reported with the column
            if isinstance(inner, pgtypes.ValueConversionError):
                return EventError(str(inner))
            return EventError(f"column {column.qualified} ({column.type_name}, field {name}): cannot convert the "
                              f"value: {type(inner).__name__}: {inner}; check the session settings "
                              f"(pgtypes.SESSION_SETTINGS) or report this as a bug")
    return EventError(f"table {plan.qualified}: cannot convert a row: {type(exc).__name__}: {exc}")


def values(plan: Plan, tup: tuple) -> tuple[list, list[str]]:
    """(converted values in column order, names of unchanged TOASTed fields); unchanged values are None."""
    if len(tup) != plan.ncols:
        raise _bad_tuple(plan, tup)
    try:
        if UNCHANGED_TOAST not in tup:
            return [v if c is None or v is None else c(v) for c, v in zip(plan.convs, tup, strict=True)], []
        unchanged = [n for n, v in zip(plan.names, tup, strict=True) if v is UNCHANGED_TOAST]
        return [None if v is UNCHANGED_TOAST else v if c is None or v is None else c(v)
                for c, v in zip(plan.convs, tup, strict=True)], unchanged
    except Exception as exc:
        raise _conversion_error(plan, tup, exc) from exc


def row(plan: Plan, tup: tuple) -> tuple[dict, list[str]]:
    """(field -> value, names of unchanged TOASTed fields) of one tuple; unchanged fields are None."""
    converted, unchanged = values(plan, tup)
    return plan.as_dict(converted), unchanged


def key_values(plan: Plan, converted: list, raw: tuple, old: list | None = None) -> list:
    """The primary key values (in key order) of a converted row; an unchanged TOASTed key value is taken from old."""
    result = []
    for name, i in zip(plan.key_names, plan.key_index, strict=True):
        value = converted[i]
        if value is None:
            value = old[i] if old is not None else None
            if value is None:
                what = "an unchanged TOASTed value" if raw[i] is UNCHANGED_TOAST else "NULL"
                raise EventError(
                    f"table {plan.qualified}: primary key column {name} is missing from a change ({what}), so the "
                    f"event cannot be keyed; keep key values short enough not to be TOASTed (under ~2 kB) or set "
                    f"REPLICA IDENTITY FULL on the table")
        result.append(value)
    return result


def key(plan: Plan, tup: tuple) -> dict:
    """The Kafka key record (primary key field -> value) of a tuple."""
    converted, _ = values(plan, tup)
    return dict(zip(plan.key_names, key_values(plan, converted, tup), strict=True))


def source(plan: Plan, tx: Tx, lsn: int, serial: int, snapshot: str = "false") -> dict:
    """The envelope's source block (Debezium's fields plus commit_lsn and event_serial)."""
    prev = tx.prev_commit_lsn
    return {
        "version": VERSION, "connector": avro_schemas.CONNECTOR, "name": plan.prefix, "ts_ms": tx.commit_ms,
        "snapshot": snapshot, "db": plan.database,
        "sequence": f'["{prev}","{lsn}"]' if prev is not None else f'[null,"{lsn}"]',
        "schema": plan.table.schema, "table": plan.table.name, "txId": tx.txid, "lsn": lsn, "xmin": None,
        "commit_lsn": tx.commit_lsn, "event_serial": serial,
    }


def envelope(plan: Plan, op: str, before: dict | None, after: dict | None, unchanged: list[str], tx: Tx,
             lsn: int, serial: int, snapshot: str = "false") -> dict:
    """One Envelope record (op c/u/d/r)."""
    return {"before": before, "after": after, "source": source(plan, tx, lsn, serial, snapshot), "op": op,
            "ts_ms": tx.now_ms, "transaction": None, "unchanged_cols": unchanged}


def _events(plan: Plan, message) -> list[tuple]:
    """[(op, key values, before, after, unchanged, serial offset, tombstone follows)] for one row change."""
    kind = message.kind
    if kind == "I":
        new = message.new
        after, unchanged = values(plan, new)
        return [("c", key_values(plan, after, new), None, after, unchanged, 0, False)]
    if kind == "U":
        new, old = message.new, message.old
        after, unchanged = values(plan, new)
        if old is None:
            return [("u", key_values(plan, after, new), None, after, unchanged, 0, False)]
        before, _ = values(plan, old)
        old_key = key_values(plan, before, old)
        new_key = key_values(plan, after, new, before)
        if new_key != old_key:  # primary key changed: delete the old key, create the new one
            return [("d", old_key, before, None, [], 0, True), ("c", new_key, None, after, unchanged, 1, False)]
        # a key-only old tuple ('K') carries just the unchanged identity: docs/events.md keeps before null
        return [("u", new_key, before if message.old_kind == "O" else None, after, unchanged, 0, False)]
    if kind == "D":
        old = message.old
        before, _ = values(plan, old)
        return [("d", key_values(plan, before, old), before, None, [], 0, True)]
    raise EventError(f"not a row change: {kind!r} message")


def change_events(plan: Plan, message, lsn: int, tx: Tx, serial: int) -> tuple[list[tuple[dict, dict | None]], int]:
    """(key, value) dicts for one decoded Insert/Update/Delete (value None = tombstone), and the next serial."""
    out = []
    changes = _events(plan, message)
    for op, key_vals, before, after, unchanged, offset, tombstone in changes:
        k = dict(zip(plan.key_names, key_vals, strict=True))
        out.append((k, envelope(plan, op, plan.as_dict(before), plan.as_dict(after), unchanged, tx, lsn,
                                serial + offset)))
        if tombstone:
            out.append((k, None))
    return out, serial + len(changes)


def encoded_events(plan: Plan, message, lsn: int, tx: Tx, serial: int) -> tuple[list[tuple[bytes, object]], int]:
    """change_events() as Confluent wire-format (key, value) bytes; needs plan.set_ids().

    A tombstone's value is the list of Kafka headers to send with it (tombstone_headers), not None.
    """
    out = []
    changes = _events(plan, message)
    for op, key_vals, before, after, unchanged, offset, tombstone in changes:
        k = plan._key_list(key_vals)
        out.append((k, plan.value_bytes(op, before, after, unchanged, tx, lsn, serial + offset)))
        if tombstone:
            out.append((k, tombstone_headers(tx.commit_lsn, serial + offset)))
    return out, serial + len(changes)


def compiled_events(plan: Plan, payload: bytes, pos: int, lsn: int, tx: Tx,
                    serial: int) -> tuple[list[tuple[bytes, object]], int] | None:
    """encoded_events() by the compiled codec, straight from an Insert/Update/Delete payload whose relation id is at
    pos; None when the plan has no codec or the codec leaves this message to the Python path."""
    codec = plan.codec
    if codec is None:
        return None
    return codec.events(payload, pos, lsn, plan.tx_parts(tx), tx.prev_commit_lsn, tx.commit_lsn, serial)


POSITION_HEADER = "cdc.position"
_POSITION = struct.Struct(">qq")


def tombstone_headers(commit_lsn: int, event_serial: int) -> list[tuple[str, bytes]]:
    """Kafka headers of a tombstone: the position of the delete it follows (the merge guards it by that)."""
    return [(POSITION_HEADER, _POSITION.pack(commit_lsn, event_serial))]


def tombstone_position(headers) -> tuple[int, int] | None:
    """(commit_lsn, event_serial) from a tombstone's headers, or None (e.g. Debezium's tombstones carry none)."""
    for name, value in headers or ():
        if name == POSITION_HEADER and value is not None and len(value) == _POSITION.size:
            return _POSITION.unpack(value)
    return None


# ---------------------------------------------------------------------------------------------
# converters: pgtypes.converter with fast paths for the ISO date/time texts of the capture session

_DAYS: dict[str, int] = {}
_SECONDS: dict[str, int] = {}


def _days(text: str) -> int:
    """Days since 1970-01-01 of 'YYYY-MM-DD' (years 1000-9999), cached."""
    days = _DAYS.get(text)
    if days is None:
        if len(_DAYS) > 200_000:
            _DAYS.clear()
        days = _DAYS[text] = pgtypes.days_from_civil(int(text[:4]), int(text[5:7]), int(text[8:10]))
    return days


def _second(text: str) -> int:
    """Microseconds since 1970 of a checked 'YYYY-MM-DD HH:MM:SS', cached (rows of a second share it)."""
    if len(_SECONDS) > 200_000:
        _SECONDS.clear()
    micros = _SECONDS[text] = (_days(text[:10]) * 86400 + int(text[11:13]) * 3600 + int(text[14:16]) * 60
                               + int(text[17:19])) * 1_000_000
    return micros


def _is_plain_date(text: str) -> bool:
    """'YYYY-MM-DD' with a four-digit year (no BC, no infinity)."""
    return len(text) >= 10 and text[4] == "-" and text[7] == "-" and text[:4].isdigit()


def fast_converter(column: Column, unknown_types: str = "error"):
    """pgtypes.converter(column), with a faster path for date, timestamp and timestamptz in the session's ISO form.

    The fast path only takes the plain forms ('2024-05-27', '2024-05-27 08:27:17.5', '... +00'); every
    other text (BC, years > 9999, infinity, other offsets) goes through pgtypes, so results are identical.
    """
    slow = pgtypes.converter(column, unknown_types)
    t = column.type.resolved()
    if t.schema != "pg_catalog" or t.kind != "base" or t.name not in ("date", "timestamp", "timestamptz"):
        return slow
    if t.name == "date":
        def date(text, _slow=slow, _cached=_DAYS.get):
            if text is not None:
                days = _cached(text)  # only plain dates are cached
                if days is not None:
                    return days
                if len(text) == 10 and _is_plain_date(text):
                    return _days(text)
            return _slow(text)
        return date
    zone = t.name == "timestamptz"

    def timestamp(text, _slow=slow, _zone=zone, _cached=_SECONDS.get):
        if text is None:
            return None
        end = len(text)
        if _zone:
            if text[-3:] != "+00":
                return _slow(text)
            end -= 3
        base = _cached(text[:19])  # only plain 'YYYY-MM-DD HH:MM:SS' prefixes are cached
        if base is None:
            if end < 19 or text[10] != " " or not _is_plain_date(text) or text[13] != ":" or text[16] != ":":
                return _slow(text)
            base = _second(text[:19])
        if end == 19:
            return base
        if text[19] == "." and end <= 26 and text[20:end].isdigit():
            return base + int(text[20:end].ljust(6, "0"))
        return _slow(text)
    return timestamp
