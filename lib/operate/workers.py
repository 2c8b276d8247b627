"""What the capture and merge service processes run: the stream or the merge query, metrics and a lease.

``run_capture(conf)`` and ``run_merge(conf)`` run until SIGTERM (or stop_event, max_seconds), append a
metrics record every ``service.metrics_interval_s`` and renew the service's lease in the control topic,
so the notebooks' catch-up steps know not to run beside them.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import threading
import time
import traceback

from lib import config, control, source, waiting
from lib.operate import metrics, monitor

LEASE_INTERVALS, LEASE_SLACK_S = 3, 30.0  # a service's lease outlives a few missed metrics intervals
QUIET_INTERVALS = 2  # a loop that wrote no record for this many metrics intervals is inside a call: say what it awaits
LONG_BATCH_S = 30.0  # a merge micro-batch (or Spark's offset fetch) running this long: ask its dependencies


class _StopFlag:
    """Set by SIGTERM/SIGINT (main thread only) or by a caller's threading.Event."""

    def __init__(self, event=None):
        self.event = event or threading.Event()
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, lambda signum, frame: self.event.set())

    def __call__(self) -> bool:
        return self.event.is_set()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


_RENEWED: dict[str, float] = {}  # lease key -> when this process last renewed it (monotonic seconds)


def _renew_lease(conf: dict, name: str, log, force: bool = False) -> None:
    """Tell the notebooks, on any machine, that this service runs (control.running_service).

    Renewed once a third of its validity has passed, not on every metrics record: each renewal is a message
    in the control topic, which the merge reads, so renewing every second cost a micro-batch every second.
    """
    valid_s = LEASE_INTERVALS * metrics.metrics_interval_s(conf) + LEASE_SLACK_S
    key, now = control.lease_key(conf, name), time.monotonic()
    if not force and now - _RENEWED.get(key, float("-inf")) < valid_s / 3:
        return
    try:
        control.renew_lease(conf, name, valid_s)
        _RENEWED[key] = now
    except control.ControlError as exc:
        log(f"{name:<9} cannot renew its lease in the control topic: {exc}")


def _drop_lease(conf: dict, name: str) -> None:
    with contextlib.suppress(control.ControlError):
        control.put(conf, control.lease_key(conf, name), None)


def run_capture(conf: dict, stop_event=None, max_seconds: float | None = None, log=print) -> dict:
    """The capture in this process until stopped (SIGTERM, stop_event, max_seconds); appends metrics records."""
    from lib.capture import stream

    interval = metrics.metrics_interval_s(conf)
    previous: dict = {}
    conn = source.connect(conf)
    conn.autocommit = True
    watch = QuietWatch(conf, "capture", interval)

    def on_metrics(m: dict) -> None:
        nonlocal conn
        log(stream.summary(m))
        if conn.closed and not m.get("waiting_for"):  # cut while the link stalled: again once the server answers
            with contextlib.suppress(source.SourceError):
                conn = source.connect(conf, connect_timeout=5)
                conn.autocommit = True
        watch.record(capture_record(conf, m, previous, conn))
        _renew_lease(conf, "capture", log)

    _renew_lease(conf, "capture", log, force=True)
    try:
        result = stream.run(conf, until="forever", stop_event=stop_event, max_seconds=max_seconds,
                            metrics_callback=on_metrics, metrics_interval_s=interval,
                            heartbeat_s=float(config.get(conf, "service.heartbeat_s")),
                            log=log)
        on_metrics(result)
        _drop_lease(conf, "capture")  # a clean stop; after a crash the keeper starts it again, the lease stays
    finally:
        watch.stop()
        conn.close()
    return result


class QuietWatch:
    """A service's metrics records, and a thread that writes one when the service's loop has written none for
    QUIET_INTERVALS intervals (it is inside a call: a registry request retried, a full producer queue): the last
    record again, no events in the interval, and what the process waits for (lib/waiting.py)."""

    def __init__(self, conf: dict, name: str, interval_s: float):
        self.conf, self.name, self.interval_s = conf, name, interval_s
        self.lock, self.last, self.at = threading.Lock(), None, time.monotonic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{name}-quiet-watch", daemon=True)
        self.thread.start()

    def record(self, record: dict) -> None:
        """Write the loop's own record."""
        with self.lock:
            metrics.record(self.conf, self.name, record)
            self.last, self.at = record, time.monotonic()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            with self.lock:
                quiet = time.monotonic() - self.at
                if self.last is None or quiet < QUIET_INTERVALS * self.interval_s:
                    continue
                what = waiting.longest(0.0) or f"a call to return (its loop has been inside one for {quiet:.0f} s)"
                metrics.record(self.conf, self.name, {**self.last, "waiting_for": what, "quiet_s": round(quiet, 1),
                                                      "interval_s": self.interval_s, "interval_events_per_table": {},
                                                      "interval_events_per_s": 0.0})

    def stop(self) -> None:
        self.stopping.set()


