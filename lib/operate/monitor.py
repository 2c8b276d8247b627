"""Observe the running pipeline: slot lag and retained WAL, events/s, the merge's Kafka lag, positions, dead letters.

``status(conf)`` gathers, per slot and per table, what an operator needs to know without starting
Spark (``python -m lib.operate.monitor`` prints it; ``make status`` includes it):

- **slot** (from ``pg_replication_slots``): whether a consumer is attached, lag in bytes (server WAL
  position minus the position the capture confirmed), lag in seconds (the capture's own measure:
  now minus the commit time of the oldest change not yet in Kafka), WAL retained for the slot
  (server position minus ``restart_lsn``) and ``wal_status``;
- **per table**: events/s into Kafka (capture) and out of it into Delta (merge), the merge's Kafka
  lag (end offsets minus the offsets of the last micro-batch committed in the merge's checkpoint),
  the last source position merged into silver, and dead-lettered messages;
- **warnings**: retained WAL above ``monitor.warn_retained_wal_bytes``, a slot with no consumer
  attached (it keeps WAL until the disk fills or ``max_slot_wal_keep_size`` invalidates it), a
  ``wal_status`` of ``unreserved`` or ``lost``, a service that died.

The long-running services (lib/operate/service.py) append one JSON line per interval to
``<service.dir>/<slot>/<service>.metrics.jsonl``; ``history(conf)`` reads them into pandas and
``plot(conf)`` draws them. With a Spark session, ``status(conf, spark)`` reads the last merged
positions and dead letters from Delta itself instead of from that history.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from lib import config, control, kafka_client, source
from lib import topics as topics_lib
from lib.capture.pgoutput import lsn_to_str, str_to_lsn
from lib.lake import lake_paths
from lib.operate import keeper, metrics

FRESH_FACTOR = 3  # a service's last record counts as current for this many metrics intervals


def utc(when):
    """A time as a UTC pandas Timestamp, comparable with the history's ``ts``; a naive time is taken as UTC."""
    import pandas as pd

    stamp = pd.Timestamp(when)
    return stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")


