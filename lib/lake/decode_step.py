"""The decode step: the raw log's commits the bronze log lacks, decoded into it in one commit, dead letters set aside.

The trigger only appends Kafka's records undecoded (lib/lake/raw_log.py), so what grows with the tables (one
``from_avro`` per table and writer schema) is paid here, once for every trigger the step covers, off the
streaming query's path. The merge service runs a step as soon as a trigger committed, and every silver step
(lib/lake/silver_step.py) runs one first, so silver applies every record the raw log holds.

Each row keeps its raw ``_seq``. The bronze log commit records the raw commit it reached (userMetadata
{"merge_batch": "decode", "batch": n, "seq": n, "touched": ...}), so a step repeated after a crash starts after
it, and the dead letters of a step that crashed before that commit are found by the same number (the next step
decodes the same commits again and does not append them twice).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lib import config
from lib import spark as spark_session
from lib.lake import bronze_log, dead_letter, decode, delta_io, lake_paths, raw_log, writer_schemas
from lib.lake.lake_paths import MergeError, TableSpec
from lib.lake.writer_schemas import Layout, Schemas

log = logging.getLogger(__name__)

MARKER = "decode"  # the bronze log's and the dead-letter table's commits written by a decode step
APPEND_HISTORY_COMMITS = 100  # dead-letter commits searched for a crashed step's append


@dataclass
class Decoding:
    """What a process keeps between decode steps: the registry's schemas, the dead letters' last step."""

    conf: dict
    schemas: Schemas
    dead_letters_upto: int | None = None  # the raw commit the last dead-letter append reached (read once)
    history: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one step at a time (the service's two threads)


def decoding(conf: dict, schemas: Schemas | None = None) -> Decoding:
    """A new Decoding for conf."""
    return Decoding(conf=conf, schemas=schemas or Schemas(conf))


def run(conf: dict, spark: SparkSession, dec: Decoding | None = None) -> dict:
    """Decode the raw log's commits the bronze log lacks into it. Returns {'seq': the raw commit the bronze log
    holds now, 'commits': raw commits decoded, 'tables': {table: {events, tombstones, dead_letters}}}."""
    dec = dec or decoding(conf)
    with dec.lock:  # two steps at once would append the same raw commits twice
        return _run(conf, spark, dec)


def in_trigger(conf: dict, spark: SparkSession, dec: Decoding, frame: DataFrame, seq: int,
               ids: dict[str, tuple[list, list]]) -> dict:
    """Decode the raw commit a trigger just wrote (frame: its rows, _seq = seq; ids: {table: (value schema ids, key
    schema ids)} as the trigger counted them) from the trigger's own rows, without reading the raw log back: what a
    trigger touching few tables does (merge.decode_in_trigger_tables), so a trickle waits for one step, not two.
    When the bronze log lacks older raw commits too, the ordinary step runs."""
    with dec.lock:
        return _run(conf, spark, dec, (frame, seq, {table: {"seq": seq, "v": v, "k": k}
                                                    for table, (v, k) in ids.items()}))


def _run(conf: dict, spark: SparkSession, dec: Decoding, written: tuple | None = None) -> dict:
    """The step; written: (rows, seq, present) of the raw commit the caller just wrote, decoded from those rows
    when it is the only commit the bronze log lacks."""
    began = time.monotonic()
    raw_path, path = lake_paths.raw_path(conf), lake_paths.bronze_path(conf)
    if not delta_io.is_table(spark, raw_path):
        return {"seq": -1, "commits": 0, "tables": {}, "dead_letters": {}}
    raw_state = bronze_log.state(spark, raw_path)
    delta_io.clear_failed_creation(path)
    bronze_log.ensure(spark, path)
    done = bronze_log.state(spark, path)
    upto = raw_state.seq
    if dec.dead_letters_upto is None:
        dec.dead_letters_upto = _dead_letters_upto(spark, conf)
    lettered = done.seq < dec.dead_letters_upto  # a step that crashed after its dead letters: the same commits
    if lettered:
        upto = min(upto, dec.dead_letters_upto)
    if upto <= done.seq:
        return {"seq": done.seq, "commits": 0, "tables": {}, "dead_letters": {}}
    if written is not None and upto == written[1] == done.seq + 1:
        return _decode(conf, spark, dec, written[0], done, upto, lettered, began, written[2])
    return _decode(conf, spark, dec, raw_log.pending(spark, raw_path, done.seq, upto), done, upto, lettered, began)


def _decode(conf: dict, spark: SparkSession, dec: Decoding, pending: DataFrame, done: bronze_log.State, upto: int,
            lettered: bool, began: float, present: dict | None = None) -> dict:
    """The raw rows pending (the commits after done.seq up to upto) decoded into the bronze log in one commit;
    present: {table: {seq, v, k}} (its last _seq and schema ids) when the caller knows it, else counted here."""
    path = lake_paths.bronze_path(conf)
    result = {"seq": done.seq, "commits": 0, "tables": {}, "dead_letters": {}}
    cores = spark_session.cores(spark)
    # one partition per core: each task builds every table's decoders (a Hadoop Configuration per from_avro)
    pending = (pending.coalesce(cores) if cores else pending).persist()
    combined = None
    try:
        if present is None:
            present = {row["_table"]: row for row in pending.groupBy("_table").agg(
                F.max("_seq").alias("seq"), F.collect_set("_value_schema_id").alias("v"),
                F.collect_set("_key_schema_id").alias("k")).collect()}
        specs = lake_paths.table_specs(conf)
        stray = sorted(set(present) - {s.qualified for s in specs})
        if stray:
            raise MergeError(f"the raw log {lake_paths.raw_path(conf)} holds records of table(s) {', '.join(stray)} "
                             f"after bronze commit {done.seq}, which are no longer in source.tables: put them back "
                             f"in source.tables to have them decoded (their records are kept in the raw log)")
        framed = raw_log.as_headers(pending)
        plans = []
        for n, spec in enumerate(specs):
            row = present.get(spec.qualified)
            if row is None:
                continue
            ids = {i for i in row["v"] if i is not None}, {i for i in row["k"] if i is not None}
            layout = writer_schemas.table_layout(spark, dec.schemas, spec, *ids)
            _refuse_unknown_ids(dec, framed, spec, layout, *ids)
            plans.append((n, spec.qualified, _plan(dec, n, spec, layout, framed)))
        logged = [raw_log.bronze_truncates(pending)]
        if plans:
            combined = _decoded(framed, plans).persist()
            for table, mine in _counts(combined).items():
                good = mine.get(None)
                bad = {reason: c["n"] for reason, c in mine.items() if reason is not None}
                result["tables"][table] = {"events": good["n"] - good["tombs"] if good else 0,
                                           "tombstones": good["tombs"] if good else 0,
                                           "dead_letters": sum(bad.values())}
                for reason, count in bad.items():
                    result["dead_letters"][reason] = result["dead_letters"].get(reason, 0) + count
            if result["dead_letters"] and not lettered:
                _write_dead_letters(spark, dec, combined, upto, result["dead_letters"])
            logged.insert(0, bronze_log.good(combined))
        touched = {**done.touched, **{table: int(row["seq"]) for table, row in present.items()}}
        bronze_log.append_decoded(spark, path, logged[0] if len(logged) == 1 else logged[0].unionByName(logged[1]),
                                  {"merge_batch": MARKER, "batch": upto, "seq": upto, "touched": touched})
    finally:
        pending.unpersist()
        if combined is not None:
            combined.unpersist()
    result["seq"], result["commits"] = upto, upto - max(done.seq, -1)
    result["seconds"] = round(time.monotonic() - began, 2)
    dec.history = (dec.history + [{**result, "at": time.time()}])[-100:]
    log.info("decode step to raw commit %s: %s", upto, result["tables"])
    return result


def _dead_letters_upto(spark: SparkSession, conf: dict) -> int:
    """The raw commit the dead-letter table's newest decode append reached (-1: none)."""
    for text in delta_io.commit_metadata(spark, lake_paths.dead_letter_path(conf), APPEND_HISTORY_COMMITS):
        try:
            meta = json.loads(text or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and meta.get("merge_batch") == MARKER:
            return int(meta["batch"])
    return -1


def _write_dead_letters(spark: SparkSession, dec: Decoding, combined: DataFrame, upto: int, reasons: dict) -> None:
    """Append the step's poison messages to the dead-letter table (its commit records the raw commit reached)."""
    path = lake_paths.dead_letter_path(dec.conf)
    delta_io.clear_failed_creation(path)
    dead_letter.rows(combined).write.format("delta").mode("append") \
        .option("userMetadata", json.dumps({"merge_batch": MARKER, "batch": upto})).save(path)
    dec.dead_letters_upto = upto
    log.warning("decode step to raw commit %s: %s message(s) went to the dead-letter table %s: %s", upto,
                sum(reasons.values()), path, reasons)


_PLANS: dict = {}  # (driver, table, writer layout) -> decode plan and log columns: a cache, never the lake's state
PLANS_KEPT = 2000


def _plan(dec: Decoding, n: int, spec: TableSpec, layout: Layout, framed: DataFrame) -> tuple:
    """A table's decode plan and log columns for a step of many tables (the table: n, its place in source.tables),
    built once per process and writer layout (later steps reuse them)."""
    from pyspark import SparkContext

    key = (id(SparkContext._gateway), n, spec.qualified, tuple(layout.value_ids), tuple(layout.key_ids),
           layout.row.json(), layout.key.json(), json.dumps(layout.semantic, sort_keys=True),
           json.dumps(layout.pg_names, sort_keys=True))
    if key not in _PLANS:
        if len(_PLANS) >= PLANS_KEPT:
            _PLANS.clear()
        tag = f"_t{n}"
        decoding_ = decode.plan(framed.withColumn("__t", F.lit(n)), dec.schemas, layout, tag, F.col("__t") == n)
        _PLANS[key] = (decoding_, bronze_log.log_columns(spec.qualified, tag, decoding_.reason, decoding_.detail))
    return _PLANS[key]


CARRIED = ("_query", "_batch_id", "_seq")  # raw columns every decoded row keeps


def _decoded(framed: DataFrame, plans: list[tuple]) -> DataFrame:
    """Every table's rows decoded side by side, in the bronze log's layout (bronze_log.rows_of_tables).

    One projection per stage for the whole step, each row decoded by its own table's plan only (the plans'
    guard: __t, the table's place in source.tables), instead of a branch per table scanning the rows again.
    ``plans``: (n, table, (decode plan, log columns)) per table present.
    """
    place = F.create_map(*[F.lit(x) for n, table, _ in plans for x in (table, n)])[F.col("_table")]
    base = (*decode.BASE, *CARRIED)
    rows = framed.select(*base, place.alias("__t")).filter(F.col("__t").isNotNull())
    stage = rows.select("*", *[c for _, _, (decoding_, _) in plans for c in decoding_.stage])
    mapped = {name: c for _, _, (decoding_, _) in plans for name, c in decoding_.mapped.items()}
    if mapped:
        stage = stage.select(*[mapped.get(name, F.col(name)) for name in stage.columns])
    out = stage.select(*base, "__t", *[c for _, _, (decoding_, _) in plans for c in decoding_.out])
    return bronze_log.rows_of_tables(out, [(F.col("__t") == n, columns) for n, _, (_, columns) in plans])


def _refuse_unknown_ids(dec: Decoding, framed: DataFrame, spec: TableSpec, layout: Layout, value_ids: set,
                        key_ids: set) -> None:
    """Stop the step when a writer id is not served (merge.unknown_schema_ids: fail, the default); records a dead
    letter replay put back are set aside again whatever the setting (they were once already)."""
    missing_v = value_ids - set(layout.value_ids)
    missing_k = key_ids - set(layout.key_ids)
    if not (missing_v or missing_k) or config.get(dec.conf, "merge.unknown_schema_ids") == "dead_letter":
        return
    unknown = F.lit(False)
    if missing_v:
        unknown = unknown | F.col("__vid").isin(*missing_v)
    if missing_k:
        unknown = unknown | F.col("__kid").isin(*missing_k)
    mine = (F.col("_table") == spec.qualified) & unknown & ~F.col("_query").startswith(dead_letter.REPLAY_PREFIX)
    first = framed.filter(mine).agg(F.min(F.struct("topic", "partition", "offset")).alias("p")).collect()[0]["p"]
    if first is None:
        return
    ids = ", ".join(str(i) for i in sorted(missing_v | missing_k))
    raise MergeError(
        f"topic {first['topic']} (table {spec.qualified}): schema id(s) {ids} are not served by the schema registry "
        f"{dec.schemas.url} (asked for {dec.schemas.wait_s:.0f} s), first at partition {first['partition']} offset "
        f"{first['offset']}. The merge stops rather than set those events aside: nothing is lost (the raw log "
        f"holds them), and the step runs again on restart. Remedy: bring the registry back to a state that serves "
        f"the id (a replica that caught up, the restored registry storage), or set merge.unknown_schema_ids: "
        f"dead_letter to let the merge go on and replay the dead letters later with "
        f"merge.replay_dead_letters(conf, spark)")


def _counts(combined: DataFrame) -> dict[str, dict]:
    """One job for every table of the step: {table: {reason or None: {n, tombs}}}."""
    rows = combined.groupBy("_table", "__reason").agg(
        F.count(F.lit(1)).alias("n"), F.count(F.when(F.col("_tombstone"), 1)).alias("tombs")).collect()
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["_table"], {})[r["__reason"]] = {"n": r["n"], "tombs": r["tombs"]}
    return out
