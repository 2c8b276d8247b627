"""What the merge service says it waits for, from its marks, Spark's status and its dependencies (pure logic)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from lib import waiting
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
