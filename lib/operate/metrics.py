"""The services' folder and the metrics history they append to: one JSON line per interval per service.

``<service.dir>/<slot>/`` holds each service's pid file, keeper record, log, ``<name>.metrics.jsonl``
and the ``conf.json`` it runs with. ``history(conf)`` reads the metrics into pandas, ``plot(conf)`` draws them.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from lib import config

SERVICES = ("capture", "merge")
MAX_HISTORY_BYTES = 20 << 20  # a metrics file above this is rotated to <name>.1 (one generation kept)


def service_dir(conf: dict) -> Path:
    """<service.dir>/<slot>: pid files, logs, metrics history and the conf of one pipeline's services."""
    base = config.get(conf, "service.dir")
    return config.project_path(base) / str(config.get(conf, "source.slot"))


def metrics_path(conf: dict, service: str) -> Path:
    """<service dir>/<service>.metrics.jsonl."""
    return service_dir(conf) / f"{service}.metrics.jsonl"


def metrics_interval_s(conf: dict) -> float:
    """service.metrics_interval_s (default 10)."""
    return float(config.get(conf, "service.metrics_interval_s"))


def record(conf: dict, service: str, metrics: dict) -> dict:
    """Append one metrics record (with ts, service, pid) to the service's history; returns it."""
    path = metrics_path(conf, service)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "service": service,
            "pid": os.getpid(), **metrics}
    with contextlib.suppress(OSError):
        if path.stat().st_size > MAX_HISTORY_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    with open(path, "a") as handle:
        handle.write(json.dumps(line, default=str, sort_keys=True) + "\n")
    return line


def records(conf: dict, service: str, last: int | None = None) -> list[dict]:
    """The service's metrics records, oldest first (the rotated generation too); only the last ones if asked."""
    path = metrics_path(conf, service)
    rows = []
    for part in (path.with_name(path.name + ".1"), path):
        try:
            lines = part.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            with contextlib.suppress(ValueError):  # a line cut by a crash mid-write
                rows.append(json.loads(line))
    return rows[-last:] if last else rows


def latest(conf: dict, service: str) -> dict | None:
    """The service's newest metrics record, or None."""
    rows = records(conf, service, last=1)
    return rows[0] if rows else None


def history(conf: dict, services: tuple[str, ...] = SERVICES):
    """The metrics history as a pandas DataFrame: one row per record, ``ts`` as a timestamp, newest last.

    Columns: ts, service, pid, events_per_s (into Kafka for capture, into Delta for merge),
    lag_bytes, lag_s, retained_wal_bytes (capture), kafka_lag, batches, dead_letters (merge).
    """
    import pandas as pd

    columns = ["ts", "service", "pid", "events_per_s", "lag_bytes", "lag_s", "retained_wal_bytes", "kafka_lag",
               "batches", "dead_letters"]
    rows = []
    for service in services:
        for r in records(conf, service):
            rows.append({"ts": r.get("ts"), "service": service, "pid": r.get("pid"),
                         "events_per_s": r.get("interval_events_per_s", r.get("events_per_s")),
                         "lag_bytes": r.get("lag_bytes"), "lag_s": r.get("lag_s"),
                         "retained_wal_bytes": r.get("retained_wal_bytes"),
                         "kafka_lag": r.get("kafka_lag"), "batches": r.get("batches"),
                         "dead_letters": sum((r.get("dead_letters") or {}).values()) if service == "merge" else None})
    frame = pd.DataFrame(rows, columns=columns)
    frame["ts"] = pd.to_datetime(frame["ts"], utc=True, format="ISO8601")
    return frame.sort_values("ts", kind="stable").reset_index(drop=True)


