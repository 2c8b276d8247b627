"""The capture's own limits name the setting to change (issue 16, point 10), on the live stack."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading

import pytest

from lib import config, source, stream
from lib.pgoutput import str_to_lsn

pytestmark = pytest.mark.stack


def _position(src) -> int:
    with src.admin.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        return str_to_lsn(cur.fetchone()[0])


def _confirmed(conf: dict) -> int:
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        (config.get(conf, "source.slot"),))
            return str_to_lsn(cur.fetchone()[0])
    finally:
        conn.close()


def test_a_row_larger_than_kafka_accepts_names_the_size_settings(small_source):
    src = small_source("CREATE TABLE {s}.docs (id int PRIMARY KEY, body text)")
    before = _position(src)
    with src.admin.cursor() as cur:  # about 3 MB, over the producer's and the broker's 1 MB default
        cur.execute(f"INSERT INTO {src.schema}.docs SELECT 1, string_agg(md5(i::text), '') "
                    f"FROM generate_series(1, 100000) i")
    with pytest.raises(stream.DeliveryError) as raised:
        stream.run(src.conf, until="caught_up", heartbeat_s=0)
    message = str(raised.value)
    for part in (f"{src.schema}.docs", "message.max.bytes", "max.message.bytes", "kafka.producer"):
        assert part in message, f"{part!r} not named in: {message}"
    assert _confirmed(src.conf) <= before


@pytest.fixture
def tiny_folder():
    """A 1 MB tmpfs (root only): a spool folder that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    folder = tempfile.mkdtemp(prefix="cdc-tiny-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], check=True)
    yield folder
    subprocess.run(["umount", folder], check=False)
    os.rmdir(folder)


def test_a_full_spool_folder_names_the_folder_and_the_setting(small_source, tiny_folder):
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, pad text)",
                       CDC__SOURCE__SPOOL_DIR=tiny_folder)
    before = _position(src)
    done, failures = threading.Event(), []

    def capture():
        try:
            stream.run(src.conf, until="forever", stop_event=done, heartbeat_s=0,
                       pg_options="-c logical_decoding_work_mem=64kB")
        except BaseException as exc:  # checked below
            failures.append(exc)

    worker = threading.Thread(target=capture, daemon=True)
    worker.start()
    with src.admin.cursor() as cur:  # about 4 MB in one transaction: the server streams it, the spool fills
        cur.execute(f"INSERT INTO {src.schema}.items SELECT i, repeat(md5(i::text), 30) "
                    f"FROM generate_series(1, 4000) i")
    worker.join(60)
    done.set()
    worker.join(30)
    assert failures and isinstance(failures[0], stream.StreamError), failures or "the capture did not stop"
    message = str(failures[0])
    assert tiny_folder in message and "source.spool_dir" in message, message
    assert _confirmed(src.conf) <= before
