"""What this process waits for now: a mark set around a call that can block on another service (the schema
registry, Kafka taking messages), read by the services' metrics records, so that `make status` names the wait while
the call has not returned."""

from __future__ import annotations

import contextlib
import threading
import time

_MARKS: dict[int, tuple[str, float]] = {}  # thread id -> (what it waits for, since when: monotonic seconds)


@contextlib.contextmanager
def on(what: str):
    """Mark the calling thread as waiting for what while the block runs (inside another mark: the outer one stays)."""
    ident = threading.get_ident()
    if ident in _MARKS:
        yield
        return
    _MARKS[ident] = (what, time.monotonic())
    try:
        yield
    finally:
        _MARKS.pop(ident, None)


def longest(after_s: float = 10.0) -> str | None:
    """The wait of this process's threads that has lasted longest, if longer than after_s: 'what, for N s'."""
    marks = list(_MARKS.values())
    if not marks:
        return None
    what, since = min(marks, key=lambda mark: mark[1])
    waited = time.monotonic() - since
    return f"{what}, for {waited:.0f} s" if waited > after_s else None
