"""What one capture run holds (connections, producer, positions, counters), and the errors that stop it."""

from __future__ import annotations

import time
from collections import Counter, deque

from lib import config, control
from lib.capture import catalog, events
from lib.capture.pgoutput import Decoder, lsn_to_str


class StreamError(RuntimeError):
    """The capture stopped; the message names the table/column/topic and the remedy."""


class SnapshotIncompleteError(StreamError):
    """The slot's snapshot is not complete: streaming would leave rows out of the topics."""


class SchemaChangeError(StreamError):
    """The registry refused a table's new schema."""


class DeliveryError(StreamError):
    """Kafka did not accept a message after the producer's retries."""


class Acks:
    """Positions: what Kafka acknowledged, what the slot was told, and each transaction still in flight."""

    def __init__(self) -> None:
        self.start_lsn = self.acked = self.target = 0  # slot position at start, confirmed now, the catch-up target
        self.sent_feedback = 0  # the position the server was last told
        self.recorded = 0  # the newest position the control topic's position record holds (slot_position.py)
        self.recording: int | None = None  # a position whose record Kafka has not acknowledged yet
        self.last_record = 0.0
        self.record_due = False  # no record of this server yet: write one even if the position does not move
        self.last_feedback = time.monotonic()
        self.server_lsn: int | None = None
        self.inflight: deque[list] = deque()  # per transaction: [pending, end_lsn, commit_ms, commit_lsn, error]
        self.delivery_errors: list[tuple] = []
        self.last_commit_ms: int | None = None  # commit time of the last transaction Kafka acknowledged
        # Kafka's progress on the oldest transaction in flight: its tracker and pending count when last seen to
        # move, and since when (delivery.advance stops the capture when it has not moved for delivery_timeout_s)
        self.progress_tx: list | None = None
        self.progress_pending = 0
        self.progress_at = time.monotonic()
        self.delivery_timeout_s = 300.0


class Relations:
    """What the capture knows of the tables: Relation messages, their plans, topics and registered schemas."""

    def __init__(self) -> None:
        self.topics: dict[str, str] = {}  # configured schema.table -> topic
        self.keys: dict[str, list[str]] = {}  # schema.table -> key columns declared in source.keys
        self.messages: dict[int, object] = {}  # relation oid -> latest Relation message
        self.plans: dict[int, events.Plan] = {}  # relation oid -> plan of its current Relation
        self.shapes: dict[tuple, events.Plan] = {}  # Relation shape -> plan (a Relation may be resent)
        self.tables: dict[str, catalog.Table] = {}  # schema.table -> table version of the latest plan
        self.registered: list[dict] = []  # schema versions registered or found during the run


