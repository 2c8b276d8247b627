"""Give the heap a large transaction grew back to the operating system once Kafka has acknowledged it.

glibc keeps freed memory in its arenas (librdkafka's threads each have one) until something asks for it: after a
transaction of a million rows the capture kept about 12 MB it no longer used, for hours. ``malloc_trim(0)``
returns it; it runs only after at least TRIM_EVENTS events and with nothing in flight, so it costs nothing per event.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

TRIM_EVENTS = 100_000  # events sent since the last trim before the next one is worth it


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def maybe_trim(events: int, trimmed_at: int, idle: bool) -> int:
    """Trim when TRIM_EVENTS events passed since trimmed_at and nothing is in flight; the new trimmed_at."""
    if events - trimmed_at < TRIM_EVENTS or not idle:
        return trimmed_at
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return events
