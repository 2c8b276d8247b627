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


class State:
    """Everything one capture run holds (connections, producer, positions, counters)."""

    def __init__(self, conf: dict, until: str, heartbeat_s: float | None, metrics_interval_s: float,
                 max_seconds: float | None, stop_event, metrics_callback, log) -> None:
        self.conf, self.until, self.log = conf, until, log
        self.slot = config.get(conf, "source.slot")
        self.publication = config.get(conf, "source.publication")
        self.database = config.get(conf, "source.database")
        self.prefix = config.get(conf, "kafka.topic_prefix")
        self.unknown_types = config.get(conf, "source.unknown_types")
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
        self.incremental: list[dict] = []  # requested incremental snapshots (lib.capture.incremental), oldest first
        self.chunk: dict | None = None  # the chunk being read or waiting for its watermark
        self.chunk_seq = self.chunk_failures = 0
        self.chunk_rows = int(config.get(conf, "source.incremental_chunk_rows"))
        self.last_incremental_check = time.monotonic()
        self.incremental_check_s = float(config.get(conf, "source.incremental_check_s"))
        self.chunk_retry_at = 0.0

    def metrics(self, interval_s: float | None = None) -> dict:
        """Counters and lag of a run (also what run() returns)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        server = self.server_lsn
        caught_up_now = not self.inflight and self.tx is None and (server is None or self.acked >= server)
        last = self.last_commit_ms
        lag_s = 0.0 if caught_up_now or last is None else max(0.0, time.time() - last / 1000)
        result = {
            "slot": self.slot, "until": self.until, "elapsed_s": round(elapsed, 3),
            "events": self.events, "events_per_s": round(self.events / elapsed, 1),
            "events_per_table": dict(sorted(self.per_table.items())), "tombstones": self.tombstones,
            "truncates": dict(sorted(self.truncates.items())), "transactions": self.transactions,
            "streamed_transactions": self.streamed, "streamed_subtransaction_aborts": self.subxact_aborts,
            "heartbeats": self.heartbeats, "start_lsn": lsn_to_str(self.start_lsn), "acked_lsn": lsn_to_str(self.acked),
            "target_lsn": lsn_to_str(self.target), "server_lsn": lsn_to_str(server) if server else None,
            "lag_bytes": max(0, self.server_lsn - self.acked) if self.server_lsn else None, "lag_s": round(lag_s, 3),
            "in_flight_transactions": len(self.inflight), "open_streamed_transactions": len(self.spools),
            "schemas": list(self.schemas), "stopped": self.stop_reason, "caught_up": self.caught_up,
        }
        if interval_s:
            result["interval_events_per_s"] = round((self.events - self.interval_events) / interval_s, 1)
        return result
