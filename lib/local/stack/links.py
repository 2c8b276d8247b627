"""A TCP link between clients and a service that a drill can stall or cut (issue 30, network faults).

``Link(target).start()`` listens on a free port of the target's host and forwards each connection to the
target. ``stall()``: from then on no byte moves either way and new connections get no answer, so the peers
see a network that stopped, not a service that refuses (a stopped service refuses). ``resume()``: bytes move
again, those held meanwhile included. ``drop()``: every open connection is reset at once, as a link that fails
mid-transfer; new connections work. The link runs in threads of the process that made it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading


class Link:
    """clients -> 127.0.0.1:<port> -> target, until close()."""

    def __init__(self, target: tuple[str, int], port: int = 0):
        self.target, self.port = target, port
        self.flowing = threading.Event()
        self.flowing.set()
        self._server: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far

    @property
    def address(self) -> tuple[str, int]:
        return self.target[0], self.port

    def start(self) -> Link:
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((self.target[0], self.port))
        self.port = self._server.getsockname()[1]
        self._server.listen(64)
        threading.Thread(target=self._accept, name=f"link-{self.port}", daemon=True).start()
        return self

    def stall(self) -> None:
        """No byte moves either way from now on; new connections get no answer."""
        self.flowing.clear()

    def resume(self) -> None:
        """Bytes move again."""
        self.flowing.set()

    def drop(self) -> int:
        """Reset every open connection (both sides); returns how many sockets were cut."""
        with self._lock:
            cut, self._open = list(self._open), set()
        for sock in cut:
            _reset(sock)
        return len(cut)

    def close(self) -> None:
        """Stop listening and cut every connection."""
        self.flowing.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        self.drop()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            with self._lock:
                self._open.add(client)
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self.flowing.wait()  # a stalled link answers no new connection either
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            if client not in self._open:  # dropped meanwhile
                _reset(upstream)
                return
            self._open.add(upstream)
        ended = [0]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b, ended), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, ended: list) -> None:
        """Copy source to sink while flowing; the second direction to end closes both sockets."""
        watch = select.poll()  # poll, not select: a long drill opens sockets past select's limit of 1024
        watch.register(source, select.POLLIN)
        try:
            while True:
                self.flowing.wait()
                if not watch.poll(200):
                    continue
                self.flowing.wait()  # stalled between poll and recv: the bytes stay in the kernel
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    break
                sink.sendall(data)
        except OSError:
            for sock in (source, sink):
                _reset(sock)
        with self._lock:
            ended[0] += 1
            if ended[0] == 2:
                for sock in (source, sink):
                    self._open.discard(sock)
                    sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0) rather than an orderly end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
