"""The merge's bronze step (micro-batch function) and silver step on synthetic Confluent frames (no Kafka for the
data; live registry ids). Each micro-batch is followed by a silver step, as a catch-up ends with one.

One module fixture runs three micro-batches over three small tables and the tests check what each
scenario left in the bronze log, silver and the dead-letter table:

- batch 0: snapshot + out-of-order updates, duplicates, TOAST-unchanged columns, delete before any
  insert, delete + tombstone, a primary key change, two writer schema ids of one table, poison of
  every kind next to good rows;
- batch 1: late older events, TOAST keeps the stored value, a lone tombstone, a reverted schema,
  a truncate from the control topic;
- batch 1 again with the same id (a retried batch): the bronze log and dead-letter appends are skipped, and
  the silver step finds nothing to apply;
- the silver step of batch 1 repeated (as after a crash between its MERGE and the record of it): no row changes.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path

import deltalake
import fastavro
import own_services
import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from pyspark.sql import types as T

from lib import config, control, schema_registry
from lib.capture import avro_schemas, events
from lib.capture.catalog import Column, PgType, Table
from lib.lake import (
    bronze_log,
    browse,
    decode_step,
    delta_io,
    lake_paths,
    merge,
    micro_batch,
    silver_step,
    silver_table,
    writer_schemas,
)

pytestmark = pytest.mark.stack

NOW_MS = int(time.time() * 1000)


def _type(name: str, typmod: int = -1, category: str = "U") -> PgType:
    return PgType(oid=0, schema="pg_catalog", name=name, kind="base", category=category, typmod=typmod)


TEXT = _type("text", category="S")
TYPES = {
    "int4": (_type("int4", category="N"), "integer", False),
    "int8": (_type("int8", category="N"), "bigint", False),
    "text": (TEXT, "text", True),
    "numeric": (_type("numeric", ((14 << 16) | 2) + 4, "N"), "numeric(14,2)", True),
    "timestamptz": (_type("timestamptz", category="D"), "timestamp with time zone", False),
    "timestamp": (_type("timestamp", category="D"), "timestamp without time zone", False),
    "date": (_type("date", category="D"), "date", False),
    "uuid": (_type("uuid"), "uuid", False),
    "text[]": (PgType(oid=0, schema="pg_catalog", name="_text", kind="array", category="A", element=TEXT),
               "text[]", True),
}


def make_table(schema: str, name: str, columns: list[tuple[str, str]], key: tuple[str, ...] = ("id",)) -> Table:
    """A catalog.Table built by hand: (column, type key of TYPES); key columns NOT NULL."""
    cols = []
    for attnum, (column, kind) in enumerate(columns, start=1):
        pgtype, type_name, toastable = TYPES[kind]
        cols.append(Column(table=f"{schema}.{name}", name=column, attnum=attnum, type_name=type_name, type=pgtype,
                           not_null=column in key, toastable=toastable))
    return Table(schema=schema, name=name, oid=0, columns=tuple(cols), primary_key=key, replica_identity="d")


ITEMS_COLUMNS = [
    ("id", "int8"), ("name", "text"), ("amount", "numeric"), ("paid_at", "timestamptz"), ("local_at", "timestamp"),
    ("due", "date"), ("ref", "uuid"), ("tags", "text[]"), ("big", "text"), ("first name", "text")]
ITEMS = make_table("unit", "items", ITEMS_COLUMNS)
EVOLVE_V1 = make_table("unit", "evolve", [("id", "int8"), ("name", "text")])
EVOLVE_V2 = make_table("unit", "evolve", [("id", "int8"), ("name", "text"), ("extra", "text")])
TRUNC = make_table("unit", "trunc", [("id", "int8"), ("name", "text")])
WIDEN_V1 = make_table("unit", "widen", [("id", "int8"), ("n", "int4")])
WIDEN_V2 = make_table("unit", "widen", [("id", "int8"), ("n", "int8")])


class Writer:
    """Registers a table's schemas and frames its keys and envelopes like the capture does."""

    def __init__(self, registry, prefix: str, table: Table):
        self.table, self.prefix = table, prefix
        self.topic = avro_schemas.topic_name(prefix, table)
        self.value = avro_schemas.value_schema(table, prefix)
        self.key = avro_schemas.key_schema(table, prefix)
        key_subject, value_subject = schema_registry.subjects(self.topic)
        self.value_id = schema_registry.register(registry, value_subject, self.value)[0]
        self.key_id = schema_registry.register(registry, key_subject, self.key)[0]
        self.parsed_value = fastavro.parse_schema(self.value)
        self.parsed_key = fastavro.parse_schema(self.key)
        self.names = avro_schemas.field_names(table.columns)

    @staticmethod
    def frame(schema_id: int, parsed, record) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, record)
        return b"\x00" + schema_id.to_bytes(4, "big") + buf.getvalue()

    def row(self, **values) -> dict:
        out = {self.names[c.name]: None for c in self.table.columns}
        out.update(values)
        return out

    def key_bytes(self, key: int) -> bytes:
        return self.frame(self.key_id, self.parsed_key, {"id": key})

    def event(self, op: str, key: int, lsn: int, serial: int = 0, unchanged=(), before=None, **values) -> tuple:
        after = None if op == "d" else self.row(id=key, **values)
        if op == "d":
            before = before or self.row(id=key)
        source = {"version": "test", "connector": "postgresql", "name": self.prefix, "ts_ms": NOW_MS + lsn,
                  "snapshot": "true" if op == "r" else "false", "db": "unit", "sequence": None,
                  "schema": self.table.schema, "table": self.table.name, "txId": None, "lsn": lsn, "xmin": None,
                  "commit_lsn": lsn, "event_serial": -1 if op == "r" else serial}
        envelope = {"before": before, "after": after, "source": source, "op": op, "ts_ms": NOW_MS,
                    "transaction": None, "unchanged_cols": list(unchanged)}
        return self.key_bytes(key), self.frame(self.value_id, self.parsed_value, envelope)

    def tombstone(self, key: int) -> tuple:
        return self.key_bytes(key), None


