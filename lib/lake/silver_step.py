"""Silver on its own cadence: each table's bronze log events it has not applied, in one position-guarded MERGE.

A step first decodes the raw log's commits the bronze log lacks (lib/lake/decode_step.py).

A step reads the log's state (its last commit, and per table the last commit holding one of its events),
and for every table whose events silver has not applied yet MERGEs the log rows after silver's recorded
commit up to that last one. The MERGE's own commit records the log commit it reached (userMetadata
{"bronze_seq": n}), so a step repeated after a crash reads the same rows again and changes nothing, and
no event is skipped: what silver applied is a log commit number, never a source position (rows reach the
log out of LSN order: an incremental re-read carries an older position than the stream's newest events).

The merge service runs a step every ``merge.silver_interval``, sooner for a table whose pending events pass
``merge.silver_pending_events``, and a catch-up (merge.run_until_caught_up) runs one at its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lib import config
from lib.lake import bronze_log, decode_step, delta_io, lake_paths, micro_batch, raw_log, silver_table, writer_schemas
from lib.lake.lake_paths import MergeError, quote

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What a process knows of silver between steps: the log commit each table reached, the truncates applied."""

    conf: dict
    schemas: writer_schemas.Schemas
    applied: dict[str, int] = field(default_factory=dict)
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)  # table -> {partition: last offset applied}
    truncates: dict[str, tuple] = field(default_factory=dict)
    ready: dict = field(default_factory=dict)  # silver path -> {row, filled}
    last_cleanup: float = field(default_factory=time.monotonic)
    last_compaction: float = field(default_factory=time.monotonic)
    history: list[dict] = field(default_factory=list)
    sessions: list = field(default_factory=list)  # sessions of their own for MERGEs side by side
    decoding: decode_step.Decoding | None = None  # the decode step's cache (its registry client shared)


def progress(conf: dict) -> Progress:
    """A new Progress for conf (read from the tables on first use)."""
    schemas = writer_schemas.Schemas(conf)
    return Progress(conf=conf, schemas=schemas, decoding=decode_step.decoding(conf, schemas))


def pending(spark: SparkSession, prog: Progress, log_state: bronze_log.State | None = None) -> dict[str, int]:
    """Per configured table with events silver has not applied: the log commits it is behind (0: only a truncate)."""
    conf = prog.conf
    state = log_state or bronze_log.state(spark, lake_paths.bronze_path(conf))
    behind = {}
    for spec in lake_paths.table_specs(conf):
        done = _applied(spark, prog, spec)
        touched = state.touched.get(spec.qualified, -1)
        if touched > done:
            behind[spec.qualified] = touched - done
    return behind


def _read_applied(spark: SparkSession, prog: Progress, specs: list, threads: int = 4) -> None:
    """What silver applied for each table not known yet, read side by side (one Delta history read per table:
    0.3-0.5 s each, 51 tables took 20 s one after another in a new process)."""
    from concurrent.futures import ThreadPoolExecutor

    missing = [spec for spec in specs if spec.qualified not in prog.applied]
    if len(missing) < 2:
        return
    paths = [lake_paths.silver_path(prog.conf, spec) for spec in missing]
    with ThreadPoolExecutor(max_workers=min(threads, len(missing)), thread_name_prefix="cdc-silver-applied") as pool:
        for spec, record in zip(missing, pool.map(lambda path: silver_table.last_applied(spark, path), paths),
                                strict=True):
            _remember(prog, spec, record)


def _remember(prog: Progress, spec, record: dict) -> None:
    prog.applied[spec.qualified] = int(record.get("bronze_seq", -1))
    same_topic = record.get("topic") == spec.topic
    prog.offsets[spec.qualified] = {int(p): int(o) for p, o in (record.get("offsets") or {}).items()} \
        if same_topic else {}


def _applied(spark: SparkSession, prog: Progress, spec) -> int:
    if spec.qualified not in prog.applied:
        _remember(prog, spec, silver_table.last_applied(spark, lake_paths.silver_path(prog.conf, spec)))
    return prog.applied[spec.qualified]


