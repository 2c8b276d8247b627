"""The merge through real Kafka: snapshot + changes of a scratch PostgreSQL table produced as the capture
would, a crash in the middle of a multi-batch backlog, a restart from the checkpoint, then reconcile.
"""

from __future__ import annotations

import io
from datetime import datetime, timezone

import deltalake
import fastavro
import psycopg2
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from lib import config, control, schema_registry, topics
from lib.capture import avro_schemas, catalog, pgtypes
from lib.lake import browse, fresh_read, lake_paths, merge, micro_batch, reconcile, silver_step, silver_table
from lib.views import masking
from lib.views import policy as masking_policy

pytestmark = pytest.mark.stack

DDL = """
CREATE SCHEMA mstream;
CREATE TABLE mstream.accounts (
    id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(14,2), opened date, updated timestamptz,
    local_ts timestamp, ref uuid, tags text[], note text);
INSERT INTO mstream.accounts
SELECT i, 'owner ' || i, i * 10.25, DATE '2020-01-01' + i, TIMESTAMPTZ '2024-01-01 00:00:00+00' + i * INTERVAL '1 s',
       TIMESTAMP '2024-02-03 04:05:06.789' + i * INTERVAL '1 min', md5(i::text)::uuid,
       ARRAY['t' || i, NULL], CASE WHEN i % 3 = 0 THEN NULL ELSE repeat('n', i) END
FROM generate_series(1, 40) i;
"""
CHANGES = """
UPDATE mstream.accounts SET balance = balance + 1, tags = ARRAY['changed'] WHERE id <= 10;
DELETE FROM mstream.accounts WHERE id BETWEEN 11 AND 15;
INSERT INTO mstream.accounts (id, owner, balance) SELECT i, 'new ' || i, NULL FROM generate_series(41, 45) i;
"""


class Capture:
    """Produces a table's rows as change events the way the capture does (text -> pgtypes -> Avro)."""

    def __init__(self, conf, conn, table: catalog.Table):
        self.conf, self.conn, self.table = conf, conn, table
        prefix = config.get(conf, "kafka.topic_prefix")
        self.topic = avro_schemas.topic_name(prefix, table)
        registry = schema_registry.client(conf)
        key_subject, value_subject = schema_registry.subjects(self.topic)
        self.value_schema = avro_schemas.value_schema(table, prefix)
        self.key_schema = avro_schemas.key_schema(table, prefix)
        self.value_id = schema_registry.register(registry, value_subject, self.value_schema)[0]
        self.key_id = schema_registry.register(registry, key_subject, self.key_schema)[0]
        self.names = avro_schemas.field_names(table.columns)
        self.producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"),
                                  "enable.idempotence": True})
        self.sent = 0

    def rows(self, where: str = "TRUE") -> dict[int, dict]:
        cols = list(self.table.columns)
        query = sql.SQL("SELECT {} FROM mstream.accounts WHERE " + where).format(
            sql.SQL(", ").join(sql.SQL("({})::text").format(sql.Identifier(c.name)) for c in cols))
        with self.conn.cursor() as cur:
            cur.execute(query)
            out = {}
            for row in cur.fetchall():
                values = {self.names[c.name]: pgtypes.converter(c)(v) for c, v in zip(cols, row, strict=True)}
                out[values["id"]] = values
            return out

    @staticmethod
    def _frame(schema_id, schema, record) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), record)
        return b"\x00" + schema_id.to_bytes(4, "big") + buf.getvalue()

    def send(self, op: str, key: int, lsn: int, serial: int, after: dict | None) -> None:
        source = {"version": "test", "connector": "postgresql", "name": "t", "ts_ms": 1_700_000_000_000 + lsn,
                  "snapshot": "true" if op == "r" else "false", "db": "t", "sequence": None, "schema": "mstream",
                  "table": "accounts", "txId": None, "lsn": lsn, "xmin": None, "commit_lsn": lsn,
                  "event_serial": serial}
        before = {n: None for n in self.names.values()} | {"id": key} if op == "d" else None
        envelope = {"before": before, "after": after, "source": source, "op": op, "ts_ms": None,
                    "transaction": None, "unchanged_cols": []}
        key_bytes = self._frame(self.key_id, self.key_schema, {"id": key})
        self.producer.produce(self.topic, key=key_bytes, value=self._frame(self.value_id, self.value_schema, envelope))
        self.sent += 1
        if op == "d":
            self.producer.produce(self.topic, key=key_bytes, value=None)
            self.sent += 1

    def flush(self):
        assert self.producer.flush(30) == 0


