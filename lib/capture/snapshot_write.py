"""The snapshot's rows to Kafka: 'r' events in the capture's envelope, keyed like the stream, and tombstones for keys
the topic holds that the source no longer has."""

from __future__ import annotations

import importlib.metadata
import io
import json
import time

import fastavro

from lib import config, kafka_client, schema_registry, topics
from lib.capture import avro_schemas, catalog
from lib.capture.snapshot_slot import SnapshotError
from lib.schema_registry import confluent_header


def wire_record(record: dict, fields: list[dict]) -> dict:
    """The record schema handed to to_avro: the registered one, with wire types where Spark needs them (same bytes)."""
    wire = {f["field"]: f["wire"] for f in fields if f["wire"]}
    if not wire:
        return record
    record = json.loads(json.dumps(record))
    for field in record["fields"]:
        if field["name"] in wire:
            nullable = isinstance(field["type"], list)
            field["type"] = ["null", wire[field["name"]]] if nullable else wire[field["name"]]
    return record


def _without_logical_types(schema):
    """The schema with every logical type but decimal removed (same bytes, raw values)."""
    if isinstance(schema, dict):
        return {k: _without_logical_types(v) for k, v in schema.items()
                if not (k == "logicalType" and v != "decimal")}
    if isinstance(schema, list):
        return [_without_logical_types(v) for v in schema]
    return schema


def envelope_parts(table: catalog.Table, conf: dict, value_schema: dict, consistent_lsn: int, snapshot_ts_ms: int,
                   now_ms: int, op: str = "r") -> tuple[bytes, bytes]:
    """Avro bytes of an 'r' envelope before and after its ``after`` record (the same for every row).

    Avro writes a record as its fields' encodings one after the other, so an envelope is
    ``before`` (null: union branch 0), ``after`` (union branch 1, then the Value record), then
    the constant ``source``, ``op``, ``ts_ms``, ``transaction`` and ``unchanged_cols``. These
    are encoded once here with fastavro against the registered schema; Spark encodes only the
    Value record of each row.
    """
    fields = {f["name"]: f for f in value_schema["fields"]}
    assert [f["name"] for f in value_schema["fields"]] == ["before", "after", "source", "op", "ts_ms", "transaction",
                                                           "unchanged_cols"], "envelope layout changed"
    tail_schema = {"type": "record", "name": "EnvelopeTail", "namespace": value_schema["namespace"],
                   "fields": [fields[n] for n in ("source", "op", "ts_ms", "transaction", "unchanged_cols")]}
    source_block = {
        "version": _connector_version(), "connector": avro_schemas.CONNECTOR,
        "name": config.get(conf, "kafka.topic_prefix"), "ts_ms": snapshot_ts_ms, "snapshot": "true",
        "db": config.get(conf, "source.database"), "sequence": f'[null,"{consistent_lsn}"]',
        "schema": table.schema, "table": table.name, "txId": None, "lsn": consistent_lsn, "xmin": None,
        "commit_lsn": consistent_lsn, "event_serial": -1,
    }
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(tail_schema), {
        "source": source_block, "op": op, "ts_ms": now_ms, "transaction": None, "unchanged_cols": []})
    return b"\x00\x02", buffer.getvalue()  # before: null (branch 0); after: branch 1 of ["null", Value]


