"""Catalog, mapping and Avro schemas against a real PostgreSQL and the live schema registry."""

from __future__ import annotations

import contextlib
import io
import json
from decimal import Decimal

import fastavro
import psycopg2.extensions
import pytest

from lib import config, schema_registry, source
from lib.capture import avro_schemas, catalog, pgtypes
from lib.capture.catalog import CatalogError
from lib.schema_registry import IncompatibleSchemaError

pytestmark = pytest.mark.stack

PREFIX = "cdc.test"

SETUP = """
CREATE SCHEMA s;
CREATE TYPE s.mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN s.amount AS numeric(10, 2) CHECK (VALUE >= 0);
CREATE DOMAIN s.short_text AS varchar(20);
CREATE TABLE s.every_type (
    id          integer PRIMARY KEY,
    dropped     text,
    c_bool      boolean NOT NULL,
    c_int2      smallint,
    c_int4      integer,
    c_int8      bigint,
    c_oid       oid,
    c_float4    real,
    c_float8    double precision,
    c_numeric   numeric(14, 2) NOT NULL,
    c_numeric_u numeric,
    c_numeric_n numeric(5, -2),
    c_money     money,
    c_text      text,
    c_varchar   varchar(30),
    c_bpchar    char(3),
    c_name      name,
    c_xml       xml,
    c_inet      inet,
    c_cidr      cidr,
    c_macaddr   macaddr,
    c_uuid      uuid,
    c_json      json,
    c_jsonb     jsonb,
    c_bytea     bytea,
    c_date      date,
    c_ts        timestamp,
    c_tstz      timestamptz,
    c_time      time,
    c_timetz    timetz,
    c_interval  interval,
    c_text_arr  text[],
    c_int_arr   integer[],
    c_num_arr   numeric(6, 3)[],
    c_enum      s.mood NOT NULL DEFAULT 'ok',
    c_enum_arr  s.mood[],
    c_domain    s.amount,
    c_domain_t  s.short_text,
    "first name" text,
    "amount-usd" numeric(10, 2),
    "1st"       integer,
    c_doubled   bigint GENERATED ALWAYS AS (c_int4::bigint * 2) STORED
);
ALTER TABLE s.every_type DROP COLUMN dropped;
CREATE TABLE s.composite (a integer NOT NULL, b text NOT NULL, note text, PRIMARY KEY (b, a));
CREATE TABLE s.no_pk (x integer, y text);
CREATE TABLE s.full_ident (id bigint PRIMARY KEY, v integer NOT NULL);
ALTER TABLE s.full_ident REPLICA IDENTITY FULL;
CREATE TABLE s.index_ident (id bigint PRIMARY KEY, code text NOT NULL, v integer);
CREATE UNIQUE INDEX index_ident_code ON s.index_ident (code, id);
ALTER TABLE s.index_ident REPLICA IDENTITY USING INDEX index_ident_code;
CREATE TABLE s.geo (id integer PRIMARY KEY, location point);
CREATE TABLE s.evolving (id integer PRIMARY KEY, qty integer);
"""

ROW = """
INSERT INTO s.every_type VALUES (
    1, true, -32768, -2147483648, -9223372036854775808, 4294967295, 0.5, 1e30,
    -123456789012.34, '-98765432109876543210987654321098765432.10', 1234.5, '-1234.5',
    'héllo, "wörld" {x}', 'v', 'ab', 'nm', '<a>1</a>', '10.0.0.1/8', '10.0.0.0/8', '08:00:2b:01:02:03',
    '6f1c1f0e-3c1d-4d3e-9a4b-1c2d3e4f5a6b', '{"a": [1, 2.5]}', '{"b": null, "a": 1}', '\\x00ff10',
    '0044-03-15 BC', '2024-02-29 13:14:15.123456', '2024-01-02 08:34:05.5+05:30', '24:00:00', '03:04:05+02',
    '-1 days +02:03:00.25', ARRAY['a', NULL, 'x y', 'q"u', 'b\\s', 'NULL', ''], '{1,NULL,-3}', '{1.5,NULL}',
    'happy', '{sad,NULL,ok}', 12.3, 'short', 'Ann', 10.25, 7)
"""