def run(conf: dict, spark: SparkSession, prog: Progress | None = None, tables: list[str] | None = None,
        maintain: bool = True) -> dict:
    """Decode the raw log's new commits into the bronze log, then bring silver up to it for every table (or those
    named) that has events it has not applied; then, when due, the logs' upkeep (``maintain=False``: the caller
    calls ``upkeep`` itself, after it has counted the step's events as applied).

    Returns {'seq': the log commit reached, 'tables': {table: {'events': n, 'seconds': s}}, 'decoded': the decode
    step's counts}.
    """
    prog = prog or progress(conf)
    began = time.monotonic()
    path = lake_paths.bronze_path(conf)
    result = {"seq": -1, "tables": {}, "phases": {}}
    result["decoded"] = decode_step.run(conf, spark, prog.decoding)
    result["phases"]["decode"] = round(time.monotonic() - began, 2)
    if not delta_io.is_table(spark, path):
        return result
    state = bronze_log.state(spark, path)
    result["seq"] = state.seq
    _read_applied(spark, prog, [spec for spec in lake_paths.table_specs(conf) if spec.qualified in state.touched])
    result["phases"]["state"] = round(time.monotonic() - began - result["phases"]["decode"], 2)
    behind = [spec for spec in lake_paths.table_specs(conf) if (tables is None or spec.qualified in tables)
              and state.touched.get(spec.qualified, -1) > _applied(spark, prog, spec)]
    if behind:
        cuts = micro_batch.truncates(conf)
        # one read of the log for every table behind, and one job counting their events and their last offsets
        pending = bronze_log.pending_slice(spark, path, {s.qualified: prog.applied[s.qualified] for s in behind},
                                           state.seq).persist()
        try:
            counted = _counted(pending, {s.qualified: s.topic for s in behind})
            result["phases"]["slice"] = round(time.monotonic() - began - result["phases"]["state"]
                                              - result["phases"]["decode"], 2)
            for spec, done in _side_by_side(spark, prog, behind, lambda session, spec: _step_table(
                    session, prog, spec, state.seq, pending, counted.get(spec.qualified), cuts)):
                result["tables"][spec.qualified] = done
        finally:
            pending.unpersist()
    if maintain:
        result["phases"]["maintain"] = upkeep(conf, spark, prog, state.seq)
    result["seconds"] = round(time.monotonic() - began, 2)
    if result["tables"]:
        log.info("silver step to bronze commit %s: %s", state.seq, result["tables"])
        prog.history = (prog.history + [{**result, "at": time.time()}])[-100:]
    return result


def _counted(pending, topics: dict[str, str]) -> dict[str, dict]:
    """Per table in the pending rows: its events (truncates left out), those with TOAST-unchanged columns, the
    writer schema ids of their values and keys, and the last offset of each partition of its topic."""
    event = (F.col("op") != bronze_log.TRUNCATE_OP) | F.col("op").isNull()
    counted: dict[str, dict] = {}
    for row in pending.groupBy("_table", "_kafka_topic", "_kafka_partition").agg(
            F.count(F.when(event, 1)).alias("n"), F.count(F.when(F.size("unchanged_cols") > 0, 1)).alias("toast"),
            F.max(F.when(event, F.col("_kafka_offset"))).alias("last"),
            F.collect_set("_value_schema_id").alias("value_ids"), F.collect_set("_key_schema_id").alias("key_ids"),
    ).collect():
        table = counted.setdefault(row["_table"], {"n": 0, "toast": 0, "offsets": {}, "value_ids": set(),
                                                   "key_ids": set()})
        table["n"] += row["n"]
        table["toast"] += row["toast"]
        table["value_ids"].update(int(i) for i in row["value_ids"] if i is not None)
        table["key_ids"].update(int(i) for i in row["key_ids"] if i is not None)
        if row["_kafka_topic"] == topics.get(row["_table"]) and row["last"] is not None:
            table["offsets"][int(row["_kafka_partition"])] = int(row["last"])
    return counted


def _sessions(spark: SparkSession, prog: Progress, count: int) -> list[SparkSession]:
    """Up to merge.parallelism sessions for MERGEs side by side: each MERGE's record of what it applied is a
    session setting, so two MERGEs at once need two sessions (one, the caller's, over Spark Connect)."""
    want = min(count, max(1, int(config.get(prog.conf, "merge.parallelism"))))
    if want < 2 or type(spark).__module__.startswith("pyspark.sql.connect"):
        return [spark]
    while len(prog.sessions) < want:
        prog.sessions.append(spark.newSession())
    return prog.sessions[:want]


def _side_by_side(spark: SparkSession, prog: Progress, specs: list, step) -> list:
    """step(session, spec) for every spec, up to merge.parallelism at once; [(spec, result)] in specs' order.

    A table whose step fails raises once the others have finished (their progress is recorded).
    """
    import queue
    from concurrent.futures import ThreadPoolExecutor

    free: queue.SimpleQueue = queue.SimpleQueue()
    for session in _sessions(spark, prog, len(specs)):
        free.put(session)

    def one(spec):
        session = free.get()
        try:
            return step(session, spec)
        finally:
            free.put(session)

    if free.qsize() == 1:
        return [(spec, one(spec)) for spec in specs]
    with ThreadPoolExecutor(max_workers=free.qsize(), thread_name_prefix="cdc-silver-merge") as pool:
        return list(zip(specs, pool.map(one, specs), strict=True))


