"""Merge stage: the table topics (Confluent Avro, Debezium envelope) -> the Delta bronze log every trigger, silver
tables on their own cadence (lib/lake/silver_step.py).

How it works and what it guarantees: docs/merge.md.
"""

from __future__ import annotations

import json
import logging
import os
import re

from pyspark.sql import DataFrame, SparkSession

from lib import config, control, kafka_client, secrets
from lib import spark as spark_session
from lib.capture import incremental
from lib.lake import dead_letter, decode_step, delta_io, lake_paths, micro_batch, silver_step, silver_table
from lib.lake.lake_paths import MergeError, query_name

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# the micro-batch


def replay_dead_letters(conf: dict, spark: SparkSession) -> dict:
    """Merge dead letters again: those that decode now reach bronze and silver (position-guarded, so late is safe)
    and leave the dead-letter table; the others stay there with their (new) reason. Returns the batch's counts."""
    import hashlib

    path = lake_paths.dead_letter_path(conf)
    if not delta_io.is_table(spark, path):
        return {"replayed": 0}
    letters = spark.read.format("delta").load(path).select("key", "value", "topic", "partition", "offset",
                                                           "timestamp").dropDuplicates(["topic", "partition",
                                                                                        "offset"])
    rows = letters.collect()
    if not rows:
        return {"replayed": 0}
    digest = hashlib.sha256(",".join(sorted(f"{r['topic']}/{r['partition']}/{r['offset']}" for r in rows))
                            .encode()).hexdigest()[:12]
    query = f"{dead_letter.REPLAY_PREFIX}{digest}"  # the same letters replayed again: their append is found, skipped
    replay_conf = config.apply_overrides(conf, {"CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "0"})
    frame = spark.createDataFrame(rows, letters.schema)
    stats = micro_batch.process_batch(frame, 0, micro_batch.context(replay_conf, query=query, app_id=query))
    # the decode step sets what still does not decode aside again, under this query's name (an unknown writer id
    # too, whatever merge.unknown_schema_ids says: lib/lake/decode_step.py), and silver applies the rest
    step = silver_step.run(replay_conf, spark)
    replayed = f"cdc_replayed_{digest}"  # SQL rather than the DeltaTable API: it runs over Spark Connect too
    frame.select("topic", "partition", "offset").createOrReplaceTempView(replayed)
    try:
        still = spark.sql(f"SELECT count(DISTINCT d.`topic`, d.`partition`, d.`offset`) AS n "
                          f"FROM delta.{lake_paths.quote(path)} AS d JOIN {replayed} AS r ON d.`topic` = r.`topic` "
                          f"AND d.`partition` = r.`partition` AND d.`offset` = r.`offset` "
                          f"WHERE d.`query` = {delta_io.literal(query)}").first()["n"]
        spark.sql(f"MERGE INTO delta.{lake_paths.quote(path)} AS d USING {replayed} AS r ON d.`topic` = r.`topic` "
                  f"AND d.`partition` = r.`partition` AND d.`offset` = r.`offset` AND d.`query` <> "
                  f"{delta_io.literal(query)} WHEN MATCHED THEN DELETE")
    finally:
        spark.catalog.dropTempView(replayed)
    log.info("replayed %s dead letter(s): %s merged, %s still dead letters", len(rows), len(rows) - still, still)
    return {**stats, "decoded": step.get("decoded"), "replayed": len(rows) - still, "still_dead": still}


# ---------------------------------------------------------------------------------------------
# the streaming query


def retired_topics(conf: dict) -> list[str]:
    """The topics re-keyed tables wrote before (python -m lib.operate.tables rekey), from the control topic.

    The merge still subscribes to them, since Spark fails a query whose checkpoint holds a topic it no
    longer reads (as lost data), and skips their messages: the table's new topic holds it anew.
    """
    prefix = incremental.rekey_key(config.get(conf, "source.slot"), "")
    records = control.read_all(conf, timeout=float(config.get(conf, "merge.control_timeout_s")))
    current = {spec.topic for spec in lake_paths.table_specs(conf)}
    return sorted({t for key, r in records.items() if key.startswith(prefix) for t in r["retired_topics"]} - current)


def removed_topics(conf: dict, spark: SparkSession, checkpoint: str, retired: list[str] = ()) -> list[str]:
    """The topics the merge's checkpoint holds that no table of source.tables writes now (a table taken out of
    source.tables), the control topic and re-keyed tables' old topics (retired) aside.

    The merge goes on subscribing to them, as to a re-keyed table's old topic: Spark fails a query whose checkpoint
    holds a topic it no longer reads ("partitions have been deleted"), and their records are skipped.
    """
    held = checkpoint_topics(spark, checkpoint)
    current = {spec.topic for spec in lake_paths.table_specs(conf)} | {control.topic(conf)} | set(retired)
    return sorted(held - current)


def checkpoint_topics(spark: SparkSession, checkpoint: str) -> set[str]:
    """The topics in the newest offsets file of a streaming checkpoint (none for a new checkpoint)."""
    local = delta_io.local_path(checkpoint)
    if local:
        folder = os.path.join(local, "offsets")
        numbered = [int(n) for n in os.listdir(folder) if n.isdigit()] if os.path.isdir(folder) else []
        if not numbered:
            return set()
        with open(os.path.join(folder, str(max(numbered)))) as handle:
            return _offset_topics(handle.read().splitlines())
    return checkpoint_topics_read(spark, checkpoint)


def checkpoint_topics_read(spark: SparkSession, checkpoint: str) -> set[str]:
    """checkpoint_topics through Spark, for a checkpoint this process does not see (s3://, dbfs:/, a Connect
    server's filesystem)."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    try:
        lines = spark.read.text(f"{checkpoint}/offsets").select("value", F.input_file_name().alias("f")).collect()
    except AnalysisException:  # no offsets folder yet: a new checkpoint
        return set()
    by_batch: dict[int, list[str]] = {}
    for row in lines:
        name = row["f"].rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit():
            by_batch.setdefault(int(name), []).append(row["value"])
    return _offset_topics(by_batch[max(by_batch)]) if by_batch else set()


def _offset_topics(lines: list[str]) -> set[str]:
    """The topics of an offsets file's lines: a version line, the batch's metadata, then one JSON per source."""
    found = set()
    for line in lines:
        try:
            offsets = json.loads(line)
        except ValueError:
            continue
        if isinstance(offsets, dict) and "batchWatermarkMs" not in offsets:
            found |= {topic for topic, partitions in offsets.items() if isinstance(partitions, dict)}
    return found


def kafka_options(conf: dict, retired: list[str] = ()) -> dict[str, str]:
    """Kafka source options from conf: servers and security, topics, earliest start, maxOffsetsPerTrigger, extras."""
    options = {
        **kafka_client.spark_options(conf),
        # the control topic too: a truncate alone (no later change) must still start a micro-batch
        "subscribe": ",".join([spec.topic for spec in lake_paths.table_specs(conf)] + list(retired)
                              + [control.topic(conf)]),
        # only for a new checkpoint: on a reused one Spark resumes from it and reads a topic added to conf since
        # (lib.operate.tables add) from its earliest offset (tests/test_incremental.py)
        "startingOffsets": "earliest",
        "includeHeaders": "true",  # a tombstone's position (lib/capture/events.py tombstone_headers)
        "maxOffsetsPerTrigger": str(int(config.get(conf, "merge.max_offsets_per_trigger"))),
        "failOnDataLoss": str(bool(config.get(conf, "merge.fail_on_data_loss"))).lower(),
        # a task reading a topic-partition to its end polls once more there, and the broker holds that fetch for
        # fetch.max.wait.ms (Kafka's default 500 ms) when no new record comes: half a second per topic-partition
        # per micro-batch (51 tables x 3 partitions: 40 s of a catch-up). Spark's consumers only read known
        # offset ranges, so a short wait costs no idle polling (docs/benchmarks.md, "Kafka's fetch wait")
        "kafka.fetch.max.wait.ms": "10",
    }
    for key, value in (config.get(conf, "merge.kafka_options") or {}).items():
        name = key if key.startswith("kafka.") or key in ("minPartitions", "fetchOffset.numRetries") else f"kafka.{key}"
        options[name] = secrets.setting(conf, f"merge.kafka_options.{key}") if secrets.is_reference(value) \
            else str(value)
    return options


def read_stream(conf: dict, spark: SparkSession, retired: list[str] = ()) -> DataFrame:
    """The streaming DataFrame of every configured table topic (Kafka's key, value, topic, partition, ...)."""
    kafka_client.hide_login(spark)
    reader = spark.readStream.format("kafka")
    for key, value in kafka_options(conf, retired).items():
        reader = reader.option(key, value)
    return reader.load()


def start(conf: dict, spark: SparkSession, trigger: str = "available_now", interval: str = "5 seconds",
          decoding: decode_step.Decoding | None = None):
    """Start the merge query: trigger 'available_now' (catch up, then stop) or 'processing_time' (every interval).

    ``decoding`` (the decode steps' Decoding of this process): a trigger touching few tables decodes them into bronze
    itself, one commit after its raw one (merge.decode_in_trigger_tables; not over Spark Connect, where the trigger
    runs in the server's process and the decode steps in this one).

    The checkpoint is <lake.root>/_checkpoints/<query name>. Deleting it replays the topics from
    the start (safe: silver only moves forward; bronze gets the events again).
    """
    kafka_client.check(conf)  # a refused login or an unknown CA, named, before Spark's own client retries
    silver_table.rebuild_moved(conf, spark)  # before the query: a re-keyed table's silver is rebuilt from its new topic
    name = query_name(conf)
    ctx = micro_batch.context(conf, name)
    ctx.checkpoint = lake_paths.checkpoint_path(conf, name)
    retired = retired_topics(conf)
    removed = removed_topics(conf, spark, ctx.checkpoint, retired)
    for topic in removed:
        log.warning("merge query %s: its checkpoint %s holds topic %s, which no table of source.tables writes now (a "
                    "table taken out of source.tables?): the query goes on reading it and skips its records; that "
                    "table's silver table stays as it was (drop it if it is no longer wanted)", name, ctx.checkpoint,
                    topic)
    ctx.session, ctx.retired = spark, frozenset(retired + removed)
    if spark_session.is_remote(spark):  # the function runs on the Connect server: it carries names and lib/, not ctx
        function = spark_session.carrying(micro_batch.BatchFunction(conf, name, ctx.checkpoint, ctx.retired))
    else:
        ctx.decoding = decoding

        def function(frame, batch_id):
            return micro_batch.process_batch(frame, batch_id, ctx)
    writer = read_stream(conf, spark, sorted(ctx.retired)).writeStream.queryName(name) \
        .option("checkpointLocation", ctx.checkpoint).foreachBatch(function)
    if trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    elif trigger == "processing_time":
        writer = writer.trigger(processingTime=interval)
    else:
        raise ValueError(f"trigger must be 'available_now' or 'processing_time', not {trigger!r}")
    query = writer.start()
    query.merge_context = ctx  # the batches' counts: query.merge_context.history
    return query


def batches(query) -> list[dict]:
    """A merge query's batches: the records its foreachBatch function kept in this process, or where that function
    ran in another (a Spark Connect server), Spark's progress reports (no per-table counts)."""
    refresh(query)
    return list(query.merge_context.history)


def refresh(query) -> None:
    """Over Spark Connect, bring the client's record of a merge query up to date from Spark's progress reports (its
    foreachBatch function keeps its own records on the server): the batches with input rows (``input_rows``, no
    per-table counts) in ``ctx.history``, and whether a batch runs now in ``ctx.active``. Nothing to do locally."""
    ctx = query.merge_context
    if not spark_session.is_remote(ctx.session):
        return
    known = {b["batch_id"] for b in ctx.history}
    found = [{"batch_id": p.batchId, "tables": {}, "input_rows": p.numInputRows,
              "seconds": round((p.durationMs or {}).get("triggerExecution", 0) / 1000, 2)}
             for p in query.recentProgress if p.numInputRows and p.batchId not in known]
    ctx.history = (ctx.history + found)[-100:]
    try:
        ctx.active = bool(query.status["isTriggerActive"])
    except Exception:  # noqa: BLE001 - the query just ended
        ctx.active = False


def kafka_metrics_bug(exc: BaseException) -> bool:
    """True when Spark 4.1.1's Kafka source stopped a query computing its metrics after a batch it had committed
    (SPARK-55271): starting the query again loses nothing."""
    text = str(exc)
    trace = getattr(exc, "_stackTrace", None) or ""  # PySpark's captured JVM stack (str() has it only when enabled)
    return "NullPointerException" in text and re.search(r"KafkaMicroBatchStream\$?\.metrics", f"{text}\n{trace}") \
        is not None  # the Scala object's frame ($.metrics) as Spark Connect reports it, or the class's


def restart_reason(exc: BaseException, batches: int) -> str:
    """One line on why Spark stopped a query that had run batches, and that it is started again."""
    if kafka_metrics_bug(exc):
        return ("Spark 4.1.1's Kafka source failed to report progress after re-running the micro-batch an unclean "
                "stop had left uncommitted (SPARK-55271); Spark had committed that batch first, so nothing is lost: "
                "starting the query again from the checkpoint")
    return (f"stopped by Spark after {batches} batch(es) ({spark_session.error_line(exc, 300)}); starting it again "
            f"from the checkpoint")


def run_until_caught_up(conf: dict, spark: SparkSession, cleanup: bool = True, silver: bool = True) -> dict:
    """Run the merge with availableNow until every topic is in the raw log, then a silver step (which decodes it into
    bronze first); batches and counts.

    A failing batch raises MergeError naming the batch and the cause (the checkpoint keeps the
    batch, so the next run retries it; its Delta commits are idempotent). When Spark itself stops
    the query after batches went through (Spark 4.1.1's Kafka source fails computing its metrics
    right after re-running a batch left uncommitted by a crash), the query is started again, up to
    merge.restart_attempts (2) times.
    """
    from pyspark.errors import StreamingQueryException

    lease = control.running_service(conf, "merge")
    if lease is not None:
        checkpoint = lake_paths.checkpoint_path(conf, query_name(conf))
        raise MergeError(f"the continuous merge of slot {config.get(conf, 'source.slot')} runs "
                         f"({control.describe_lease(lease)}) on checkpoint {checkpoint}, "
                         f"which serves one query: it already merges every change. Stop it first "
                         f"({config.make(conf, 'stop')}, or pause the cdc_merge job) to run this step, or skip this "
                         f"step")
    attempts = int(config.get(conf, "merge.restart_attempts"))
    history: list[dict] = []
    name = query_name(conf)
    for attempt in range(attempts + 1):
        query = start(conf, spark, "available_now")
        ctx = query.merge_context
        try:
            query.awaitTermination()
            history += batches(query)
            break
        except StreamingQueryException as exc:
            history += batches(query)
            if ctx.failure is not None:
                batch_id, cause = ctx.failure
                raise MergeError(
                    f"merge query {name} stopped in micro-batch {batch_id}: {type(cause).__name__}: {cause}. The "
                    f"checkpoint {lake_paths.checkpoint_path(conf, name)} keeps the batch; fix the cause and run again "
                    f"(the batch is retried, its Delta commits are idempotent)") from cause
            if not (ctx.history or kafka_metrics_bug(exc)) or attempt == attempts:  # over Connect the batches'
                raise  # records stay on the server: Spark's bug is known by its message
            log.warning("merge query %s: %s (attempt %s of %s)", name, restart_reason(exc, len(ctx.history)),
                        attempt + 1, attempts)
        finally:
            if query.isActive:
                query.stop()
    # a catch-up ends with the raw log decoded into bronze and silver holding all of it (silver=False: bronze only,
    # the fresh view has it)
    if silver:
        applied = silver_step.run(conf, spark)
    else:
        decoded = decode_step.run(conf, spark)
        applied = {"seq": decoded["seq"], "tables": {}, "decoded": decoded}
    if cleanup:
        silver_table.cleanup_tombstones(conf, spark)
    totals: dict[str, int] = {}
    for batch in history:
        for counts in batch["tables"].values():
            for key, value in counts.items():
                if isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
    decoded = applied.get("decoded") or {}
    totals["dead_letters"] = sum((decoded.get("dead_letters") or {}).values())  # set aside by the decode step
    return {"query": name, "batches": len(history), **totals, "batch_seconds": [b.get("seconds") for b in history],
            "batch_phases": [b.get("phases") for b in history],
            "bronze_seq": applied["seq"], "silver_tables": len(applied["tables"]), "silver_s": applied.get("seconds")}


