"""The drills' TCP links (lib/local/stack/links.py): a stall of one process's connections leaves the others going."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading

from lib.local.stack.links import Link

CLIENT = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
for line in sys.stdin:
    conn.sendall(line.encode())
    print(conn.recv(100).decode().strip(), flush=True)
"""


def _echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn):
        with contextlib.suppress(OSError):  # the link resets its connections when the test closes it
            while data := conn.recv(100):
                conn.sendall(data)

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def _ask(child: subprocess.Popen, text: str, timeout_s: float) -> str | None:
    child.stdin.write(text + "\n")
    child.stdin.flush()
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    return child.stdout.readline().strip() if ready else None


def test_a_stall_of_one_process_holds_its_connection_while_the_others_go_on():
    server = _echo_server()
    link = Link(server.getsockname()).start()
    child = subprocess.Popen([sys.executable, "-c", CLIENT, str(link.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    own = socket.create_connection(link.address, timeout=5)
    try:
        assert _ask(child, "one", 5) == "one"
        assert link.stall(clients={child.pid}) == 1
        own.sendall(b"mine")
        assert own.recv(100) == b"mine"  # this process's connection still flows
        assert _ask(child, "two", 1.5) is None  # the child's is held: no answer, no error
        link.resume()
        ready, _, _ = select.select([child.stdout], [], [], 5)
        assert ready and child.stdout.readline().strip() == "two"  # what was held arrives
    finally:
        child.kill()
        own.close()
        link.close()
        server.close()
