"""Delta through SQL (Spark Connect runs it too): create a table, ask what it is, let a column widen."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from lib import config
from lib.lake.lake_paths import quote

log = logging.getLogger(__name__)

COMMIT_FILE = re.compile(r"\d{20}\.json")  # a commit in _delta_log (not a checkpoint, .crc or compacted range)


def ensure_table(spark: SparkSession, path: str, schema: T.StructType, stats_columns: list[str] | None = None,
                 properties: dict[str, str] | None = None) -> None:
    """Create the Delta table at path if missing (SQL, which Spark Connect runs too).

    Deletion vectors stay off: on small micro-batches they made each MERGE several jobs slower. Type
    widening is not on from the start: readers other than Spark (delta-rs, Polars, DuckDB) refuse a
    table with that feature, so allow_widening turns it on only when a column actually widens.
    """
    props = {"delta.enableDeletionVectors": "false", **(properties or {})}
    if stats_columns and len(schema.fields) > 32:
        props["delta.dataSkippingStatsColumns"] = ",".join(quote(c) for c in stats_columns)
    columns = ", ".join(f"{quote(f.name)} {sql_type(f.dataType)}" for f in schema.fields)
    options = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in props.items())
    spark.sql(f"CREATE TABLE IF NOT EXISTS delta.{quote(path)} ({columns}) USING delta TBLPROPERTIES ({options})")


def clear_failed_creation(path: str) -> None:
    """Remove the _delta_log of a local table whose creation failed before its first commit (a full disk).

    Such a log holds no commit, only Delta's temporary file, and Delta then refuses to create the table there
    (DELTA_TABLE_NOT_FOUND) on every retry, so the merge could not recover by itself once space was back. Only a
    log without any commit, checkpoint or staged commit is removed; remote paths are left alone.
    """
    log_dir = os.path.join(path, "_delta_log")
    if config.is_remote(path) or not os.path.isdir(log_dir):
        return
    entries = [name for name in os.listdir(log_dir) if not name.startswith(".")]
    staged = os.path.join(log_dir, "_staged_commits")
    if set(entries) <= {"_staged_commits"} and not (os.path.isdir(staged) and os.listdir(staged)):
        log.warning("merge: %s holds no commit (its creation failed, e.g. on a full disk): removing it so the table "
                    "is created again", log_dir)
        shutil.rmtree(log_dir, ignore_errors=True)


def sql_type(datatype: T.DataType) -> str:
    """A Spark type as SQL, field names quoted (a column may be called `first name`)."""
    if isinstance(datatype, T.StructType):
        return "struct<" + ", ".join(f"{quote(f.name)}: {sql_type(f.dataType)}" for f in datatype.fields) + ">"
    if isinstance(datatype, T.ArrayType):
        return f"array<{sql_type(datatype.elementType)}>"
    if isinstance(datatype, T.MapType):
        return f"map<{sql_type(datatype.keyType)}, {sql_type(datatype.valueType)}>"
    return datatype.simpleString()


def literal(text: str) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("\\", "\\\\").replace("'", "\\'") + "'"


def properties(spark: SparkSession, path: str) -> dict[str, str]:
    """The table's properties (detail)."""
    return detail(spark, path)["properties"]


def detail(spark: SparkSession, path: str) -> dict:
    """The table's data files (numFiles) and properties: from its commit files while its log here has no checkpoint
    yet (a young table, e.g. silver's first steps: no Spark job), else in one DESCRIBE DETAIL."""
    young = _replayed(_local_log(path))
    if young is not None:
        return young
    row = spark.sql(f"DESCRIBE DETAIL delta.{quote(path)}").select("numFiles", "properties").collect()[0]
    return {"numFiles": int(row["numFiles"] or 0), "properties": dict(row["properties"] or {})}


def is_table(spark: SparkSession, path: str) -> bool:
    """True when a Delta table exists at path: a commit in its _delta_log folder here, else asked through SQL
    (the session's filesystem may not be this process's: Spark Connect, a cluster)."""
    from pyspark.errors import AnalysisException

    if _newest_version(_local_log(path)) >= 0:
        return True
    try:
        spark.sql(f"DESCRIBE DETAIL delta.{quote(path)}").select("format").collect()
        return True
    except AnalysisException:
        return False


def widens(current: T.DataType, new: T.DataType) -> bool:
    """True when new changes the type of a field current has (at any depth), e.g. int -> bigint."""
    if isinstance(current, T.StructType) and isinstance(new, T.StructType):
        have = {f.name.lower(): f.dataType for f in current.fields}
        return any(widens(have[f.name.lower()], f.dataType) for f in new.fields if f.name.lower() in have)
    if isinstance(current, T.ArrayType) and isinstance(new, T.ArrayType):
        return widens(current.elementType, new.elementType)
    return current.simpleString() != new.simpleString()


