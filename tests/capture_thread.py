"""Test helper: the capture streaming in a thread until stopped, keeping what ended it."""

from __future__ import annotations

import threading

from lib.capture import stream


class CaptureThread:
    """stream.run(conf, until='forever') in a daemon thread; ``failures`` holds the exception that ended it."""

    def __init__(self, conf: dict, stop: threading.Event | None = None, **options):
        self.stop = stop or threading.Event()
        self.failures: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(conf, options), daemon=True)
        self.thread.start()

    def _run(self, conf: dict, options: dict) -> None:
        try:
            stream.run(conf, until="forever", stop_event=self.stop, heartbeat_s=1, **options)
        except Exception as exc:  # a test's fault ends it: the test checks which
            self.failures.append(exc)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
