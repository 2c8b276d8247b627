"""Decoder of pgoutput logical replication messages (protocol versions 1 to 4) into plain objects.

``Decoder().decode(payload)`` takes the payload of one replication message (psycopg2's
``ReplicationMessage.payload`` with ``decode=False``) and returns one of the message
dataclasses below. The decoder tracks Stream Start / Stream Stop itself: inside a stream
block, Relation, Type, Insert, Update, Delete, Truncate and Message carry the streamed
transaction's xid (otherwise their ``xid`` is None). Column values stay as the server sent
them: text as ``str``, binary as ``bytes``, NULL as None and an unchanged TOASTed value
(not sent) as ``UNCHANGED_TOAST``; converting them to Python types happens elsewhere.
LSNs are ints (``lsn_to_str`` / ``str_to_lsn`` convert to and from ``X/Y``), timestamps
timezone-aware UTC datetimes. Messages are read-only by convention (Begin, Commit, Insert,
Update and Delete are not frozen dataclasses only because those build faster). Two-phase
messages (P, K, r, p, b; option ``two_phase``) are not supported and raise ``PgOutputError``
like any unknown message byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import ClassVar

PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)

_u32 = struct.Struct(">I").unpack_from  # bound once: the hot path skips the attribute lookups
_i32 = struct.Struct(">i").unpack_from
_i16 = struct.Struct(">h").unpack_from
_BEGIN = struct.Struct(">QqI")  # final lsn, commit timestamp, xid
_COMMIT = struct.Struct(">BQQq")  # flags, commit lsn, end lsn, commit timestamp
_ORIGIN = struct.Struct(">Q")  # commit lsn on the origin
_COLUMN = struct.Struct(">Ii")  # type oid, type modifier
_MESSAGE = struct.Struct(">BQ")  # flags, lsn
_TRUNCATE = struct.Struct(">iB")  # number of relations, options
_STREAM_START = struct.Struct(">IB")  # xid, first segment
_STREAM_COMMIT = struct.Struct(">IBQQq")  # xid, flags, commit lsn, end lsn, commit timestamp
_STREAM_ABORT = struct.Struct(">II")  # xid, subxid
_STREAM_ABORT_V4 = struct.Struct(">IIQq")  # xid, subxid, abort lsn, abort timestamp


class PgOutputError(ValueError):
    """A payload that is not a well-formed pgoutput message."""


class _UnchangedToast:
    """Type of UNCHANGED_TOAST."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _UnchangedToast()
"""Value of a column whose TOASTed value did not change and was not sent (kind 'u')."""


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs per change
class Begin:
    """B: start of a (non-streamed) transaction."""

    kind: ClassVar[str] = "B"
    final_lsn: int
    commit_ts: datetime
    xid: int


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs per change
class Commit:
    """C: end of a (non-streamed) transaction."""

    kind: ClassVar[str] = "C"
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    """O: the transaction came from another node through a replication origin."""

    kind: ClassVar[str] = "O"
    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a Relation message."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def key(self) -> bool:
        """Whether the column is part of the replica identity (key)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Relation:
    """R: a table's schema, sent before its first change and again after it changes."""

    kind: ClassVar[str] = "R"
    relation_oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Type:
    """Y: a non-built-in type used by a following Relation (namespace '' means pg_catalog)."""

    kind: ClassVar[str] = "Y"
    type_oid: int
    namespace: str
    name: str
    xid: int | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs per change
class Insert:
    """I: a new row."""

    kind: ClassVar[str] = "I"
    relation_oid: int
    new: tuple
    xid: int | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs per change
class Update:
    """U: a changed row; old is the key ('K') or the whole old row ('O') when sent, else None."""

    kind: ClassVar[str] = "U"
    relation_oid: int
    old_kind: str | None
    old: tuple | None
    new: tuple
    xid: int | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs per change
