"""Test helper: what PostgreSQL says about a pipeline's replication slot."""

from __future__ import annotations

import time

from lib import config, source
from lib.capture.pgoutput import str_to_lsn


def confirmed_lsn(conf: dict) -> int:
    """The slot's confirmed_flush_lsn: the server resends nothing committed below it."""
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        (config.get(conf, "source.slot"),))
            return str_to_lsn(cur.fetchone()[0])
    finally:
        conn.close()


def wait_released(conf: dict, timeout_s: float = 20.0) -> None:
    """Until no server process holds the slot: a closed replication connection's walsender exits a moment later."""
    conn = source.connect(conf)
    deadline = time.monotonic() + timeout_s
    try:
        with conn.cursor() as cur:
            while True:
                cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                            (config.get(conf, "source.slot"),))
                row = cur.fetchone()
                if row is None or row[0] is None:
                    return
                assert time.monotonic() < deadline, f"slot still held by server process {row[0]}"
                time.sleep(0.1)
    finally:
        conn.close()
