"""Avro key and value (Debezium-compatible envelope) schemas of a table, topic names, canonical JSON.

The contract is written out for data engineers in docs/events.md. In short: the key is a
record of the primary key columns; the value is an ``Envelope`` with ``before``/``after``
(the same ``Value`` record), ``op``, ``ts_ms``, ``source`` (Debezium's fields plus our
``commit_lsn`` and ``event_serial``: the merge orders events per key by that pair),
``transaction`` and ``unchanged_cols`` (columns whose unchanged TOASTed value was not sent).

Value fields are nullable unless every event is certain to carry the column: a NOT NULL
column is still ``["null", T]`` when it is TOASTable (may arrive as "unchanged") or when an
UPDATE/DELETE's ``before`` omits it (not in the replica identity). Such fields carry
``"pg.not_null": true``. Every field carries ``"pg.type"`` (SQL type) and, when its name had
to be changed to be a valid Avro name, ``"pg.column"`` (the original name).
"""

from __future__ import annotations

import hashlib
import re

from lib import config
from lib.capture import pgtypes
from lib.capture.catalog import CatalogError, Table

SOURCE_RECORD = "io.debezium.connector.postgresql.Source"
TRANSACTION_RECORD = "event.block"
CONNECTOR = "postgresql"
OPS = ("c", "u", "d", "r", "t")

_AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def avro_name(name: str) -> str:
    """A valid Avro name for name: invalid characters -> '_', leading digit gets a '_' prefix."""
    if _AVRO_NAME.fullmatch(name):
        return name
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"_{cleaned}"


def field_names(columns) -> dict[str, str]:
    """Column name -> Avro field name; a sanitized name that collides gets a hash suffix (order-independent)."""
    valid = {c.name for c in columns if _AVRO_NAME.fullmatch(c.name)}
    result, taken = {}, set(valid)
    for col in columns:
        if col.name in valid:
            result[col.name] = col.name
            continue
        name = avro_name(col.name)
        if name in taken:
            name = f"{name}_{hashlib.sha1(col.name.encode()).hexdigest()[:8]}"
        taken.add(name)
        result[col.name] = name
    return result


def namespace(topic_prefix: str | None, table: Table) -> str:
    """'<topic_prefix>.<schema>.<table>' with every part a valid Avro name."""
    parts = ([*topic_prefix.split(".")] if topic_prefix else []) + [table.schema, table.name]
    return ".".join(avro_name(p) for p in parts)


def topic_name(topic_prefix: str, table: Table | str, named: dict | None = None) -> str:
    """'<prefix>.<schema>.<table>', or the table's entry in named (conf kafka.topics); characters Kafka does not
    allow become '_'."""
    qualified = table.qualified if isinstance(table, Table) else table
    chosen = (named or {}).get(qualified)
    name = _TOPIC_CHARS.sub("_", chosen or f"{topic_prefix}.{qualified}")
    if len(name) > 249:
        setting = f"kafka.topics.{qualified}" if chosen else "kafka.topic_prefix"
        raise ValueError(f"topic name for {qualified} is longer than Kafka's 249 characters: shorten {setting}")
    return name


def topic_for(conf: dict, table: Table | str) -> str:
    """The topic of a table under conf: kafka.topics names it, else '<kafka.topic_prefix>.<schema>.<table>'."""
    return topic_name(config.get(conf, "kafka.topic_prefix"), table, config.get(conf, "kafka.topics"))


def shared_topics(topic_prefix: str, tables, named: dict | None = None) -> dict[str, list[str]]:
    """Topics that more than one of tables would write (names differing only in characters Kafka does not allow)."""
    by_topic: dict[str, list[str]] = {}
    for table in tables:
        by_topic.setdefault(topic_name(topic_prefix, table, named), []).append(
            table.qualified if isinstance(table, Table) else table)
    return {topic: names for topic, names in by_topic.items() if len(names) > 1}


