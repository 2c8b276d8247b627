"""The capture: one logical replication slot (pgoutput) -> one compacted, keyed Kafka topic per table, Avro.

``run(conf, until="caught_up" | "forever")`` streams the slot's changes; ``python -m lib.stream
--target local`` does the same from a shell. Events follow docs/events.md (lib/events.py builds
them). What it guarantees and how:

- **Starts only after the snapshot**: ``control.snapshot_state(conf, slot)`` must be ``complete``
  (notebook 02); it then resumes at the slot's confirmed position (START_REPLICATION 0).
- **At-least-once**: a transaction's end LSN is acknowledged to PostgreSQL (``lib.replication``)
  only when Kafka acknowledged every message of it and of every earlier transaction. After a
  crash the server resends everything after the acknowledged position; duplicates carry the same
  ``(commit_lsn, event_serial)``, so consumers drop them.
- **Memory stays bounded**: a regular transaction's Begin already carries its commit LSN and time,
  so its changes are sent as they arrive (nothing is held until Commit). A transaction the server
  streams while still in progress (protocol 2, ``streaming on``) is spooled to a temp file per
  top-level xid (``source.spool_dir`` in conf, default the system temp dir: it needs room for the largest
  transaction), with the changes of rolled-back subtransactions dropped, and replayed at Stream Commit.
  The Kafka producer's queue is capped (64 MB / 100k messages); when full, the capture waits.
- **Idle slots move**: with nothing in flight the capture acknowledges the server's keepalive
  position, and it writes a heartbeat (``pg_logical_emit_message``) every ``heartbeat_s`` seconds so
  that a database whose writes all go to unpublished tables still advances the slot.
- **Stops rather than guesses**: a schema change the registry refuses, an unsupported type, a value
  that cannot be converted, a table in the publication but not in ``source.tables``, or a failed
  Kafka delivery stops the capture with an error naming the table/column/topic and the remedy,
  without acknowledging the affected transaction.

**Operators: a stopped capture (error, or simply not running) does not acknowledge anything, so
PostgreSQL keeps all WAL from the slot's position on until the disk fills or
``max_slot_wal_keep_size`` invalidates the slot (then the tables must be snapshotted again).**
Watch ``lag_bytes`` and restart the capture after fixing the reported cause.

Kafka producer settings are PRODUCER_DEFAULTS (idempotent, acks=all, Java's murmur2 partitioner so
keys land where Spark or Kafka Connect put them), overridden by an optional ``kafka.producer`` mapping
in conf. Metrics (returned, and passed to ``metrics_callback`` every ``metrics_interval_s``): events
and events/s, events per table, tombstones, truncates, lag in bytes (server WAL position minus
acknowledged) and seconds (now minus the commit time of the last delivered transaction).

TRUNCATE has no key, so it is not written to the table topic: the capture writes
``truncate/<schema.table>`` = ``{commit_lsn, event_serial, ts_ms, ...}`` to the control topic
(``lib.control``) and counts it in the metrics; the merge deletes the rows ordered before it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from collections import Counter, deque

import psycopg2
import psycopg2.errors
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from lib import (
    avro_schemas,
    catalog,
    config,
    control,
    events,
    incremental,
    pgtypes,
    replication,
    schema_registry,
    source,
)
from lib.avro_schemas import topic_name
from lib.pgoutput import Decoder, PgOutputError, lsn_to_str, str_to_lsn

UNTIL = ("caught_up", "forever")
HEARTBEAT_PREFIX = "cdc-heartbeat"
STATUS_INTERVAL_S = 5  # psycopg2 sends a status message at least this often while reading
KEEPALIVE_S = 5.0  # while blocked (full producer queue, long replay) a status message goes out this often
FLUSH_TIMEOUT_S = 30.0
PRODUCER_DEFAULTS = {
    "enable.idempotence": True,  # per-partition order and no duplicates from producer retries
    "acks": "all",
    "partitioner": "murmur2_random",  # Java's default: the same key lands where Spark/Kafka Connect put it
    "linger.ms": 20,
    "compression.type": "lz4",
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 65_536,
}
INCREMENTAL_CHECK_S = 10.0  # how often the capture looks for new incremental snapshot requests
_SPOOLED = frozenset(b"RYIUDTM")  # messages inside a stream block that belong to the streamed transaction
_RECORD = struct.Struct(">QI")  # spool record header: data_start, payload length


class StreamError(RuntimeError):
    """The capture stopped; the message names the table/column/topic and the remedy."""


class SnapshotIncompleteError(StreamError):
    """The slot's snapshot is not complete: streaming would leave rows out of the topics."""


class SchemaChangeError(StreamError):
    """The registry refused a table's new schema."""


class DeliveryError(StreamError):
    """Kafka did not accept a message after the producer's retries."""


class _State:
    """Everything one capture run holds (connections, producer, positions, counters)."""

    def __init__(self, conf: dict, until: str, heartbeat_s: float | None, metrics_interval_s: float,
                 max_seconds: float | None, stop_event, metrics_callback, log) -> None:
        self.conf, self.until, self.log = conf, until, log
        self.slot = config.get(conf, "source.slot")
        self.publication = config.get(conf, "source.publication")
        self.database = config.get(conf, "source.database")
        self.prefix = config.get(conf, "kafka.topic_prefix")
        self.unknown_types = config.get(conf, "source.unknown_types", "error")
        self.heartbeat_s = heartbeat_s if heartbeat_s and heartbeat_s > 0 else None
        self.metrics_interval_s = metrics_interval_s
        self.stop_event, self.metrics_callback = stop_event, metrics_callback
        self.started = time.monotonic()
        self.deadline = self.started + max_seconds if max_seconds else None
        self.stop_reason: str | None = None
        self.sql = self.repl = self.cursor = self.producer = self.registry = None
        self.control: control.Tail | None = None  # the control topic, read as it grows (incremental requests)
        self.spool_dir: str | None = None
        self.topics: dict[str, str] = {}  # configured schema.table -> topic
        self.keys: dict[str, list[str]] = {}  # schema.table -> key columns declared in source.keys
        self.relations: dict[int, object] = {}  # relation oid -> latest Relation message
        self.plans: dict[int, events.Plan] = {}  # relation oid -> plan of its current Relation
        self.shapes: dict[tuple, events.Plan] = {}  # Relation shape -> plan (a Relation may be resent)
        self.tables: dict[str, catalog.Table] = {}  # schema.table -> table version of the latest plan
        self.decoder = Decoder()
        self.tx: events.Tx | None = None  # the transaction being sent (Begin..Commit, or a replayed stream)
        self.serial = 0
        self.tracker: list | None = None
        self.on_delivery = None
        self.prev_commit: int | None = None
        self.stream_xid: int | None = None
        self.spools: dict[int, list] = {}  # top-level xid -> [file, aborted subxids, path]
        self.inflight: deque[list] = deque()  # per transaction: [pending, end_lsn, commit_ms, commit_lsn, error]
        self.delivery_errors: list[tuple] = []
        self.start_lsn = self.acked = self.target = 0
        self.sent_feedback = 0
        self.last_feedback = self.last_heartbeat = self.last_metrics = time.monotonic()
        self.last_commit_ms: int | None = None
        self.events = self.tombstones = self.transactions = self.heartbeats = self.streamed = 0
        self.subxact_aborts = 0
        self.per_table: Counter = Counter()
        self.truncates: Counter = Counter()
        self.schemas: list[dict] = []
        self.interval_events = 0
        self.server_lsn: int | None = None
        self.caught_up = False
        self.incremental: list[dict] = []  # requested incremental snapshots (lib.incremental), oldest first
        self.chunk: dict | None = None  # the chunk being read or waiting for its watermark
        self.chunk_seq = self.chunk_failures = 0
        self.chunk_rows = int(config.get(conf, "source.incremental_chunk_rows", incremental.DEFAULT_CHUNK_ROWS))
        self.last_incremental_check = time.monotonic()
        self.incremental_check_s = float(config.get(conf, "source.incremental_check_s", INCREMENTAL_CHECK_S))
        self.chunk_retry_at = 0.0


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
    st = _State(conf, until, heartbeat_s, metrics_interval_s, max_seconds, stop_event, metrics_callback,
                log or (lambda line: None))
    handlers = _install_signal_handlers(st)
    failure: BaseException | None = None
    try:
        _open(st, pg_options, spool_dir or config.get(conf, "source.spool_dir", None))
        try:
            _loop(st)
        except psycopg2.Error as exc:
            raise StreamError(f"replication from slot {slot} failed: {_pg_message(exc)}; nothing after "
                              f"{lsn_to_str(st.acked)} was acknowledged: restart the capture to resume there") from exc
    except BaseException as exc:
        failure = exc
        raise
    finally:
        late = _close(st, failure)
        _restore_signal_handlers(handlers)
        if late is not None and failure is None:
            raise late
    return metrics(st)


