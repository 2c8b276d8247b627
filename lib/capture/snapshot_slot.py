"""The snapshot's slot: created with an exported snapshot, so the rows read and the changes streamed meet at one
position, and the connections that read inside that snapshot."""

from __future__ import annotations

import time

import psycopg2

from lib import config, control, source
from lib.capture import slot_position
from lib.capture.catalog import sql_ident, sql_literal
from lib.capture.pgoutput import lsn_to_str, str_to_lsn

PLUGIN = "pgoutput"


class SnapshotError(RuntimeError):
    """The snapshot cannot start or failed; the message names the slot/table/setting and the remedy."""


def slot_info(conn, slot: str) -> dict | None:
    """The slot's row in pg_replication_slots as a dict, or None when it does not exist."""
    with conn.cursor() as cur:
        cur.execute("SELECT slot_name, plugin, slot_type, database, active, active_pid, "
                    "confirmed_flush_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = %s",
                    (slot,))
        row = cur.fetchone()
    if row is None:
        return None
    keys = ("slot", "plugin", "slot_type", "database", "active", "active_pid", "confirmed_flush_lsn", "wal_status")
    return dict(zip(keys, row, strict=True))


def drop_slot(conn, slot: str) -> None:
    """Drop an inactive slot; an active one -> SnapshotError naming the process that holds it."""
    info = slot_info(conn, slot)
    if info is None:
        return
    if info["active"]:
        raise _active_slot(info)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        if not conn.autocommit:
            conn.commit()
    except psycopg2.errors.ObjectInUse as exc:
        if not conn.autocommit:
            conn.rollback()
        raise _active_slot(slot_info(conn, slot) or info) from exc


def _active_slot(info: dict) -> SnapshotError:
    return SnapshotError(
        f"replication slot {info['slot']} is in use by process {info['active_pid']} (a stream or another "
        f"snapshot is reading it), so it cannot be dropped for a new snapshot; stop that process first "
        f"(SELECT pg_terminate_backend({info['active_pid']}) if it is a leftover), then run the snapshot again")


def create_slot_with_snapshot(conf: dict, log=print, resnapshot: bool = False):
    """Create the slot with an exported snapshot: (replication_conn, consistent_lsn, snapshot_name).

    Keep the returned connection open and idle until every reader imported the snapshot: any
    command on it, or closing it, ends the snapshot. Close it as soon as the reads are done.
    While the slot exists it retains WAL from its consistent point on: a slot nobody streams
    from fills the server's disk (bounded only by max_slot_wal_keep_size).

    When the slot exists already:

    - control says the snapshot is ``complete``: nothing to do, returns ``(None, consistent_lsn,
      None)`` with the recorded point (unless ``resnapshot``);
    - control says ``running`` or has no record (a snapshot failed or was killed): the slot is
      dropped and created again, which takes a NEW snapshot at a NEW consistent point. Topics may
      already hold 'r' rows of the failed attempt: harmless, the new snapshot sends every row
      again with the new (later) consistent point, and streamed changes sort after both; a key
      the failed attempt sent but that was deleted before the new point gets a delete event and
      a tombstone (``retract_stale_keys``). A slot that is active (someone streams from it) is
      never dropped: SnapshotError;
    - the slot uses another plugin or another database: SnapshotError naming it.

    ``resnapshot=True`` takes a new snapshot even after a complete one (the slot is dropped:
    changes it had not streamed yet are replaced by the new snapshot; keys deleted meanwhile are
    retracted as above). Stop the stream first. When the control record says complete but the
    slot is gone (dropped, or invalidated by max_slot_wal_keep_size), the stream cannot
    continue: this raises unless ``resnapshot``.
    """
    slot = config.get(conf, "source.slot")
    record = _snapshot_state(conf, slot)
    state = (record or {}).get("state")
    check = source.connect(conf)
    check.autocommit = True
    try:
        _check_server(check)
        info = slot_info(check, slot)
        with check.cursor() as cur:
            cur.execute("SELECT current_database()")
            database = cur.fetchone()[0]
        if info is not None and (info["plugin"] != PLUGIN or info["slot_type"] != "logical"
                                 or info["database"] != database):
            found = (f"with plugin {info['plugin']} on database {info['database']}" if info["slot_type"] == "logical"
                     else f"as a {info['slot_type']} slot")
            raise SnapshotError(
                f"replication slot {slot} exists {found}, but this pipeline needs a logical {PLUGIN} slot on "
                f"database {database}: "
                f"choose another source.slot in {conf.get('conf_file', 'conf')}, or drop the slot "
                f"(SELECT pg_drop_replication_slot('{slot}')) if nothing else uses it")
        lost = info is not None and info["wal_status"] == "lost"  # invalidated: it still exists but cannot stream
        if lost and state == "complete" and not resnapshot:
            raise SnapshotError(
                f"the snapshot of slot {slot} is recorded as complete, but PostgreSQL invalidated the slot (it "
                f"retained more WAL than max_slot_wal_keep_size allows while nobody streamed from it): changes "
                f"since then are lost to the stream. Remedy: stop the stream and take a new snapshot (notebook 02 "
                f"with resnapshot=True, or run(conf, spark, resnapshot=True)); consider a larger "
                f"max_slot_wal_keep_size")
        if info is not None and state == "complete" and not resnapshot:
            log(f"snapshot: slot {slot} exists and its snapshot is complete (consistent point "
                f"{lsn_to_str(int(record['consistent_lsn']))}): nothing to do")
            return None, int(record["consistent_lsn"]), None
        if info is None and state == "complete" and not resnapshot:
            raise SnapshotError(
                f"the snapshot of slot {slot} is recorded as complete, but the slot does not exist any more "
                f"(dropped, or invalidated by max_slot_wal_keep_size): changes since then are lost to the "
                f"stream. Remedy: stop the stream and take a new snapshot with run(conf, spark, resnapshot=True)")
        if info is not None:
            reason = "a new snapshot was requested" if resnapshot else (
                f"its snapshot did not complete (control state {state or 'missing'})")
            log(f"snapshot: slot {slot} exists but {reason}: dropping it and taking a new snapshot")
            drop_slot(check, slot)
    finally:
        check.close()
    return _create_slot(conf, slot)