def key_schema(table: Table, topic_prefix: str | None = None, unknown_types: str = "error") -> dict:
    """Avro record 'Key' of the primary key columns (non-null), in key order."""
    if not table.primary_key:
        raise CatalogError(
            f"table {table.qualified} has no primary key, so its topic has no key: add a primary key "
            f"or remove the table from source.tables")
    names = field_names(table.columns)
    fields = []
    for col_name in table.primary_key:
        col = table.column(col_name)
        fields.append(_field(names[col.name], col,
                             pgtypes.avro_type(table, col, unknown_types, nullable=False), nullable=False))
    return {"type": "record", "name": "Key", "namespace": namespace(topic_prefix, table), "fields": fields}


def value_fields(table: Table, unknown_types: str = "error") -> list[dict]:
    """Fields of the 'Value' record: every non-generated column in attnum order."""
    names = field_names(table.columns)
    identity = set(table.identity_columns) if table.replica_identity in ("d", "i") else None
    fields = []
    for col in table.columns:
        if col.generated:
            continue  # pgoutput (PostgreSQL <= 17) does not send generated columns
        always_present = col.not_null and not col.toastable and (identity is None or col.name in identity)
        avro = pgtypes.avro_type(table, col, unknown_types, nullable=not always_present)
        fields.append(_field(names[col.name], col, avro, nullable=not always_present))
    return fields


def value_schema(table: Table, topic_prefix: str, unknown_types: str = "error") -> dict:
    """The Debezium-compatible Envelope record of a table's topic."""
    ns = namespace(topic_prefix, table)
    value = {"type": "record", "name": "Value", "namespace": ns, "fields": value_fields(table, unknown_types)}
    return {
        "type": "record", "name": "Envelope", "namespace": ns,
        "fields": [
            {"name": "before", "type": ["null", value], "default": None},
            {"name": "after", "type": ["null", f"{ns}.Value"], "default": None},
            {"name": "source", "type": source_schema()},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
            {"name": "transaction", "type": ["null", transaction_schema()], "default": None},
            {"name": "unchanged_cols", "type": {"type": "array", "items": "string"}, "default": []},
        ],
    }


def value_record(envelope: dict) -> dict:
    """The Value record (a row's columns) inside an Envelope schema, where 'before' defines it."""
    return next(f["type"][1] for f in envelope["fields"] if f["name"] == "before")


def source_schema() -> dict:
    """The 'source' block: Debezium's PostgreSQL fields plus commit_lsn and event_serial (the merge order)."""
    nullable_string = ["null", "string"]
    nullable_long = ["null", "long"]
    return {
        "type": "record", "name": SOURCE_RECORD.rsplit(".", 1)[1], "namespace": SOURCE_RECORD.rsplit(".", 1)[0],
        "fields": [
            {"name": "version", "type": "string"},
            {"name": "connector", "type": "string"},
            {"name": "name", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "snapshot", "type": "string", "default": "false"},
            {"name": "db", "type": "string"},
            {"name": "sequence", "type": nullable_string, "default": None},
            {"name": "schema", "type": "string"},
            {"name": "table", "type": "string"},
            {"name": "txId", "type": nullable_long, "default": None},
            {"name": "lsn", "type": nullable_long, "default": None},
            {"name": "xmin", "type": nullable_long, "default": None},
            {"name": "commit_lsn", "type": "long"},
            {"name": "event_serial", "type": "long"},
        ],
    }


def transaction_schema() -> dict:
    """Debezium's transaction block (id, total_order, data_collection_order)."""
    return {
        "type": "record", "name": TRANSACTION_RECORD.rsplit(".", 1)[1],
        "namespace": TRANSACTION_RECORD.rsplit(".", 1)[0],
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "total_order", "type": "long"},
            {"name": "data_collection_order", "type": "long"},
        ],
    }


def _field(name: str, col, avro, nullable: bool) -> dict:
    field = {"name": name, "type": avro}
    if nullable:
        field["default"] = None
    field["pg.type"] = col.type_name
    if name != col.name:
        field["pg.column"] = col.name
    if nullable and col.not_null:
        field["pg.not_null"] = True
    return field


