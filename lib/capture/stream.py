"""The capture: one logical replication slot (pgoutput) -> one compacted, keyed Kafka topic per table, Avro.

``run(conf, until="caught_up" | "forever")``; ``python -m lib.capture.stream --target local`` from a shell. What it
guarantees (at-least-once, bounded memory, idle slots move, stops rather than guesses) and how: docs/capture.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import psycopg2
import psycopg2.errors

from lib import config, control, kafka_client, schema_registry, source
from lib.capture import (
    avro_schemas,
    catalog,
    changes,
    delivery,
    heap,
    incremental,
    incremental_chunks,
    native,
    pgtypes,
    relations,
    replication,
    server_link,
    slot_position,
    streamed_transactions,
)
from lib.capture.pgoutput import PgOutputError, lsn_to_str, protocol_options, str_to_lsn
from lib.capture.stream_state import DeliveryError, SnapshotIncompleteError, State, StreamError

UNTIL = ("caught_up", "forever")
HEARTBEAT_PREFIX = server_link.HEARTBEAT_PREFIX
STATUS_INTERVAL_S = 5  # psycopg2 sends a status message at least this often while reading

# ---------------------------------------------------------------------------------------------
# entry point


def run(conf: dict, until: str = "caught_up", max_seconds: float | None = None, stop_event=None,
        metrics_callback=None, *, heartbeat_s: float | None = 10.0, metrics_interval_s: float = 10.0,
        pg_options: str = "", spool_dir: str | None = None, log=None) -> dict:
    """Stream the slot into Kafka until caught up with the WAL position at start, or forever; returns metrics.

    'forever' stops on stop_event, SIGTERM/SIGINT (main thread) or max_seconds: it stops reading,
    flushes the producer, acknowledges what Kafka acknowledged (force=True) and closes.
    pg_options adds libpq startup options (e.g. '-c logical_decoding_work_mem=64kB').
    """
    if until not in UNTIL:
        raise ValueError(f"until must be one of {', '.join(UNTIL)}, not {until!r}")
    slot = config.get(conf, "source.slot")
    if until == "caught_up":
        _refuse_beside_the_service(conf)
    _require_snapshot(conf, slot)
    st = State(conf, until, heartbeat_s, metrics_interval_s, max_seconds, stop_event, metrics_callback,
               log or (lambda line: None))
    handlers = _install_signal_handlers(st)
    failure: BaseException | None = None
    try:
        _open(st, pg_options, spool_dir or config.get(conf, "source.spool_dir"))
        try:
            _loop(st)
        except psycopg2.Error as exc:
            raise StreamError(f"replication from slot {slot} failed: {server_link.pg_message(exc)}; nothing after "
                              f"{lsn_to_str(st.acks.acked)} was acknowledged: restart the capture to resume "
                              f"there") from exc
    except BaseException as exc:
        failure = exc
        raise
    finally:
        late = _close(st, failure)
        _restore_signal_handlers(handlers)
        if late is not None and failure is None:
            raise late
    return st.metrics()


def _refuse_beside_the_service(conf: dict) -> None:
    """A run to catch up (notebook 03, a job) must not race the continuous capture for the slot."""
    lease = control.running_service(conf, "capture")
    if lease is not None:
        raise StreamError(f"the continuous capture of slot {config.get(conf, 'source.slot')} runs "
                          f"({control.describe_lease(lease)}), and a slot serves one reader: it already streams "
                          f"every change to Kafka. Stop it first ({config.make(conf, 'stop')}, or pause the "
                          f"cdc_capture job) to run this step, or skip this step")


def _require_snapshot(conf: dict, slot: str) -> None:
    """Refuse to stream before the slot's snapshot is complete."""
    try:
        state = control.snapshot_state(conf, slot)
    except control.ControlError as exc:
        raise SnapshotIncompleteError(f"cannot read the snapshot state of slot {slot}: {exc}") from exc
    if not state or state.get("state") != "complete":
        found = "no snapshot was started" if not state else f"its snapshot state is {state.get('state')!r}"
        raise SnapshotIncompleteError(
            f"slot {slot}: {found}; the capture streams only after the slot's snapshot is complete (otherwise "
            f"the topics would miss the rows that existed before the slot): run notebook 02 (snapshot) for "
            f"slot {slot} first")