@pytest.fixture(scope="module")
def admin_conn(live_stack, scratch_database):
    conn = source.connect(live_stack, admin=True, dbname=scratch_database, options=pgtypes.session_options())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(SETUP)
        cur.execute(ROW)
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def tables(admin_conn):
    names = ["s.every_type", "s.composite", "s.no_pk", "s.full_ident", "s.index_ident", "s.geo", "s.evolving"]
    return catalog.describe_tables(admin_conn, names)


@pytest.fixture(scope="module")
def registry(live_stack):
    return schema_registry.client(live_stack)


def test_columns_in_attnum_order_with_types(tables):
    t = tables["s.every_type"]
    assert (t.schema, t.name, t.qualified) == ("s", "every_type", "s.every_type")
    names = [c.name for c in t.columns]
    assert names[:4] == ["id", "c_bool", "c_int2", "c_int4"]  # the dropped column is gone
    assert names[-4:] == ["first name", "amount-usd", "1st", "c_doubled"]
    assert [c.attnum for c in t.columns] == sorted(c.attnum for c in t.columns)
    numeric = t.column("c_numeric")
    assert (numeric.type_name, numeric.type.name, numeric.precision, numeric.scale, numeric.not_null) == (
        "numeric(14,2)", "numeric", 14, 2, True)
    assert numeric.type_oid == 1700 and numeric.typmod == (14 << 16 | 2) + 4
    assert (t.column("c_numeric_u").precision, t.column("c_numeric_u").scale) == (None, None)
    assert (t.column("c_numeric_n").precision, t.column("c_numeric_n").scale) == (5, -2)
    assert t.column("c_text_arr").type.kind == "array" and t.column("c_text_arr").element_type.name == "text"
    assert t.column("c_num_arr").element_type.typmod == (6 << 16 | 3) + 4
    assert t.column("c_enum").enum_labels == ("sad", "ok", "happy")
    assert t.column("c_enum").type.kind == "enum" and t.column("c_enum").type_name == "s.mood"
    assert t.column("c_enum_arr").element_type.labels == ("sad", "ok", "happy")
    domain = t.column("c_domain")
    assert domain.type.kind == "domain" and domain.base_type.name == "numeric"
    assert (domain.precision, domain.scale) == (10, 2)
    assert t.column("c_domain_t").base_type.name == "varchar"
    assert t.column("c_int4").toastable is False and t.column("c_text").toastable is True
    assert t.column("c_doubled").generated is True
    assert t.column("c_bool").not_null and not t.column("c_int2").not_null
    assert (t.primary_key, t.replica_identity) == (("id",), "d")


def test_keys_and_replica_identity(tables):
    assert tables["s.composite"].primary_key == ("b", "a")  # key order, not column order
    assert tables["s.no_pk"].primary_key == ()
    assert tables["s.full_ident"].replica_identity == "f"
    index = tables["s.index_ident"]
    assert (index.replica_identity, index.identity_index, index.identity_index_columns) == (
        "i", "index_ident_code", ("code", "id"))
    assert index.primary_key == ("id",)
    for name in ("s.composite", "s.full_ident", "s.index_ident", "s.every_type"):
        catalog.check_capturable(tables[name])
    with pytest.raises(CatalogError, match="s.no_pk has no primary key"):
        catalog.check_capturable(tables["s.no_pk"])


def test_missing_table_is_named(admin_conn):
    with pytest.raises(CatalogError) as err:
        catalog.describe_tables(admin_conn, ["s.composite", "s.nope", "nope_either"])
    assert "s.nope" in str(err.value) and "nope_either" in str(err.value) and "source.tables" in str(err.value)


