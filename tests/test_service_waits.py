"""What the merge service says it waits for, from its marks, Spark's status and its dependencies (pure logic)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from lib import config, control, waiting
from lib.operate import keeper, workers


class _Query:
    def __init__(self, message: str, active: bool = True):
        self.status = {"message": message, "isTriggerActive": active, "isDataAvailable": False}


def test_the_merge_names_a_marked_registry_call_first(conf, monkeypatch):
    waits = workers.MergeWaits(conf)
    with waiting.on("the schema registry at http://r:1 to answer (subject s-value)"):
        later = time.monotonic() + 12
        monkeypatch.setattr(waiting, "time", SimpleNamespace(monotonic=lambda: later))  # 12 s into the call
        said = waits.now(SimpleNamespace(active=False), _Query("Waiting for next trigger", active=False))
    assert said == "the schema registry at http://r:1 to answer (subject s-value), for 12 s"


def test_a_long_offset_fetch_names_the_dependency_that_does_not_answer(conf, monkeypatch):
    asked = []
    monkeypatch.setattr(keeper, "unreachable", lambda c, name: asked.append(name) or "Kafka at k:1 (timed out)")
    waits = workers.MergeWaits(conf)
    query, ctx = _Query("Getting offsets from KafkaV2[Subscribe[t]]"), SimpleNamespace(active=False)
    assert waits.now(ctx, query) is None and not asked  # just began: nothing to say, nobody asked
    waits.status = (waits.status[0], time.monotonic() - workers.LONG_BATCH_S - 5)
    said = waits.now(ctx, query)
    assert said.startswith("Kafka at k:1 (timed out): Spark's 'Getting offsets from KafkaV2[Subscribe[t]]' has run "
                           "for 35 s"), said
    assert asked == ["merge"]
    waits.now(ctx, query)
    assert asked == ["merge"], "the dependencies are asked at most once per LONG_BATCH_S"


def test_a_long_micro_batch_whose_dependencies_answer_is_not_a_wait(conf, monkeypatch):
    monkeypatch.setattr(keeper, "unreachable", lambda c, name: None)
    ctx = SimpleNamespace(active=True, active_since=time.monotonic() - 90)
    assert workers.MergeWaits(conf).now(ctx, _Query("Processing new data")) is None


def test_a_control_record_kafka_does_not_acknowledge_is_marked_while_the_capture_waits(conf):
    silent = config.apply_overrides(conf, {"CDC__KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9"})
    failed = []
    put = threading.Thread(target=lambda: _record_failure(failed, silent))
    put.start()
    seen = None
    while put.is_alive() and seen is None:
        seen = waiting.longest(0.0)
        time.sleep(0.05)
    put.join()
    assert seen is not None and seen.startswith(
        f"Kafka at 127.0.0.1:9 to acknowledge snapshot/s1 in {control.topic(silent)}, for "), seen
    assert failed and "could not write snapshot/s1" in failed[0], failed
    assert waiting.longest(0.0) is None  # the mark ends with the call


def _record_failure(failed: list, conf: dict) -> None:
    try:
        control.put(conf, "snapshot/s1", {"state": "running"}, timeout=2.0)
    except control.ControlError as exc:
        failed.append(str(exc))