def capture_record(conf: dict, m: dict, previous: dict, conn=None) -> dict:
    """A history record from stream metrics: rates per table since the previous record, slot WAL figures."""
    now = time.monotonic()
    per_table = dict(m.get("events_per_table") or {})
    before = previous.get("per_table", {})
    interval = now - previous["at"] if "at" in previous else float(m.get("elapsed_s") or 1.0)
    out = {key: m.get(key) for key in ("slot", "events", "tombstones", "transactions", "heartbeats", "acked_lsn",
                                       "server_lsn", "lag_bytes", "lag_s", "in_flight_transactions", "stopped",
                                       "caught_up", "waiting_for")}
    out.update({"events_per_table": per_table, "interval_s": round(interval, 3),
                "interval_events_per_table": {t: n - before.get(t, 0) for t, n in per_table.items()},
                "interval_events_per_s": m.get("interval_events_per_s", m.get("events_per_s")),
                "truncates": sum((m.get("truncates") or {}).values())})
    try:
        if conn is None or conn.closed:
            raise ConnectionError("no connection to PostgreSQL for the slot's figures")
        with source.bounded(conn, 15.0):  # a stalled link must not hold the capture's loop
            row = monitor.slot_row(conf, conn)
        if row:
            out.update({"retained_wal_bytes": row["retained_wal_bytes"], "wal_status": row["wal_status"],
                        "slot_lag_bytes": row["lag_bytes"]})
    except Exception as exc:  # noqa: BLE001 - a monitoring query must not stop the capture
        out["slot_error"] = str(exc)
    previous.update({"at": now, "per_table": per_table})
    return out


def run_merge(conf: dict, spark=None, stop_event=None, max_seconds: float | None = None, log=print) -> dict:
    """The merge query (processing-time trigger) in this process until stopped; appends metrics records."""
    from pyspark.errors import StreamingQueryException

    from lib import spark as spark_lib
    from lib.lake import merge

    if spark is None:
        settings = dict(config.get(conf, "spark.settings") or {})
        settings.setdefault("spark.ui.showConsoleProgress", "false")  # progress bars would fill the log
        # the merge only uses Delta paths: an in-memory catalog leaves a local (one-driver) metastore free
        options = {"catalog": "in-memory"} if "catalog" in inspect.signature(spark_lib.from_conf).parameters else {}
        spark = spark_lib.from_conf({**conf, "spark": {**conf.get("spark", {}), "settings": settings}}, **options)
    interval = str(config.get(conf, "service.merge_interval"))
    budget = int(config.get(conf, "service.merge_restarts"))
    every = metrics.metrics_interval_s(conf)
    stop = _StopFlag(stop_event)
    deadline = time.monotonic() + max_seconds if max_seconds else None
    tally = _MergeTally(conf, spark)
    failures = 0
    _renew_lease(conf, "merge", log, force=True)
    cadence = SilverCadence(conf, spark, log)
    waits = MergeWaits(conf)
    try:
        while True:
            query = merge.start(conf, spark, "processing_time", interval, decoding=cadence.progress.decoding)
            ctx = query.merge_context
            cadence.follow(ctx)
            log(f"merge     query {query.name} ({query.id}) started, bronze every {interval}, silver every "
                f"{cadence.interval_s:g} s")
            last = time.monotonic()
            try:
                while query.isActive and not stop():
                    cadence.raise_failure()
                    if deadline is not None and time.monotonic() >= deadline:
                        stop.event.set()
                        break
                    try:
                        query.awaitTermination(1)
                    except StreamingQueryException:
                        break
                    merge.refresh(query)  # over Spark Connect: its batches from Spark's progress (else nothing)
                    if time.monotonic() - last >= every:
                        last = time.monotonic()
                        metrics.record(conf, "merge", {**tally.tick(ctx, log, cadence), **cadence.record(),
                                                       "waiting_for": waits.now(ctx, query)})
                        _renew_lease(conf, "merge", log)
            finally:
                _stop_query(query, float(config.get(conf, "service.stop_grace_s")), log)
            metrics.record(conf, "merge", {**tally.tick(ctx, log, cadence), **cadence.record()})
            if stop():
                cadence.stop()
                _drop_lease(conf, "merge")
                return tally.totals()
            if ctx.failure is not None:
                batch_id, cause = ctx.failure
                raise merge.MergeError(
                    f"merge query {ctx.query} stopped in micro-batch {batch_id}: {type(cause).__name__}: {cause}. The "
                    f"checkpoint keeps the batch; fix the cause and start the merge again (the batch is retried, its "
                    f"Delta commits are idempotent)") from cause
            failures = 0 if ctx.history else failures + 1
            exception = query.exception()
            error = spark_lib.error_line(exception, 300)
            if failures > budget:
                raise merge.MergeError(f"merge query {ctx.query} was stopped by Spark {failures} times in a row "
                                       f"without a micro-batch (last: {error}); see the log, fix the cause and start "
                                       f"it again")
            log(f"merge     query {merge.restart_reason(exception, len(ctx.history))}")
    finally:
        cadence.stop()
        stop.restore()