def _install_signal_handlers(st: State) -> dict:
    """SIGTERM/SIGINT -> graceful stop (only possible in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def stop(signum, frame):
        st.stop_reason = f"signal {signal.Signals(signum).name}"

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, stop)
    return previous


def _restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# start and stop


def _open(st: State, pg_options: str, spool_dir: str | None) -> None:
    """Check the slot, publication, tables, topics and heartbeat grant; start the producer and replication."""
    conf = st.conf
    st.sql = source.connect(conf, options=pgtypes.session_options())
    st.sql.autocommit = True
    slot_row = _wait_for_slot(st)
    st.acks.start_lsn = st.acks.acked = str_to_lsn(slot_row[3]) if slot_row[3] else 0
    with st.sql.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (st.publication,))
        if cur.fetchone() is None:
            raise StreamError(f"publication {st.publication} (source.publication) does not exist in database "
                              f"{st.database}: run notebook 01 (bootstrap) to create it")
        if st.heartbeat_s:
            # by oid: PostgreSQL 17 added a fourth parameter (flush), so the signature differs between majors
            cur.execute("SELECT p.oid::regprocedure::text, has_function_privilege(p.oid, 'EXECUTE') FROM pg_proc p "
                        "WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace "
                        "AND p.proargtypes[2] = 'text'::regtype")
            st.heartbeat_function, allowed = cur.fetchone()
            if not allowed:
                raise StreamError(server_link.heartbeat_grant(st))
        cur.execute("SELECT pg_current_wal_lsn()::text")
        st.acks.target = st.acks.server_lsn = str_to_lsn(cur.fetchone()[0])
    names = list(config.get(conf, "source.tables"))
    declared = config.get(conf, "source.keys") or {}
    described = catalog.describe_tables(st.sql, names, declared)
    named = config.get(conf, "kafka.topics")
    for topic, shared in avro_schemas.shared_topics(st.prefix, described.values(), named).items():
        raise StreamError(f"tables {' and '.join(shared)} would both write topic {topic} (Kafka topic names allow "
                          f"only letters, digits, '.', '_' and '-'): rename one, or capture it with another conf")
    for name, table in described.items():
        catalog.check_capturable(table)
        st.relations.topics[table.qualified] = avro_schemas.topic_for(conf, table)
        if name in declared:
            st.relations.keys[table.qualified] = declared[name]
    _check_topics(st)
    st.control = control.Tail(conf)
    records = st.control.catch_up()
    incremental_chunks.check_requests(st)
    st.registry = schema_registry.client(conf)
    st.producer, st.acks.delivery_timeout_s = delivery.producer(conf, st.slot)
    options = f"{pgtypes.session_options()} {pg_options}".strip()
    st.repl = source.connect(conf, replication=True, options=options)
    _check_position(st, records)
    _ensure_failover(st)
    cursor = st.repl.cursor()
    version = st.repl.server_version
    proto = protocol_options(version)
    try:
        cursor.start_replication(slot_name=st.slot, decode=False, start_lsn=0, status_interval=STATUS_INTERVAL_S,
                                 options={**proto, "publication_names": _quote_ident(st.publication)})
    except psycopg2.Error as exc:
        remedy = ("the changes it no longer holds are lost to the stream: take a new snapshot (notebook 02 with "
                  "resnapshot=True), then start the capture again" if "invalidated" in server_link.pg_message(exc) else
                  f"check that no other capture uses the slot and that publication {st.publication} exists")
        raise StreamError(f"cannot start replication from slot {st.slot}: {server_link.pg_message(exc)}; "
                          f"{remedy}") from exc
    st.cursor = replication.Stream(st.repl, STATUS_INTERVAL_S, st.acks.acked,  # psycopg2 reads nothing from here on
                                   float(config.get(st.conf, "source.stall_timeout_s")))
    st.cursor.send_status()
    st.acks.sent_feedback = st.acks.acked
    _remove_stale_spools(st.slot, spool_dir)  # only now: the slot is ours, no other capture of it runs
    st.spools.dir = tempfile.mkdtemp(prefix=f"cdc-stream-{st.slot}-", dir=spool_dir)
    st.log(f"stream    slot {st.slot} from {lsn_to_str(st.acks.acked)}, caught up at {lsn_to_str(st.acks.target)} "
           f"(PostgreSQL {version // 10000}, protocol {proto['proto_version']}; {native.REASON})")


def _check_position(st: State, records: dict) -> None:
    """The slot continues what this capture confirmed last (slot_position.py); the record gates feedback from now."""
    st.identity = slot_position.identify(st.repl)
    recorded = records.get(slot_position.key(st.slot))
    server = f"{config.get(st.conf, 'source.host')}:{config.get(st.conf, 'source.port')}"
    slot_position.check(st.slot, recorded, st.acks.acked, st.identity,
                        lambda timeline: slot_position.history(st.repl, timeline), server)
    if recorded and recorded.get("timeline") == st.identity["timeline"]:
        st.acks.recorded = max(st.acks.acked, str_to_lsn(recorded["lsn"]))
    else:
        st.acks.recorded, st.acks.record_due = st.acks.acked, True  # record this server's identity now


def _ensure_failover(st: State) -> None:
    """With source.failover_slot, the slot is a failover slot (one made before the setting is altered to be one)."""
    if not config.get(st.conf, "source.failover_slot"):
        return
    refusal = slot_position.failover_refusal(st.conf, st.repl.server_version)
    if refusal:
        raise StreamError(refusal)
    with st.sql.cursor() as cur:
        cur.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (st.slot,))
        row = cur.fetchone()
    if row and not row[0]:
        with st.repl.cursor() as cur:
            cur.execute(f"ALTER_REPLICATION_SLOT {_quote_ident(st.slot)} (FAILOVER true)")
        st.log(f"stream    slot {st.slot} is now a failover slot (source.failover_slot)")


def _wait_for_slot(st: State, timeout_s: float = 20.0) -> tuple:
    """The slot's row (plugin, database, active_pid, confirmed_flush_lsn) once no other process holds it."""
    deadline = time.monotonic() + timeout_s
    with st.sql.cursor() as cur:
        while True:
            cur.execute("SELECT plugin, database, active_pid, confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (st.slot,))
            row = cur.fetchone()
            if row is None:
                raise StreamError(
                    f"replication slot {st.slot} (source.slot) does not exist on {config.get(st.conf, 'source.host')}"
                    f":{config.get(st.conf, 'source.port')}, but its snapshot is complete: the slot was dropped, "
                    f"invalidated, or lost in a failover to a standby that had no failover slot, and the changes "
                    f"since the capture last confirmed are lost to the stream. Do not create it by hand: "
                    f"{slot_position.REMEDY}")
            if row[0] != "pgoutput" or row[1] != st.database:
                raise StreamError(f"replication slot {st.slot} uses plugin {row[0]} in database {row[1]}, but the "
                                  f"capture needs pgoutput in {st.database} (source.database); use another "
                                  f"source.slot or drop that slot")
            if row[2] is None:
                return row
            if time.monotonic() > deadline:  # a killed capture's walsender goes away within seconds
                raise StreamError(f"replication slot {st.slot} is in use by server process {row[2]}: another "
                                  f"capture is running for it; stop that one first (two would not share one slot)")
            time.sleep(0.25)


def _remove_stale_spools(slot: str, spool_dir: str | None) -> None:
    """Spool folders a killed capture of this slot left behind (the slot is free, so none is in use)."""
    parent = spool_dir or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(f"cdc-stream-{slot}-"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _check_topics(st: State) -> None:
    """Every configured table's topic exists (auto topic creation is off)."""
    try:
        with kafka_client.waiting_on(st.conf, "list its topics"):
            existing = kafka_client.check(st.conf).topics
    except kafka_client.KafkaAccessError as exc:
        raise StreamError(str(exc)) from exc
    missing = [f"{t} (table {q})" for q, t in st.relations.topics.items() if t not in existing]
    if missing:
        raise StreamError(f"topics missing: {', '.join(missing)}; run notebook 01 (bootstrap) to create them")


def _close(st: State, failure: BaseException | None) -> BaseException | None:
    """Flush Kafka, acknowledge what it acknowledged (force=True), close; returns a delivery error found now."""
    late = None
    if st.producer is not None:
        deadline = time.monotonic() + (0 if isinstance(failure, DeliveryError) else delivery.FLUSH_TIMEOUT_S)
        with kafka_client.waiting_on(st.conf, "acknowledge what the capture sent before it stops"):
            while st.producer.flush(1.0) > 0 and time.monotonic() < deadline:
                delivery.keepalive(st, quiet=True)
        if isinstance(failure, DeliveryError):  # Kafka stopped acknowledging: nothing more goes out of this producer
            st.producer.purge(in_queue=True, in_flight=True)
            st.producer.poll(0)
        try:
            delivery.advance(st)
        except DeliveryError as exc:
            late = exc
        if (failure is None and late is None and not st.acks.inflight and st.tx is None and not st.spools.files
                and not st.decoder.in_stream and st.cursor is not None):
            delivery.ack(st, st.cursor.wal_end)  # everything read was delivered: the server's position is safe
        if st.cursor is not None and st.identity is not None:
            slot_position.record_now(st, 10.0)  # the slot hears of a position only once its record is in Kafka
        if st.until == "caught_up" and failure is None and late is None:  # only later commits may be unsent
            st.caught_up = st.stop_reason == "caught_up" and all(t[3] >= st.acks.target for t in st.acks.inflight)
    if st.cursor is not None:
        with contextlib.suppress(psycopg2.Error):
            slot_position.release(st)
            st.cursor.send_status()
            st.acks.sent_feedback = st.cursor.flushed
    for conn in (st.repl, st.sql):
        if conn is not None:
            with contextlib.suppress(psycopg2.Error):
                if conn is st.sql and not conn.closed:
                    with source.bounded(conn, st.stall_s), conn.cursor() as cur:
                        cur.execute("SELECT pg_current_wal_lsn()::text")
                        st.acks.server_lsn = str_to_lsn(cur.fetchone()[0])
                conn.close()
    if st.control is not None:
        st.control.close()
    for spool in st.spools.files.values():
        with contextlib.suppress(OSError):
            spool[0].close()
    if st.spools.dir:
        shutil.rmtree(st.spools.dir, ignore_errors=True)
    reason = f"{type(failure).__name__}: {failure}" if failure is not None else st.stop_reason
    st.log(f"stream    stopped ({reason}); acknowledged {lsn_to_str(st.acks.acked)}")
    return late


# ---------------------------------------------------------------------------------------------
# the loop


def _loop(st: State) -> None:
    """Read replication messages; between batches serve Kafka callbacks, acks, heartbeats, metrics and stops."""
    read = st.cursor.read
    poll = st.producer.poll
    busy = 0
    while True:
        message = read()
        if message is not None:
            _handle(st, message)
            busy += 1
            if busy < 256 and st.stop_reason is None:  # a signal or an interrupted replay stops reading at once
                continue
        busy = 0
        poll(0)
        delivery.advance(st)
        if message is None:
            _idle(st)
        if _tick(st):
            return
        if message is None:
            st.cursor.wait(0.2)


def _handle(st: State, message: tuple[int, bytes]) -> None:
    """Dispatch one replication message (data start, payload)."""
    data_start, payload = message
    if payload and payload[0] in changes.ROW_CHANGES and not st.decoder.in_stream \
            and changes.change_raw(st, payload, data_start):
        return
    if st.decoder.in_stream and payload[0] in streamed_transactions.SPOOLED:
        try:
            spool = st.spools.files[st.spools.xid][0]
            spool.write(streamed_transactions.RECORD.pack(data_start, len(payload)))
            spool.write(payload)
        except OSError as exc:
            raise streamed_transactions.spool_error(st, st.spools.xid, exc) from exc
        return
    try:
        m = st.decoder.decode(payload)
    except PgOutputError as exc:
        raise StreamError(f"malformed pgoutput message at LSN {lsn_to_str(data_start)}: {exc}; the slot "
                          f"stays at {lsn_to_str(st.acks.acked)}; report this with the server version") from exc
    kind = m.kind
    if kind in "IUD":
        changes.change(st, m, data_start)
    elif kind == "B":
        delivery.begin(st, m.final_lsn, m.xid, m.commit_ts)
    elif kind == "C":
        delivery.commit(st, m.commit_lsn, m.end_lsn)
    elif kind == "R":
        relations.remember_relation(st, m)
    elif kind == "T":
        changes.truncate(st, m, data_start)
    elif kind == "S":
        streamed_transactions.stream_start(st, m)
    elif kind == "E":
        st.spools.xid = None
    elif kind == "c":
        streamed_transactions.stream_commit(st, m, _tick)
    elif kind == "A":
        streamed_transactions.stream_abort(st, m)
    elif kind == "M" and m.prefix == incremental.WATERMARK_PREFIX:
        incremental_chunks.watermark(st, m)
    # Y (types: the catalog describes them), M (logical messages, e.g. heartbeats), O (origin): nothing to send


def _idle(st: State) -> None:
    """Nothing to read: with nothing pending, acknowledge the server's position (an idle slot must not pin WAL).

    The keepalive's position is safe then: the server sends every transaction committed below it
    before the keepalive itself.
    """
    if not st.acks.inflight and st.tx is None and not st.spools.files and not st.decoder.in_stream:
        delivery.ack(st, st.cursor.wal_end)
    if (st.until == "caught_up" and st.heartbeat_s and st.cursor.wal_end < st.acks.target
            and time.monotonic() - st.last_heartbeat >= 1.0):
        st.last_heartbeat = time.monotonic()  # a record past the target: its message proves we read that far
        server_link.heartbeat(st)


def _tick(st: State) -> bool:
    """Time-based work: stop conditions, feedback, heartbeat, metrics. True when the loop should end."""
    now = time.monotonic()
    if st.stop_reason is not None:
        pass
    elif st.stop_event is not None and st.stop_event.is_set():
        st.stop_reason = "stop_event"
    elif st.deadline is not None and now >= st.deadline:
        st.stop_reason = "max_seconds"
    elif st.until == "caught_up" and _caught_up(st):
        st.stop_reason = "caught_up"
    slot_position.maybe_record(st, now)
    if st.cursor.flushed != st.acks.sent_feedback and now - st.acks.last_feedback >= 1.0:
        st.cursor.send_status()
        st.acks.sent_feedback, st.acks.last_feedback = st.cursor.flushed, now
    if st.heartbeat_s and now - st.last_heartbeat >= st.heartbeat_s:
        st.last_heartbeat = now
        server_link.heartbeat(st)
    if now - st.chunks.last_check >= st.chunks.check_s:
        st.chunks.last_check = now
        incremental_chunks.check_requests(st)
    incremental_chunks.next_chunk(st)
    if now - st.last_metrics >= st.metrics_interval_s:
        interval = now - st.last_metrics
        st.last_metrics = now
        server_link.server_lsn(st)
        if st.metrics_callback is not None:
            st.metrics_callback(st.metrics(interval))
        st.interval_events = st.events
        st.trimmed_at = heap.maybe_trim(st.events + st.tombstones, st.trimmed_at,
                                        not st.acks.inflight and st.tx is None)
    return st.stop_reason is not None


def _caught_up(st: State) -> bool:
    """Everything committed before the target position was read, and every requested incremental snapshot done."""
    if st.chunks.requests or st.chunks.current is not None:
        return False
    if st.tx is not None and st.tx.commit_lsn < st.acks.target:
        return False
    if st.cursor.wal_end >= st.acks.target:
        return True
    return st.acks.acked >= st.acks.target and st.tx is None and not st.acks.inflight  # nothing was left to send


# ---------------------------------------------------------------------------------------------
# relations, plans and schemas


def _quote_ident(name: str) -> str:
    """A publication name as publication_names parses it (quoted unless a plain lower-case identifier)."""
    if name.replace("_", "a").isalnum() and name == name.lower() and not name[0].isdigit():
        return name
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------------------------------------
# truncate and streamed transactions


# ---------------------------------------------------------------------------------------------
# incremental snapshots (lib/capture/incremental.py): chunks read beside the stream


# ---------------------------------------------------------------------------------------------
# metrics and command line


def summary(m: dict) -> str:
    """One line for a metrics dict."""
    rate = m.get("interval_events_per_s", m["events_per_s"])
    lag = f"{m['lag_bytes']} B" if m["lag_bytes"] is not None else "?"
    return (f"stream {m['slot']}: {m['events']} events ({rate}/s), {m['tombstones']} tombstones, "
            f"{sum(m['truncates'].values())} truncates, {m['transactions']} tx; acked {m['acked_lsn']}, "
            f"lag {lag} / {m['lag_s']} s" + (f"; stopped: {m['stopped']}" if m.get("stopped") else ""))


def main(argv: list[str] | None = None) -> int:
    """python -m lib.capture.stream --target local [--until caught_up|forever]: a line per interval, then a summary."""
    parser = argparse.ArgumentParser(prog="python -m lib.capture.stream", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    parser.add_argument("--until", choices=UNTIL, default="caught_up")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--heartbeat-s", type=float, default=10.0, help="heartbeat interval, 0 = none (default 10)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between summary lines (default 10)")
    parser.add_argument("--pg-options", default="", help="libpq startup options for the replication connection, "
                        "e.g. --pg-options='-c logical_decoding_work_mem=64kB'")
    args = parser.parse_args(argv)
    try:
        conf = config.load(args.target)
        result = run(conf, until=args.until, max_seconds=args.max_seconds, heartbeat_s=args.heartbeat_s,
                     pg_options=args.pg_options, metrics_interval_s=args.interval,
                     metrics_callback=lambda m: print(summary(m), flush=True),
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print("final " + summary(result), flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