@pytest.fixture(scope="module")
def stream_conf(live_stack, run_id, scratch_database, tmp_path_factory):
    prefix = f"cdc-ms-{run_id}"
    conf = config.apply_overrides(live_stack, {
        "CDC__KAFKA__TOPIC_PREFIX": prefix, "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("merge_stream")),
        "CDC__SOURCE__TABLES": "[mstream.accounts]", "CDC__MERGE__MAX_OFFSETS_PER_TRIGGER": "35"})
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    names = [avro_schemas.topic_name(prefix, "mstream.accounts")]
    topics.ensure_topics(admin, names, partitions=3)
    control.ensure(conf)
    yield conf
    for future in admin.delete_topics(names + [control.topic(conf)]).values():
        future.result(30)


@pytest.fixture(scope="module")
def source_conn(pg_admin_dsn):
    conn = psycopg2.connect(pg_admin_dsn, options=pgtypes.session_options())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(DDL)
    yield conn
    conn.close()


def test_crash_mid_backlog_then_restart_gives_exact_silver(stream_conf, source_conn, spark_session, monkeypatch):
    conf, spark = stream_conf, spark_session
    table = catalog.describe_tables(source_conn, ["mstream.accounts"])["mstream.accounts"]
    capture = Capture(conf, source_conn, table)
    for key, row in capture.rows().items():
        capture.send("r", key, 1000, -1, row)
    with source_conn.cursor() as cur:
        cur.execute(CHANGES)
    after = capture.rows()
    lsn = 2000
    for key in range(1, 11):
        capture.send("u", key, lsn + key, 0, after[key])
    for key in range(11, 16):
        capture.send("d", key, lsn + 100, key, None)  # one transaction: serials order the events
    for key in range(41, 46):
        capture.send("c", key, lsn + 200, key, after[key])
    capture.flush()
    assert capture.sent == 40 + 10 + 10 + 5

    def crash(stage, batch_id, table_name):
        if stage == "after_bronze" and batch_id == 1:
            raise RuntimeError("simulated crash after the bronze append of batch 1")

    monkeypatch.setattr(micro_batch, "_fire", crash)
    with pytest.raises(Exception, match="simulated crash"):
        merge.run_until_caught_up(conf, spark, cleanup=False)
    monkeypatch.undo()
    done = merge.run_until_caught_up(conf, spark, cleanup=False)  # restarts from the checkpoint: batch 1 again
    assert done["batches"] >= 1 and 0 < done["events"] + done["tombstones"] < capture.sent

    bronze = spark.read.format("delta").load(lake_paths.bronze_path(conf))
    assert bronze.count() == bronze.select("_kafka_partition", "_kafka_offset").distinct().count() == capture.sent
    silver = {r["id"]: r for r in browse.silver(conf, spark, "mstream.accounts", include_deleted=True).collect()}
    assert sorted(k for k, r in silver.items() if not r["_deleted"]) == sorted(after)
    assert all(silver[k]["_deleted"] and silver[k]["_op"] == "d" for k in range(11, 16))

    result = reconcile.reconcile(conf, spark, conn=source_conn)
    assert [(r["table"], r["source_rows"], r["silver_rows"], r["equal"]) for r in result] == [
        ("mstream.accounts", 40, 40, True)], result
    with source_conn.cursor() as cur:  # a change the merge never saw
        cur.execute("UPDATE mstream.accounts SET note = 'drift' WHERE id = 7; "
                    "DELETE FROM mstream.accounts WHERE id = 8")
    result = reconcile.reconcile(conf, spark, conn=source_conn)[0]
    assert not result["equal"] and (result["source_rows"], result["silver_rows"]) == (39, 40)
    assert result["differences"] == [{"id": 7, "kind": "different", "columns": ["note"]},
                                    {"id": 8, "kind": "extra_in_silver"}]


