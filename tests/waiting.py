"""Test helper: wait for a condition, failing with what was awaited."""

from __future__ import annotations

import time


def until(done, timeout_s: float, what: str):
    """Poll done() every 0.2 s until it returns something true, and return that; AssertionError naming what after
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)
    return value
