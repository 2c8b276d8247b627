"""Where the lake keeps each configured table (bronze, silver), the dead letters and the checkpoints, and the names
it uses."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lib import config
from lib.capture import avro_schemas, catalog


class MergeError(RuntimeError):
    """The merge cannot go on: the message names the table, column or setting and the remedy."""


META_COLUMNS = ("_commit_lsn", "_event_serial", "_op", "_deleted", "_deleted_at", "_updated_at", "_unknown_cols",
                "_bronze_seq")


@dataclass(frozen=True)
class TableSpec:
    """A configured table: its schema, name and topic."""

    schema: str
    name: str
    topic: str

    @property
    def qualified(self) -> str:
        """schema.table (as in the control topic's truncate/<schema.table> keys)."""
        return f"{self.schema}.{self.name}"


def table_specs(conf: dict) -> list[TableSpec]:
    """The configured tables (source.tables) with their topics; unquoted names fold to lower case like SQL."""
    specs = []
    for name in config.get(conf, "source.tables"):
        schema, table = catalog.normalize(name)
        specs.append(TableSpec(schema, table, avro_schemas.topic_for(conf, f"{schema}.{table}")))
    return specs


def table_spec(conf: dict, table: str) -> TableSpec:
    """The configured table named 'schema.table' (or just 'table')."""
    spec = next((s for s in table_specs(conf) if s.qualified == table or s.name == table), None)
    if spec is None:
        raise MergeError(f"table {table} is not in source.tables ({', '.join(s.qualified for s in table_specs(conf))})")
    return spec


def quote(name: str) -> str:
    """A SQL identifier in backticks."""
    return "`" + str(name).replace("`", "``") + "`"


def lake_path(conf: dict, *parts: str) -> str:
    """<lake.root>/<parts...>."""
    return "/".join([config.location(config.get(conf, "lake.root")).rstrip("/"), *parts])


def bronze_path(conf: dict) -> str:
    """<lake.root>/bronze/_log: the one change log of every table (lib/lake/bronze_log.py)."""
    return lake_path(conf, "bronze", "_log")


def raw_path(conf: dict) -> str:
    """<lake.root>/bronze/_raw: every table's Kafka records as the trigger appended them (lib/lake/raw_log.py)."""
    return lake_path(conf, "bronze", "_raw")


def silver_path(conf: dict, spec: TableSpec) -> str:
    """<lake.root>/silver/<schema>/<table> (catalog.path_segment: a name can never leave its folder)."""
    return lake_path(conf, "silver", catalog.path_segment(spec.schema), catalog.path_segment(spec.name))


def dead_letter_path(conf: dict) -> str:
    """<lake.root>/_dead_letter."""
    return lake_path(conf, "_dead_letter")


def checkpoint_path(conf: dict, query_name: str) -> str:
    """<lake.root>/_checkpoints/<query name>: one folder per streaming query."""
    return lake_path(conf, "_checkpoints", query_name)


def query_name(conf: dict) -> str:
    """merge.query_name, default 'merge_<topic prefix>' (names must be unique among a session's queries)."""
    default = "merge_" + re.sub(r"[^A-Za-z0-9_]", "_", str(config.get(conf, "kafka.topic_prefix")))
    return str(config.get(conf, "merge.query_name", default))