@pytest.mark.parametrize("cut", ["before its commit", "after its commit"])
def test_a_silver_step_cut_short_is_completed_by_the_next_one_exactly(stream_conf, source_conn, spark_session,
                                                                       monkeypatch, cut):
    """A silver step killed before its MERGE commits leaves silver as it was; killed after, its commit already
    records the bronze log commit it reached. Either way the next step (a new process) ends exact."""
    conf, spark = stream_conf, spark_session
    table = catalog.describe_tables(source_conn, ["mstream.accounts"])["mstream.accounts"]
    capture = Capture(conf, source_conn, table)
    base = 5000 if cut == "before its commit" else 6000
    with source_conn.cursor() as cur:
        cur.execute(f"UPDATE mstream.accounts SET note = 'step {base}' WHERE id <= 9")
    now = capture.rows()
    for key in sorted(now):  # every row as it is now (the first test left changes silver never saw)
        capture.send("u", key, base + key, 0, now[key])
    for key in set(range(1, 46)) - set(now):
        capture.send("d", key, base + 100, key, None)
    capture.flush()
    merge.run_until_caught_up(conf, spark, cleanup=False, silver=False)
    assert not reconcile.reconcile(conf, spark, conn=source_conn)[0]["equal"]  # bronze has it, silver not yet
    real = silver_table.merge_silver

    def killed(*args, **kwargs):
        if cut == "after its commit":
            real(*args, **kwargs)
        raise RuntimeError(f"silver step killed {cut}")

    monkeypatch.setattr(silver_table, "merge_silver", killed)
    with pytest.raises(RuntimeError, match="silver step killed"):
        silver_step.run(conf, spark)
    monkeypatch.undo()
    again = silver_step.run(conf, spark)  # a new process: what silver applied comes from its own commits
    assert (again["tables"] != {}) == (cut == "before its commit"), again
    result = reconcile.reconcile(conf, spark, conn=source_conn)
    assert [(r["table"], r["equal"]) for r in result] == [("mstream.accounts", True)], result


def _silver_live(conf: dict, with_updated: bool = False) -> list[dict]:
    """Silver's live rows read with delta-rs (outside Spark), data columns only, by id."""
    spec = lake_paths.table_spec(conf, "mstream.accounts")
    rows = deltalake.DeltaTable(lake_paths.silver_path(conf, spec)).to_pyarrow_table().to_pylist()
    keep = lambda c: c not in lake_paths.META_COLUMNS or (with_updated and c == "_updated_at")  # noqa: E731
    return sorted(({c: v for c, v in r.items() if keep(c)} for r in rows if not r["_deleted"]), key=lambda r: r["id"])


