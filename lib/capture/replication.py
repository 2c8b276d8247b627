"""The replication connection's wire protocol: read messages, and report only the position the capture chose.

**Operators: the position sent here becomes the slot's ``confirmed_flush_lsn``; PostgreSQL never
resends a transaction that committed below it. Report a position only after Kafka acknowledged every
event at or below it, or those events are lost when the capture restarts.**

psycopg2 starts replication (``start_replication``) and keeps the connection; this module then reads
and writes the COPY stream through the same libpq connection. psycopg2's own ``read_message`` is not
used because it moves its flush position to a server keepalive's WAL end whenever the flushed
position is at or above the last message's start. Begin, Stream Start/Stop, changes of interleaved
transactions and Relation messages (start 0) all start at or below positions already confirmed, so
a keepalive after one of them would confirm transactions Kafka has not acknowledged (psycopg2
2.9, ``pq_read_replication_message``). Here, the status message always carries the position given to
``acknowledge``, nothing else.

When the compiled module is built (lib/capture/native.py), messages are read in batches through the same libpq
functions; the WAL end of a message still counts only once the message is handed out, and a keepalive's only once
every message before it was handed out and handled, exactly as when they are read one at a time.
"""

from __future__ import annotations

import ctypes
import select
import struct
import time

import psycopg2
import psycopg2._psycopg

from lib.capture import native

_XLOGDATA = struct.Struct(">QQq")  # data start, WAL end, send time
_KEEPALIVE = struct.Struct(">QqB")  # WAL end, send time, reply requested
_STATUS = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, send time, reply requested
_PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in microseconds since 1970-01-01
_PGRES_FATAL_ERROR = 7
BATCH = 512  # messages the compiled reader takes from libpq per call


def _libpq() -> ctypes.CDLL:
    """libpq's functions as psycopg2 links them (the same library instance that owns its connections)."""
    lib = ctypes.CDLL(psycopg2._psycopg.__file__)
    conn, res, buf = ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char)
    for name, restype, argtypes in (
            ("PQgetCopyData", ctypes.c_int, [conn, ctypes.POINTER(buf), ctypes.c_int]),
            ("PQputCopyData", ctypes.c_int, [conn, ctypes.c_char_p, ctypes.c_int]),
            ("PQflush", ctypes.c_int, [conn]),
            ("PQconsumeInput", ctypes.c_int, [conn]),
            ("PQfreemem", None, [ctypes.c_void_p]),
            ("PQerrorMessage", ctypes.c_char_p, [conn]),
            ("PQgetResult", res, [conn]),
            ("PQresultStatus", ctypes.c_int, [res]),
            ("PQresultErrorMessage", ctypes.c_char_p, [res]),
            ("PQclear", None, [res])):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_pq = _libpq()