def plot(conf: dict, frame=None, since=None):
    """A matplotlib figure of the history (all of it, or the records since a time such as the services' start):
    events/s in and out, slot lag and retained WAL, bronze's Kafka lag and silver's pending events."""
    import matplotlib.pyplot as plt

    frame = metrics.history(conf) if frame is None else frame
    if since is not None and not frame.empty:
        frame = frame[frame["ts"] >= utc(since)]
    capture, merged = frame[frame["service"] == "capture"], frame[frame["service"] == "merge"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    line = {"marker": ".", "drawstyle": "steps-post"}  # a rate holds over the interval that ends at its record
    axes[0].plot(capture["ts"], capture["events_per_s"], label="into Kafka (capture)", **line)
    axes[0].plot(merged["ts"], merged["events_per_s"], label="into Delta (merge)", **line)
    axes[0].set_ylabel("events/s")
    axes[1].plot(capture["ts"], capture["lag_bytes"] / 1e6, label="slot lag (not yet in Kafka)", marker=".")
    axes[1].plot(capture["ts"], capture["retained_wal_bytes"] / 1e6, label="WAL retained by the slot")
    warn = float(config.get(conf, "monitor.warn_retained_wal_bytes"))
    if capture.empty or capture["retained_wal_bytes"].max() >= warn / 20:
        axes[1].axhline(warn / 1e6, color="red", linestyle=":", label="monitor.warn_retained_wal_bytes")
    else:  # far below the threshold: a line there would flatten the data
        axes[1].plot([], [], color="red", linestyle=":", label=f"monitor.warn_retained_wal_bytes: {warn / 1e6:,.0f} MB "
                                                                 f"(far above)")
    axes[1].set_ylabel("MB")
    axes[2].plot(merged["ts"], merged["kafka_lag"], label="bronze: Kafka messages not yet in the bronze log",
                 marker=".", drawstyle="steps-post")
    if "silver_pending_events" in merged:
        axes[2].plot(merged["ts"], merged["silver_pending_events"], label="silver: bronze events not yet applied",
                     marker=".", drawstyle="steps-post")
    axes[2].set_ylabel("messages")
    for ax in axes:
        ax.legend(loc="upper left", fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"pipeline {config.get(conf, 'source.slot')}")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# the metrics history the services append to


# ---------------------------------------------------------------------------------------------
# slots


SLOT_SQL = """
SELECT s.slot_name, s.plugin, s.database, s.active, s.active_pid, s.restart_lsn::text, s.confirmed_flush_lsn::text,
       s.wal_status, s.safe_wal_size, pg_current_wal_lsn()::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
       extract(epoch FROM r.flush_lag)::float8
FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_type = 'logical' AND (s.slot_name = %s OR %s)
ORDER BY s.slot_name
"""
SLOT_KEYS = ("slot", "plugin", "database", "active", "active_pid", "restart_lsn", "confirmed_flush_lsn", "wal_status",
             "safe_wal_bytes", "server_lsn", "retained_wal_bytes", "lag_bytes", "flush_lag_s")


def slots(conf: dict, all_slots: bool = False, conn=None) -> list[dict]:
    """The configured slot's row (or every logical slot of the server) with lag and retained WAL in bytes."""
    own = conn is None
    conn = source.connect(conf) if own else conn
    try:
        with conn.cursor() as cur:
            cur.execute(SLOT_SQL, (config.get(conf, "source.slot"), all_slots))
            rows = [dict(zip(SLOT_KEYS, row, strict=True)) for row in cur.fetchall()]
        if not conn.autocommit:
            conn.rollback()
        return rows
    finally:
        if own:
            conn.close()


def slot_row(conf: dict, conn=None) -> dict | None:
    """The configured slot's row from slots(), or None when it does not exist."""
    rows = slots(conf, conn=conn)
    return rows[0] if rows else None


# ---------------------------------------------------------------------------------------------
# Kafka: what the merge has not read yet


def _local_path(location: str) -> Path | None:
    """A checkpoint location as a local path (dbfs:/ through /dbfs), or None for object-store URIs."""
    if location.startswith("dbfs:"):
        return Path("/dbfs" + location[len("dbfs:"):])
    if "://" in location:
        return None
    return Path(location)


def committed_offsets(checkpoint: str) -> dict[str, dict[int, int]] | None:
    """{topic: {partition: next offset}} of the last micro-batch committed in a Structured Streaming checkpoint.

    None when the checkpoint has no committed batch yet or cannot be read as files here.
    """
    folder = _local_path(checkpoint)
    if folder is None or not (folder / "commits").is_dir():
        return None
    done = sorted((int(p.name) for p in (folder / "commits").iterdir() if p.name.isdigit()), reverse=True)
    for batch in done:
        try:
            lines = (folder / "offsets" / str(batch)).read_text().splitlines()
        except OSError:
            continue
        offsets: dict[str, dict[int, int]] = {}
        for line in lines[2:]:  # 'v1', the batch metadata, then one JSON line per source
            with contextlib.suppress(ValueError):
                for topic, parts in (json.loads(line) or {}).items():
                    if isinstance(parts, dict):
                        offsets.setdefault(topic, {}).update({int(p): int(o) for p, o in parts.items()})
        return offsets
    return None


def end_offsets(conf: dict, topics: list[str], timeout: float = 10.0) -> dict[str, dict[int, int]]:
    """{topic: {partition: high watermark}} for the topics that exist."""
    return topics_lib.end_offsets(kafka_client.admin(conf), topics, timeout)


def kafka_lag(conf: dict) -> dict[str, dict]:
    """Per topic the merge reads: end offset, offset the merge committed (None: nothing yet) and lag in messages."""

    topics = [spec.topic for spec in lake_paths.table_specs(conf)] + [control.topic(conf)]
    ends = end_offsets(conf, topics)
    done = committed_offsets(lake_paths.checkpoint_path(conf, lake_paths.query_name(conf)))
    result = {}
    for topic in topics:
        if topic not in ends:
            result[topic] = {"end": None, "merged": None, "lag": None}
            continue
        end = sum(ends[topic].values())
        merged = None if done is None else sum(min(done.get(topic, {}).get(p, 0), high)
                                               for p, high in ends[topic].items())
        result[topic] = {"end": end, "merged": merged, "lag": end - (merged or 0)}
    return result


def bronze_touched(conf: dict, spark=None) -> dict[str, int]:
    """Per table: the newest raw log commit (_seq) holding one of its records (the bronze log's, for a lake from
    before the raw log); read from the Delta log."""
    from lib.lake import delta_io

    log_meta = delta_io.newest_metadata(spark, lake_paths.raw_path(conf), "seq") \
        or delta_io.newest_metadata(spark, lake_paths.bronze_path(conf), "seq") or {}
    return {table: int(seq) for table, seq in (log_meta.get("touched") or {}).items()}


def silver_behind(conf: dict, spark=None, touched: dict[str, int] | None = None) -> dict[str, int]:
    """Per table with events silver has not applied: how many bronze log commits it is behind ({}: silver holds
    everything bronze has, or everything up to touched, a bronze_touched() taken earlier). Local lakes are read
    from the Delta logs' files, so no Spark is needed."""
    from lib.lake import delta_io

    touched = bronze_touched(conf, spark) if touched is None else touched
    behind = {}
    for spec in lake_paths.table_specs(conf):
        needed = touched.get(spec.qualified, -1)
        if needed < 0:
            continue
        applied = delta_io.newest_metadata(spark, lake_paths.silver_path(conf, spec), "bronze_seq") or {}
        done = int(applied.get("bronze_seq", -1))
        if needed > done:
            behind[spec.qualified] = needed - done
    return behind


def merged_positions(conf: dict, spark) -> dict[str, int | None]:
    """The newest source position (commit LSN) in each silver table, from Delta (one Spark job)."""
    from pyspark.sql import functions as F

    from lib.lake import delta_io

    frames, result = [], {}
    for spec in lake_paths.table_specs(conf):
        path = lake_paths.silver_path(conf, spec)
        result[spec.qualified] = None
        if delta_io.is_table(spark, path):
            frames.append(spark.read.format("delta").load(path).agg(
                F.lit(spec.qualified).alias("t"), F.max("_commit_lsn").alias("lsn")))
    if frames:
        union = frames[0]
        for frame in frames[1:]:
            union = union.unionByName(frame)
        result.update({row["t"]: row["lsn"] for row in union.collect()})
    return result


# ---------------------------------------------------------------------------------------------
# status


def _fresh(row: dict | None, conf: dict, running: bool) -> bool:
    """True when a running service wrote this record within a few metrics intervals."""
    if not row or not running:
        return False
    age = time.time() - datetime.fromisoformat(row["ts"]).timestamp()
    return age <= FRESH_FACTOR * metrics.metrics_interval_s(conf) + 5


def _lsn(value) -> str | None:
    return lsn_to_str(int(value)) if value is not None else None


def status(conf: dict, spark=None, all_slots: bool = False) -> dict:
    """Services, slots, per-table flow and warnings; each part that cannot be read becomes a warning."""

    warnings: list[str] = []
    services = []
    for name in metrics.SERVICES:
        row = keeper.state(conf, name)
        services.append(row)
        if row["state"] == "waiting":
            warnings.append(f"the {name} service is {row['last_line']}; it starts again by itself once that answers")
        if row["state"] == "crashed":
            warnings.append(f"the {name} service died (pid {row['pid']}, see {row['log']}): "
                            f"{row.get('last_line') or 'no message'}; {config.make(conf, 'run')} (service.start) "
                            f"resumes it")
    running = {row["service"]: row["state"] == "running" for row in services}
    capture_last, merge_last = metrics.latest(conf, "capture"), metrics.latest(conf, "merge")
    slot_rows = _slot_status(conf, all_slots, running["capture"], capture_last, warnings)
    lag = {}
    try:
        lag = kafka_lag(conf)
    except Exception as exc:  # noqa: BLE001 - shown as a warning, the rest of the status still counts
        warnings.append(f"Kafka lag unknown: {exc}; check Kafka at {config.get(conf, 'kafka.bootstrap_servers')}")
    positions, dead = _merge_side(conf, spark, merge_last, warnings)
    try:
        silver = silver_behind(conf, spark)
    except Exception as exc:  # noqa: BLE001
        silver = {}
        warnings.append(f"silver's progress unknown: {exc}")
    capture_now = capture_last if _fresh(capture_last, conf, running["capture"]) else None
    if capture_now and capture_now.get("waiting_for"):
        warnings.append(f"the capture service waits for {capture_now['waiting_for']}")
    merge_now = merge_last if _fresh(merge_last, conf, running["merge"]) else None
    if merge_now and merge_now.get("waiting_for"):
        warnings.append(f"the merge service waits for {merge_now['waiting_for']}")
    tables = []
    for spec in lake_paths.table_specs(conf):
        topic_lag = lag.get(spec.topic, {})
        tables.append({
            "table": spec.qualified, "topic": spec.topic,
            "events_in_per_s": _rate(capture_now, spec.qualified),
            "events_out_per_s": _rate(merge_now, spec.qualified),
            "events_in": ((capture_last or {}).get("events_per_table") or {}).get(spec.qualified),
            "events_out": ((merge_last or {}).get("events_per_table") or {}).get(spec.qualified),
            "kafka_messages": topic_lag.get("end"), "kafka_lag": topic_lag.get("lag"),
            "silver_behind": silver.get(spec.qualified, 0),
            "last_merged_lsn": _lsn(positions.get(spec.qualified)),
            "dead_letters": dead.get(spec.qualified, 0),
        })
    return {"slot": config.get(conf, "source.slot"), "services": services, "slots": slot_rows, "tables": tables,
            "kafka_lag": sum(t["kafka_lag"] or 0 for t in tables),
            "silver_behind": sum(t["silver_behind"] for t in tables), "warnings": warnings,
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _rate(row: dict | None, table: str) -> float:
    if not row:
        return 0.0
    interval = row.get("interval_s") or 1.0
    return round(((row.get("interval_events_per_table") or {}).get(table, 0)) / max(interval, 1e-9), 1)


def _slot_status(conf: dict, all_slots: bool, capture_running: bool, capture_last: dict | None,
                 warnings: list[str]) -> list[dict]:
    """Slot rows with lag seconds and warnings (no consumer, retained WAL, wal_status)."""
    slot = config.get(conf, "source.slot")
    try:
        rows = slots(conf, all_slots)
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"slot status unknown: {exc}")
        return []
    warn = int(config.get(conf, "monitor.warn_retained_wal_bytes"))
    if not any(r["slot"] == slot for r in rows):
        warnings.append(f"replication slot {slot} does not exist: nothing is captured; run notebooks 01 and 02 "
                        f"(bootstrap, snapshot) to create it with its snapshot")
    for row in rows:
        mine = row["slot"] == slot
        if mine and capture_last:
            if capture_running:
                row["lag_s"] = capture_last.get("lag_s")
            elif row["lag_bytes"]:  # nobody reads: at least as old as the capture's last word
                age = time.time() - datetime.fromisoformat(capture_last["ts"]).timestamp()
                row["lag_s"] = round(age + float(capture_last.get("lag_s") or 0), 1)
        row.setdefault("lag_s", row["flush_lag_s"] if row["active"] else None)
        if not row["active"]:
            warnings.append(
                f"slot {row['slot']} has no consumer attached: PostgreSQL keeps all WAL from "
                f"{row['restart_lsn']} on ({human_size(row['retained_wal_bytes'])} now) until the disk fills or "
                f"max_slot_wal_keep_size invalidates the slot; start the capture ({config.make(conf, 'run')}) or "
                f"drop the slot ({config.make(conf, 'teardown')})" if mine else
                f"slot {row['slot']} (not this pipeline's) has no consumer attached and retains "
                f"{human_size(row['retained_wal_bytes'])} of WAL; drop it if it is a leftover")
        if row["retained_wal_bytes"] is not None and row["retained_wal_bytes"] > warn and (mine or all_slots):
            warnings.append(f"slot {row['slot']} retains {human_size(row['retained_wal_bytes'])} of WAL, above "
                            f"monitor.warn_retained_wal_bytes ({human_size(warn)}): the capture is behind or stopped")
        if row["wal_status"] in ("unreserved", "lost"):
            warnings.append(f"slot {row['slot']} wal_status is {row['wal_status']}: "
                            + ("its WAL is gone, the slot is unusable: tear it down and take a new snapshot"
                               if row["wal_status"] == "lost" else
                               "WAL it needs is past max_slot_wal_keep_size and may be removed at the next "
                               "checkpoint: catch the capture up now"))
    return rows


def _merge_side(conf: dict, spark, merge_last: dict | None, warnings: list[str]) -> tuple[dict, dict]:
    """Last merged position and dead letters per table: from Delta with Spark, else from the merge's history."""
    if spark is not None:
        from lib.lake import browse  # Spark only when a session is given

        try:
            positions = merged_positions(conf, spark)
            by_topic = {row["topic"]: row["messages"] for row in
                        browse.dead_letter_counts(conf, spark).groupBy("topic").sum("messages")
                        .withColumnRenamed("sum(messages)", "messages").collect()}
            dead = {spec.qualified: int(by_topic.get(spec.topic, 0)) for spec in lake_paths.table_specs(conf)}
            return positions, dead
        except Exception as exc:  # noqa: BLE001
            warnings.append(f"Delta positions unknown: {exc}")
    if not merge_last:
        return {}, {}
    return dict(merge_last.get("positions") or {}), dict(merge_last.get("dead_letters") or {})


def human_size(n) -> str:
    """Bytes as text (B, kB, MB, GB, TB)."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


FRAME_COLUMNS = {
    "services": ("service", "state", "pid", "log", "last_line"),
    "slots": SLOT_KEYS + ("lag_s",),
    "tables": ("table", "topic", "events_in_per_s", "events_out_per_s", "events_in", "events_out", "kafka_messages",
               "kafka_lag", "silver_behind", "last_merged_lsn", "dead_letters"),
}


def frames(st: dict) -> dict:
    """The status as pandas DataFrames (services, slots, tables) for a notebook; no rows still gives the columns."""
    import pandas as pd

    return {name: pd.DataFrame(st[name]) if st[name] else pd.DataFrame(columns=list(columns))
            for name, columns in FRAME_COLUMNS.items()}


def report(st: dict) -> str:
    """The status as text for a terminal."""
    lines = [f"pipeline  slot {st['slot']} at {st['at']}"]
    for s in st["services"]:
        lines.append(f"{s['service']:9s} {s['state']:9s} pid {str(s['pid'] or '-'):>7s}  log {s['log']}")
    lines.append("")
    lines.append(f"{'slot':24s} {'consumer':10s} {'lag':>10s} {'lag s':>8s} {'retained WAL':>13s}  wal_status")
    for r in st["slots"]:
        consumer = f"pid {r['active_pid']}" if r["active"] else "NONE"
        lag_s = "-" if r.get("lag_s") is None else f"{r['lag_s']:.1f}"
        lines.append(f"{r['slot']:24s} {consumer:10s} {human_size(r['lag_bytes']):>10s} {lag_s:>8s} "
                     f"{human_size(r['retained_wal_bytes']):>13s}  {r['wal_status']}")
    lines.append("")
    lines.append(f"{'table':24s} {'in/s':>7s} {'out/s':>7s} {'in Kafka':>9s} {'bronze lag':>10s} "
                 f"{'silver lag':>10s} {'last merged':>13s} {'dead':>5s}")
    for t in st["tables"]:  # bronze lag: Kafka messages not in bronze; silver lag: bronze log commits not applied
        lines.append(f"{t['table']:24s} {t['events_in_per_s']:>7.1f} {t['events_out_per_s']:>7.1f} "
                     f"{_dash(t['kafka_messages']):>9s} {_dash(t['kafka_lag']):>10s} {t['silver_behind']:>10d} "
                     f"{t['last_merged_lsn'] or '-':>13s} {t['dead_letters']:>5d}")
    for warning in st["warnings"]:
        lines.append(f"WARNING   {warning}")
    return "\n".join(lines)


def _dash(value) -> str:
    return "-" if value is None else str(value)


# ---------------------------------------------------------------------------------------------
# waiting


def wait_until_recording(conf: dict, since, services: tuple[str, ...] = metrics.SERVICES, timeout_s: float = 300.0,
                         poll_s: float = 1.0) -> float:
    """Wait until every service has appended a metrics record after since (a UTC time): it runs and reports.
    Returns the seconds waited; TimeoutError names the silent services and where to look."""
    start = utc(since)
    began = time.monotonic()
    while True:
        frame = metrics.history(conf)
        heard = set(frame[frame["ts"] >= start]["service"]) if not frame.empty else set()
        silent = [name for name in services if name not in heard]
        if not silent:
            return round(time.monotonic() - began, 1)
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"{' and '.join(silent)} recorded no metrics within {timeout_s:.0f} s of starting; "
                               f"their state and log: {config.make(conf, 'status')}")
        time.sleep(poll_s)


def wait_until_caught_up(conf: dict, timeout_s: float = 300.0, poll_s: float = 1.0, spark=None) -> dict:
    """Wait until the slot confirmed the WAL position of now, bronze holds Kafka's end offsets and silver has
    applied bronze; with the merge service running, also until its metrics history records that state.

    Returns {'seconds', 'bronze_s', 'silver_s', 'target_lsn', 'kafka_end'} (bronze_s, silver_s: when each was
    found caught up; seconds: when the service's history recorded it too); TimeoutError names the stage behind.
    """
    began = time.monotonic()
    deadline = began + timeout_s
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            target = cur.fetchone()[0]
            while True:
                row = slot_row(conf, conn)
                if row and row["confirmed_flush_lsn"] and str_to_lsn(row["confirmed_flush_lsn"]) >= str_to_lsn(target):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"slot {config.get(conf, 'source.slot')} did not confirm {target} within "
                                       f"{timeout_s:.0f} s (at {row and row['confirmed_flush_lsn']}): is the capture "
                                       f"running? {config.make(conf, 'status')}")
                time.sleep(poll_s)
    finally:
        conn.close()

    topics = [spec.topic for spec in lake_paths.table_specs(conf)] + [control.topic(conf)]
    ends = end_offsets(conf, topics)
    checkpoint = lake_paths.checkpoint_path(conf, lake_paths.query_name(conf))
    while True:  # bronze: the merge's checkpoint holds Kafka's end offsets
        done = committed_offsets(checkpoint) or {}
        behind = {t: sum(high - done.get(t, {}).get(p, 0) for p, high in parts.items() if high > done.get(t, {})
                         .get(p, 0)) for t, parts in ends.items()}
        behind = {t: n for t, n in behind.items() if n > 0}
        if not behind:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the merge ({checkpoint}) did not reach Kafka's end offsets within {timeout_s:.0f} s; "
                               f"behind: {behind}; is the merge running? {config.make(conf, 'status')}")
        time.sleep(poll_s)
    bronze_s = round(time.monotonic() - began, 1)
    # Silver must hold the bronze commits that held Kafka's end offsets, not bronze's newest: under writes bronze
    # commits every trigger, and a moving target is reached only when a silver step happens to end between two.
    holding = bronze_touched(conf, spark)
    while behind := silver_behind(conf, spark, holding):
        if time.monotonic() > deadline:
            raise TimeoutError(f"silver did not apply the bronze log within {timeout_s:.0f} s (bronze holds Kafka's "
                               f"end offsets); log commits behind per table: {behind}; is the merge running? "
                               f"{config.make(conf, 'status')}")
        time.sleep(poll_s)
    caught_at, silver_s = datetime.now(timezone.utc), round(time.monotonic() - began, 1)
    if keeper.state(conf, "merge")["state"] == "running":  # its history then ends on this state too (lag 0)
        wait_until_recording(conf, caught_at, ("merge",), timeout_s=max(30.0, deadline - time.monotonic()))
    return {"seconds": round(time.monotonic() - began, 1), "bronze_s": bronze_s, "silver_s": silver_s,
            "target_lsn": target,
            "kafka_end": {t: sum(p.values()) for t, p in ends.items()}}


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    """python -m lib.operate.monitor [--target local] [--all-slots] [--watch SECONDS] [--json]."""
    parser = argparse.ArgumentParser(prog="python -m lib.operate.monitor", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    parser.add_argument("--all-slots", action="store_true", help="every logical slot of the server, not only ours")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    try:
        conf = config.load(args.target)
    except config.ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    while True:
        st = status(conf, all_slots=args.all_slots)
        print(json.dumps(st, default=str, indent=1) if args.json else report(st), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)
        print()


if __name__ == "__main__":
    sys.exit(main())