def test_the_fresh_reader_applies_the_kafka_events_silver_has_not_and_agrees_with_silver_after(
        stream_conf, source_conn, spark_session):
    """fresh_read reads silver and the topic after the offsets silver's commit records (no Spark, no bronze step):
    changes sent to Kafka show at once, and equal silver once the merge has applied them."""
    conf, spark = stream_conf, spark_session
    table = catalog.describe_tables(source_conn, ["mstream.accounts"])["mstream.accounts"]
    capture = Capture(conf, source_conn, table)
    now = capture.rows()
    for key in sorted(now)[:9]:  # events on every partition: silver's next commit records an offset for each
        capture.send("u", key, 8500 + key, 0, now[key])
    capture.flush()
    merge.run_until_caught_up(conf, spark, cleanup=False)
    stats: dict = {}
    assert fresh_read.rows(conf, "mstream.accounts", masked=False, stats=stats) == _silver_live(conf)
    assert stats["messages"] == 0 and len(stats["start"]) == 3, stats  # silver's record: nothing after it yet
    with source_conn.cursor() as cur:
        cur.execute("UPDATE mstream.accounts SET note = 'fresh ' || id, balance = balance + 0.5 WHERE id <= 4; "
                    "DELETE FROM mstream.accounts WHERE id = 6; "
                    "INSERT INTO mstream.accounts (id, owner, balance, ref) VALUES (46, 'fresh', 1.25, "
                    "'00000000-0000-0000-0000-00000000002e')")
    now = capture.rows()
    for key in (1, 2, 3, 4):
        capture.send("u", key, 9000 + key, 0, now[key])
    capture.send("u", 2, 9000, 0, {**now[2], "note": "older"})  # older than key 2's update above: changes nothing
    capture.send("d", 6, 9010, 0, None)
    capture.send("c", 46, 9020, 0, now[46])
    capture.flush()
    fresh = fresh_read.rows(conf, "mstream.accounts", masked=False, stats=stats)
    assert stats["messages"] == 8, stats  # 5 updates, the delete and its tombstone, the insert: only the tail
    assert fresh != _silver_live(conf)  # silver has not applied them
    assert [r["id"] for r in fresh] == sorted(now)
    by_id = {r["id"]: r for r in fresh}
    assert by_id[2]["note"] == "fresh 2" and by_id[46]["ref"] == "00000000-0000-0000-0000-00000000002e"
    looked_up = fresh_read.rows(conf, "mstream.accounts", masked=False, keys=[{"id": 46}, {"id": 6}, {"id": 2}])
    assert looked_up == [by_id[2], by_id[46]]  # 6 was deleted
    merge.run_until_caught_up(conf, spark, cleanup=False)
    assert fresh == _silver_live(conf)  # the same rows, values and types as silver once the merge applied them
    assert reconcile.reconcile(conf, spark, conn=source_conn)[0]["equal"]


def test_the_fresh_reader_masks_as_the_clean_view_does(stream_conf, spark_session, monkeypatch):
    conf, spark = stream_conf, spark_session
    monkeypatch.setenv("CDC_TEST_FRESH_SALT", "pepper")
    policy = {"default": "drop", "salt": {"env": "CDC_TEST_FRESH_SALT"}, "tables": {"mstream.accounts": {
        "id": "keep", "owner": "partial", "balance": "hash", "opened": "partial", "updated": "partial",
        "ref": "hash", "note": "redact", "local_ts": "null"}}}
    spec = lake_paths.table_spec(conf, "mstream.accounts")
    spark.read.format("delta").load(lake_paths.silver_path(conf, spec)).createOrReplaceTempView("fresh_mask_silver")
    spark.createDataFrame([(masking_policy.derive_key("pepper"),)], "key string") \
        .createOrReplaceTempView("fresh_mask_key")
    try:
        select, names = masking.clean_select("mstream.accounts", spark.table("fresh_mask_silver").schema,
                                             masking.load_policy(conf, policy), "fresh_mask_silver", "fresh_mask_key")
        in_spark = sorted((r.asDict() for r in spark.sql(select).collect()), key=lambda r: r["id"])
    finally:
        spark.catalog.dropTempView("fresh_mask_silver")
        spark.catalog.dropTempView("fresh_mask_key")
    in_python = fresh_read.mask(conf, "mstream.accounts", _silver_live(conf, with_updated=True), policy)
    naive = lambda v: v.astimezone(timezone.utc).replace(tzinfo=None) if isinstance(v, datetime) and v.tzinfo else v  # noqa: E731
    assert [{c: naive(v) for c, v in r.items()} for r in in_python] == in_spark
    assert list(in_python[0]) == names and "tags" not in names
    assert all(r["note"] in (None, masking_policy.REDACTED) for r in in_python)
    with pytest.raises(masking_policy.MaskingError, match=r"mstream.accounts.tags: the fresh reader hashes"):
        fresh_read.mask(conf, "mstream.accounts", _silver_live(conf), {**policy, "tables": {
            "mstream.accounts": {"tags": "hash"}}})