def _step_table(spark: SparkSession, prog: Progress, spec, seq: int, pending, counted, cuts: dict) -> dict:
    """One table's MERGE of its pending log rows (or the record that nothing changed); its events and seconds."""
    conf, path, done = prog.conf, lake_paths.bronze_path(prog.conf), prog.applied[spec.qualified]
    n, toast = (int(counted["n"]), int(counted["toast"])) if counted else (0, 0)
    started = time.monotonic()
    silver = lake_paths.silver_path(conf, spec)
    cut = cuts.get(spec.qualified)
    pending_cut = cut if cut is not None and prog.truncates.get(spec.qualified) != cut \
        and silver_table.truncate_pending(spark, silver, cut) else None
    # the ids the pending events were written with: a version newer than the cached ones (a column added while the
    # merge runs) makes the layout ask the registry again, so silver gets the new column
    layout = writer_schemas.table_layout(spark, prog.schemas, spec, counted["value_ids"] if counted else set(),
                                         counted["key_ids"] if counted else set())
    _refuse_unserved(prog, spec, layout, counted)
    events = bronze_log.events(spark, path, spec.qualified, done, seq, layout.key, layout.row, log=pending)
    # per partition, the log holds the topic's offsets in order: silver now holds every offset up to the last one
    offsets = dict(prog.offsets.get(spec.qualified, {}))
    for partition, last in (counted["offsets"] if counted else {}).items():
        offsets[partition] = max(last, offsets.get(partition, -1))  # a dead-letter replay carries older offsets
    if n or pending_cut is not None:
        source = silver_table.merge_source(events, layout, cut[:2] if cut else None, toast=toast > 0)
        silver_table.merge_silver(spark, silver, spec, layout, source, pending_cut, seq, prog.ready, offsets)
    else:  # only a truncate silver had applied already: record the commit reached all the same
        silver_table.record_applied(spark, silver, spec, seq, offsets)
    prog.applied[spec.qualified] = seq
    prog.offsets[spec.qualified] = offsets
    if cut is not None:
        prog.truncates[spec.qualified] = cut
    return {"events": n, "seconds": round(time.monotonic() - started, 2)}


def _refuse_unserved(prog: Progress, spec, layout, counted: dict | None) -> None:
    """Stop when pending log events were written with a schema id the registry no longer serves.

    Their columns are known only from that schema: silver would lose a column only that version had, silently.
    """
    if not counted:
        return
    ids = sorted((counted["value_ids"] - set(layout.value_ids)) | (counted["key_ids"] - set(layout.key_ids)))
    if ids:
        raise MergeError(
            f"table {spec.qualified}: the bronze log holds events not yet in silver that were written with schema "
            f"id(s) {', '.join(map(str, ids))}, which the schema registry {prog.schemas.url} no longer serves (asked "
            f"for {prog.schemas.wait_s:.0f} s). The silver step stops rather than guess their columns; nothing is "
            f"applied or lost. Remedy: restore those schema versions in the registry (undelete the subject's versions "
            f"or restore its storage), then start the merge again: silver resumes from where it stopped")


def upkeep(conf: dict, spark: SparkSession, prog: Progress, decoded_seq: int) -> float:
    """Now and then: drop old soft tombstones from silver, compact the logs (the raw log pruned to what the bronze
    log's commit decoded_seq has not decoded); the seconds it took."""
    began, path = time.monotonic(), lake_paths.bronze_path(conf)
    minutes = float(config.get(conf, "merge.cleanup_interval_minutes"))
    if minutes > 0 and time.monotonic() - prog.last_cleanup >= minutes * 60:
        silver_table.cleanup_tombstones(conf, spark)
        prog.last_cleanup = time.monotonic()
    minutes = float(config.get(conf, "merge.compact_interval_minutes"))
    if minutes > 0 and time.monotonic() - prog.last_compaction >= minutes * 60:
        compact(spark, path)
        raw = lake_paths.raw_path(conf)
        if delta_io.is_table(spark, raw):
            raw_log.prune(spark, raw, decoded_seq)  # the bronze log's state this step read
            compact(spark, raw)
        prog.last_compaction = time.monotonic()
    return round(time.monotonic() - began, 2)


def compact(spark: SparkSession, path: str) -> dict:
    """OPTIMIZE a log: one commit per trigger leaves many small files; a reader opens fewer after it."""
    metrics = spark.sql(f"OPTIMIZE delta.{quote(path)}").collect()[0].asDict(recursive=True).get("metrics") or {}
    return {"files_added": metrics.get("numFilesAdded"), "files_removed": metrics.get("numFilesRemoved")}