class MergeWaits:
    """What the merge waits for, when it does: a marked call of this process (the registry, lib/waiting.py), or the
    dependency that does not answer (keeper.unreachable) once a micro-batch or Spark's offset fetch has run for
    LONG_BATCH_S; None while it works or a long batch has nothing to blame."""

    def __init__(self, conf: dict):
        self.conf = conf
        self.status = (None, time.monotonic())  # Spark's last status message of the query, and since when
        self.probed = (0.0, None)  # when the dependencies were last asked, and what did not answer

    def now(self, ctx, query) -> str | None:
        from lib.operate import keeper

        marked = waiting.longest()
        if marked:
            return marked
        try:
            status = query.status
        except Exception:  # noqa: BLE001 - the query just ended: nothing to say
            return None
        message = status.get("message") if status.get("isTriggerActive") else None
        if message != self.status[0]:
            self.status = (message, time.monotonic())
        began = ctx.active_since if ctx.active else None  # over Spark Connect: active, its start unknown
        running = max(time.monotonic() - began if began is not None else 0.0,
                      time.monotonic() - self.status[1] if message else 0.0)
        if running < LONG_BATCH_S:
            return None
        if time.monotonic() - self.probed[0] >= LONG_BATCH_S:
            self.probed = (time.monotonic(), keeper.unreachable(self.conf, "merge"))
        down = self.probed[1]
        return f"{down}: Spark's {message or 'micro-batch'!r} has run for {running:.0f} s" if down else None