def encode(rows, table: catalog.Table, conf: dict, key_schema: dict, value_schema: dict, key_id: int,
           value_id: int, consistent_lsn: int, snapshot_ts_ms: int, fields: list[dict]):
    """DataFrame (key, value): Confluent-framed Avro key and 'r' envelope for every row (to_avro per row)."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import to_avro

    value_record = avro_schemas.value_record(value_schema)
    names = avro_schemas.field_names(table.columns)
    key_struct = F.struct(*[F.col(names[c]) for c in table.primary_key])
    after = F.struct(*[F.col(f["field"]) for f in fields])
    head, tail = envelope_parts(table, conf, value_schema, consistent_lsn, snapshot_ts_ms, int(time.time() * 1000))
    key_json = schema_registry.canonical_json(wire_record(key_schema, fields))
    value_json = schema_registry.canonical_json(wire_record(value_record, fields))
    return rows.select(
        F.concat(F.lit(confluent_header(key_id)), to_avro(key_struct, key_json)).alias("key"),
        F.concat(F.lit(confluent_header(value_id) + head), to_avro(after, value_json), F.lit(tail)).alias("value"),
    )


def _connector_version() -> str:
    try:
        return importlib.metadata.version("cdc-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def write(encoded, conf: dict, topic: str | None = None) -> None:
    """Spark's Kafka sink: idempotent producer, acks=all; returns when every task flushed its sends.

    Without ``topic`` each row names its own in a ``topic`` column."""
    options = {
        **kafka_client.spark_options(conf),
        "kafka.enable.idempotence": "true",
        "kafka.acks": "all",
        "kafka.linger.ms": "20",
        "kafka.batch.size": str(512 * 1024),
        "kafka.compression.type": "lz4",
        **({"topic": topic} if topic else {}),
    }
    options.update(_kafka_options(conf))
    kafka_client.hide_login(encoded.sparkSession)
    encoded.write.format("kafka").options(**options).save()


def _kafka_options(conf: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in (config.get(conf, "snapshot.kafka_options") or {}).items()}


def retract_stale_keys(conf: dict, spark, table: catalog.Table, topic: str, schemas: tuple, fields: list[dict],
                       earlier: dict[int, int], written: dict[int, int], consistent_lsn: int,
                       snapshot_ts_ms: int) -> int:
    """Delete events (+ tombstones) for keys that earlier messages hold but this snapshot does not; their count.

    A topic can hold rows from before this snapshot: a failed attempt, or the snapshot and
    stream before a re-snapshot. A key deleted in the source since then is absent from the new
    snapshot and no streamed change will ever mention it again, so without this its old row
    would stay in the topic (and in silver) forever. Each such key gets a 'd' event at the new
    consistent point (newer than anything before it) and a tombstone, like a streamed delete.
    ``earlier`` and ``written`` are per-partition end offsets before and after this snapshot's rows.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro, to_avro

    if not any(earlier.values()):
        return 0
    key_schema, value_schema, key_id, value_id = schemas
    value_record = avro_schemas.value_record(value_schema)
    names = avro_schemas.field_names(table.columns)
    key_fields = {names[c] for c in table.primary_key}
    plain = [f["name"] for f in value_record["fields"]
             if f["name"] not in key_fields and not isinstance(f["type"], list)]
    if plain:
        raise SnapshotError(
            f"topic {topic} holds rows from before this snapshot, and keys deleted since then must be retracted, "
            f"but table {table.qualified} (REPLICA IDENTITY FULL) needs the whole old row for a delete event "
            f"(non-null fields {', '.join(plain)}); remedy: snapshot into new topics (a new kafka.topic_prefix, or "
            f"delete the table's topic and rerun notebook 01)")

    def keys(start: dict, end: dict):
        """Distinct Avro keys (without the Confluent header) of the messages in [start, end) per partition."""
        return (spark.read.format("kafka")
                .options(**kafka_client.spark_options(conf)).options(**_kafka_options(conf))
                .option("subscribe", topic).option("failOnDataLoss", "false")
                .option("startingOffsets", json.dumps({topic: {str(p): o for p, o in start.items()}}))
                .option("endingOffsets", json.dumps({topic: {str(p): o for p, o in end.items()}}))
                .load().select(F.expr("substring(key, 6)").alias("k")).distinct())

    kafka_client.hide_login(spark)
    stale = keys({p: -2 for p in earlier}, earlier).join(keys(earlier, written), "k", "left_anti")
    # decoded without logical types (dates as int, timestamps as long, ...), exactly as column_transport selects them
    key_json = schema_registry.canonical_json(_without_logical_types(wire_record(key_schema, fields)))
    value_json = schema_registry.canonical_json(wire_record(value_record, fields))
    decoded = stale.select("k", from_avro(F.col("k"), key_json).alias("key"))
    before = F.struct(*[(F.col(f"key.{f['field']}").cast(f["spark_type"]) if f["field"] in key_fields
                         else F.lit(None).cast(f["spark_type"])).alias(f["field"]) for f in fields])
    _, tail = envelope_parts(table, conf, value_schema, consistent_lsn, snapshot_ts_ms, int(time.time() * 1000), "d")
    delete = F.concat(F.lit(confluent_header(value_id) + b"\x02"), to_avro(before, value_json), F.lit(b"\x00" + tail))
    events = decoded.select(F.concat(F.lit(confluent_header(key_id)), F.col("k")).alias("key"),
                            F.explode(F.array(delete, F.lit(None).cast("binary"))).alias("value"))  # d, then tombstone
    admin = kafka_client.admin(conf)
    start = sum(end_offsets(admin, [topic])[topic].values())
    write(events, conf, topic)
    return (sum(end_offsets(admin, [topic])[topic].values()) - start) // 2


def end_offsets(admin, names: list[str], timeout: float = 30.0) -> dict[str, dict[int, int]]:
    """Every topic's end offset per partition (lib.topics.end_offsets); a missing topic -> SnapshotError."""
    ends = topics.end_offsets(admin, names, timeout)
    missing = [t for t in names if t not in ends]
    if missing:
        raise SnapshotError(f"topic(s) {', '.join(missing)} are not readable; run notebook 01 to create them")
    return ends