def _snapshot_state(conf: dict, slot: str) -> dict | None:
    """control.snapshot_state, tolerating a control topic created a moment ago (metadata not there yet)."""
    for attempt in range(10):
        try:
            return control.snapshot_state(conf, slot)
        except control.ControlError:
            if attempt == 9:
                raise
            time.sleep(1)
    return None


def _check_server(conn) -> None:
    """PostgreSQL >= 13 (exported snapshots with pgoutput as used here)."""
    if conn.server_version < 130000:
        raise SnapshotError(f"PostgreSQL {conn.server_version} is too old: the pipeline needs 13 or newer")


def _create_slot(conf: dict, slot: str):
    """CREATE_REPLICATION_SLOT ... with an exported snapshot, on a new replication connection."""
    # the connection must survive idle while Spark reads: no idle timeouts, TCP keepalives on
    conn = source.connect(conf, replication=True, keepalives=1, keepalives_idle=30,
                          settings={"idle_session_timeout": "0", "idle_in_transaction_session_timeout": "0",
                                    "statement_timeout": "0"})
    failover = bool(config.get(conf, "source.failover_slot"))
    refusal = slot_position.failover_refusal(conf, conn.server_version)
    if refusal:
        conn.close()
        raise SnapshotError(refusal)
    if conn.server_version >= 150000:
        options = "SNAPSHOT 'export', FAILOVER true" if failover else "SNAPSHOT 'export'"
        command = f"CREATE_REPLICATION_SLOT {sql_ident(slot)} LOGICAL {PLUGIN} ({options})"
    else:
        command = f"CREATE_REPLICATION_SLOT {sql_ident(slot)} LOGICAL {PLUGIN} EXPORT_SNAPSHOT"
    try:
        with conn.cursor() as cur:
            cur.execute(command)  # waits for transactions that hold an XID to finish
            _, consistent_point, snapshot_name, _ = cur.fetchone()
    except psycopg2.Error as exc:
        conn.close()
        reason = str(exc).strip().splitlines()[0]
        raise SnapshotError(f"cannot create replication slot {slot}: {reason}; check that the role "
                            f"{config.get(conf, 'source.user')} has REPLICATION and that max_replication_slots "
                            f"is not exhausted (notebook 01 checks both)") from exc
    return conn, str_to_lsn(consistent_point), snapshot_name


def import_snapshot_sql(snapshot_name: str) -> str:
    """What every reader runs first: session settings, then a transaction on the exported snapshot."""
    return ("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, MDY'; SET IntervalStyle = 'iso_8601'; "
            "SET lc_monetary = 'C'; SET bytea_output = 'hex'; SET extra_float_digits = 3; "
            "SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0; "
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; "
            f"SET TRANSACTION SNAPSHOT {sql_literal(snapshot_name)}")


def snapshot_connection(conf: dict, snapshot_name: str):
    """A psycopg2 connection (pipeline role) inside a transaction on the exported snapshot."""
    conn = source.connect(conf)
    conn.autocommit = True  # the explicit BEGIN below opens the transaction; psycopg2 must not open another
    try:
        with conn.cursor() as cur:
            cur.execute(import_snapshot_sql(snapshot_name))
    except psycopg2.Error as exc:
        conn.close()
        raise _import_failed(snapshot_name, exc) from exc
    return conn


def _import_failed(snapshot_name: str, exc: Exception) -> SnapshotError:
    return SnapshotError(
        f"cannot import snapshot {snapshot_name}: {str(exc).strip().splitlines()[0]}; the replication "
        f"connection that exported it was closed or used for another command. Remedy: run the snapshot again "
        f"(a new slot and snapshot are taken)")