def test_quoted_and_unqualified_names(admin_conn):
    with admin_conn.cursor() as cur:
        cur.execute('CREATE TABLE public."Mixed Case" (id int PRIMARY KEY)')
    found = catalog.describe_tables(admin_conn, ['"Mixed Case"', 'public."Mixed Case"'])
    assert {t.qualified for t in found.values()} == {"public.Mixed Case"}
    with pytest.raises(CatalogError, match="view"):
        with admin_conn.cursor() as cur:
            cur.execute("CREATE VIEW s.v AS SELECT 1 AS one")
        catalog.describe_tables(admin_conn, ["s.v"])


def test_schemas_parse_and_names_are_sanitized(tables):
    t = tables["s.every_type"]
    key = avro_schemas.key_schema(t, PREFIX)
    value = avro_schemas.value_schema(t, PREFIX)
    fastavro.parse_schema(key)
    fastavro.parse_schema(value)
    assert key["name"] == "Key" and key["namespace"] == "cdc.test.s.every_type"
    assert key["fields"] == [{"name": "id", "type": "int", "pg.type": "integer"}]
    fields = {f["name"]: f for f in avro_schemas.value_fields(t)}
    assert fields["first_name"]["pg.column"] == "first name"
    assert fields["amount_usd"]["pg.column"] == "amount-usd"
    assert fields["_1st"]["pg.column"] == "1st"
    assert "c_doubled" not in fields  # generated: pgoutput does not send it
    assert fields["id"]["type"] == "int"  # key column, fixed length: always present
    assert fields["c_numeric"]["type"] == ["null", {"type": "bytes", "logicalType": "decimal", "precision": 14,
                                                    "scale": 2}]
    assert fields["c_numeric"]["pg.not_null"] is True  # not in the replica identity: absent from 'before'
    assert fields["c_numeric_u"]["pg.type"] == "numeric" and fields["c_numeric_u"]["type"] == ["null", "string"]
    assert all("pg.type" in f for f in fields.values())
    composite = avro_schemas.key_schema(tables["s.composite"], PREFIX)
    assert [f["name"] for f in composite["fields"]] == ["b", "a"]
    assert [f["type"] for f in composite["fields"]] == ["string", "int"]
    full = {f["name"]: f["type"] for f in avro_schemas.value_fields(tables["s.full_ident"])}
    assert full == {"id": "long", "v": "int"}  # REPLICA IDENTITY FULL: every column in every image
    with pytest.raises(CatalogError, match="no primary key"):
        avro_schemas.key_schema(tables["s.no_pk"], PREFIX)
    with pytest.raises(pgtypes.UnsupportedTypeError, match="s.geo.location"):
        avro_schemas.value_schema(tables["s.geo"], PREFIX)
    assert avro_schemas.value_schema(tables["s.geo"], PREFIX, unknown_types="string")
    assert avro_schemas.topic_name(PREFIX, t) == "cdc.test.s.every_type"


def test_envelope_shape(tables):
    value = avro_schemas.value_schema(tables["s.composite"], PREFIX)
    assert (value["name"], value["namespace"]) == ("Envelope", "cdc.test.s.composite")
    fields = {f["name"]: f for f in value["fields"]}
    assert list(fields) == ["before", "after", "source", "op", "ts_ms", "transaction", "unchanged_cols"]
    assert fields["after"]["type"] == ["null", "cdc.test.s.composite.Value"]
    assert fields["unchanged_cols"]["default"] == []
    source_fields = [f["name"] for f in fields["source"]["type"]["fields"]]
    for name in ("version", "connector", "name", "ts_ms", "snapshot", "db", "sequence", "schema", "table",
                 "txId", "lsn", "xmin", "commit_lsn", "event_serial"):
        assert name in source_fields