class Stream:
    """A started replication connection: ``read()`` messages, ``acknowledge()`` positions, ``send_status()``."""

    def __init__(self, connection, status_interval_s: float = 5.0, acknowledged: int = 0,
                 silence_s: float = 60.0) -> None:
        self.connection = connection
        # the server answers a status message that asks for a reply at once: silence_s without a byte after asking
        # is a connection that stalls (a network that drops everything, a frozen server), not an idle slot
        self.silence_s = silence_s
        self.last_heard = time.monotonic()
        self.asked_at: float | None = None
        self._conn = ctypes.c_void_p(connection.pgconn_ptr)
        self._buf = ctypes.POINTER(ctypes.c_char)()
        self.status_interval_s = status_interval_s
        self.flushed = acknowledged  # the only position ever reported to the server
        self.wal_end = 0  # the furthest WAL position the server said it has sent (messages and keepalives)
        self.last_status = 0.0  # time.monotonic() of the last status message
        self._reader = native.copy_reader(connection, _pq)  # None: one message per read() through ctypes
        self._batch: list = []  # (data start, payload, WAL end) read by the compiled reader, not yet handed out
        self._next = 0
        self._keepalive_end = 0  # a keepalive after the batch: counts once the batch was handled
        self._failed = 0  # the reader's failure, raised once the batch before it was handed out

    def fileno(self) -> int:
        return self.connection.fileno()

    def read(self) -> tuple[int, bytes] | None:
        """The next XLogData message as (data start, payload), or None when none is waiting."""
        if self._next < len(self._batch):
            start, payload, end = self._batch[self._next]
            self._next += 1
            if end > self.wal_end:
                self.wal_end = end
            return start, payload
        now = time.monotonic()
        if now - self.last_status >= self.status_interval_s:
            self.send_status(reply=self.asked_at is None and now - self.last_heard >= self.status_interval_s)
        message = self._read_batch() if self._reader is not None else self._read_one()
        # only a read that found nothing counts: after the loop was busy elsewhere (a full producer queue) the
        # server's reply may be waiting unread
        if message is None and self.asked_at is not None and time.monotonic() - self.asked_at > self.silence_s:
            now = time.monotonic()
            raise psycopg2.OperationalError(
                f"the server sent nothing for {now - self.last_heard:.0f} s, not even the reply to a status message "
                f"that asked for one {now - self.asked_at:.0f} s ago (source.stall_timeout_s): the connection "
                f"stalls (a network that drops packets, or a frozen server)")
        return message

    def _read_one(self) -> tuple[int, bytes] | None:
        """One message through ctypes (no compiled reader), or None."""
        consumed = False
        while True:
            size = _pq.PQgetCopyData(self._conn, ctypes.byref(self._buf), 1)
            if size > 0:
                data = ctypes.string_at(self._buf, size)
                _pq.PQfreemem(self._buf)
                kind = data[0]
                self._heard()
                if kind == 0x77:  # 'w' XLogData
                    start, end, _ = _XLOGDATA.unpack_from(data, 1)
                    if end > self.wal_end:
                        self.wal_end = end
                    return start, data[25:]
                if kind == 0x6B:  # 'k' primary keepalive: remember the position, answer if asked
                    end, _, reply = _KEEPALIVE.unpack_from(data, 1)
                    if end > self.wal_end:
                        self.wal_end = end
                    if reply:
                        self.send_status()
                    consumed = True
                    continue
                raise psycopg2.OperationalError(f"unexpected replication message type {chr(kind)!r} from the server")
            if size == 0:
                if consumed:
                    return None
                if not _pq.PQconsumeInput(self._conn):
                    raise psycopg2.OperationalError(self._error())
                consumed = True
                continue
            if size == -1:
                raise psycopg2.OperationalError(self._end_of_copy())
            raise psycopg2.OperationalError(self._error())

    def _read_batch(self) -> tuple[int, bytes] | None:
        """Refill the batch from the compiled reader; its first message, or None."""
        if self._keepalive_end > self.wal_end:  # every message before that keepalive was handled by now
            self.wal_end = self._keepalive_end
        if self._failed:
            self._raise(self._failed)
        reader = self._reader
        batch, status = reader.read(BATCH)
        if reader.reply:
            reader.reply = False
            self.send_status()
        if batch or reader.keepalive_end:  # the reader keeps a keepalive's end: zero until the next one
            self._heard()
        if not batch:
            if reader.keepalive_end > self.wal_end:
                self.wal_end = reader.keepalive_end
            reader.keepalive_end = 0
            if status:
                self._raise(status)
            return None
        self._failed = status
        self._keepalive_end, reader.keepalive_end = reader.keepalive_end, 0
        self._batch, self._next = batch, 1
        start, payload, end = batch[0]
        if end > self.wal_end:
            self.wal_end = end
        return start, payload

    def _raise(self, status: int) -> None:
        if status == -1:
            raise psycopg2.OperationalError(self._end_of_copy())
        if status == -3:
            kind = chr(self._reader.unexpected)
            raise psycopg2.OperationalError(f"unexpected replication message type {kind!r} from the server")
        raise psycopg2.OperationalError(self._error())

    def _heard(self) -> None:
        self.last_heard, self.asked_at = time.monotonic(), None

    def acknowledge(self, lsn: int) -> bool:
        """Remember lsn as flushed (sent with the next status message); True when it moved."""
        if lsn > self.flushed:
            self.flushed = lsn
            return True
        return False

    def send_status(self, reply: bool = False) -> None:
        """Send a standby status update carrying the acknowledged position now."""
        now_us = int(time.time() * 1_000_000) - _PG_EPOCH_US
        message = _STATUS.pack(b"r", self.flushed, self.flushed, 0, now_us, 1 if reply else 0)
        if _pq.PQputCopyData(self._conn, message, len(message)) <= 0 or _pq.PQflush(self._conn) != 0:
            raise psycopg2.OperationalError(self._error())
        self.last_status = time.monotonic()
        if reply:
            self.asked_at = self.last_status

    def wait(self, timeout_s: float) -> None:
        """Block until the server sends something or timeout_s passes."""
        select.select([self], [], [], timeout_s)

    def _error(self) -> str:
        message = _pq.PQerrorMessage(self._conn)
        return (message or b"").decode(errors="replace").strip() or "the replication connection failed"

    def _end_of_copy(self) -> str:
        """Why the server ended the COPY stream (its error message, if it sent one)."""
        result = _pq.PQgetResult(self._conn)
        try:
            if result and _pq.PQresultStatus(result) == _PGRES_FATAL_ERROR:
                return (_pq.PQresultErrorMessage(result) or b"").decode(errors="replace").strip()
        finally:
            if result:
                _pq.PQclear(result)
        return "the server ended replication"
