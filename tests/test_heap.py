"""The capture gives back the heap a large transaction grew (lib/capture/heap.py)."""

import ctypes
import ctypes.util

from lib.capture import heap


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_trim_waits_for_enough_events_and_nothing_in_flight():
    assert heap.maybe_trim(heap.TRIM_EVENTS - 1, 0, idle=True) == 0
    assert heap.maybe_trim(heap.TRIM_EVENTS * 3, heap.TRIM_EVENTS, idle=False) == heap.TRIM_EVENTS
    assert heap.maybe_trim(heap.TRIM_EVENTS * 3, heap.TRIM_EVENTS, idle=True) == heap.TRIM_EVENTS * 3


def test_a_trim_returns_freed_memory_that_glibc_kept():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(200_000):  # 200,000 small blocks (50 MB), touched so that they are resident
        block = libc.malloc(256)
        ctypes.memset(block, 1, 256)
        blocks.append(block)
    pinned = blocks.pop()  # the heap's top stays in use: glibc cannot shrink the heap by itself
    for block in blocks:
        libc.free(block)
    kept = _rss_mb()
    heap.maybe_trim(heap.TRIM_EVENTS, 0, idle=True)
    returned = kept - _rss_mb()
    libc.free(pinned)
    assert returned > 30, f"malloc_trim gave back {returned:.1f} MB of the 50 MB freed"
