"""Test helper: what PostgreSQL says about a pipeline's replication slot."""

from __future__ import annotations

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