class SilverCadence:
    """The merge service's decode and silver steps in a thread of their own, beside the bronze query: a decode step
    (lib/lake/decode_step.py) as soon as a trigger committed, a silver step (lib/lake/silver_step.py) every
    merge.silver_interval, sooner once a table's pending events pass merge.silver_pending_events,
    and as soon as the bronze query has caught up (no micro-batch running, none for two triggers) with events
    pending: the end of a burst does not wait for the next interval."""

    def __init__(self, conf: dict, spark, log):
        from lib.lake import silver_step

        self.conf, self.spark, self.log = conf, spark, log
        self.interval_s = float(config.get(conf, "merge.silver_interval_s"))
        self.threshold = int(config.get(conf, "merge.silver_pending_events"))
        self.idle_s = max(2.0, 2 * trigger_seconds(str(config.get(conf, "service.merge_interval"))))
        self.progress = silver_step.progress(conf)
        self.ctx = None
        self.steps, self.changes, self.failure, self.last = 0, 0, None, None  # changes: steps that applied events
        self.failed_step = "silver step"  # which step set failure
        self.done_batches = -1  # the bronze batch id the last step started after
        self.decoded_batch = -1  # the bronze batch id the last decode step started after
        self.seen = (None, time.monotonic())  # the newest bronze batch id, and when it was first seen
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="silver-cadence", daemon=True)
        self.decoder = threading.Thread(target=self._decode, name="decode-cadence", daemon=True)
        self.thread.start()
        self.decoder.start()

    def follow(self, ctx) -> None:
        """The bronze query's context whose batches count toward the threshold (a restarted query: its new one)."""
        self.ctx, self.done_batches, self.decoded_batch = ctx, -1, -1

    def _pending_events(self) -> int:
        """Events the bronze query logged since the last step began (its batches' counts)."""
        history = list(self.ctx.history) if self.ctx is not None else []
        return sum(sum(int(c.get("events", 0)) + int(c.get("tombstones", 0)) for c in b["tables"].values())
                   if b["tables"] else int(b.get("input_rows", 0))  # over Spark Connect: the batch's Kafka records
                   for b in history if b["batch_id"] > self.done_batches)

    def _decode(self) -> None:
        """A decode step as soon as a trigger committed (beside a silver step that runs long: the fresh view reads
        bronze, so its rows must not wait for silver's MERGEs)."""
        from lib.lake import decode_step

        while not self.stopping.wait(0.2) and self.failure is None:
            history = list(self.ctx.history) if self.ctx is not None else []
            newest = history[-1]["batch_id"] if history else self.decoded_batch
            if newest == self.decoded_batch:
                continue
            try:
                decode_step.run(self.conf, self.spark, self.progress.decoding)
            except Exception as exc:  # noqa: BLE001 - raised in the service's main thread (raise_failure)
                self._failed("decode step", exc)
                return
            self.decoded_batch = newest

    def _run(self) -> None:
        from lib.lake import silver_step

        due = time.monotonic() + self.interval_s
        while not self.stopping.wait(0.2):
            history = list(self.ctx.history) if self.ctx is not None else []
            newest = history[-1]["batch_id"] if history else self.done_batches
            if newest != self.seen[0]:
                self.seen = (newest, time.monotonic())
            if not self._due(due):
                continue
            due = time.monotonic() + self.interval_s  # start to start: a step that ran long is not followed by a wait
            try:
                done = silver_step.run(self.conf, self.spark, self.progress, maintain=False)
            except Exception as exc:  # noqa: BLE001 - raised in the service's main thread (raise_failure)
                self._failed("silver step", exc)
                return
            self.done_batches, self.steps = newest, self.steps + 1  # applied: no longer pending, upkeep or not
            self.changes += 1 if done["tables"] else 0
            self.last = {"at": time.time(), "seq": done["seq"], "seconds": done.get("seconds"),
                         "tables": len(done["tables"]), "events": sum(t["events"] for t in done["tables"].values())}
            if done["tables"]:
                self.log(f"merge     silver: {self.last['events']} event(s) of {self.last['tables']} table(s) applied, "
                         f"bronze commit {done['seq']}, {done.get('seconds')} s")
            if done["seq"] >= 0:
                try:
                    silver_step.upkeep(self.conf, self.spark, self.progress, done["seq"])
                except Exception as exc:  # noqa: BLE001 - raised in the service's main thread (raise_failure)
                    self._failed("silver upkeep", exc)
                    return

    def _failed(self, step: str, exc: Exception) -> None:
        """Keep the failure for the main thread, with its whole traceback (Java's too) in the service's log."""
        from lib import spark as spark_session

        self.log(f"merge     {step} failed: {type(exc).__name__}: {spark_session.error_line(exc)}\n"
                 + "".join(traceback.format_exception(exc)))
        self.failure, self.failed_step = exc, step

    def _due(self, due: float) -> bool:
        """A step is due: the interval passed, the pending events passed the threshold, or bronze caught up (no
        micro-batch runs, and none ended for two triggers: not merely a long batch under way)."""
        pending, now = self._pending_events(), time.monotonic()
        idle = not getattr(self.ctx, "active", False) and now - self.seen[1] >= self.idle_s
        return now >= due or pending >= self.threshold or (pending > 0 and idle)

    def raise_failure(self) -> None:
        """Stop the service when a silver step failed (its keeper starts it again; the step is repeated)."""
        if self.failure is not None:
            from lib import spark as spark_session
            from lib.lake import merge

            raise merge.MergeError(f"{self.failed_step} failed: {type(self.failure).__name__}: "
                                   f"{spark_session.error_line(self.failure)}; the service stops and its next "
                                   f"start repeats the step (it changes nothing it applied already)") \
                from self.failure

    def record(self) -> dict:
        """The silver side of a metrics record."""
        return {"silver_steps": self.steps, "silver_last": self.last, "silver_pending_events": self._pending_events(),
                "silver_applied": dict(self.progress.applied)}

    def stop(self) -> None:
        """Let a running step finish, then end the threads."""
        self.stopping.set()
        for thread in (self.thread, self.decoder):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(float(config.get(self.conf, "service.stop_grace_s")))


TRIGGER_UNITS = {"ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001, "s": 1.0, "second": 1.0,
                 "seconds": 1.0, "minute": 60.0, "minutes": 60.0, "hour": 3600.0, "hours": 3600.0}


def trigger_seconds(interval: str) -> float:
    """Seconds of a trigger interval such as '1 second', '10 seconds', '500 milliseconds' or '2 minutes'."""
    number, _, unit = interval.strip().removeprefix("interval ").strip().partition(" ")
    try:
        return float(number) * TRIGGER_UNITS[unit.strip().lower() or "s"]
    except (ValueError, KeyError):
        raise ValueError(f"service.merge_interval {interval!r} is not a number and a unit (e.g. '1 second', "
                         f"'500 milliseconds', '2 minutes'): set it as one") from None