def allow_widening(spark: SparkSession, path: str) -> None:
    """Turn on Delta type widening for the table at path, before a column widens in place.

    Operators: from then on the table carries the typeWidening reader feature, which Spark and
    Databricks read and some other readers (delta-rs 1.6, hence Polars and DuckDB's delta) refuse.
    """
    spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('delta.enableTypeWidening' = 'true')")


def commit_metadata(spark: SparkSession | None, path: str, limit: int = 100) -> Iterator[str | None]:
    """The userMetadata of the table's newest commits, newest first (nothing when no table is there).

    A table whose _delta_log this process sees is read from its commit files (no Spark job: the merge asks on every
    micro-batch and silver step, make status without a session); any other through DESCRIBE HISTORY, which Spark
    Connect runs (a path this process does not see may still be a table on the session's filesystem).
    """
    folder = _local_log(path)
    newest = _newest_version(folder)
    if newest >= 0:
        for version in range(newest, max(newest - limit, -1), -1):
            try:
                with open(os.path.join(folder, f"{version:020d}.json")) as handle:
                    lines = handle.readlines()
            except FileNotFoundError:  # older commits removed by the log's cleanup
                return
            info = next((action["commitInfo"] for action in map(json.loads, lines) if "commitInfo" in action), None)
            if info is not None:
                yield info.get("userMetadata")
        return
    if spark is None or not is_table(spark, path):
        return
    for row in spark.sql(f"DESCRIBE HISTORY delta.{quote(path)} LIMIT {limit}").select("userMetadata").collect():
        yield row["userMetadata"]


def local_path(path: str) -> str:
    """path on this machine's filesystem ('' for a URL such as s3:// or dbfs:/)."""
    if "://" in path and not path.startswith("file:"):
        return ""
    return path.removeprefix("file://").removeprefix("file:")


def _local_log(path: str) -> str:
    """The _delta_log folder of path on this machine's filesystem ('' for a URL such as s3:// or dbfs:/)."""
    local = local_path(path)
    return os.path.join(local, "_delta_log") if local else ""


def _newest_version(folder: str) -> int:
    """The newest commit in a local _delta_log (-1: none, or no such folder here): counted up from the last
    checkpoint, so a log of many commits is not listed; listed when it has no checkpoint yet."""
    if not folder or not os.path.isdir(folder):
        return -1
    try:
        with open(os.path.join(folder, "_last_checkpoint")) as handle:
            version = int(json.load(handle)["version"])
    except (OSError, ValueError, KeyError):
        return max((int(name[:20]) for name in os.listdir(folder) if COMMIT_FILE.fullmatch(name)), default=-1)
    while os.path.exists(os.path.join(folder, f"{version + 1:020d}.json")):
        version += 1
    return version


def _replayed(folder: str) -> dict | None:
    """numFiles and properties of a local log that has only commit files (none cleaned up, no checkpoint), from
    replaying them in order; None for any other log (DESCRIBE DETAIL reads it)."""
    if not folder or not os.path.isdir(folder) or os.path.exists(os.path.join(folder, "_last_checkpoint")):
        return None
    versions = sorted(int(name[:20]) for name in os.listdir(folder) if COMMIT_FILE.fullmatch(name))
    if not versions or versions != list(range(len(versions))):
        return None
    files: set[str] = set()
    properties: dict[str, str] = {}
    for version in versions:
        with open(os.path.join(folder, f"{version:020d}.json")) as handle:
            for action in map(json.loads, filter(str.strip, handle)):
                if "add" in action:
                    files.add(action["add"]["path"])
                elif "remove" in action:
                    files.discard(action["remove"]["path"])
                elif "metaData" in action:
                    properties = dict(action["metaData"].get("configuration") or {})
    return {"numFiles": len(files), "properties": properties}


def newest_metadata(spark: SparkSession | None, path: str, key: str, limit: int = 100) -> dict | None:
    """The newest commit's userMetadata (JSON) that has key, or None (commit_metadata)."""
    return first_with(commit_metadata(spark, path, limit), key)


def first_with(texts, key: str) -> dict | None:
    """The first of these userMetadata texts (newest first) that is a JSON object with key, or None."""
    for text in texts:
        try:
            meta = json.loads(text or "{}")
        except ValueError:
            continue
        if isinstance(meta, dict) and key in meta:
            return meta
    return None