def test_live_text_values_convert_exactly_and_encode(admin_conn, tables):
    """The row's pgoutput-equivalent text (col::text in the capture's session settings) -> Avro -> back."""
    t = tables["s.every_type"]
    columns = [c for c in t.columns if not c.generated]
    with admin_conn.cursor() as cur:
        # raw output-function text, as pgoutput sends it (no casts, no psycopg2 typecasting)
        query = "SELECT " + ", ".join(f'"{c.name}"' for c in columns) + " FROM s.every_type"
        cur.execute(query + " LIMIT 0")
        oids = tuple({d.type_code for d in cur.description})
        psycopg2.extensions.register_type(psycopg2.extensions.new_type(oids, "RAW", lambda v, _c: v), cur)
        cur.execute(query)
        texts = cur.fetchone()
    with admin_conn.cursor() as cur:
        cur.execute("""SELECT (extract(epoch FROM c_tstz) * 1000000)::bigint,
                              (extract(epoch FROM c_ts) * 1000000)::bigint,
                              c_date - DATE '1970-01-01', c_numeric::text, c_money::numeric::text,
                              encode(c_bytea, 'hex'), array_to_json(c_text_arr)::text,
                              (extract(epoch FROM c_time) * 1000000)::bigint
                       FROM s.every_type""")
        tstz, ts, days, numeric, money, hexed, text_arr, time_us = cur.fetchone()
        cur.execute("SET IntervalStyle = iso_8601")
        cur.execute("SELECT c_interval::text FROM s.every_type")
        iso_interval = cur.fetchone()[0]
        cur.execute("SET IntervalStyle = postgres")
    names = avro_schemas.field_names(t.columns)
    row = {names[c.name]: pgtypes.converter(c)(text) for c, text in zip(columns, texts, strict=True)}
    assert row["c_tstz"] == tstz and row["c_ts"] == ts and row["c_date"] == days and row["c_time"] == time_us
    assert row["c_numeric"] == Decimal(numeric) and row["c_money"] == Decimal(money)
    assert row["c_bytea"].hex() == hexed
    assert json.dumps(row["c_text_arr"], ensure_ascii=False, separators=(",", ":")) == text_arr
    assert row["c_interval"] == iso_interval
    assert row["c_numeric_u"] == "-98765432109876543210987654321098765432.10"
    assert row["c_numeric_n"] == Decimal("1200")
    assert row["c_enum_arr"] == ["sad", None, "ok"] and row["c_num_arr"] == [Decimal("1.500"), None]
    assert row["first_name"] == "Ann" and row["amount_usd"] == Decimal("10.25")

    value = avro_schemas.value_schema(t, PREFIX)
    envelope = {
        "before": None, "after": row, "op": "r", "ts_ms": 1,
        "source": {"version": "0.1.0", "connector": "postgresql", "name": PREFIX, "ts_ms": 1, "snapshot": "true",
                   "db": "scratch", "sequence": None, "schema": "s", "table": "every_type", "txId": 7,
                   "lsn": 100, "xmin": None, "commit_lsn": 100, "event_serial": -1},
        "transaction": None, "unchanged_cols": [],
    }
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(value), envelope)
    buf.seek(0)
    back = fastavro.schemaless_reader(buf, fastavro.parse_schema(_strip_logical(value)), None)
    assert back["after"]["c_tstz"] == tstz and back["after"]["c_date"] == days  # 44 BC survives as a plain int
    assert back["source"]["event_serial"] == -1


