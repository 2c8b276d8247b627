"""Reading a table inside the exported snapshot with COPY, split by physical block (CTID) ranges, in Spark tasks.

Each Spark task opens its own connection, imports the slot's exported snapshot and streams
``COPY (SELECT ... WHERE ctid >= '(lo,0)' AND ctid < '(hi,0)') TO STDOUT (FORMAT csv)`` into
Arrow record batches. PostgreSQL stays on its cheapest path: a sequential read of a range of
heap blocks (a TID range scan, PostgreSQL 14+), no index, no key quantiles, no row-by-row
parsing in Java. The ranges come from ``pg_relation_size``, so they need no statistics.

Why Spark's Python data source (``pyspark.sql.datasource``): the read stays a Spark job, so a
cluster spreads the ranges over its executors, and the rows arrive as Arrow batches in the same
tasks that encode them to Avro and write them to Kafka (no second pass, no shuffle).

The values are those of ``snapshot_read.column_transport`` (what pgoutput would send), carried
as CSV text that Arrow parses with explicit types: bytea as hex and arrays as JSON, then turned
back into Spark's types by the transport's own ``post``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading

from pyspark import cloudpickle
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from lib import config, secrets, source
from lib.capture import catalog, snapshot_slot
from lib.capture.catalog import sql_ident

NAME = "cdc_pg_copy"
MIN_RANGE_BLOCKS = 128  # 1 MiB of 8 KiB blocks: smaller ranges cost more in connections than they save
_ARROW = {"boolean": "bool_", "int": "int32", "bigint": "int64", "float": "float32", "double": "float64",
          "string": "string"}


def copy_field(field: dict) -> dict:
    """How a snapshot_read field travels through COPY: {'sql', 'arrow', 'read_type', 'finish'}."""
    from pyspark.sql import functions as F

    spark_type = field["spark_type"]
    if spark_type.startswith("array<"):
        read_type = "array<string>" if spark_type == "array<binary>" or field["wire"] else spark_type
        if read_type.startswith("array<decimal"):
            read_type = "array<string>"  # the transport already carries decimal elements as exact text
        return {"sql": f"to_json({field['sql']})", "arrow": "string", "read_type": "string",
                "finish": lambda c, t=read_type, post=field["post"]: post(F.from_json(c, t))}
    if spark_type == "binary" and not field["wire"]:
        return {"sql": f"encode({field['sql']}, 'hex')", "arrow": "string", "read_type": "string",
                "finish": F.unhex}
    if spark_type == "binary":  # a decimal above 38 digits: its exact text, made into Avro bytes by post
        return {"sql": field["sql"], "arrow": "string", "read_type": "string", "finish": field["post"]}
    if spark_type.startswith("decimal("):
        precision, scale = (int(x) for x in spark_type[8:-1].split(","))
        return {"sql": field["sql"], "arrow": f"decimal128({precision},{scale})", "read_type": spark_type,
                "finish": field["post"]}
    return {"sql": field["sql"], "arrow": _ARROW[spark_type], "read_type": spark_type, "finish": field["post"]}


# per relation: its blocks (of its largest leaf partition) and a signature of its files (every leaf's file node)
SIZE_SQL = ("COALESCE((SELECT max(pg_relation_size(relid)) FROM pg_partition_tree({0}) WHERE isleaf), "
            "pg_relation_size({0})) / current_setting('block_size')::int8")
NODES_SQL = ("COALESCE((SELECT string_agg(pg_relation_filenode(relid)::text, ',' ORDER BY relid::oid) "
             "FROM pg_partition_tree({0}) WHERE isleaf), pg_relation_filenode({0})::text)")


def block_ranges(conn, table: catalog.Table, parts: int,
                 min_blocks: int = MIN_RANGE_BLOCKS) -> list[tuple[str, int, int | None, str | None]]:
    """(relation, first block, end block or None for 'to the end', file nodes) ranges of a table, about parts.

    Sizes come from pg_relation_size, at least min_blocks a range; the last range is open-ended,
    so a block the planner did not count is still read. A partitioned table is read through its
    parent (so SELECT on it is enough): a block range applies to every leaf partition, and the
    ranges are cut from the largest leaf. The file nodes let each task check that the table was
    not rewritten since (VACUUM FULL, CLUSTER, ALTER TABLE): block numbers would then mean other rows.
    """
    relation = f"{sql_ident(table.schema)}.{sql_ident(table.name)}"
    with conn.cursor() as cur:
        cur.execute(f"SELECT {SIZE_SQL.format('%(r)s::regclass')}, {NODES_SQL.format('%(r)s::regclass')}",
                    {"r": relation})
        blocks, nodes = cur.fetchone()
    return [(*r, nodes) for r in split_blocks({relation: blocks}, parts, min_blocks)]


def split_blocks(blocks: dict[str, int], parts: int, min_blocks: int) -> list[tuple[str, int, int | None]]:
    """Block ranges over relations of the given sizes (see block_ranges)."""
    total = sum(blocks.values()) or 1
    ranges = []
    for relation in blocks:
        n = max(1, min(math.ceil(parts * blocks[relation] / total), blocks[relation] // min_blocks or 1))
        step = math.ceil(blocks[relation] / n) if blocks[relation] else 1
        edges = [i * step for i in range(n)]
        ranges += [(relation, lo, hi) for lo, hi in zip(edges, edges[1:] + [None], strict=True)]
    return ranges


def range_sql(select_list: str, relation: str, lo: int, hi: int | None, nodes: str | None = None,
              partitioned: bool = False) -> str:
    """The COPY statement of one block range (nodes: see block_ranges); ONLY unless partitioned (its leaves)."""
    where = f"ctid >= '({lo},0)'::tid" + (f" AND ctid < '({hi},0)'::tid" if hi is not None else "")
    source_rows = relation if partitioned else f"ONLY {relation}"
    return f"COPY (SELECT {select_list} FROM {source_rows} WHERE {where}) TO STDOUT WITH (FORMAT csv)"


def connection_options(conf: dict) -> dict[str, str]:
    """What every task needs to connect (the password resolved here, on the driver, as for JDBC)."""
    params = {"host": config.get(conf, "source.host"), "port": int(config.get(conf, "source.port")),
              "user": config.get(conf, "source.user"), "dbname": config.get(conf, "source.database"),
              "connect_timeout": 30, "application_name": f"{config.get(conf, 'spark.app_name')}-snapshot",
              **source.tls(conf)}
    return {"connect": json.dumps(params), "password": secrets.setting(conf, "source.password")}


def read_table(conf: dict, spark, snapshot_name: str, plan: dict, fields: list[dict]):
    """A DataFrame of the table as of the snapshot (plan['ranges']), one column per field under its Value name."""
    from pyspark.sql import functions as F

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors need not import lib
    spark.dataSource.register(PgCopySource)
    copies = [copy_field(f) for f in fields]
    copy_list = ", ".join(f"{c['sql']} AS {f['alias']}" for c, f in zip(copies, fields, strict=True))
    options = {**connection_options(conf), "session": snapshot_slot.import_snapshot_sql(snapshot_name),
               "schema": ", ".join(f"{f['alias']} {c['read_type']}" for c, f in zip(copies, fields, strict=True)),
               "arrow": json.dumps([c["arrow"] for c in copies]),
               "ranges": json.dumps([[range_sql(copy_list, *r, plan.get("partitioned", False)), r[0], r[3]]
                                     for r in plan["ranges"]])}
    df = spark.read.format(NAME).options(**options).load()
    return df.select(*[c["finish"](F.col(f["alias"])).alias(f["field"]) for c, f in zip(copies, fields,
                                                                                          strict=True)])


class PgCopySource(DataSource):
    """Spark data source 'cdc_pg_copy': one partition per COPY statement in option 'ranges'."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return self.options["schema"]

    def reader(self, schema) -> DataSourceReader:
        return PgCopyReader(self.options)


