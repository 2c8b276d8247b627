"""A TCP link between clients and a service that a drill can stall or cut (issue 30, network faults).

``Link(target).start()`` listens on a free port of the target's host and forwards each connection to the
target. ``stall()``: from then on no byte moves either way and new connections get no answer, so the peers
see a network that stopped, not a service that refuses (a stopped service refuses); ``stall(clients=pids)`` stalls
only the connections of those processes (one service's link, the others' go on). ``resume()``: bytes move
again, those held meanwhile included. ``drop()``: every open connection is reset at once, as a link that fails
mid-transfer; new connections work. The link runs in threads of the process that made it.
"""

from __future__ import annotations

import contextlib
import os
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
        self._gates: dict[socket.socket, threading.Event] = {}  # client socket -> its connection flows
        self._held: set[int] | None = None  # the processes whose connections a partial stall holds
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

    def stall(self, clients: set[int] | None = None) -> int:
        """No byte moves either way from now on; new connections get no answer. ``clients``: only the connections
        of these processes (pids) stall, the others go on. Returns the open connections held."""
        if clients is None:
            self.flowing.clear()
            with self._lock:
                return len(self._gates)
        self._held = set(clients)
        with self._lock:
            gates = list(self._gates.items())
        held = 0
        for client, gate in gates:
            if self._owned(client, self._held):
                gate.clear()
                held += 1
        return held

    def resume(self) -> None:
        """Bytes move again."""
        self._held = None
        with self._lock:
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()
        self.flowing.set()

    def _owned(self, client: socket.socket, pids: set[int]) -> bool:
        """The client end of this connection is a socket of one of pids (looked up in /proc: same machine only)."""
        try:
            port = client.getpeername()[1]
        except OSError:
            return False
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as rows:
                next(rows)  # the header
                for fields in (row.split() for row in rows):  # local address, remote address (hex ip:port), ..., inode
                    local, remote = (int(fields[i].rsplit(":", 1)[1], 16) for i in (1, 2))
                    if local == port and remote == self.port:
                        inodes.add(f"socket:[{fields[9]}]")
        for pid in pids:
            with contextlib.suppress(OSError):
                folder = f"/proc/{pid}/fd"
                for fd in os.listdir(folder):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"{folder}/{fd}") in inodes:
                            return True
        return False

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
        gate = threading.Event()
        gate.set()
        with self._lock:
            self._gates[client] = gate
        held = self._held
        if held is not None and self._owned(client, held):
            gate.clear()
        self.flowing.wait()  # a stalled link answers no new connection either
        gate.wait()
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            with self._lock:
                self._gates.pop(client, None)
            return
        with self._lock:
            if client not in self._open:  # dropped meanwhile
                self._gates.pop(client, None)
                _reset(upstream)
                return
            self._open.add(upstream)
        ended = [0]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b, ended, gate), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, ended: list, gate: threading.Event) -> None:
        """Copy source to sink while flowing; the second direction to end closes both sockets."""
        watch = select.poll()  # poll, not select: a long drill opens sockets past select's limit of 1024
        watch.register(source, select.POLLIN)
        try:
            while True:
                self.flowing.wait()
                gate.wait()
                if not watch.poll(200):
                    continue
                self.flowing.wait()  # stalled between poll and recv: the bytes stay in the kernel
                gate.wait()
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
                    self._gates.pop(sock, None)
                    self._open.discard(sock)
                    sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0) rather than an orderly end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
