"""Writer schemas from the registry, and the layout each table's changes are decoded into."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from confluent_kafka.schema_registry.error import SchemaRegistryError
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro

from lib import config, schema_registry
from lib.lake import debezium
from lib.lake.lake_paths import META_COLUMNS, MergeError, TableSpec

log = logging.getLogger(__name__)

UNKNOWN_SCHEMA_RECHECK_S = 60.0  # a missing id is asked for again after this long


class Schemas:
    """Writer schemas by id (each fetched once) and the versions of each subject, cached on the driver."""

    def __init__(self, conf: dict, client=None):
        self.client = client or schema_registry.client(conf)
        self.url = config.get(conf, "registry.url", "")
        self.wait_s = float(config.get(conf, "merge.unknown_schema_wait_s"))
        self.by_id: dict[int, dict] = {}
        self.missing: dict[int, float] = {}  # id -> when the registry last said 404 (asked again later)
        self.subject_ids: dict[str, list[int]] = {}  # subject -> ids, oldest version first
        self.spark_types: dict[int, T.DataType] = {}

    def writer(self, schema_id: int) -> dict | None:
        """The parsed writer schema of an id; None while the registry does not serve it (404 for wait_s)."""
        if schema_id in self.by_id:
            return self.by_id[schema_id]
        missed = self.missing.get(schema_id)
        if missed is not None and time.monotonic() - missed < UNKNOWN_SCHEMA_RECHECK_S:
            return None
        deadline, delay = time.monotonic() + self.wait_s, 0.5
        while True:
            try:
                with schema_registry.asking(self.url, f"schema id {schema_id}"):
                    self.by_id[schema_id] = json.loads(self.client.get_schema(schema_id).schema_str)
                self.missing.pop(schema_id, None)
                return self.by_id[schema_id]
            except SchemaRegistryError as exc:
                if exc.http_status_code != 404:
                    raise MergeError(f"schema registry {self.url} failed to return schema id {schema_id} "
                                     f"(HTTP {exc.http_status_code}): {exc.error_message}; check registry.url "
                                     f"and the registry's log") from exc
            if time.monotonic() >= deadline:
                self.missing[schema_id] = time.monotonic()
                log.warning("schema registry %s does not serve schema id %s (asked for %.0f s)", self.url,
                            schema_id, self.wait_s)
                return None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def versions(self, subject: str, refresh: bool = False) -> list[int]:
        """Schema ids of every version of subject, oldest first ([] when the subject does not exist)."""
        if refresh or subject not in self.subject_ids:
            with schema_registry.asking(self.url, subject):
                try:
                    numbers = sorted(self.client.get_versions(subject))
                except SchemaRegistryError as exc:
                    if exc.http_status_code != 404:
                        raise MergeError(f"schema registry {self.url} failed to list versions of {subject} "
                                         f"(HTTP {exc.http_status_code}): {exc.error_message}") from exc
                    numbers = []
                ids = []
                for number in numbers:
                    registered = self.client.get_version(subject, number)
                    self.by_id.setdefault(registered.schema_id, json.loads(registered.schema.schema_str))
                    ids.append(registered.schema_id)
            self.subject_ids[subject] = ids
        return self.subject_ids[subject]

    def spark_type(self, spark: SparkSession, schema_id: int) -> T.DataType:
        """The Spark type from_avro gives a writer schema (analysis only, no job)."""
        if schema_id not in self.spark_types:
            text = json.dumps(self.by_id[schema_id])
            frame = spark.range(0).select(from_avro(F.lit(None).cast("binary"), text).alias("x"))
            self.spark_types[schema_id] = frame.schema["x"].dataType
        return self.spark_types[schema_id]


@dataclass
class Layout:
    """How one table's messages in a batch decode: writer ids, target row and key structs."""

    value_ids: list[int]
    key_ids: list[int]
    row: T.StructType  # union of every version's Value fields
    key: T.StructType
    nullable: set[str]  # fields that may be null in some version (TOAST candidates)
    pg_names: dict[int, dict[str, str]]  # writer id -> {pg column: avro field} where they differ
    semantic: dict[int, dict[str, str]] = field(default_factory=dict)  # id -> Debezium types to convert


def _value_record(schema: dict) -> dict | None:
    """The 'Value' record inside an envelope schema (defined in before or after)."""
    for fld in schema.get("fields", []):
        if fld["name"] in ("before", "after"):
            types = fld["type"] if isinstance(fld["type"], list) else [fld["type"]]
            for t in types:
                if isinstance(t, dict) and t.get("type") == "record":
                    return t
    return None


def table_layout(spark: SparkSession, schemas: Schemas, spec: TableSpec, value_ids: set[int],
                 key_ids: set[int]) -> Layout:
    """Resolve the writer ids seen in a batch and the table's target structs."""
    key_subject, value_subject = schema_registry.subjects(spec.topic)
    versions = schemas.versions(value_subject)
    if any(i not in versions for i in value_ids):
        versions = schemas.versions(value_subject, refresh=True)
    known_values = sorted(i for i in value_ids if schemas.writer(i) is not None)
    ordered = list(reversed(versions)) + [i for i in known_values if i not in versions]
    row_fields: dict[str, T.StructField] = {}
    nullable: set[str] = set()
    pg_names: dict[int, dict[str, str]] = {}
    semantic: dict[int, dict[str, str]] = {}
    for schema_id in ordered:
        record = _value_record(schemas.by_id[schema_id]) or {"fields": []}
        after = schemas.spark_type(spark, schema_id)["after"].dataType
        if debezium.is_debezium(schemas.by_id[schema_id]):  # Debezium's types and TOAST placeholders
            semantic[schema_id] = debezium.semantic_fields(record)
            after = debezium.row_type(after, semantic[schema_id])
            nullable |= debezium.toast_candidates(after)
        for fld in after.fields:
            row_fields.setdefault(fld.name.lower(), T.StructField(fld.name, fld.dataType))
        for fld in record["fields"]:
            if isinstance(fld["type"], list) and "null" in fld["type"]:
                nullable.add(fld["name"])
        renamed = {f["pg.column"]: f["name"] for f in record["fields"] if "pg.column" in f}
        if renamed:
            pg_names[schema_id] = renamed
    key_versions = schemas.versions(key_subject)
    if any(i not in key_versions for i in key_ids):
        key_versions = schemas.versions(key_subject, refresh=True)
    known_keys = sorted(i for i in key_ids if schemas.writer(i) is not None)
    key_order = list(reversed(key_versions)) + [i for i in known_keys if i not in key_versions]
    for i in key_order:
        semantic[i] = debezium.semantic_fields(schemas.by_id[i])
    key_type = debezium.row_type(schemas.spark_type(spark, key_order[0]), semantic[key_order[0]]) if key_order \
        else T.StructType([])
    row = T.StructType(list(row_fields.values()))
    for name in (f.name for f in row.fields):
        if name.lower() in META_COLUMNS or name.startswith("__"):
            raise MergeError(f"table {spec.qualified} has a column {name} whose name the merge reserves for its own "
                             f"columns ({', '.join(META_COLUMNS)}, __*): rename the source column")
    missing = [f.name for f in key_type.fields if f.name.lower() not in row_fields]
    if missing and row.fields:
        raise MergeError(f"topic {spec.topic}: key field(s) {', '.join(missing)} are not fields of the value "
                         f"schema; the key must be the table's primary key columns (see docs/events.md)")
    return Layout(known_values, known_keys, row, key_type, nullable, pg_names, semantic)
