"""The capture's SQL connection beside its replication stream: heartbeats and the server's WAL position.

Each query is bounded (lib.source.bounded): a network that stalls instead of failing would otherwise block the
capture's loop for good. A failed query closes the connection and asks the stream for the server's reply; the
connection is made again only once the server answers there (else the stream stops after
source.stall_timeout_s and the capture's keeper waits for PostgreSQL).
"""

from __future__ import annotations

import contextlib

import psycopg2
import psycopg2.errors

from lib import config, source
from lib.capture import pgtypes
from lib.capture.pgoutput import str_to_lsn
from lib.capture.stream_state import State, StreamError

HEARTBEAT_PREFIX = "cdc-heartbeat"


def heartbeat(st: State) -> None:
    """A non-transactional logical message: moves the slot even when no published table is written."""
    if not _sql_ready(st):
        return
    try:
        with source.bounded(st.sql, st.stall_s), st.sql.cursor() as cur:
            cur.execute("SELECT pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,))
        st.heartbeats += 1
    except psycopg2.errors.InsufficientPrivilege as exc:
        raise StreamError(heartbeat_grant(st)) from exc
    except psycopg2.Error as exc:  # not fatal: the next heartbeat reconnects
        st.log(f"stream    heartbeat failed ({pg_message(exc)}); reconnecting once the server answers")
        _sql_failed(st)


def _sql_ready(st: State) -> bool:
    """The SQL connection can take a query: reconnected if a query failed, unless the stream waits for the
    server's reply too (then the server or the network stalls: the stream stops after source.stall_timeout_s)."""
    if st.cursor is not None and st.cursor.asked_at is not None:
        return False
    if st.sql.closed:
        _reconnect_sql(st)
    return not st.sql.closed


def _sql_failed(st: State) -> None:
    """A query failed or was cut: close the connection and ask the stream whether the server still answers."""
    with contextlib.suppress(psycopg2.Error):
        st.sql.close()
        if st.cursor is not None:
            st.cursor.send_status(reply=True)


def heartbeat_grant(st: State) -> str:
    """The remedy for a role that may not write heartbeats, naming the function's signature on this server."""
    user = config.get(st.conf, "source.user")
    return (f"role {user} may not call pg_logical_emit_message, which the capture uses for heartbeats (so an idle "
            f"slot keeps moving): as a superuser run GRANT EXECUTE ON FUNCTION "
            f"pg_catalog.{st.heartbeat_function} TO {user}; or run with heartbeat_s=0 (then writes to unpublished "
            f"tables alone may not advance the slot)")


def _reconnect_sql(st: State) -> None:
    with contextlib.suppress(psycopg2.Error):
        st.sql.close()
    try:
        st.sql = source.connect(st.conf, options=pgtypes.session_options(), connect_timeout=max(2, int(st.stall_s)))
        st.sql.autocommit = True
    except source.SourceError as exc:
        st.log(f"stream    cannot reconnect for heartbeats: {exc}")


def server_lsn(st: State) -> None:
    if not _sql_ready(st):
        return
    try:
        with source.bounded(st.sql, st.stall_s), st.sql.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            st.acks.server_lsn = str_to_lsn(cur.fetchone()[0])
    except psycopg2.Error:
        _sql_failed(st)


def pg_message(exc: psycopg2.Error) -> str:
    """The server's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