class PgCopyReader(DataSourceReader):
    """Runs one COPY per partition inside the exported snapshot and yields Arrow record batches."""

    def __init__(self, options: dict) -> None:
        self.options = dict(options)

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(tuple(statement)) for statement in json.loads(self.options["ranges"])]

    def read(self, partition: InputPartition):
        import psycopg2
        import pyarrow as pa
        import pyarrow.csv as pcsv

        statement, relation, node = partition.value
        conn = psycopg2.connect(password=self.options["password"], **json.loads(self.options["connect"]))
        read_fd, write_fd = os.pipe()
        failure: list[BaseException] = []

        def copy() -> None:
            try:
                with os.fdopen(write_fd, "wb") as sink, conn.cursor() as cur:
                    cur.execute(self.options["session"])
                    # locked first: no rewrite can start during the COPY, and one before it shows in the file node
                    cur.execute(f"LOCK TABLE {relation.replace('%', '%%')} IN ACCESS SHARE MODE; "
                                f"SELECT {NODES_SQL.format('%(r)s::regclass')}", {"r": relation})
                    if cur.fetchone()[0] != node:
                        raise RuntimeError(f"table {relation} was rewritten (VACUUM FULL, CLUSTER or an ALTER TABLE "
                                           f"that rewrites it) while the snapshot read it, so its block ranges no "
                                           f"longer hold the same rows; run the snapshot again")
                    cur.copy_expert(statement, sink, size=1 << 20)
            except BaseException as exc:  # noqa: BLE001 - raised in the task's thread after the reader stops
                failure.append(exc)

        names = [name.split()[0] for name in self.options["schema"].split(", ")]
        types = [_arrow_type(pa, t) for t in json.loads(self.options["arrow"])]
        writer = threading.Thread(target=copy, name="cdc-snapshot-copy", daemon=True)
        writer.start()
        try:
            with os.fdopen(read_fd, "rb") as stream:
                batches = pcsv.open_csv(
                    stream, read_options=pcsv.ReadOptions(column_names=names, block_size=4 << 20),
                    parse_options=pcsv.ParseOptions(newlines_in_values=True),
                    convert_options=pcsv.ConvertOptions(column_types=dict(zip(names, types, strict=True)),
                                                        true_values=["t"], false_values=["f"], null_values=[""],
                                                        strings_can_be_null=True, quoted_strings_can_be_null=False))
                yield from batches
        except pa.ArrowInvalid as exc:
            writer.join()
            if failure:
                raise _copy_error(failure[0], statement) from exc
            if "Empty CSV file" not in str(exc):
                raise
        finally:
            writer.join()
            conn.close()
        if failure:
            raise _copy_error(failure[0], statement)


def _arrow_type(pa, name: str):
    """pyarrow type from its name: 'int64', 'decimal128(10,2)', ..."""
    if name.startswith("decimal128("):
        precision, scale = (int(x) for x in name[11:-1].split(","))
        return pa.decimal128(precision, scale)
    return getattr(pa, name)()


def _copy_error(exc: BaseException, statement: str) -> RuntimeError:
    """A failed COPY as the database's message with the statement's range (snapshot._read_failed finds the line)."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = statement[statement.rfind(" FROM "):statement.rfind(") TO STDOUT")]
    return RuntimeError(f"cdc snapshot: COPY{where} failed: {reason}")