def _refuse_beside_the_service(conf: dict) -> None:
    """A run to catch up (notebook 03, a job) must not race the continuous capture for the slot."""
    lease = control.running_service(conf, "capture")
    if lease is not None:
        raise StreamError(f"the continuous capture of slot {config.get(conf, 'source.slot')} runs "
                          f"({control.describe_lease(lease)}), and a slot serves one reader: it already streams "
                          f"every change to Kafka. Stop it first (make stop, or pause the cdc_capture job) to run "
                          f"this step, or skip this step")


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


def _install_signal_handlers(st: _State) -> dict:
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


def _open(st: _State, pg_options: str, spool_dir: str | None) -> None:
    """Check the slot, publication, tables, topics and heartbeat grant; start the producer and replication."""
    conf = st.conf
    st.sql = source.connect(conf, options=pgtypes.session_options())
    st.sql.autocommit = True
    slot_row = _wait_for_slot(st)
    st.start_lsn = st.acked = str_to_lsn(slot_row[3]) if slot_row[3] else 0
    with st.sql.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (st.publication,))
        if cur.fetchone() is None:
            raise StreamError(f"publication {st.publication} (source.publication) does not exist in database "
                              f"{st.database}: run notebook 01 (bootstrap) to create it")
        if st.heartbeat_s:
            cur.execute("SELECT has_function_privilege('pg_catalog.pg_logical_emit_message(boolean,text,text)', "
                        "'EXECUTE')")
            if not cur.fetchone()[0]:
                raise StreamError(_heartbeat_grant(st))
        cur.execute("SELECT pg_current_wal_lsn()::text")
        st.target = st.server_lsn = str_to_lsn(cur.fetchone()[0])
    names = list(config.get(conf, "source.tables"))
    declared = config.get(conf, "source.keys", {}) or {}
    described = catalog.describe_tables(st.sql, names, declared)
    for topic, shared in avro_schemas.shared_topics(st.prefix, described.values()).items():
        raise StreamError(f"tables {' and '.join(shared)} would both write topic {topic} (Kafka topic names allow "
                          f"only letters, digits, '.', '_' and '-'): rename one, or capture it with another conf")
    for name, table in described.items():
        catalog.check_capturable(table)
        st.topics[table.qualified] = topic_name(st.prefix, table)
        if name in declared:
            st.keys[table.qualified] = declared[name]
    _check_topics(st)
    st.control = control.Tail(conf)
    st.control.catch_up()
    _check_incremental(st)
    st.registry = schema_registry.client(conf)
    settings = {**PRODUCER_DEFAULTS, **(config.get(conf, "kafka.producer", None) or {}),
                "bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                "client.id": f"cdc-stream-{st.slot}"}
    st.producer = Producer(settings)
    options = f"{pgtypes.session_options()} {pg_options}".strip()
    st.repl = source.connect(conf, replication=True, options=options)
    cursor = st.repl.cursor()
    version = st.repl.server_version
    proto = {"proto_version": "2", "streaming": "on", "messages": "true"} if version >= 140000 else {
        "proto_version": "1"}
    try:
        cursor.start_replication(slot_name=st.slot, decode=False, start_lsn=0, status_interval=STATUS_INTERVAL_S,
                                    options={**proto, "publication_names": _quote_ident(st.publication)})
    except psycopg2.Error as exc:
        raise StreamError(f"cannot start replication from slot {st.slot}: {_pg_message(exc)}; check that no other "
                          f"capture uses the slot and that publication {st.publication} exists") from exc
    st.cursor = replication.Stream(st.repl, STATUS_INTERVAL_S, st.acked)  # psycopg2 reads nothing from here on
    st.cursor.send_status()
    st.sent_feedback = st.acked
    _remove_stale_spools(st.slot, spool_dir)  # only now: the slot is ours, no other capture of it runs
    st.spool_dir = tempfile.mkdtemp(prefix=f"cdc-stream-{st.slot}-", dir=spool_dir)
    st.log(f"stream    slot {st.slot} from {lsn_to_str(st.acked)}, caught up at {lsn_to_str(st.target)} "
           f"(PostgreSQL {version // 10000}, protocol {proto['proto_version']})")


def _wait_for_slot(st: _State, timeout_s: float = 20.0) -> tuple:
    """The slot's row (plugin, database, active_pid, confirmed_flush_lsn) once no other process holds it."""
    deadline = time.monotonic() + timeout_s
    with st.sql.cursor() as cur:
        while True:
            cur.execute("SELECT plugin, database, active_pid, confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (st.slot,))
            row = cur.fetchone()
            if row is None:
                raise StreamError(f"replication slot {st.slot} (source.slot) does not exist: run notebook 01 "
                                  f"(bootstrap) and notebook 02 (snapshot) to create and fill it")
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


def _check_topics(st: _State) -> None:
    """Every configured table's topic exists (auto topic creation is off)."""
    admin = AdminClient({"bootstrap.servers": config.get(st.conf, "kafka.bootstrap_servers")})
    try:
        existing = admin.list_topics(timeout=15).topics
    except KafkaException as exc:
        raise StreamError(f"cannot reach Kafka at {config.get(st.conf, 'kafka.bootstrap_servers')}: "
                          f"{exc.args[0].str()}; check kafka.bootstrap_servers and that the brokers run") from exc
    missing = [f"{t} (table {q})" for q, t in st.topics.items() if t not in existing]
    if missing:
        raise StreamError(f"topics missing: {', '.join(missing)}; run notebook 01 (bootstrap) to create them")


def _close(st: _State, failure: BaseException | None) -> BaseException | None:
    """Flush Kafka, acknowledge what it acknowledged (force=True), close; returns a delivery error found now."""
    late = None
    if st.producer is not None:
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while st.producer.flush(1.0) > 0 and time.monotonic() < deadline:
            _keepalive(st, quiet=True)
        try:
            _advance(st)
        except DeliveryError as exc:
            late = exc
        if (failure is None and late is None and not st.inflight and st.tx is None and not st.spools
                and not st.decoder.in_stream and st.cursor is not None):
            _ack(st, st.cursor.wal_end)  # everything read was delivered: the server's position is safe
        if st.until == "caught_up" and failure is None and late is None:  # only later commits may be unsent
            st.caught_up = st.stop_reason == "caught_up" and all(t[3] >= st.target for t in st.inflight)
    if st.cursor is not None:
        with contextlib.suppress(psycopg2.Error):
            st.cursor.acknowledge(st.acked)
            st.cursor.send_status()
            st.sent_feedback = st.acked
    for conn in (st.repl, st.sql):
        if conn is not None:
            with contextlib.suppress(psycopg2.Error):
                if conn is st.sql and not conn.closed:
                    with conn.cursor() as cur:
                        cur.execute("SELECT pg_current_wal_lsn()::text")
                        st.server_lsn = str_to_lsn(cur.fetchone()[0])
                conn.close()
    if st.control is not None:
        st.control.close()
    for spool in st.spools.values():
        with contextlib.suppress(OSError):
            spool[0].close()
    if st.spool_dir:
        shutil.rmtree(st.spool_dir, ignore_errors=True)
    reason = f"{type(failure).__name__}: {failure}" if failure is not None else st.stop_reason
    st.log(f"stream    stopped ({reason}); acknowledged {lsn_to_str(st.acked)}")
    return late


# ---------------------------------------------------------------------------------------------
# the loop


def _loop(st: _State) -> None:
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
        _advance(st)
        if message is None:
            _idle(st)
        if _tick(st):
            return
        if message is None:
            st.cursor.wait(0.2)


def _handle(st: _State, message: tuple[int, bytes]) -> None:
    """Dispatch one replication message (data start, payload)."""
    data_start, payload = message
    if st.decoder.in_stream and payload[0] in _SPOOLED:
        try:
            spool = st.spools[st.stream_xid][0]
            spool.write(_RECORD.pack(data_start, len(payload)))
            spool.write(payload)
        except OSError as exc:
            raise _spool_error(st, st.stream_xid, exc) from exc
        return
    try:
        m = st.decoder.decode(payload)
    except PgOutputError as exc:
        raise StreamError(f"malformed pgoutput message at LSN {lsn_to_str(data_start)}: {exc}; the slot "
                          f"stays at {lsn_to_str(st.acked)}; report this with the server version") from exc
    kind = m.kind
    if kind in "IUD":
        _change(st, m, data_start)
    elif kind == "B":
        _begin(st, m.final_lsn, m.xid, m.commit_ts)
    elif kind == "C":
        _commit(st, m.commit_lsn, m.end_lsn)
    elif kind == "R":
        _relation(st, m)
    elif kind == "T":
        _truncate(st, m, data_start)
    elif kind == "S":
        _stream_start(st, m)
    elif kind == "E":
        st.stream_xid = None
    elif kind == "c":
        _stream_commit(st, m)
    elif kind == "A":
        _stream_abort(st, m)
    elif kind == "M" and m.prefix == incremental.WATERMARK_PREFIX:
        _watermark(st, m)
    # Y (types: the catalog describes them), M (logical messages, e.g. heartbeats), O (origin): nothing to send


def _begin(st: _State, commit_lsn: int, xid: int, commit_ts) -> None:
    if st.tx is not None:
        raise StreamError(f"transaction {xid} began before transaction {st.tx.txid} ended (protocol error); restart "
                          f"the capture (it resumes from {lsn_to_str(st.acked)})")
    commit_ms = int(commit_ts.timestamp() * 1000)
    st.tx = events.Tx(commit_lsn, xid, commit_ms, st.prev_commit, int(time.time() * 1000))
    st.serial = 0
    tracker = [0, None, commit_ms, commit_lsn, None]
    errors = st.delivery_errors

    def delivered(err, msg, _t=tracker):
        _t[0] -= 1
        if err is not None:
            _t[4] = err
            errors.append((msg.topic(), msg.partition(), err))

    st.inflight.append(tracker)
    st.tracker, st.on_delivery = tracker, delivered


def _commit(st: _State, commit_lsn: int, end_lsn: int) -> None:
    st.tracker[1] = end_lsn
    st.tx = st.tracker = st.on_delivery = None
    st.prev_commit = commit_lsn
    st.transactions += 1


def _change(st: _State, m, lsn: int) -> None:
    """Turn one Insert/Update/Delete into events and produce them."""
    tx = st.tx
    if tx is None:
        raise StreamError(f"{m.kind} message at LSN {lsn_to_str(lsn)} outside a transaction (protocol error); "
                          f"restart the capture")
    plan = st.plans.get(m.relation_oid) or _plan(st, m.relation_oid)
    try:
        pairs, st.serial = events.encoded_events(plan, m, lsn, tx, st.serial)
    except events.EventError as exc:
        raise StreamError(f"{exc} (change at LSN {lsn_to_str(lsn)}, transaction {tx.txid}); the capture stopped "
                          f"before this transaction and the slot stays at {lsn_to_str(st.acked)}") from exc
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise StreamError(f"table {plan.qualified}: an event does not fit its Avro schema ({type(exc).__name__}: "
                          f"{exc}; change at LSN {lsn_to_str(lsn)}); the slot stays at {lsn_to_str(st.acked)}; "
                          f"report this as a bug") from exc
    _produce(st, plan, pairs)


def _produce(st: _State, plan: events.Plan, pairs: list) -> None:
    """Produce wire-format (key, value) pairs; a full producer queue waits, keeping the slot alive."""
    tracker, delivered, produce = st.tracker, st.on_delivery, st.producer.produce
    topic = plan.topic
    chunk = st.chunk
    if chunk is not None and chunk["table"] == plan.qualified:  # streamed changes of the table being snapshotted
        commit_lsn = st.tx.commit_lsn
        chunk["changed"].extend((commit_lsn, k[5:]) for k, _ in pairs)
    for k, v in pairs:
        tracker[0] += 1
        while True:
            try:
                if v.__class__ is list:  # a tombstone, with the position of its delete in the headers
                    produce(topic, None, k, on_delivery=delivered, headers=v)
                else:
                    produce(topic, v, k, on_delivery=delivered)
                break
            except BufferError:  # queue full: let librdkafka deliver
                st.producer.poll(0.05)
                _advance(st)
                _keepalive(st)
            except KafkaException as exc:
                tracker[0] -= 1
                raise DeliveryError(f"cannot produce to topic {topic} (table {plan.qualified}): "
                                    f"{exc.args[0].str()}{_size_remedy(exc.args[0], topic, len(k) + len(v))}; the "
                                    f"slot stays at {lsn_to_str(st.acked)}") from exc
        if v.__class__ is list:
            st.tombstones += 1
        else:
            st.events += 1
            st.per_table[plan.qualified] += 1


def _advance(st: _State) -> None:
    """Acknowledge the end of every leading transaction whose messages Kafka all acknowledged."""
    inflight = st.inflight
    moved = False
    while inflight:
        t = inflight[0]
        if t[0] or t[1] is None or t[4] is not None:
            break
        inflight.popleft()
        st.acked = max(st.acked, t[1])
        st.last_commit_ms = t[2]
        moved = True
    if moved:
        st.cursor.acknowledge(st.acked)
    if st.delivery_errors:
        topic, partition, err = st.delivery_errors[0]
        raise DeliveryError(
            f"Kafka did not accept an event for topic {topic} partition {partition}: {err.str()} ({err.name()})"
            f"{_size_remedy(err, topic)}, "
            f"after the producer's retries (message.timeout.ms); the capture stopped without acknowledging it: "
            f"the slot stays at {lsn_to_str(st.acked)} and a restart resends everything after that. Check the "
            f"brokers at {config.get(st.conf, 'kafka.bootstrap_servers')} and the topic (notebook 01)")


def _size_remedy(err: KafkaError, topic: str, size: int | None = None) -> str:
    """For a message too large for Kafka: which settings bound it and how to raise them."""
    if err.code() != KafkaError.MSG_SIZE_TOO_LARGE:
        return ""
    return (f" (the event{f' is {size:,} bytes' if size else ''}; an event holds a whole row, before and after). "
            f"Raise the limits together: the topic's max.message.bytes (kafka-configs --alter --entity-type topics "
            f"--entity-name {topic} --add-config max.message.bytes=N), the producer's message.max.bytes "
            f"(kafka.producer in conf), and for the merge the consumer's max.partition.fetch.bytes; or keep such "
            f"values out of the published columns. The capture never skips the row")


def _ack(st: _State, lsn: int) -> None:
    if lsn > st.acked:
        st.acked = lsn
        st.cursor.acknowledge(lsn)


def _idle(st: _State) -> None:
    """Nothing to read: with nothing pending, acknowledge the server's position (an idle slot must not pin WAL).

    The keepalive's position is safe then: the server sends every transaction committed below it
    before the keepalive itself.
    """
    if not st.inflight and st.tx is None and not st.spools and not st.decoder.in_stream:
        _ack(st, st.cursor.wal_end)
    if (st.until == "caught_up" and st.heartbeat_s and st.cursor.wal_end < st.target
            and time.monotonic() - st.last_heartbeat >= 1.0):
        st.last_heartbeat = time.monotonic()  # a record past the target: its message proves we read that far
        _heartbeat(st)


def _keepalive(st: _State, quiet: bool = False) -> None:
    """Send a status message now and then while the loop is blocked (wal_sender_timeout)."""
    now = time.monotonic()
    if now - st.last_feedback < KEEPALIVE_S or st.cursor is None:
        return
    st.last_feedback = now
    try:
        st.cursor.send_status()
    except psycopg2.Error:
        if not quiet:
            raise


def _tick(st: _State) -> bool:
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
    if st.acked != st.sent_feedback and now - st.last_feedback >= 1.0:
        st.cursor.send_status()
        st.sent_feedback, st.last_feedback = st.acked, now
    if st.heartbeat_s and now - st.last_heartbeat >= st.heartbeat_s:
        st.last_heartbeat = now
        _heartbeat(st)
    if now - st.last_incremental_check >= st.incremental_check_s:
        st.last_incremental_check = now
        _check_incremental(st)
    _next_chunk(st)
    if now - st.last_metrics >= st.metrics_interval_s:
        interval = now - st.last_metrics
        st.last_metrics = now
        _server_lsn(st)
        if st.metrics_callback is not None:
            st.metrics_callback(metrics(st, interval))
        st.interval_events = st.events
    return st.stop_reason is not None


def _caught_up(st: _State) -> bool:
    """Everything committed before the target position was read, and every requested incremental snapshot done."""
    if st.incremental or st.chunk is not None:
        return False
    if st.tx is not None and st.tx.commit_lsn < st.target:
        return False
    if st.cursor.wal_end >= st.target:
        return True
    return st.acked >= st.target and st.tx is None and not st.inflight  # nothing was left to send


def _heartbeat(st: _State) -> None:
    """A non-transactional logical message: moves the slot even when no published table is written."""
    try:
        with st.sql.cursor() as cur:
            cur.execute("SELECT pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,))
        st.heartbeats += 1
    except psycopg2.errors.InsufficientPrivilege as exc:
        raise StreamError(_heartbeat_grant(st)) from exc
    except psycopg2.Error as exc:  # not fatal: the next heartbeat reconnects
        st.log(f"stream    heartbeat failed ({_pg_message(exc)}); reconnecting")
        _reconnect_sql(st)


def _heartbeat_grant(st: _State) -> str:
    user = config.get(st.conf, "source.user")
    return (f"role {user} may not call pg_logical_emit_message, which the capture uses for heartbeats (so an idle "
            f"slot keeps moving): as a superuser run GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message("
            f"boolean, text, text) TO {user}; or run with heartbeat_s=0 (then writes to unpublished tables alone "
            f"may not advance the slot)")


def _reconnect_sql(st: _State) -> None:
    with contextlib.suppress(psycopg2.Error):
        st.sql.close()
    try:
        st.sql = source.connect(st.conf, options=pgtypes.session_options())
        st.sql.autocommit = True
    except source.SourceError as exc:
        st.log(f"stream    cannot reconnect for heartbeats: {exc}")


def _server_lsn(st: _State) -> None:
    try:
        with st.sql.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            st.server_lsn = str_to_lsn(cur.fetchone()[0])
    except psycopg2.Error:
        _reconnect_sql(st)


# ---------------------------------------------------------------------------------------------
# relations, plans and schemas


def _relation(st: _State, m) -> None:
    """A table's (new) shape: the plan is rebuilt at its next change."""
    st.relations[m.relation_oid] = m
    st.plans.pop(m.relation_oid, None)


def _plan(st: _State, oid: int) -> events.Plan:
    """The plan of a relation's current shape (catalog read and schemas registered on first use)."""
    relation = st.relations.get(oid)
    if relation is None:
        raise StreamError(f"change for relation {oid} before its Relation message (protocol error); restart the "
                          f"capture (it resumes from {lsn_to_str(st.acked)})")
    shape = (relation.namespace, relation.name, relation.replica_identity, relation.columns)
    plan = st.shapes.get(shape)
    if plan is None:
        plan = st.shapes[shape] = _build_plan(st, relation)
    st.plans[oid] = plan
    return plan


def _build_plan(st: _State, relation) -> events.Plan:
    qualified = f"{relation.namespace}.{relation.name}"
    stopped = f"the capture stopped before this change; the slot stays at {lsn_to_str(st.acked)}"
    if qualified not in st.topics:
        _check_incremental(st, catch_up=True)  # a table added live (lib.incremental) is known once its request is read
    if qualified not in st.topics:
        root = _partition_root(st, relation)
        if root in st.topics:
            raise StreamError(
                f"a change to {qualified}, a partition of {root}, came under the partition's name: publication "
                f"{st.publication} lacks publish_via_partition_root. Run notebook 01 (bootstrap) again, which sets it, "
                f"or ALTER PUBLICATION {st.publication} SET (publish_via_partition_root = true), then restart the "
                f"capture; {stopped}")
        raise StreamError(
            f"table {qualified} is in publication {st.publication} but not in source.tables "
            f"({st.conf.get('conf_file', 'conf')}): add it there (and run notebooks 01 and 02 for it) or remove it "
            f"from the publication (ALTER PUBLICATION {st.publication} DROP TABLE {qualified}); {stopped}")
    _keepalive(st, quiet=True)  # catalog and registry calls block: keep the walsender's timeout away
    name = f'"{_quote(relation.namespace)}"."{_quote(relation.name)}"'
    try:
        declared = {name: st.keys[qualified]} if qualified in st.keys else None
        table = catalog.describe_tables(st.sql, [name], declared)[name]
        catalog.check_capturable(table)
        table = _match_relation(st, table, relation)
        plan = events.plan(table, st.prefix, st.database, st.unknown_types)
    except (catalog.CatalogError, pgtypes.UnsupportedTypeError, ValueError) as exc:
        raise StreamError(f"{exc}; {stopped}") from exc
    subjects = schema_registry.subjects(plan.topic)
    previous = _columns(st.tables[qualified]) if qualified in st.tables else _registered_columns(st, subjects[1])
    _request_backfill(st, table, previous, stopped)  # before the new schema exists: a crash between keeps it
    try:
        key_id, wide_key_id, widened = _key_ids(st, plan, subjects[0], stopped)
        value_id, version, status = schema_registry.register(st.registry, subjects[1], plan.value_schema)
    except schema_registry.IncompatibleSchemaError as exc:
        raise SchemaChangeError(
            f"table {qualified} changed ({_describe_change(previous, table)}) and the schema registry refused the "
            f"new schema: {exc}. {stopped[0].upper()}{stopped[1:]} (nothing is lost): once the change is made "
            f"compatible or the subject's compatibility is relaxed, restart the capture and it resumes there") from exc
    except schema_registry.RegistryError as exc:
        raise StreamError(f"table {qualified}: {exc}; {stopped}") from exc
    _keepalive(st, quiet=True)
    plan.set_ids(key_id, value_id, wide_key_id, widened)
    st.tables[qualified] = table
    entry = {"table": qualified, "subject": subjects[1], "version": version, "id": value_id, "status": status}
    if status == "registered":
        entry["change"] = _describe_change(previous, table)
    st.schemas.append(entry)
    st.log(f"schema    {subjects[1]} version {version} ({status})" + (f": {entry['change']}" if "change" in entry
                                                                       else ""))
    return plan


def _partition_root(st: _State, relation) -> str | None:
    """schema.table of the partitioned table a relation belongs to (None when it is no partition)."""
    with st.sql.cursor() as cur:
        cur.execute("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = "
                    "c.relnamespace WHERE c.oid = pg_partition_root(%s::oid::regclass) AND c.oid <> %s",
                    (relation.relation_oid, relation.relation_oid))
        row = cur.fetchone()
    return row[0] if row else None


def _request_backfill(st: _State, table: catalog.Table, previous: dict[str, str] | None, stopped: str) -> None:
    """Read a table again (incremental snapshot) when a new column holds values in rows no change will carry.

    DDL is not in the WAL stream: ADD COLUMN with a default gives every existing row a value without
    writing it, and a rename looks like a dropped column plus a new one. Rows that never change again
    would keep null (or the old name's column) in silver while the source holds values.
    """
    if previous is None:
        return
    added = [c.name for c in table.columns if not c.generated and c.name not in previous]
    if not added:
        return
    renamed = any(name not in {c.name for c in table.columns} for name in previous)
    if not renamed:
        with st.sql.cursor() as cur:
            cur.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s AND attname = ANY(%s) "
                        "AND (atthasdef OR atthasmissing OR attnotnull)", (table.oid, added))
            added = [row[0] for row in cur.fetchall()]
    if not added:
        return  # new nullable columns without a default: existing rows hold null there, as silver will
    why = f"column(s) {', '.join(added)} {'renamed or ' if renamed else ''}added with values in existing rows"
    if st.repl.server_version < 140000:
        raise SchemaChangeError(f"table {table.qualified}: {why}, which rows that do not change again would never "
                                f"carry; reading the table again live needs PostgreSQL 14: run notebook 02 again for "
                                f"it (re-snapshot), then restart the capture; {stopped}")
    incremental.request(st.conf, table, f"{why}: existing rows are read again")
    _check_incremental(st, catch_up=True)
    st.log(f"schema    {table.qualified}: {why}; reading the table again (incremental snapshot)")


def _key_ids(st: _State, plan: events.Plan, subject: str, stopped: str) -> tuple[int, int | None, tuple]:
    """Registry ids for the table's keys such that a row's key bytes never change while it keeps its topic.

    A compacted topic forgets a key only when a tombstone with the same bytes arrives; the schema id is
    part of those bytes. So the topic's first key schema stays in use while the key encodes the same:
    annotations (pg.type) may change, int may widen to long (wider values get the long schema's id).
    Anything else (other key columns, another type) is refused: it needs a new topic.
    Returns (first key id, id for widened values or None, positions of widened fields).
    """
    try:
        versions = st.registry.get_versions(subject)
    except SchemaRegistryError as exc:
        if exc.http_status_code != 404:
            raise schema_registry.RegistryError(f"subject {subject}: {exc}") from exc
        versions = []
    except Exception as exc:  # noqa: BLE001 - connection errors of the registry client
        raise schema_registry.RegistryError(f"cannot reach the schema registry for subject {subject}: "
                                            f"{type(exc).__name__}: {exc}; check registry.url in conf") from exc
    if not versions:
        key_id, _, _ = schema_registry.register(st.registry, subject, plan.key_schema)
        return key_id, None, ()
    first = st.registry.get_version(subject, versions[0])
    old = _key_signature(json.loads(first.schema.schema_str))
    new = _key_signature(plan.key_schema)
    remedy = (f"{stopped}. Compaction keeps a key only under the exact bytes it was written with, so a new key needs "
              f"a new topic: restore the key, or re-key the table (remove it with python -m lib.incremental remove, "
              f"delete topic {plan.topic}, its subjects and its Delta tables, then add it again with python -m "
              f"lib.incremental add, which reads it anew)")
    if [name for name, _ in old] != [name for name, _ in new]:
        was, now = ", ".join(n for n, _ in old), ", ".join(n for n, _ in new)
        raise SchemaChangeError(f"table {plan.qualified}: the primary key changed from ({was}) to ({now}); {remedy}")
    widened = []
    for i, ((name, was), (_, now)) in enumerate(zip(old, new, strict=True)):
        if was == now:
            continue
        if (was, now) != ('"int"', '"long"'):
            raise SchemaChangeError(f"table {plan.qualified}: key column {name} changed type ({was} -> {now} in "
                                    f"Avro), which changes every key's bytes; {remedy}")
        widened.append(i)
    if not widened:
        return first.schema_id, None, ()
    wide_id, _, _ = schema_registry.register(st.registry, subject, plan.key_schema)
    return first.schema_id, wide_id, tuple(widened)


def _key_signature(schema: dict) -> list[tuple[str, str]]:
    """(field, Avro type without annotations) per key field: what decides a key's bytes besides the schema id."""
    def bare(avro):
        if isinstance(avro, dict):
            return {k: bare(v) for k, v in avro.items() if not k.startswith("pg.") and k not in ("doc", "default")}
        if isinstance(avro, list):
            return [bare(v) for v in avro]
        return avro
    return [(f["name"], json.dumps(bare(f["type"]), sort_keys=True)) for f in schema["fields"]]


def _quote(name: str) -> str:
    return name.replace('"', '""')


def _quote_ident(name: str) -> str:
    """A publication name as publication_names parses it (quoted unless a plain lower-case identifier)."""
    if name.replace("_", "a").isalnum() and name == name.lower() and not name[0].isdigit():
        return name
    return f'"{_quote(name)}"'


def _match_relation(st: _State, table: catalog.Table, relation) -> catalog.Table:
    """The table as the Relation message describes it (the catalog may already show later DDL)."""
    plain = [c for c in table.columns if not c.generated]
    wanted = [(c.name, c.type_oid, c.type_modifier) for c in relation.columns]
    if [(c.name, c.type_oid, c.typmod) for c in plain] == wanted:
        return table
    by_name = {c.name: c for c in table.columns}
    columns = []
    for attnum, rc in enumerate(relation.columns, 1):
        known = by_name.get(rc.name)
        if known is not None and known.type_oid == rc.type_oid and known.typmod == rc.type_modifier:
            columns.append(known)
        else:
            columns.append(_column_from_relation(st, table, rc, known, attnum))
    sent = {rc.name for rc in relation.columns}
    missing = [k for k in table.primary_key if k not in sent]
    if missing:
        raise StreamError(f"table {table.qualified}: primary key column(s) {', '.join(missing)} are not in the "
                          f"change's Relation message (the key changed since): the topic's key must change, which "
                          f"needs a new topic and a new snapshot (notebooks 01 and 02)")
    return dataclasses.replace(table, columns=tuple(columns))


def _column_from_relation(st: _State, table: catalog.Table, rc, known, attnum: int) -> catalog.Column:
    """A catalog Column for a Relation column whose type the current catalog no longer shows."""
    with st.sql.cursor() as cur:
        pgtype = catalog.type_of(cur, rc.type_oid, rc.type_modifier)
        cur.execute("SELECT format_type(%s, %s), typlen = -1 FROM pg_type WHERE oid = %s",
                    (rc.type_oid, rc.type_modifier, rc.type_oid))
        row = cur.fetchone()
    if row is None or pgtype is None:
        raise StreamError(f"column {table.qualified}.{rc.name}: its type (oid {rc.type_oid}) no longer exists, so "
                          f"changes made before the type was dropped cannot be converted; re-snapshot the table "
                          f"(notebook 02)")
    return catalog.Column(table=table.qualified, name=rc.name, attnum=attnum, type_name=row[0],
                          type=pgtype,
                          not_null=known.not_null if known is not None else False, toastable=row[1])


def _columns(table: catalog.Table) -> dict[str, str]:
    """Column name -> SQL type of the columns pgoutput sends."""
    return {c.name: c.type_name for c in table.columns if not c.generated}


def _registered_columns(st: _State, subject: str) -> dict[str, str] | None:
    """Column name -> SQL type ('pg.type') of the subject's latest registered version; None if unknown."""
    try:
        latest = json.loads(st.registry.get_latest_version(subject).schema.schema_str)
        value = next(f["type"][1] for f in latest["fields"] if f["name"] == "before")
        return {f.get("pg.column", f["name"]): f.get("pg.type", "?") for f in value["fields"]}
    except Exception:  # noqa: BLE001 - only used to describe a change
        return None


def _describe_change(old: dict[str, str] | None, table: catalog.Table) -> str:
    """'added x (text); dropped y; qty integer -> text' between the previous and the new table version."""
    new = _columns(table)
    if old is None:
        return "columns now: " + ", ".join(f"{n} {t}" for n, t in new.items())
    parts = [f"added {n} ({t})" for n, t in new.items() if n not in old]
    parts += [f"dropped {n}" for n in old if n not in new]
    parts += [f"{n} {old[n]} -> {t}" for n, t in new.items() if n in old and old[n] != t]
    return "; ".join(parts) or "column properties changed"


# ---------------------------------------------------------------------------------------------
# truncate and streamed transactions


def _truncate(st: _State, m, lsn: int) -> None:
    """TRUNCATE: one control record per table (it has no key, so it cannot go to the table's topic)."""
    tx = st.tx
    for oid in m.relation_oids:
        relation = st.relations.get(oid)
        qualified = f"{relation.namespace}.{relation.name}" if relation else f"relation {oid}"
        if qualified not in st.topics:
            raise StreamError(f"TRUNCATE of {qualified}, which is in publication {st.publication} but not in "
                              f"source.tables; add it there or remove it from the publication")
        record = {"commit_lsn": tx.commit_lsn, "event_serial": st.serial, "ts_ms": tx.commit_ms, "lsn": lsn,
                  "txId": tx.txid, "cascade": m.cascade, "restart_identity": m.restart_identity}
        if st.chunk is not None and st.chunk["table"] == qualified:
            st.chunk["truncated"] = tx.commit_lsn
        _keepalive(st, quiet=True)
        try:
            control.put(st.conf, f"truncate/{qualified}", record)
        except control.ControlError as exc:
            raise DeliveryError(f"TRUNCATE of {qualified} could not be recorded: {exc}; the slot stays at "
                                f"{lsn_to_str(st.acked)}") from exc
        st.serial += 1
        st.truncates[qualified] += 1
        st.log(f"truncate  {qualified} at commit {lsn_to_str(tx.commit_lsn)} recorded in {control.topic(st.conf)}")


def _stream_start(st: _State, m) -> None:
    st.stream_xid = m.xid
    spool = st.spools.get(m.xid)
    if spool is not None and m.first_segment:  # the server starts this transaction over
        _drop_spool(st, m.xid)
        spool = None
    if spool is None:
        path = os.path.join(st.spool_dir, f"xid-{m.xid}.spool")
        try:
            st.spools[m.xid] = [open(path, "w+b", buffering=1 << 20), set(), path]  # noqa: SIM115 - see _drop_spool
        except OSError as exc:
            raise _spool_error(st, m.xid, exc) from exc


def _spool_error(st: _State, xid: int, exc: OSError) -> StreamError:
    return StreamError(
        f"cannot write the spool of in-progress transaction {xid} in {st.spool_dir}: {exc.strerror or exc}. The "
        f"server streams transactions larger than logical_decoding_work_mem while they run, and the capture keeps "
        f"them on disk until they commit: free space there, or set source.spool_dir (conf) to a folder with room "
        f"for the largest transaction. The slot stays at {lsn_to_str(st.acked)}; a restart resumes there")


def _drop_spool(st: _State, xid: int) -> None:
    spool = st.spools.pop(xid, None)
    if spool is not None:
        with contextlib.suppress(OSError):  # buffered bytes that cannot be written any more are not needed
            spool[0].close()
        with contextlib.suppress(OSError):
            os.unlink(spool[2])


def _stream_abort(st: _State, m) -> None:
    """Rollback of a streamed transaction (drop its spool) or of one of its subtransactions (skip its changes)."""
    if m.subxid == m.xid:
        _drop_spool(st, m.xid)
    elif m.xid in st.spools:
        st.spools[m.xid][1].add(m.subxid)
        st.subxact_aborts += 1


def _stream_commit(st: _State, m) -> None:
    """Replay a streamed transaction's spool as one transaction with the commit LSN."""
    _begin(st, m.commit_lsn, m.xid, m.commit_ts)
    spool = st.spools.get(m.xid)
    if spool is not None and not _replay(st, spool):
        return  # stopping: the transaction stays unacknowledged and is resent after a restart
    _drop_spool(st, m.xid)
    _commit(st, m.commit_lsn, m.end_lsn)
    st.streamed += 1


def _replay(st: _State, spool: list) -> bool:
    """Send the spooled changes in order, skipping rolled-back subtransactions; False when stopped midway."""
    file, aborted = spool[0], spool[1]
    try:
        file.flush()
    except OSError as exc:
        raise _spool_error(st, st.tx.txid, exc) from exc
    file.seek(0)
    decoder = Decoder()
    decoder.in_stream = True  # spooled messages carry the xid of their (sub)transaction
    read, unpack, size = file.read, _RECORD.unpack, _RECORD.size
    count = 0
    while True:
        header = read(size)
        if not header:
            return True
        lsn, length = unpack(header)
        m = decoder.decode(read(length))
        kind = m.kind
        if kind in "IUD":
            if m.xid not in aborted:
                _change(st, m, lsn)
        elif kind == "R":
            _relation(st, m)  # applied even from a rolled-back subtransaction: later changes may rely on it
        elif kind == "T" and m.xid not in aborted:
            _truncate(st, m, lsn)
        elif kind == "M" and m.prefix == incremental.WATERMARK_PREFIX and m.xid not in aborted:
            _watermark(st, m)
        count += 1
        if count % 1000 == 0:
            st.producer.poll(0)
            _advance(st)
            _keepalive(st)
            if _tick(st) and st.stop_reason != "caught_up":
                return False


# ---------------------------------------------------------------------------------------------
# incremental snapshots (lib/incremental.py): chunks read beside the stream


def _check_incremental(st: _State, catch_up: bool = False) -> None:
    """Pick up new incremental snapshot requests from the control topic (a table added live joins st.topics).

    Reads only what arrived since the last look, without waiting (catch_up: up to the topic's end, a few s).
    """
    try:
        requests = incremental.pending(st.conf, st.control.catch_up(5.0) if catch_up else st.control.poll())
    except control.ControlError as exc:
        st.log(f"incremental cannot read requests: {exc}")
        return
    queued = {r["table"] for r in st.incremental}
    for record in requests:
        table = record["table"]
        if table not in st.topics:  # added live: its changes may arrive from now on
            st.topics[table] = topic_name(st.prefix, _describe(st, table, record.get("declared_key")))
            if record.get("declared_key"):
                st.keys[table] = record["declared_key"]
        if table in queued or record["state"] == "requested":  # 'requested': not published yet, no chunk
            continue
        st.incremental.append(record)
        st.log(f"incremental {table}: {record['state']}, resuming after key {record['last_key']}"
               if record.get("last_key") else f"incremental {table}: starting")


def _describe(st: _State, qualified: str, declared: list | None) -> catalog.Table:
    """A table of an incremental request, described and checked like a configured one."""
    schema, _, name = qualified.partition(".")
    ident = f'"{_quote(schema)}"."{_quote(name)}"'
    try:
        table = catalog.describe_tables(st.sql, [ident], {ident: declared} if declared else None)[ident]
        catalog.check_capturable(table)
    except catalog.CatalogError as exc:
        raise StreamError(f"incremental snapshot of {qualified}: {exc}") from exc
    return table


def _next_chunk(st: _State) -> None:
    """Start reading the next chunk when none is under way; report a chunk that failed."""
    chunk = st.chunk
    if chunk is not None:
        if chunk["error"] is not None and not chunk["thread"].is_alive():
            st.chunk, st.chunk_failures = None, st.chunk_failures + 1
            reason = f"{type(chunk['error']).__name__}: {str(chunk['error']).strip().splitlines()[0]}"
            if st.chunk_failures >= 3:
                raise StreamError(f"incremental snapshot of {chunk['table']}: reading a chunk failed 3 times "
                                  f"({reason}); check that a replication slot and a WAL sender are free "
                                  f"(max_replication_slots, max_wal_senders) and that the role may read the table, "
                                  f"then restart the capture")
            st.log(f"incremental {chunk['table']}: reading a chunk failed ({reason}); retrying in 5 s")
            st.chunk_retry_at = time.monotonic() + 5.0
        return
    if not st.incremental or time.monotonic() < st.chunk_retry_at or st.stop_reason is not None:
        return
    record = st.incremental[0]
    table = _describe(st, record["table"], record.get("declared_key"))
    plan = events.plan(table, st.prefix, st.database, st.unknown_types)
    key_subject, value_subject = schema_registry.subjects(plan.topic)
    try:
        key_id = schema_registry.register(st.registry, key_subject, plan.key_schema)[0]
        value_id = schema_registry.register(st.registry, value_subject, plan.value_schema)[0]
    except schema_registry.RegistryError as exc:
        raise StreamError(f"incremental snapshot of {table.qualified}: {exc}") from exc
    plan.set_ids(key_id, value_id)
    st.chunk_seq += 1
    chunk = {"table": table.qualified, "id": f"{os.getpid()}_{st.chunk_seq}", "plan": plan, "record": record,
             "changed": [], "truncated": None, "result": None, "error": None}
    args = (st.conf, table, list(plan.columns), record.get("last_key"), st.chunk_rows, chunk["id"])

    def read(_chunk=chunk, _args=args):
        try:
            _chunk["result"] = incremental.read_chunk(*_args)
        except BaseException as exc:  # noqa: BLE001 - reported by _next_chunk in the capture's thread
            _chunk["error"] = exc

    chunk["thread"] = threading.Thread(target=read, name=f"cdc-chunk-{chunk['id']}", daemon=True)
    st.chunk = chunk
    chunk["thread"].start()


def _watermark(st: _State, m) -> None:
    """A chunk's high watermark: every change committed before its snapshot was sent; send the chunk now."""
    try:
        mark = json.loads(bytes(m.content).decode())
    except ValueError:
        return
    chunk = st.chunk
    if mark.get("slot") != st.slot or chunk is None or mark.get("chunk") != chunk["id"]:
        return  # another capture's, or one from before a restart (its chunk is read again)
    chunk["thread"].join()
    if chunk["error"] is not None:
        return  # _next_chunk reports it
    st.chunk = None
    st.chunk_failures = 0
    _emit_chunk(st, chunk)


def _emit_chunk(st: _State, chunk: dict) -> None:
    """Send the chunk's rows as 'r' events at (consistent point, -1), minus keys changed since; record progress."""
    result, plan, record = chunk["result"], chunk["plan"], dict(chunk["record"])
    consistent = result["consistent_lsn"]
    newer = {body for lsn, body in chunk["changed"] if lsn >= consistent}
    pairs = []
    if chunk["truncated"] is None or chunk["truncated"] < consistent:
        tx = events.Tx(consistent, None, int(time.time() * 1000), None, int(time.time() * 1000))
        for row in result["rows"]:
            converted, _ = events.values(plan, row)
            key = plan.key_bytes(converted)
            if key[5:] in newer:
                continue
            value = plan.encode_value(events.envelope(plan, "r", None, plan.as_dict(converted), [], tx, consistent,
                                                      -1, "incremental"))
            pairs.append((key, value))
    _produce(st, plan, pairs)
    if st.producer.flush(FLUSH_TIMEOUT_S):
        raise DeliveryError(f"incremental snapshot of {chunk['table']}: Kafka did not acknowledge a chunk within "
                            f"{FLUSH_TIMEOUT_S:.0f} s; the slot stays at {lsn_to_str(st.acked)} and the chunk is read "
                            f"again after a restart")
    _advance(st)
    record.update(state="complete" if result["done"] else "running", last_key=result["last_key"],
                  rows=record.get("rows", 0) + len(pairs), chunks=record.get("chunks", 0) + 1,
                  updated_ms=int(time.time() * 1000))
    control.put(st.conf, incremental.record_key(st.slot, chunk["table"]), record)
    st.incremental[0] = record
    if result["done"]:
        st.incremental.pop(0)
    st.log(f"incremental {chunk['table']}: chunk {record['chunks']} sent {len(pairs)} row(s) "
           f"({len(result['rows']) - len(pairs)} newer in the stream), {record['rows']} in all"
           + (", complete" if result["done"] else ""))


# ---------------------------------------------------------------------------------------------
# metrics and command line


def metrics(st: _State, interval_s: float | None = None) -> dict:
    """Counters and lag of a run (also what run() returns)."""
    elapsed = max(time.monotonic() - st.started, 1e-9)
    caught_up_now = not st.inflight and st.tx is None and (st.server_lsn is None or st.acked >= st.server_lsn)
    lag_s = 0.0 if caught_up_now or st.last_commit_ms is None else max(0.0, time.time() - st.last_commit_ms / 1000)
    result = {
        "slot": st.slot, "until": st.until, "elapsed_s": round(elapsed, 3),
        "events": st.events, "events_per_s": round(st.events / elapsed, 1),
        "events_per_table": dict(sorted(st.per_table.items())), "tombstones": st.tombstones,
        "truncates": dict(sorted(st.truncates.items())), "transactions": st.transactions,
        "streamed_transactions": st.streamed, "streamed_subtransaction_aborts": st.subxact_aborts,
        "heartbeats": st.heartbeats, "start_lsn": lsn_to_str(st.start_lsn), "acked_lsn": lsn_to_str(st.acked),
        "target_lsn": lsn_to_str(st.target), "server_lsn": lsn_to_str(st.server_lsn) if st.server_lsn else None,
        "lag_bytes": max(0, st.server_lsn - st.acked) if st.server_lsn else None, "lag_s": round(lag_s, 3),
        "in_flight_transactions": len(st.inflight), "open_streamed_transactions": len(st.spools),
        "schemas": list(st.schemas), "stopped": st.stop_reason, "caught_up": st.caught_up,
    }
    if interval_s:
        result["interval_events_per_s"] = round((st.events - st.interval_events) / interval_s, 1)
    return result


def summary(m: dict) -> str:
    """One line for a metrics dict."""
    rate = m.get("interval_events_per_s", m["events_per_s"])
    lag = f"{m['lag_bytes']} B" if m["lag_bytes"] is not None else "?"
    return (f"stream {m['slot']}: {m['events']} events ({rate}/s), {m['tombstones']} tombstones, "
            f"{sum(m['truncates'].values())} truncates, {m['transactions']} tx; acked {m['acked_lsn']}, "
            f"lag {lag} / {m['lag_s']} s" + (f"; stopped: {m['stopped']}" if m.get("stopped") else ""))


def main(argv: list[str] | None = None) -> int:
    """python -m lib.stream --target local [--until caught_up|forever]: one line per interval, then a summary."""
    parser = argparse.ArgumentParser(prog="python -m lib.stream", description=__doc__.splitlines()[0])
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


def _pg_message(exc: psycopg2.Error) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