class Spools:
    """Transactions the server streams while they run, each spooled to a file until it commits or aborts."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.files: dict[int, list] = {}  # top-level xid -> [file, aborted subxids, path]
        self.xid: int | None = None  # the streamed transaction whose block is being read
        self.subxact_aborts = 0


class Chunks:
    """Incremental snapshots: the requests, oldest first, and the chunk being read or waiting for its watermark."""

    def __init__(self, conf: dict) -> None:
        self.requests: list[dict] = []
        self.current: dict | None = None
        self.seq = self.failures = 0
        self.rows = int(config.get(conf, "source.incremental_chunk_rows"))
        self.check_s = float(config.get(conf, "source.incremental_check_s"))
        self.last_check = time.monotonic()
        self.retry_at = 0.0


class State:
    """One capture run: settings, connections, the transaction being sent and counters, with its parts."""

    def __init__(self, conf: dict, until: str, heartbeat_s: float | None, metrics_interval_s: float,
                 max_seconds: float | None, stop_event, metrics_callback, log) -> None:
        self.conf, self.until, self.log = conf, until, log
        self.slot = config.get(conf, "source.slot")
        self.publication = config.get(conf, "source.publication")
        self.database = config.get(conf, "source.database")
        self.prefix = config.get(conf, "kafka.topic_prefix")
        self.unknown_types = config.get(conf, "source.unknown_types")
        self.heartbeat_s = heartbeat_s if heartbeat_s and heartbeat_s > 0 else None
        self.heartbeat_function = "pg_logical_emit_message(boolean,text,text)"  # as the server names it (_open)
        self.metrics_interval_s = metrics_interval_s
        self.stop_event, self.metrics_callback = stop_event, metrics_callback
        self.started = time.monotonic()
        self.deadline = self.started + max_seconds if max_seconds else None
        self.stop_reason: str | None = None
        self.sql = self.repl = self.cursor = self.producer = self.registry = None
        # a heartbeat or position query blocked longer than this is cut (they take milliseconds)
        self.stall_s = min(15.0, float(config.get(conf, "source.stall_timeout_s")) / 2)
        self.control: control.Tail | None = None  # the control topic, read as it grows (incremental requests)
        self.identity: dict | None = None  # the server's system identifier and timeline (slot_position.py)
        self.acks, self.relations, self.spools, self.chunks = Acks(), Relations(), Spools(), Chunks(conf)
        self.decoder = Decoder()
        self.tx: events.Tx | None = None  # the transaction being sent (Begin..Commit, or a replayed stream)
        self.serial = 0
        self.tracker: list | None = None
        self.on_delivery = None
        self.prev_commit: int | None = None
        self.last_heartbeat = self.last_metrics = time.monotonic()
        self.events = self.tombstones = self.transactions = self.heartbeats = self.streamed = 0
        self.per_table: Counter = Counter()
        self.truncates: Counter = Counter()
        self.interval_events = 0
        self.trimmed_at = 0  # st.events when the heap was last trimmed (heap.py)
        self.caught_up = False

    def metrics(self, interval_s: float | None = None) -> dict:
        """Counters and lag of a run (also what run() returns)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        acks = self.acks
        server = acks.server_lsn
        caught_up_now = not acks.inflight and self.tx is None and (server is None or acks.acked >= server)
        last = acks.last_commit_ms
        lag_s = 0.0 if caught_up_now or last is None else max(0.0, time.time() - last / 1000)
        result = {
            "slot": self.slot, "until": self.until, "elapsed_s": round(elapsed, 3),
            "events": self.events, "events_per_s": round(self.events / elapsed, 1),
            "events_per_table": dict(sorted(self.per_table.items())), "tombstones": self.tombstones,
            "truncates": dict(sorted(self.truncates.items())), "transactions": self.transactions,
            "streamed_transactions": self.streamed, "streamed_subtransaction_aborts": self.spools.subxact_aborts,
            "heartbeats": self.heartbeats, "start_lsn": lsn_to_str(acks.start_lsn), "acked_lsn": lsn_to_str(acks.acked),
            "target_lsn": lsn_to_str(acks.target), "server_lsn": lsn_to_str(server) if server else None,
            "lag_bytes": max(0, server - acks.acked) if server else None, "lag_s": round(lag_s, 3),
            "in_flight_transactions": len(acks.inflight), "open_streamed_transactions": len(self.spools.files),
            "schemas": list(self.relations.registered), "stopped": self.stop_reason, "caught_up": self.caught_up,
        }
        if interval_s:
            result["interval_events_per_s"] = round((self.events - self.interval_events) / interval_s, 1)
        result["waiting_for"] = self.waiting_for()
        return result

    def waiting_for(self, after_s: float = 10.0) -> str | None:
        """What the capture has waited for longer than after_s (Kafka's acknowledgements, the server's reply)."""
        now = time.monotonic()
        if self.acks.inflight and self.acks.inflight[0][0] and now - self.acks.progress_at > after_s:
            return (f"Kafka to acknowledge {self.acks.inflight[0][0]} event(s) of the oldest transaction, for "
                    f"{now - self.acks.progress_at:.0f} s (it stops after {self.acks.delivery_timeout_s:.0f} s)")
        asked = getattr(self.cursor, "asked_at", None)
        if asked is not None and now - asked > after_s:
            return (f"PostgreSQL to answer, for {now - asked:.0f} s (it stops after "
                    f"{self.cursor.silence_s:.0f} s: source.stall_timeout_s)")
        return None