class Feed:
    """Kafka-shaped rows (key, value, topic, partition, offset, timestamp) with offsets per topic partition."""

    def __init__(self):
        self.next: dict[tuple[str, int], int] = {}

    def rows(self, topic: str, messages: list[tuple], partition: int = 0) -> list[tuple]:
        out = []
        for key, value in messages:
            offset = self.next.get((topic, partition), 0)
            self.next[(topic, partition)] = offset + 1
            out.append((key, value, topic, partition, offset, datetime.now(timezone.utc).replace(tzinfo=None)))
        return out


KAFKA_SCHEMA = "key binary, value binary, topic string, partition int, offset long, timestamp timestamp"
UUID6 = str(uuid.UUID(int=6))


@pytest.fixture(scope="module")
def unit_conf(live_stack, run_id, tmp_path_factory):
    prefix = f"cdc-mu-{run_id}"
    conf = config.apply_overrides(live_stack, {
        "CDC__KAFKA__TOPIC_PREFIX": prefix, "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("merge_unit")),
        "CDC__SOURCE__TABLES": "[unit.items, unit.evolve, unit.trunc]",
        # the poison below includes a schema id that will never exist: set it aside without waiting
        "CDC__MERGE__UNKNOWN_SCHEMA_IDS": "dead_letter", "CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "0"})
    control.ensure(conf)
    yield conf
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    for future in admin.delete_topics([control.topic(conf)]).values():
        future.result(30)


@pytest.fixture(scope="module")
def run(unit_conf, spark_session):
    """Run the three micro-batches; returns what the tests look at."""
    conf, spark = unit_conf, spark_session
    registry = schema_registry.client(conf)
    prefix = config.get(conf, "kafka.topic_prefix")
    items, trunc = Writer(registry, prefix, ITEMS), Writer(registry, prefix, TRUNC)
    ev1, ev2 = Writer(registry, prefix, EVOLVE_V1), Writer(registry, prefix, EVOLVE_V2)
    feed = Feed()
    typed = dict(amount=Decimal("12.34"), paid_at=1_700_000_000_123_456, local_at=86_400_000_001, due=19_000,
                 ref=UUID6, tags=["a", None], first_name="Ann")
    poison = [
        (items.key_bytes(90), b"\x01\x00\x00\x00\x01junk"),  # magic byte 1
        (items.key_bytes(91), b"\x00\x00"),  # shorter than the header
        (items.key_bytes(92), b"\x00" + (2_000_000_000).to_bytes(4, "big") + b"\x02"),  # unknown schema id
        (items.key_bytes(93), b"\x00" + items.value_id.to_bytes(4, "big") + b"\xff\xff\xff"),  # body undecodable
        (None, items.event("c", 94, 1)[1]),  # no key
        (b"abc", items.event("c", 95, 1)[1]),  # key not framed
    ]
    batch0 = (
        feed.rows(items.topic, [
            items.event("u", 1, 111, unchanged=["big"], name="one-c"),  # out of order inside the batch
            items.event("r", 1, 100, name="one", big="B1"),
            items.event("u", 1, 110, unchanged=["big"], name="one-b"),
            items.event("c", 2, 120, name="two", big="B2"),
            items.event("c", 2, 120, name="two", big="B2"),  # duplicate
            items.event("d", 3, 130),  # delete of a row merge never saw
            items.event("c", 4, 140, name="four"), items.event("d", 4, 141), items.tombstone(4),
            items.event("u", 5, 150, unchanged=["big"], name="five"),  # TOAST-unchanged, nothing stored
            items.event("c", 6, 160, name="six", big="B6", **typed),
            items.event("c", 7, 170, name="seven"),
            items.event("c", 8, 175, name="eight"),
            items.event("u", 9, 176, before=items.row(id=8), name="nine"),  # primary key 8 -> 9
            *poison]) +
        feed.rows(ev1.topic, [ev1.event("c", 1, 10, name="a")], partition=1) +
        feed.rows(ev2.topic, [ev2.event("c", 2, 11, name="b", extra="x"), ev2.event("u", 1, 12, name="a2",
                                                                                    extra="y")], partition=2) +
        feed.rows(trunc.topic, [trunc.event("c", 1, 10, name="t1"), trunc.event("c", 2, 11, name="t2"),
                                trunc.event("c", 3, 30, name="t3")]))
    batch1_messages = {
        items.topic: [
            items.event("c", 3, 125, name="late"),  # older than the delete: no resurrection
            items.event("u", 1, 105, unchanged=["big"], name="late"),  # older than stored
            items.event("u", 6, 180, unchanged=["big"], name="six-b", **typed),  # TOAST: big stays B6
            items.event("u", 5, 185, name="five-b", big="B5"),
            items.tombstone(7),  # lone tombstone (its d compacted away)
            items.tombstone(4)],  # tombstone again for a deleted row
        ev1.topic: [ev1.event("u", 2, 13, name="b2")],  # schema reverted to v1: extra becomes null
        trunc.topic: [trunc.event("c", 4, 15, name="t4"), trunc.event("c", 5, 25, name="t5")],
    }
    batch1 = [row for topic, messages in batch1_messages.items() for row in feed.rows(topic, messages)]

    app_id = f"unit-{uuid.uuid4().hex[:6]}"
    ctx, prog = micro_batch.context(conf, query="unit", app_id=app_id), silver_step.progress(conf)
    frame = lambda rows: spark.createDataFrame(rows, KAFKA_SCHEMA)  # noqa: E731
    stats = [micro_batch.process_batch(frame(batch0), 0, ctx)]
    first = silver_step.run(conf, spark, prog)
    seq_after_0 = first["seq"]
    items_after_0 = _rows(spark, conf, "items")
    control.put(conf, "truncate/unit.trunc", {"commit_lsn": 20, "event_serial": 0, "ts_ms": NOW_MS})
    stats.append(micro_batch.process_batch(frame(batch1), 1, ctx))
    steps = [silver_step.run(conf, spark, prog)]
    versions_after_1, silver_after_1 = _versions(spark, conf), _silver_rows(spark, conf)
    # the same batch again in a new context, as after a crash: the log commit is found by its batch id
    stats.append(micro_batch.process_batch(frame(batch1), 1, micro_batch.context(conf, query="unit", app_id=app_id)))
    steps.append(silver_step.run(conf, spark))  # a new process: what silver applied is read from its commits
    versions_after_retry, silver_after_retry = _versions(spark, conf), _silver_rows(spark, conf)
    # batch 1's silver step again, as after a crash before its record: no row changes
    again = silver_step.progress(conf)
    again.applied = {spec.qualified: seq_after_0 for spec in lake_paths.table_specs(conf)}
    steps.append(silver_step.run(conf, spark, again))
    return {"conf": conf, "spark": spark, "stats": stats, "steps": steps, "versions_after_1": versions_after_1,
            "sessions": len(prog.sessions),
            "versions_after_retry": versions_after_retry, "silver_after_1": silver_after_1,
            "silver_after_retry": silver_after_retry, "silver_after_repeat": _silver_rows(spark, conf),
            "items_id": items.value_id,
            "items_after_0": items_after_0, "decoded_0": first["decoded"]}


def _versions(spark, conf) -> dict:
    """Latest Delta version of every bronze and silver table and the dead-letter table."""
    paths = [lake_paths.dead_letter_path(conf), lake_paths.bronze_path(conf)] + [
        lake_paths.silver_path(conf, spec) for spec in lake_paths.table_specs(conf)]
    return {p: spark.sql(f"DESCRIBE HISTORY delta.`{p}` LIMIT 1").collect()[0]["version"] for p in paths}


def _silver_rows(spark, conf) -> dict:
    """Every silver table's rows, every column, sorted."""
    return {spec.qualified: sorted(map(str, browse.silver(conf, spark, spec.qualified, include_deleted=True).collect()))
            for spec in lake_paths.table_specs(conf)}


def _rows(spark, conf, table) -> dict:
    """Every silver row (deleted ones too) by id."""
    return {r["id"]: r.asDict() for r in browse.silver(conf, spark, f"unit.{table}", include_deleted=True).collect()}


@pytest.fixture(scope="module")
def items(run):
    return _rows(run["spark"], run["conf"], "items")


def test_order_duplicates_and_toast_inside_one_batch(items):
    one = items[1]
    assert (one["name"], one["big"], one["_op"], one["_commit_lsn"], one["_deleted"]) == ("one-c", "B1", "u", 111,
                                                                                          False)
    assert items[2]["name"] == "two" and items[2]["_commit_lsn"] == 120


def test_typed_columns_come_out_with_spark_types(run, items):
    schema = browse.silver(run["conf"], run["spark"], "unit.items").schema
    types = {f.name: f.dataType for f in schema.fields}
    assert types["amount"] == T.DecimalType(14, 2)
    assert types["paid_at"] == T.TimestampType() and types["local_at"] == T.TimestampNTZType()
    assert types["due"] == T.DateType() and types["ref"] == T.StringType()
    assert types["tags"] == T.ArrayType(T.StringType()) and "first_name" in types
    assert types["_deleted"] == T.BooleanType() and types["_deleted_at"] == T.TimestampType()
    six = items[6]
    assert six["amount"] == Decimal("12.34") and six["due"] == date(2022, 1, 8) and six["ref"] == UUID6
    assert six["local_at"] == datetime(1970, 1, 2, 0, 0, 0, 1) and six["tags"] == ["a", None]
    assert six["first_name"] == "Ann"
    assert six["paid_at"] == datetime.fromtimestamp(1_700_000_000).replace(microsecond=123_456)


def test_deletes_leave_tombstones_that_late_events_cannot_resurrect(items):
    three = items[3]
    assert three["_deleted"] and three["_commit_lsn"] == 130 and three["name"] is None  # late c(125) ignored
    four = items[4]
    assert four["_deleted"] and four["_op"] == "d" and four["_commit_lsn"] == 141 and four["name"] == "four"
    assert items[1]["name"] == "one-c"  # late u(105) ignored


def test_lone_tombstone_soft_deletes_and_keeps_position(items):
    seven = items[7]
    assert seven["_deleted"] and seven["_op"] == "tombstone" and seven["_commit_lsn"] == 170


def test_primary_key_change_deletes_the_old_key(items):
    assert items[8]["_deleted"] and items[8]["_commit_lsn"] == 176
    assert items[9]["name"] == "nine" and not items[9]["_deleted"]


def test_unchanged_toast_keeps_the_stored_value(items):
    assert items[6]["name"] == "six-b" and items[6]["big"] == "B6"
    # inserted while big was unknown: marked, then filled by a later event
    assert items[5]["big"] == "B5" and items[5]["_unknown_cols"] is None


def test_unknown_toast_on_insert_is_marked(run):
    five = run["items_after_0"][5]
    assert (five["name"], five["big"], five["_unknown_cols"]) == ("five", None, ["big"])
    assert run["stats"][0]["tables"]["unit.items"] == {"events": 19, "tombstones": 1}  # the trigger: records
    assert run["decoded_0"]["tables"]["unit.items"] == {"events": 13, "tombstones": 1, "dead_letters": 6}


def test_schema_versions_in_one_batch_and_a_reverted_schema(run):
    rows = _rows(run["spark"], run["conf"], "evolve")
    assert (rows[1]["name"], rows[1]["extra"]) == ("a2", "y")
    assert (rows[2]["name"], rows[2]["extra"], rows[2]["_commit_lsn"]) == ("b2", None, 13)  # dropped: null


def test_truncate_from_the_control_topic(run):
    rows = _rows(run["spark"], run["conf"], "trunc")
    assert {k: (r["_deleted"], r["_op"]) for k, r in rows.items()} == {
        1: (True, "t"), 2: (True, "t"), 3: (False, "c"), 5: (False, "c")}  # 4 (older than the truncate) ignored
    assert (rows[1]["_commit_lsn"], rows[1]["_event_serial"]) == (20, 0)


def test_poison_goes_to_the_dead_letter_table_and_good_rows_still_merge(run, items):
    counts = {(r["reason"]): r["messages"] for r in browse.dead_letter_counts(run["conf"], run["spark"]).collect()}
    assert counts == {"not_framed": 3, "unknown_schema_id": 1, "undecodable": 1, "null_key": 1}
    assert run["decoded_0"]["dead_letters"] == counts  # the decode step set them aside, not the trigger
    dead = run["spark"].read.format("delta").load(lake_paths.dead_letter_path(run["conf"])) \
        .filter("reason = 'undecodable'").collect()[0]
    assert dead["value"].endswith(b"\xff\xff\xff") and dead["value_schema_id"] == run["items_id"]
    assert "offset" in dead["detail"] and dead["topic"].endswith("unit.items")
    assert 90 not in items and 2 in items


def test_a_retried_batch_appends_nothing_and_changes_no_silver_row(run):
    counted = [{t: (c["events"], c["tombstones"]) for t, c in run["stats"][i]["tables"].items()} for i in (1, 2)]
    assert counted[0] == counted[1]  # it was processed again...
    assert run["versions_after_retry"] == run["versions_after_1"]  # ...nothing was appended, no MERGE committed
    assert run["steps"][1]["tables"] == {}  # the new process's silver step found nothing left to apply
    assert run["silver_after_retry"] == run["silver_after_1"]
    assert sum(len(rows) for rows in run["silver_after_1"].values()) > 10
    first = lake_paths.table_specs(run["conf"])[0]
    bronze = run["spark"].read.format("delta").load(lake_paths.bronze_path(run["conf"])) \
        .filter(f"_kafka_topic = '{first.topic}'")
    assert bronze.count() == bronze.select("_kafka_partition", "_kafka_offset").distinct().count() == 13 + 1 + 6


def test_a_silver_step_repeated_after_a_crash_changes_no_row(run):
    repeated = run["steps"][2]["tables"]
    assert set(repeated) == {"unit.items", "unit.evolve", "unit.trunc"} and repeated["unit.items"]["events"] == 6
    assert run["silver_after_repeat"] == run["silver_after_1"]


def test_a_steps_merges_run_side_by_side_and_each_commit_records_its_own_table(run):
    assert run["sessions"] == 3  # one session each: merge.parallelism (4) covers the three tables
    for spec in lake_paths.table_specs(run["conf"]):
        path = lake_paths.silver_path(run["conf"], spec)
        merges = [json.loads(r["userMetadata"]) for r in run["spark"].sql(
            f"DESCRIBE HISTORY delta.`{path}`").collect() if r["operation"] == "MERGE"]
        assert len(merges) >= 2 and {m["table"] for m in merges} == {spec.qualified}
        assert merges[0]["bronze_seq"] == run["steps"][0]["seq"]
        assert delta_io.detail(run["spark"], path)["properties"]["delta.autoOptimize.autoCompact"] == "true"


def test_summary_and_cleanup_of_old_tombstones(run):
    summary = {r["table"]: r for r in browse.summary(run["conf"], run["spark"]).collect()}
    assert summary["unit.items"]["silver_rows"] == 5 and summary["unit.items"]["deleted_rows"] == 4
    assert summary["unit.trunc"]["last_lsn"] == "0/1E"
    assert silver_table.cleanup_tombstones(run["conf"], run["spark"])["unit.items"] == 0  # younger than 168 h
    removed = silver_table.cleanup_tombstones(run["conf"], run["spark"], retention_hours=0)
    assert removed == {"unit.items": 4, "unit.evolve": 0, "unit.trunc": 2}


def test_key_history_lists_one_keys_events_in_arrival_order_with_positions(run):
    one = browse.key_history(run["conf"], run["spark"], "unit.items", {"id": 1}).collect()
    assert [(r["op"], r["commit_lsn"], r["batch"]) for r in one] == [("u", 111, 0), ("r", 100, 0), ("u", 110, 0),
                                                                     ("u", 105, 1)]
    assert one[0]["after"]["name"] == "one-c" and one[0]["lsn"] == "0/6F" and one[1]["position"] == "(0/64, -1)"
    four = browse.key_history(run["conf"], run["spark"], "items", {"id": 4}).collect()
    assert [(r["op"], r["commit_lsn"], r["tombstone"]) for r in four] == [("c", 140, False), ("d", 141, False),
                                                                          (None, None, True), (None, None, True)]
    assert four[2]["position"] is None and four[2]["tx_id"] is None
    with pytest.raises(lake_paths.MergeError, match=r"key of unit.items is \(id\), not \(name\)"):
        browse.key_history(run["conf"], run["spark"], "unit.items", {"name": "x"})


def test_a_replayed_tombstone_does_not_hide_a_row_inserted_again_later(unit_conf, spark_session):
    """A tombstone carries its delete's position (Kafka header): alone in a later batch it is that old delete."""
    conf, spark = unit_conf, spark_session
    items = Writer(schema_registry.client(conf), config.get(conf, "kafka.topic_prefix"), ITEMS)
    feed, headers = Feed(), "headers array<struct<key: string, value: binary>>"

    def frame(messages):  # (key, value, headers) -> Kafka-shaped rows with headers
        rows = feed.rows(items.topic, [(k, v) for k, v, _ in messages])
        return spark.createDataFrame([(*row, h) for row, (_, _, h) in zip(rows, messages, strict=True)],
                                     f"{KAFKA_SCHEMA}, {headers}")

    def tomb(key, lsn):
        return (*items.tombstone(key), [(k, v) for k, v in events.tombstone_headers(lsn, 0)])

    ctx, prog = micro_batch.context(conf, query="tombs", app_id=f"tombs-{uuid.uuid4().hex[:6]}"), None

    def batch(frame_, batch_id):
        micro_batch.process_batch(frame_, batch_id, ctx)
        silver_step.run(conf, spark, prog)

    prog = silver_step.progress(conf)
    batch(frame([(*items.event("c", 201, 1000, name="first"), None), (*items.event("d", 201, 1010), None),
                 tomb(201, 1010), (*items.event("c", 201, 1020, name="again"), None),
                 (*items.event("c", 202, 1030, name="kept"), None)]), 0)
    # a replay: the old delete's tombstone alone, and a lone tombstone without a position (Debezium's kind)
    batch(frame([tomb(201, 1010), (*items.tombstone(202), None)]), 1)
    rows = _rows(spark, conf, "items")
    assert (rows[201]["name"], rows[201]["_deleted"], rows[201]["_commit_lsn"]) == ("again", False, 1020)
    assert rows[202]["_deleted"] and rows[202]["_op"] == "tombstone" and rows[202]["_commit_lsn"] == 1030
    # and a positioned tombstone newer than the row deletes it at that position
    batch(frame([tomb(201, 1040)]), 2)
    deleted = _rows(spark, conf, "items")[201]
    assert (deleted["_deleted"], deleted["_op"], deleted["_commit_lsn"], deleted["name"]) == (True, "d", 1040, "again")


def _next_schema_id(registry) -> int:
    """The id the registry gives the next new schema (Apicurio numbers new contents one after another)."""
    probe = {"type": "record", "name": "Probe", "fields": [{"name": f"p{uuid.uuid4().hex}", "type": "int"}]}
    return schema_registry.register(registry, f"probe-{uuid.uuid4().hex[:8]}", probe)[0] + 1


def _later_version(writer: Writer, registry, column: str) -> tuple[Writer, int]:
    """A new value schema version of writer's table (one more column) and the id it will get, not registered yet."""
    table = make_table("unit", "items", [*ITEMS_COLUMNS, (column, "text")])
    later = object.__new__(Writer)
    later.__dict__.update(writer.__dict__)
    later.table, later.value = table, avro_schemas.value_schema(table, writer.prefix)
    later.parsed_value = fastavro.parse_schema(later.value)
    later.names = avro_schemas.field_names(table.columns)
    later.value_id = _next_schema_id(registry)
    return later, later.value_id


def _register(later: Writer, registry, expected: int) -> None:
    subject = schema_registry.subjects(later.topic)[1]
    got = schema_registry.register(registry, subject, later.value)[0]
    assert got == expected, f"another schema was registered meanwhile (got id {got}, framed {expected})"


class _Watching:
    """The real registry client; notes when it answered 404 for one schema id (so a test can register it then)."""

    def __init__(self, client, schema_id: int):
        self.client, self.schema_id, self.asked = client, schema_id, threading.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def get_schema(self, schema_id, *args, **kwargs):
        try:
            return self.client.get_schema(schema_id, *args, **kwargs)
        except SchemaRegistryError as exc:
            if schema_id == self.schema_id and exc.http_status_code == 404:
                self.asked.set()
            raise


@pytest.fixture(scope="module")
def own_registry(tmp_path_factory):
    """Overrides for a registry of this module's own: the tests below frame the id it gives next, so nothing else may
    register there meanwhile (the rest of the suite registers on the stack's registry beside them)."""
    overrides = own_services.own_registry(str(tmp_path_factory.mktemp("registry")))
    yield overrides
    own_services.stop(overrides)


def test_an_event_whose_schema_id_arrives_late_is_merged_after_waiting(unit_conf, own_registry, spark_session):
    conf = config.apply_overrides(unit_conf, {**own_registry, "CDC__MERGE__UNKNOWN_SCHEMA_IDS": "fail",
                                              "CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "20"})
    registry = schema_registry.client(conf)
    items = Writer(registry, config.get(conf, "kafka.topic_prefix"), ITEMS)
    later, schema_id = _later_version(items, registry, "late_a")
    rows = Feed().rows(items.topic, [later.event("c", 301, 3010, name="late", late_a="x")])
    ctx = micro_batch.context(conf, query="late", app_id=f"late-{uuid.uuid4().hex[:6]}")
    micro_batch.process_batch(spark_session.createDataFrame(rows, KAFKA_SCHEMA), 0, ctx)  # the trigger: bytes only
    watching = _Watching(registry, schema_id)
    prog = silver_step.progress(conf)
    prog.decoding.schemas = writer_schemas.Schemas(conf, client=watching)

    def register_once_asked():
        assert watching.asked.wait(120), "the decode step never asked for the schema id"
        _register(later, registry, schema_id)

    registering = threading.Thread(target=register_once_asked)
    registering.start()
    step = silver_step.run(conf, spark_session, prog)
    registering.join()
    assert step["decoded"]["dead_letters"] == {} and step["decoded"]["tables"]["unit.items"]["events"] == 1
    row = _rows(spark_session, conf, "items")[301]
    assert (row["name"], row["late_a"]) == ("late", "x")


def test_a_schema_id_never_served_stops_the_decode_step_naming_topic_offset_and_id(unit_conf, spark_session):
    conf = config.apply_overrides(unit_conf, {"CDC__MERGE__UNKNOWN_SCHEMA_IDS": "fail",
                                              "CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "1", "CDC__LAKE__ROOT": str(
        Path(config.get(unit_conf, "lake.root")) / f"never-{uuid.uuid4().hex[:6]}")})
    items = Writer(schema_registry.client(conf), config.get(conf, "kafka.topic_prefix"), ITEMS)
    framed = b"\x00" + (2_000_000_001).to_bytes(4, "big") + b"\x02"
    rows = Feed().rows(items.topic, [items.event("c", 310, 3100, name="ok"), (items.key_bytes(311), framed)])
    micro_batch.process_batch(spark_session.createDataFrame(rows, KAFKA_SCHEMA), 0,
                              micro_batch.context(conf, query="never", app_id=f"never-{uuid.uuid4().hex[:6]}"))
    with pytest.raises(lake_paths.MergeError, match=rf"topic {items.topic} .*schema id\(s\) 2000000001 .*partition 0 "
                       r"offset 1.*nothing is lost.*unknown_schema_ids: dead_letter"):
        silver_step.run(conf, spark_session)
    spec = lake_paths.table_specs(conf)[0]
    assert not delta_io.is_table(spark_session, lake_paths.silver_path(conf, spec))  # nothing was applied...
    raw = spark_session.read.format("delta").load(lake_paths.raw_path(conf)).filter("_table = 'unit.items'")
    assert sorted(r["_kafka_offset"] for r in raw.collect()) == [0, 1]  # ...and nothing lost: the raw log holds both
    aside = config.apply_overrides(conf, {"CDC__MERGE__UNKNOWN_SCHEMA_IDS": "dead_letter"})
    step = silver_step.run(aside, spark_session)  # the remedy named: set it aside, merge the rest
    assert step["decoded"]["dead_letters"] == {"unknown_schema_id": 1}
    assert _rows(spark_session, conf, "items")[310]["name"] == "ok"


class _Forgetting(_Watching):
    """The real registry client, except that it no longer serves one schema id (as after a deleted version)."""

    def get_schema(self, schema_id, *args, **kwargs):
        if schema_id == self.schema_id:
            raise SchemaRegistryError(404, 40403, f"Schema {schema_id} not found")
        return self.client.get_schema(schema_id, *args, **kwargs)

    def get_versions(self, subject, *args, **kwargs):
        return [number for number in self.client.get_versions(subject, *args, **kwargs)
                if self.client.get_version(subject, number).schema_id != self.schema_id]


def test_a_silver_step_stops_naming_table_and_id_when_pending_events_schema_is_no_longer_served(unit_conf,
                                                                                                spark_session):
    conf = config.apply_overrides(unit_conf, {"CDC__MERGE__UNKNOWN_SCHEMA_WAIT_S": "1", "CDC__LAKE__ROOT": str(
        Path(config.get(unit_conf, "lake.root")) / f"forgotten-{uuid.uuid4().hex[:6]}")})
    items = Writer(schema_registry.client(conf), config.get(conf, "kafka.topic_prefix"), ITEMS)
    rows = Feed().rows(items.topic, [items.event("c", 331, 3300, name="pending")])
    micro_batch.process_batch(spark_session.createDataFrame(rows, KAFKA_SCHEMA), 0,
                              micro_batch.context(conf, query="gone", app_id=f"gone-{uuid.uuid4().hex[:6]}"))
    prog = silver_step.progress(conf)
    prog.schemas = writer_schemas.Schemas(conf, client=_Forgetting(schema_registry.client(conf), items.value_id))
    with pytest.raises(lake_paths.MergeError, match=rf"table unit.items: .* schema id\(s\) {items.value_id}, "
                       r"which the schema registry .* no longer serves .*Remedy: restore those schema versions"):
        silver_step.run(conf, spark_session, prog)
    assert not delta_io.is_table(spark_session, lake_paths.silver_path(conf, lake_paths.table_specs(conf)[0])) or \
        331 not in _rows(spark_session, conf, "items")  # nothing applied
    silver_step.run(conf, spark_session)  # the registry serves it again: silver resumes and applies the event
    assert _rows(spark_session, conf, "items")[331]["name"] == "pending"


def test_dead_letters_whose_schema_arrived_are_replayed_into_silver(unit_conf, own_registry, spark_session):
    conf = config.apply_overrides(unit_conf, {**own_registry, "CDC__LAKE__ROOT": str(
        Path(config.get(unit_conf, "lake.root")) / f"replay-{uuid.uuid4().hex[:6]}")})
    registry = schema_registry.client(conf)
    items = Writer(registry, config.get(conf, "kafka.topic_prefix"), ITEMS)
    later, schema_id = _later_version(items, registry, "late_b")
    rows = Feed().rows(items.topic, [items.event("c", 321, 3200, name="first"),
                                     later.event("u", 321, 3210, name="second", late_b="y"),
                                     (items.key_bytes(322), b"\x00" + items.value_id.to_bytes(4, "big") + b"\xff")])
    micro_batch.process_batch(spark_session.createDataFrame(rows, KAFKA_SCHEMA), 0,
                              micro_batch.context(conf, query="dl", app_id=f"dl-{uuid.uuid4().hex[:6]}"))
    silver_step.run(conf, spark_session)
    assert _rows(spark_session, conf, "items")[321]["name"] == "first"
    _register(later, registry, schema_id)
    result = merge.replay_dead_letters(conf, spark_session)
    assert (result["replayed"], result["still_dead"]) == (1, 1)
    row = _rows(spark_session, conf, "items")[321]
    assert (row["name"], row["late_b"], row["_commit_lsn"]) == ("second", "y", 3210)
    left = spark_session.read.format("delta").load(lake_paths.dead_letter_path(conf)).collect()
    assert [(r["offset"], r["reason"]) for r in left] == [(2, "undecodable")]
    again = merge.replay_dead_letters(conf, spark_session)  # nothing new decodes: silver and the letters unchanged
    assert again["replayed"] == 0 and _rows(spark_session, conf, "items")[321]["_commit_lsn"] == 3210



def _protocol(path: str) -> dict:
    """The table's protocol as its Delta log last set it (reader features and version)."""
    found = {}
    for log in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in log.read_text().splitlines():
            found.update(json.loads(line).get("protocol") or {})
    return found


def test_silver_and_the_bronze_log_open_in_delta_rs(run):
    spec = lake_paths.table_spec(run["conf"], "unit.items")
    for path in (lake_paths.silver_path(run["conf"], spec), lake_paths.bronze_path(run["conf"])):
        assert "typeWidening" not in _protocol(path).get("readerFeatures", []), path
        rows = deltalake.DeltaTable(path).to_pyarrow_table().num_rows  # the log's VARIANT columns: as binary pairs
        assert rows == run["spark"].read.format("delta").load(path).count() > 0, path
    silver = deltalake.DeltaTable(lake_paths.silver_path(run["conf"], spec)).to_pyarrow_table()
    assert sorted(silver.column("id").to_pylist()) == sorted(_rows(run["spark"], run["conf"], "items"))


def test_a_widened_column_turns_type_widening_on_and_keeps_every_value(unit_conf, spark_session, tmp_path):
    prefix = f"{config.get(unit_conf, 'kafka.topic_prefix')}-widen"
    conf = config.apply_overrides(unit_conf, {"CDC__KAFKA__TOPIC_PREFIX": prefix, "CDC__LAKE__ROOT": str(tmp_path),
                                              "CDC__SOURCE__TABLES": "[unit.widen]"})
    control.ensure(conf)
    registry = schema_registry.client(conf)
    narrow = Writer(registry, prefix, WIDEN_V1)
    feed, ctx = Feed(), micro_batch.context(conf, query="widen", app_id=f"widen-{uuid.uuid4().hex[:6]}")
    frame = lambda rows: spark_session.createDataFrame(rows, KAFKA_SCHEMA)  # noqa: E731
    micro_batch.process_batch(frame(feed.rows(narrow.topic, [narrow.event("c", 1, 10, n=7)])), 0, ctx)
    silver_step.run(conf, spark_session)
    spec = lake_paths.table_spec(conf, "unit.widen")
    path = lake_paths.silver_path(conf, spec)
    assert "typeWidening" not in _protocol(path).get("readerFeatures", [])
    wide = Writer(registry, prefix, WIDEN_V2)  # the column widens at the source: a new schema version
    micro_batch.process_batch(frame(feed.rows(wide.topic, [wide.event("u", 1, 20, n=5_000_000_000),
                                                           wide.event("c", 2, 21, n=-3)])), 1, ctx)
    silver_step.run(conf, spark_session)
    silver = spark_session.read.format("delta").load(path)
    assert dict(silver.dtypes)["n"] == "bigint"
    assert {r["id"]: r["n"] for r in silver.collect()} == {1: 5_000_000_000, 2: -3}
    bronze = browse.bronze(conf, spark_session, "unit.widen")  # the log's variants read back as bigint
    assert sorted(r["after"]["n"] for r in bronze.collect()) == [-3, 7, 5_000_000_000]
    assert _protocol(path).get("readerFeatures", []) == ["typeWidening"]
    assert "typeWidening" not in _protocol(lake_paths.bronze_path(conf)).get("readerFeatures", [])
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    admin.delete_topics([control.topic(conf)])[control.topic(conf)].result(30)


def test_a_restart_after_sparks_known_kafka_metrics_failure_says_so_in_one_line():
    captured = RuntimeError("[STREAM_FAILED] ... java.lang.NullPointerException: Cannot invoke")
    captured._stackTrace = ("java.lang.NullPointerException\n"
                            "\tat org.apache.spark.sql.kafka010.KafkaMicroBatchStream.metrics(Unknown)")
    known = merge.restart_reason(captured, 1)
    assert "SPARK-55271" in known and "nothing is lost" in known and "\n" not in known
    other = merge.restart_reason(RuntimeError("the broker went away\nmore"), 3)
    assert other == "stopped by Spark after 3 batch(es) (the broker went away); starting it again from the checkpoint"
    carried = RuntimeError("An error occurred while calling o62.awaitTermination.\n: org.apache.spark.SparkException: "
                           "Job aborted\n\tat org.apache.spark.scheduler.DAGScheduler.failJob")  # py4j's shape
    assert "(org.apache.spark.SparkException: Job aborted)" in merge.restart_reason(carried, 2)
    over_connect = RuntimeError("[STREAM_FAILED] java.lang.NullPointerException: Cannot invoke ...\n"
                                "\tat org.apache.spark.sql.kafka010.KafkaMicroBatchStream$.metrics("
                                "KafkaMicroBatchStream.scala:520)")  # Spark Connect puts the JVM frames in the message
    assert merge.kafka_metrics_bug(over_connect) and merge.kafka_metrics_bug(captured)
    assert not merge.kafka_metrics_bug(RuntimeError("java.lang.NullPointerException in a user's metrics code"))


def test_compaction_prunes_the_raw_log_to_what_is_undecoded_and_the_trigger_goes_on_numbering(unit_conf, spark_session):
    root = Path(config.get(unit_conf, "lake.root")) / f"prune-{uuid.uuid4().hex[:6]}"
    conf = config.apply_overrides(unit_conf, {"CDC__MERGE__COMPACT_INTERVAL_MINUTES": "0.000001",
                                              "CDC__LAKE__ROOT": str(root)})
    items = Writer(schema_registry.client(conf), config.get(conf, "kafka.topic_prefix"), ITEMS)
    feed, ctx = Feed(), micro_batch.context(conf, query="prune", app_id=f"prune-{uuid.uuid4().hex[:6]}")
    first = feed.rows(items.topic, [items.event("c", 320, 3200, name="a"), items.event("c", 321, 3210, name="b")])
    micro_batch.process_batch(spark_session.createDataFrame(first, KAFKA_SCHEMA), 0, ctx)
    raw = lake_paths.raw_path(conf)
    prog = silver_step.progress(conf)
    prog.last_compaction = 0.0  # due now
    silver_step.run(conf, spark_session, prog)
    assert spark_session.read.format("delta").load(raw).count() == 0  # every raw row decoded, so pruned
    second = feed.rows(items.topic, [items.event("u", 320, 3300, name="a2")])
    micro_batch.process_batch(spark_session.createDataFrame(second, KAFKA_SCHEMA), 1, ctx)
    micro_batch.process_batch(spark_session.createDataFrame(second, KAFKA_SCHEMA), 1, ctx)  # a retried batch
    left = spark_session.read.format("delta").load(raw).collect()
    assert [(r["_seq"], r["_kafka_offset"]) for r in left] == [(1, 2)]  # the sequence went on past the pruned commit
    prog.last_compaction = 0.0
    silver_step.run(conf, spark_session, prog)
    assert {k: v["name"] for k, v in _rows(spark_session, conf, "items").items()} == {320: "a2", 321: "b"}
    assert spark_session.read.format("delta").load(raw).count() == 0


def test_a_decode_step_killed_between_its_dead_letters_and_its_bronze_commit_sets_nothing_aside_twice(
        unit_conf, spark_session, monkeypatch):
    root = Path(config.get(unit_conf, "lake.root")) / f"crash-{uuid.uuid4().hex[:6]}"
    conf = config.apply_overrides(unit_conf, {"CDC__LAKE__ROOT": str(root)})
    items = Writer(schema_registry.client(conf), config.get(conf, "kafka.topic_prefix"), ITEMS)
    rows = Feed().rows(items.topic, [items.event("c", 330, 3300, name="a"), (items.key_bytes(331), b"\x07not avro")])
    micro_batch.process_batch(spark_session.createDataFrame(rows, KAFKA_SCHEMA), 0,
                              micro_batch.context(conf, query="crash", app_id=f"crash-{uuid.uuid4().hex[:6]}"))

    def killed(*args, **kwargs):
        raise RuntimeError("killed before the bronze commit")

    monkeypatch.setattr(bronze_log, "append_decoded", killed)
    with pytest.raises(RuntimeError, match="killed before the bronze commit"):
        decode_step.run(conf, spark_session)
    monkeypatch.undo()
    dead = lambda: spark_session.read.format("delta").load(lake_paths.dead_letter_path(conf)).count()  # noqa: E731
    assert dead() == 1  # the step had set the poison aside before it died
    step = decode_step.run(conf, spark_session, decode_step.decoding(conf))  # a new process: nothing in memory
    assert (step["commits"], step["tables"]["unit.items"]["events"], dead()) == (1, 1, 1)
    logged = spark_session.read.format("delta").load(lake_paths.bronze_path(conf)).filter("_table = 'unit.items'")
    assert [r["_seq"] for r in logged.collect()] == [0]  # the good event once
    assert decode_step.run(conf, spark_session)["commits"] == 0  # and a step after it finds nothing to do


def test_a_trigger_of_few_tables_decodes_them_into_bronze_itself_and_leaves_more_to_the_decode_step(
        unit_conf, spark_session, monkeypatch):
    root = Path(config.get(unit_conf, "lake.root")) / f"inline-{uuid.uuid4().hex[:6]}"
    conf = config.apply_overrides(unit_conf, {"CDC__LAKE__ROOT": str(root), "CDC__MERGE__DECODE_IN_TRIGGER_TABLES": "1",
                                              "CDC__KAFKA__TOPIC_PREFIX": f"cdc-mi-{uuid.uuid4().hex[:6]}"})
    control.ensure(conf)  # a control topic of its own: no truncate the other tests announced touches its triggers
    registry, prefix = schema_registry.client(conf), config.get(conf, "kafka.topic_prefix")
    items, trunc = Writer(registry, prefix, ITEMS), Writer(registry, prefix, TRUNC)
    feed, app_id = Feed(), f"inline-{uuid.uuid4().hex[:6]}"
    ctx = micro_batch.context(conf, query="inline", app_id=app_id)
    ctx.decoding = decode_step.decoding(conf)
    frame = lambda rows: spark_session.createDataFrame(rows, KAFKA_SCHEMA)  # noqa: E731
    bronze = lambda: sorted((r["_seq"], r["_table"], r["_kafka_offset"]) for r in spark_session.read.format(  # noqa: E731
        "delta").load(lake_paths.bronze_path(conf)).collect())
    dead = lambda: spark_session.read.format("delta").load(lake_paths.dead_letter_path(conf)).count()  # noqa: E731

    one = feed.rows(items.topic, [items.event("c", 340, 3400, name="a"), (items.key_bytes(341), b"\x07not avro")])
    assert micro_batch.process_batch(frame(one), 0, ctx)["decoded"] == 0
    assert (bronze(), dead()) == ([(0, "unit.items", 0)], 1)  # decoded by the trigger; its poison set aside

    two = feed.rows(items.topic, [items.event("u", 340, 3500, name="a2")]) + feed.rows(
        trunc.topic, [trunc.event("c", 40, 400, name="t")])
    assert "decoded" not in micro_batch.process_batch(frame(two), 1, ctx)  # two tables: left to the decode step
    assert bronze() == [(0, "unit.items", 0)]

    three = feed.rows(items.topic, [items.event("u", 340, 3600, name="a3")])
    assert micro_batch.process_batch(frame(three), 2, ctx)["decoded"] == 2  # bronze lacked commit 1: the whole step
    assert bronze() == [(0, "unit.items", 0), (1, "unit.items", 2), (1, "unit.trunc", 0), (2, "unit.items", 3)]

    def killed(stage, batch_id, tables):
        raise RuntimeError("killed after the raw commit")

    monkeypatch.setattr(micro_batch, "_fire", killed)
    four = feed.rows(items.topic, [items.event("u", 340, 3700, name="a4")])
    with pytest.raises(RuntimeError, match="killed after the raw commit"):
        micro_batch.process_batch(frame(four), 3, ctx)
    monkeypatch.undo()
    again = micro_batch.context(conf, query="inline", app_id=app_id)  # the retried batch, in a new process
    again.decoding = decode_step.decoding(conf)
    assert "decoded" not in micro_batch.process_batch(frame(four), 3, again)  # its raw commit is there: not again
    assert decode_step.run(conf, spark_session, again.decoding)["commits"] == 1
    assert bronze()[-1] == (3, "unit.items", 4) and len(bronze()) == 5 and dead() == 1
    silver_step.run(conf, spark_session)
    assert {k: v["name"] for k, v in _rows(spark_session, conf, "items").items()} == {340: "a4"}
    AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")}).delete_topics([control.topic(conf)])