class Delete:
    """D: a deleted row, as its key ('K') or the whole old row ('O')."""

    kind: ClassVar[str] = "D"
    relation_oid: int
    old_kind: str
    old: tuple
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Truncate:
    """T: one TRUNCATE of one or more relations."""

    kind: ClassVar[str] = "T"
    options: int
    relation_oids: tuple[int, ...]
    xid: int | None = None

    @property
    def cascade(self) -> bool:
        """TRUNCATE ... CASCADE."""
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        """TRUNCATE ... RESTART IDENTITY."""
        return bool(self.options & 2)


@dataclass(frozen=True, slots=True)
class Message:
    """M: a logical decoding message (pg_logical_emit_message)."""

    kind: ClassVar[str] = "M"
    transactional: bool
    lsn: int
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class StreamStart:
    """S: start of a block of a streamed (in-progress) transaction's changes."""

    kind: ClassVar[str] = "S"
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """E: end of a stream block."""

    kind: ClassVar[str] = "E"


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """c: commit of a streamed transaction."""

    kind: ClassVar[str] = "c"
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: datetime


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """A: abort of a streamed transaction (subxid == xid) or of one of its subtransactions."""

    kind: ClassVar[str] = "A"
    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_ts: datetime | None = None


def protocol_options(server_version: int) -> dict[str, str]:
    """pgoutput's options for a server (server_version_num): the newest protocol it speaks.

    13: protocol 1 (a transaction arrives once committed; no logical messages, so heartbeats only move the slot).
    14: 2, streaming on (a large transaction arrives in blocks while it runs) and logical messages.
    15: 3; two_phase stays off, so a prepared transaction arrives at COMMIT PREPARED like any other and nothing
    a later ROLLBACK PREPARED undoes ever reaches Kafka.
    16 and later: 4 with streaming parallel (a streamed abort also carries its LSN and time).
    """
    if server_version < 140000:
        return {"proto_version": "1"}
    if server_version < 150000:
        return {"proto_version": "2", "streaming": "on", "messages": "true"}
    if server_version < 160000:
        return {"proto_version": "3", "streaming": "on", "messages": "true"}
    return {"proto_version": "4", "streaming": "parallel", "messages": "true"}