def _strip_logical(schema):
    if isinstance(schema, dict):
        return {k: _strip_logical(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_strip_logical(v) for v in schema]
    return schema


def test_sample_bank_schema_maps_completely(live_stack):
    conn = source.connect(live_stack)  # the pipeline role
    try:
        tables = catalog.describe_tables(conn, config.get(live_stack, "source.tables"))
        visits = catalog.describe_tables(conn, ["bank.branch_visits"])["bank.branch_visits"]
    finally:
        conn.close()
    assert set(tables) == set(config.get(live_stack, "source.tables"))
    type_names = set()
    for table in tables.values():
        catalog.check_capturable(table)
        fastavro.parse_schema(avro_schemas.key_schema(table, PREFIX))
        fastavro.parse_schema(avro_schemas.value_schema(table, PREFIX))
        for column in table.columns:
            assert pgtypes.is_supported(column), column.qualified
            type_names.add(column.type.resolved().name if column.type.kind != "enum" else "enum")
    assert {"numeric", "_text", "jsonb", "uuid", "timestamp", "timestamptz", "bytea", "enum", "date", "bool",
            "int8", "int4", "bpchar", "text"} <= type_names
    assert tables["bank.transactions"].column("fx_rate").precision is None
    assert tables["bank.account_holders"].primary_key == ("account_id", "customer_id")
    statements = {f["name"]: f for f in avro_schemas.value_fields(tables["bank.statements"])}
    assert statements["body"]["type"] == ["null", "string"]  # TOASTed: may arrive as 'unchanged'
    with pytest.raises(CatalogError, match="bank.branch_visits has no primary key"):
        catalog.check_capturable(visits)


@pytest.fixture
def subjects(registry, run_id):
    created = []
    yield created
    for subject in created:
        for permanent in (False, True):
            with contextlib.suppress(Exception):  # already gone
                registry.delete_subject(subject, permanent=permanent)


def test_register_then_exists(registry, tables, run_id, subjects):
    topic = avro_schemas.topic_name(f"cdc-test-{run_id}", tables["s.every_type"])
    key_subject, value_subject = schema_registry.subjects(topic)
    subjects.extend([key_subject, value_subject])
    key = avro_schemas.key_schema(tables["s.every_type"], PREFIX)
    value = avro_schemas.value_schema(tables["s.every_type"], PREFIX)
    key_id, key_version, status = schema_registry.register(registry, key_subject, key)
    assert status == "registered" and key_version == 1
    value_id, value_version, status = schema_registry.register(registry, value_subject, value)
    assert status == "registered" and value_version == 1
    assert schema_registry.register(registry, key_subject, key) == (key_id, 1, "exists")
    assert schema_registry.register(registry, value_subject, json.loads(json.dumps(value))) == (
        value_id, 1, "exists")
    latest = registry.get_latest_version(value_subject)
    assert (latest.schema_id, latest.version) == (value_id, 1)
    assert json.loads(latest.schema.schema_str) == value  # properties (pg.type, pg.column) are kept
    assert registry.get_compatibility(value_subject) == "BACKWARD"


def test_incompatible_change_is_refused_and_widening_registers(registry, admin_conn, run_id, subjects):
    def current():
        return catalog.describe_tables(admin_conn, ["s.evolving"])["s.evolving"]

    topic = avro_schemas.topic_name(f"cdc-test-{run_id}", current())
    _, subject = schema_registry.subjects(topic)
    subjects.append(subject)
    first_id, _, status = schema_registry.register(registry, subject, avro_schemas.value_schema(current(), PREFIX))
    assert status == "registered"
    with admin_conn.cursor() as cur:
        cur.execute("ALTER TABLE s.evolving ALTER COLUMN qty TYPE text")
    with pytest.raises(IncompatibleSchemaError) as err:
        schema_registry.register(registry, subject, avro_schemas.value_schema(current(), PREFIX))
    message = str(err.value)
    assert subject in message and "BACKWARD" in message and "Remedy" in message
    with admin_conn.cursor() as cur:
        cur.execute("ALTER TABLE s.evolving ALTER COLUMN qty TYPE integer USING qty::integer")
        cur.execute("ALTER TABLE s.evolving ADD COLUMN note text")
    widened_id, version, status = schema_registry.register(registry, subject,
                                                           avro_schemas.value_schema(current(), PREFIX))
    assert (status, version) == ("registered", 2) and widened_id != first_id
    assert registry.get_versions(subject) == [1, 2]


def test_unreachable_registry_is_named():
    conf = {"registry": {"url": "http://127.0.0.1:9/apis/ccompat/v7"}, "conf_file": "test"}
    client = schema_registry.client(conf)
    with pytest.raises(schema_registry.RegistryError, match="cannot reach the schema registry"):
        schema_registry.register(client, "x-value", {"type": "string"})