def _stop_query(query, grace_s: float, log) -> None:
    """Stop the query between micro-batches when one finishes within grace_s (else interrupt it: it is retried)."""
    deadline = time.monotonic() + grace_s
    while query.isActive and time.monotonic() < deadline:
        try:
            if not query.status["isTriggerActive"]:
                break
        except Exception:  # noqa: BLE001 - the query just ended
            break
        time.sleep(0.2)
    if query.isActive:
        if time.monotonic() >= deadline:
            log(f"merge     micro-batch still running after {grace_s:.0f} s: interrupting it (it runs again on the "
                f"next start; its Delta commits are idempotent)")
        query.stop()


class _MergeTally:
    """Counts of the merge service's batches since it started, per table, for the metrics history."""

    def __init__(self, conf: dict, spark):
        from lib.lake import browse, lake_paths

        self.conf, self.spark = conf, spark
        self.specs = lake_paths.table_specs(conf)
        self.events = {s.qualified: 0 for s in self.specs}
        by_topic = {row["topic"]: row["n"] for row in browse.dead_letter_counts(conf, spark)
                    .groupBy("topic").agg({"messages": "sum"}).withColumnRenamed("sum(messages)", "n").collect()}
        self.dead = {s.qualified: int(by_topic.get(s.topic) or 0) for s in self.specs}
        self.batches = 0
        self.last: dict[int, int] = {}  # id(merge context) -> last batch id counted (each query start has its own)
        self.positions: dict[str, int | None] = {}
        self.silver_changes = 0
        self.decoded_at = time.time()  # the newest decode step counted (the table's dead letters above: before it)
        self.at = time.monotonic()

    def tick(self, ctx, log, cadence: SilverCadence) -> dict:
        """One history record: the batches finished since the last tick, Kafka lag, silver's positions when a
        silver step applied events since, the dead letters the decode steps set aside (lib/lake/decode_step.py)."""
        silver_changes, decodes = cadence.changes, list(cadence.progress.decoding.history)
        now = time.monotonic()
        interval = max(now - self.at, 1e-9)
        self.at = now
        fresh = [b for b in ctx.history if b["batch_id"] > self.last.get(id(ctx), -1)]
        per_table = {s.qualified: 0 for s in self.specs}
        for batch in fresh:
            self.last[id(ctx)] = batch["batch_id"]
            self.batches += 1
            for table, counts in batch["tables"].items():
                n = int(counts.get("events", 0)) + int(counts.get("tombstones", 0))
                per_table[table] = per_table.get(table, 0) + n
                self.events[table] = self.events.get(table, 0) + n
        decode_s = []
        for step in decodes:
            if step["at"] > self.decoded_at:
                self.decoded_at = step["at"]
                if step.get("seconds") is not None:
                    decode_s.append(step["seconds"])
                for table, counts in step["tables"].items():
                    self.dead[table] = self.dead.get(table, 0) + int(counts.get("dead_letters", 0))
        if silver_changes != self.silver_changes or not self.positions:
            self.silver_changes = silver_changes
            try:
                self.positions = monitor.merged_positions(self.conf, self.spark)
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop the merge
                log(f"merge     positions unknown: {exc}")
        record = {"batches": self.batches, "last_batch_id": fresh[-1]["batch_id"] if fresh else None,
                  "interval_s": round(interval, 3), "interval_events_per_table": per_table,
                  "batch_seconds": [round(b["seconds"], 3) for b in fresh if b.get("seconds") is not None],
                  "batch_phases": [b["phases"] for b in fresh if b.get("phases")],
                  "decode_seconds": decode_s,
                  "events_per_table": dict(self.events),
                  "interval_events_per_s": round(sum(per_table.values()) / interval, 1),
                  "dead_letters": dict(self.dead), "positions": dict(self.positions)}
        try:
            lag = monitor.kafka_lag(self.conf)
            control_topic = control.topic(self.conf)  # the services' own leases land there every interval: not lag
            record["kafka_lag"] = sum(v["lag"] or 0 for t, v in lag.items() if t != control_topic)
            record["kafka_lag_per_topic"] = {t: v["lag"] for t, v in lag.items()}
        except Exception as exc:  # noqa: BLE001
            record["kafka_error"] = str(exc)
        if fresh:
            log(f"merge     {len(fresh)} batch(es), {sum(per_table.values())} events, Kafka lag "
                f"{record.get('kafka_lag', '?')}")
        return record

    def totals(self) -> dict:
        """What the service merged since it started."""
        return {"batches": self.batches, "events_per_table": dict(self.events), "dead_letters": dict(self.dead)}
