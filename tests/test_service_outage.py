"""An outage of a dependency does not use up a service's restart budget (issue 16, point 6), on the live stack.

Kafka is reached through a small TCP forwarder; stopping the forwarder is the outage (clients that
already know the broker keep their direct connections, new ones cannot bootstrap).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import pytest

from lib import config, source
from lib.capture.pgoutput import str_to_lsn
from lib.operate import keeper, service

pytestmark = pytest.mark.stack


class Forwarder:
    """127.0.0.1:<port> -> target, until stopped (then the port refuses connections)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.port, self.server = target, None, None

    def start(self) -> None:
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", self.port or 0))
        self.port = self.server.getsockname()[1]
        self.server.listen(16)
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()

    def _accept(self, server) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.close()


def _wait(what, condition, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


def test_a_kafka_outage_longer_than_the_restart_budget_is_waited_out(small_source, tmp_path):
    host, port = config.get(config.load("local"), "kafka.bootstrap_servers").split(":")
    forwarder = Forwarder((host, int(port)))
    forwarder.start()
    src = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY, v text)",
                       CDC__KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{forwarder.port}",
                       CDC__SERVICE__DIR=str(tmp_path / "pipeline"), CDC__SERVICE__MAX_RESTARTS="1",
                       CDC__SERVICE__RESTART_WINDOW_S="600", CDC__SERVICE__RESTART_BACKOFF_S="0.5",
                       CDC__SERVICE__METRICS_INTERVAL_S="2", CDC__SERVICE__HEARTBEAT_S="1")
    conf = src.conf
    service.start(conf, ("capture",), log=lambda line: None)
    try:
        child = _wait("the capture runs", lambda: keeper.state(conf, "capture")["child"])
        forwarder.stop()  # the outage: no new client can reach Kafka
        os.kill(child, signal.SIGKILL)
        row = _wait("the keeper waits for Kafka", lambda: (r := keeper.state(conf, "capture"))["state"] == "waiting"
                    and r)
        assert f"waiting for Kafka at 127.0.0.1:{forwarder.port}" in row["last_line"]
        time.sleep(8)  # backoff 0.5, 1, 2, 4 s: more retries than service.max_restarts allows failures
        row = keeper.state(conf, "capture")
        assert row["state"] == "waiting", row
        forwarder.start()  # Kafka is back
        _wait("the capture runs again", lambda: keeper.state(conf, "capture")["child"])
        with src.admin.cursor() as cur:
            cur.execute(f"INSERT INTO {src.schema}.items VALUES (1, 'after the outage')")
            cur.execute("SELECT pg_current_wal_lsn()::text")
            written = str_to_lsn(cur.fetchone()[0])

        def confirmed() -> bool:
            conn = source.connect(conf)
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                                (config.get(conf, "source.slot"),))
                    return str_to_lsn(cur.fetchone()[0]) >= written
            finally:
                conn.close()
        _wait("the capture delivers after the outage", confirmed)
        assert keeper.state(conf, "capture")["state"] == "running"
    finally:
        service.stop(conf, ("capture",), log=lambda line: None)
        forwarder.stop()
