"""The raw log's prune while triggers append: Delta refuses a DELETE that meets an append (ConcurrentAppendException,
though the appended rows are all above the prune's _seq); the prune tries again, or leaves it to the next compaction,
and never stops the merge nor deletes a row it should keep (found in a soak: a silver step failed there)."""

from __future__ import annotations

import threading

from pyspark.sql import functions as F

from lib.lake import raw_log


def _append(spark, path: str, seq: int) -> None:
    rows = spark.range(20).select(*[(F.lit(seq) if f.name == "_seq" else F.lit(None)).cast(f.dataType).alias(f.name)
                                    for f in raw_log.SCHEMA.fields])
    rows.coalesce(1).write.format("delta").mode("append").save(path)


def test_a_prune_meeting_a_triggers_appends_retries_or_waits_and_keeps_every_undecoded_row(spark_session, tmp_path):
    path = str(tmp_path / "raw")
    raw_log.ensure(spark_session, path)
    for seq in range(5):
        _append(spark_session, path, seq)
    stop, appended, failures = threading.Event(), [4], []

    def trigger():  # a trigger every moment, as the merge's query appends while a silver step compacts
        while not stop.is_set():
            try:
                _append(spark_session, path, appended[0] + 1)
                appended[0] += 1
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                failures.append(exc)
                return

    thread = threading.Thread(target=trigger, daemon=True)
    thread.start()
    outcomes = []
    try:
        for upto in (1, 3, 5, 7):
            while appended[0] < upto + 3:  # appends go on around each prune
                thread.join(0.2)
            outcomes.append((upto, raw_log.prune(spark_session, path, upto)))  # before: raised on a conflict
    finally:
        stop.set()
        thread.join(60)
    assert not failures, failures  # the prune never made a trigger's append fail
    left = {r["_seq"]: r["n"] for r in spark_session.read.format("delta").load(path).groupBy("_seq").count()
            .withColumnRenamed("count", "n").collect()}
    assert all(left.get(seq) == 20 for seq in range(8, appended[0] + 1)), left  # nothing undecoded went
    pruned = max((upto for upto, done in outcomes if done), default=-1)
    assert pruned >= 0 and not any(seq <= pruned for seq in left), (outcomes, sorted(left))