def lsn_to_str(lsn: int) -> str:
    """LSN as PostgreSQL prints it, e.g. 16/B374D848."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def str_to_lsn(text: str) -> int:
    """LSN from its X/Y form."""
    high, sep, low = text.strip().partition("/")
    try:
        if not sep or not high or not low:
            raise ValueError
        hi, lo = int(high, 16), int(low, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r} (expected X/Y in hex, e.g. 16/B374D848)") from None
    if not (0 <= hi <= 0xFFFFFFFF and 0 <= lo <= 0xFFFFFFFF):
        raise ValueError(f"not an LSN: {text!r} (each half is at most FFFFFFFF)")
    return hi << 32 | lo


def timestamp(micros: int) -> datetime:
    """A protocol timestamp (microseconds since 2000-01-01 UTC) as a UTC datetime."""
    return PG_EPOCH + timedelta(microseconds=micros)


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    """A NUL-terminated string at pos, and the offset after its NUL."""
    end = buf.find(0, pos)
    if end < 0:
        raise PgOutputError(f"truncated {chr(buf[0])!r} message: string at offset {pos} has no NUL terminator")
    return buf[pos:end].decode(), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[tuple, int]:
    """TupleData at pos (column count, then per column a kind byte and maybe a value)."""
    count = _i16(buf, pos)[0]
    pos += 2
    size = len(buf)
    values = []
    append = values.append
    for _ in range(count):
        kind = buf[pos]
        if kind == 0x74:  # 't': text
            start = pos + 5
            pos = start + _i32(buf, pos + 1)[0]
            if not start <= pos <= size:
                raise _bad_length(buf, start, pos)
            append(buf[start:pos].decode())
        elif kind == 0x6E:  # 'n': null
            append(None)
            pos += 1
        elif kind == 0x75:  # 'u': unchanged toasted value
            append(UNCHANGED_TOAST)
            pos += 1
        elif kind == 0x62:  # 'b': binary
            start = pos + 5
            pos = start + _i32(buf, pos + 1)[0]
            if not start <= pos <= size:
                raise _bad_length(buf, start, pos)
            append(buf[start:pos])
        else:
            raise PgOutputError(f"unknown tuple column kind {chr(kind)!r} (0x{kind:02x}) at offset {pos}")
    return tuple(values), pos


def _bad_length(buf: bytes, start: int, end: int) -> PgOutputError:
    """Error for a column value whose length does not fit the payload."""
    if end < start:
        return PgOutputError(f"negative column value length {end - start} at offset {start - 4}")
    return PgOutputError(f"truncated {chr(buf[0])!r} message: column value at offset {start} runs to {end}, "
                         f"payload has {len(buf)} bytes")


# Message bodies: each takes the payload, the offset after the kind byte (and after the xid inside
# a stream block) and that xid or None, and returns the message and the offset where it ended.

def _begin(buf, pos, xid):
    final_lsn, ts, txid = _BEGIN.unpack_from(buf, pos)
    return Begin(final_lsn, timestamp(ts), txid), pos + _BEGIN.size


def _commit(buf, pos, xid):
    flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(buf, pos)
    return Commit(flags, commit_lsn, end_lsn, timestamp(ts)), pos + _COMMIT.size


def _origin(buf, pos, xid):
    commit_lsn = _ORIGIN.unpack_from(buf, pos)[0]
    name, pos = _string(buf, pos + 8)
    return Origin(commit_lsn, name), pos


def _relation(buf, pos, xid):
    oid = _u32(buf, pos)[0]
    namespace, pos = _string(buf, pos + 4)
    name, pos = _string(buf, pos)
    identity = chr(buf[pos])
    count = _i16(buf, pos + 1)[0]
    pos += 3
    columns = []
    for _ in range(count):
        flags = buf[pos]
        column, pos = _string(buf, pos + 1)
        type_oid, typmod = _COLUMN.unpack_from(buf, pos)
        pos += 8
        columns.append(Column(flags, column, type_oid, typmod))
    return Relation(oid, namespace, name, identity, tuple(columns), xid), pos


def _type(buf, pos, xid):
    oid = _u32(buf, pos)[0]
    namespace, pos = _string(buf, pos + 4)
    name, pos = _string(buf, pos)
    return Type(oid, namespace, name, xid), pos


def _insert(buf, pos, xid):
    oid = _u32(buf, pos)[0]
    if buf[pos + 4] != 0x4E:  # 'N'
        raise _unexpected(buf, pos + 4, "'N'")
    new, pos = _tuple(buf, pos + 5)
    return Insert(oid, new, xid), pos


def _update(buf, pos, xid):
    oid = _u32(buf, pos)[0]
    pos += 4
    marker = buf[pos]
    old_kind = old = None
    if marker == 0x4B or marker == 0x4F:  # 'K' key, 'O' old row
        old_kind = chr(marker)
        old, pos = _tuple(buf, pos + 1)
        marker = buf[pos]
    if marker != 0x4E:
        raise _unexpected(buf, pos, "'K', 'O' or 'N'" if old is None else "'N'")
    new, pos = _tuple(buf, pos + 1)
    return Update(oid, old_kind, old, new, xid), pos


def _delete(buf, pos, xid):
    oid = _u32(buf, pos)[0]
    marker = buf[pos + 4]
    if marker != 0x4B and marker != 0x4F:
        raise _unexpected(buf, pos + 4, "'K' or 'O'")
    old, pos = _tuple(buf, pos + 5)
    return Delete(oid, chr(marker), old, xid), pos


def _truncate(buf, pos, xid):
    count, options = _TRUNCATE.unpack_from(buf, pos)
    pos += _TRUNCATE.size
    if count < 0 or pos + 4 * count > len(buf):
        raise PgOutputError(f"truncated Truncate message: {count} relations, payload has {len(buf)} bytes")
    oids = struct.unpack_from(f">{count}I", buf, pos)
    return Truncate(options, oids, xid), pos + 4 * count


def _message(buf, pos, xid):
    flags, lsn = _MESSAGE.unpack_from(buf, pos)
    prefix, pos = _string(buf, pos + _MESSAGE.size)
    size = _i32(buf, pos)[0]
    pos += 4
    if size < 0 or pos + size > len(buf):
        raise PgOutputError(f"truncated Message content: {size} bytes at offset {pos}, payload has {len(buf)}")
    return Message(bool(flags & 1), lsn, prefix, buf[pos:pos + size], xid), pos + size


def _stream_start(buf, pos, xid):
    txid, first = _STREAM_START.unpack_from(buf, pos)
    return StreamStart(txid, first == 1), pos + _STREAM_START.size


def _stream_stop(buf, pos, xid):
    return StreamStop(), pos


def _stream_commit(buf, pos, xid):
    txid, flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT.unpack_from(buf, pos)
    return StreamCommit(txid, flags, commit_lsn, end_lsn, timestamp(ts)), pos + _STREAM_COMMIT.size


def _stream_abort(buf, pos, xid):
    if len(buf) - pos >= _STREAM_ABORT_V4.size:  # protocol v4 (streaming = parallel) adds lsn and time
        txid, subxid, lsn, ts = _STREAM_ABORT_V4.unpack_from(buf, pos)
        return StreamAbort(txid, subxid, lsn, timestamp(ts)), pos + _STREAM_ABORT_V4.size
    txid, subxid = _STREAM_ABORT.unpack_from(buf, pos)
    return StreamAbort(txid, subxid), pos + _STREAM_ABORT.size


def _unexpected(buf: bytes, pos: int, expected: str) -> PgOutputError:
    """Error for a wrong submessage byte at pos."""
    if pos >= len(buf):
        return PgOutputError(f"truncated {chr(buf[0])!r} message: expected {expected} at offset {pos}, "
                             f"payload has {len(buf)} bytes")
    return PgOutputError(f"unexpected byte {chr(buf[pos])!r} (0x{buf[pos]:02x}) at offset {pos} "
                         f"in {chr(buf[0])!r} message, expected {expected}")


_HANDLERS = {
    ord("B"): _begin, ord("C"): _commit, ord("O"): _origin, ord("R"): _relation, ord("Y"): _type,
    ord("I"): _insert, ord("U"): _update, ord("D"): _delete, ord("T"): _truncate, ord("M"): _message,
    ord("S"): _stream_start, ord("E"): _stream_stop, ord("c"): _stream_commit, ord("A"): _stream_abort,
}
_STREAMED = frozenset(ord(kind) for kind in "RYIUDTM")  # carry the xid inside a stream block
_START, _STOP = ord("S"), ord("E")


class Decoder:
    """Decodes one connection's pgoutput messages in order, tracking stream blocks (S .. E)."""

    __slots__ = ("in_stream",)

    def __init__(self) -> None:
        self.in_stream = False

    def decode(self, payload: bytes | bytearray | memoryview):
        """The message object for one replication message payload."""
        buf = payload if type(payload) is bytes else bytes(payload)
        try:
            kind = buf[0]
            handler = _HANDLERS[kind]
            if self.in_stream and kind in _STREAMED:
                message, end = handler(buf, 5, _u32(buf, 1)[0])
            else:
                message, end = handler(buf, 1, None)
        except KeyError:
            raise PgOutputError(f"unknown pgoutput message byte {chr(kind)!r} (0x{kind:02x}) at offset 0") from None
        except IndexError:
            if not buf:
                raise PgOutputError("empty pgoutput payload") from None
            raise _truncated(buf) from None
        except struct.error:
            raise _truncated(buf) from None
        except UnicodeDecodeError as exc:
            raise PgOutputError(f"malformed {chr(buf[0])!r} message: text is not UTF-8: {exc}") from None
        if end != len(buf):
            raise PgOutputError(f"{len(buf) - end} unexpected trailing bytes after {chr(kind)!r} message "
                                f"at offset {end}")
        if kind in (_START, _STOP):
            if (kind == _START) == self.in_stream:
                raise PgOutputError(f"{chr(kind)!r} message {'inside' if self.in_stream else 'outside'} "
                                    f"a stream block")
            self.in_stream = kind == _START
        return message


def _truncated(buf: bytes) -> PgOutputError:
    """Error for a payload that ends too early."""
    return PgOutputError(f"truncated {chr(buf[0])!r} message: payload ends at {len(buf)} bytes")
