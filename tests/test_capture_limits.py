"""The capture's own limits name the setting to change (issue 16, point 10), on the live stack."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time

import pytest
from confluent_kafka import Producer
from slots import confirmed_lsn

from lib import config, control
from lib.capture import stream
from lib.capture.pgoutput import str_to_lsn

pytestmark = pytest.mark.stack


def _position(src) -> int:
    with src.admin.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        return str_to_lsn(cur.fetchone()[0])



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
    assert confirmed_lsn(src.conf) <= before


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
    assert confirmed_lsn(src.conf) <= before


def test_the_capture_reads_the_control_topic_without_blocking(small_source):
    """The capture looks at the control topic between replication messages: each look returns at once."""
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY)")
    conf = src.conf
    producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    for i in range(20_000):  # a long history: reading all of it takes far longer than one look may
        producer.produce(control.topic(conf), key=f"noise/{i}".encode(), value=b'{"n": 1}')
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(30) == 0
    tail = control.Tail(conf)
    try:
        started = time.monotonic()
        assert len(tail.catch_up()) == 20_001  # the noise and the snapshot record
        full_read = time.monotonic() - started
        control.put(conf, "incremental/x/y", {"state": "requested"})
        slowest, deadline = 0.0, time.monotonic() + 10
        while "incremental/x/y" not in tail.records:
            assert time.monotonic() < deadline, "a new record was not seen within 10 s"
            started = time.monotonic()
            tail.poll()
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 0.5, f"one look took {slowest:.2f} s (the whole topic: {full_read:.2f} s)"
    finally:
        tail.close()
