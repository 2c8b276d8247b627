"""Masking views: planted PII canaries never show in clean or history views, policy errors name the culprit."""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import secrets as random_secrets
from decimal import Decimal

import bronze_rows
import pytest
from pyspark.sql import types as T

from lib.lake import lake_paths
from lib.views import masking

SALT_ENV = "CDC_TEST_MASKING_SALT"
TABLE = "bank.customers"

# planted values that must never appear in a clean or history view (checked case-insensitively)
CANARIES = [
    "canary.zq81@example.com", "zq81",                 # current email
    "old.canary.zq82@example.net", "zq82",             # email before the update
    "deleted.canary.zq83@example.org", "zq83",         # the deleted customer's email
    "+1-555-0199-4242", "555-0199",                    # phone (its last four digits are kept on purpose)
    "Zorblatt", "Deletedina",                          # first names (hash)
    "Quibbleworth", "uibbleworth",                     # last name (partial keeps 'Q')
    "Xanthippe",                                       # middle name (null)
    "CANARY-123-45", "123-45",                         # national id (redact)
    "1987-06-15",                                      # date of birth (partial keeps the year)
    "7f3c9a10-canary-uuid",                            # customer_uuid (hash)
    "Zorbie-Alias",                                    # inside an array (hash)
    "nick-canary",                                     # inside the jsonb preferences (not listed: drop)
    "87.65",                                           # risk score (redact)
    "2019-03-04",                                      # created_at (partial keeps the year)
    "PASSPORT-CANARY-778",                             # column added later, not in the policy
]

POLICY = {
    "default": "drop",
    "salt": {"env": SALT_ENV},
    "tables": {TABLE: {
        "customer_id": "keep", "customer_uuid": "hash", "first_name": "hash", "middle_name": None,
        "last_name": "partial", "email": "partial", "phone": "partial", "date_of_birth": "partial",
        "national_id": "redact", "kyc_status": "keep", "risk_score": "redact", "aliases": "hash",
        "home_branch": "keep", "created_at": "partial",
    }},
}

ROW_FIELDS = [
    T.StructField("customer_id", T.LongType()), T.StructField("customer_uuid", T.StringType()),
    T.StructField("first_name", T.StringType()), T.StructField("middle_name", T.StringType()),
    T.StructField("last_name", T.StringType()), T.StructField("email", T.StringType()),
    T.StructField("phone", T.StringType()), T.StructField("date_of_birth", T.DateType()),
    T.StructField("national_id", T.StringType()), T.StructField("kyc_status", T.StringType()),
    T.StructField("risk_score", T.DecimalType(5, 2)), T.StructField("preferences", T.StringType()),
    T.StructField("aliases", T.ArrayType(T.StringType())), T.StructField("home_branch", T.StringType()),
    T.StructField("created_at", T.TimestampType()), T.StructField("updated_at", T.TimestampType()),
]
PASSPORT = T.StructField("passport_no", T.StringType())
META_FIELDS = [
    T.StructField("_commit_lsn", T.LongType()), T.StructField("_event_serial", T.LongType()),
    T.StructField("_op", T.StringType()), T.StructField("_deleted", T.BooleanType()),
    T.StructField("_deleted_at", T.TimestampType()), T.StructField("_updated_at", T.TimestampType()),
]
SOURCE = T.StructType([T.StructField(name, kind) for name, kind in [
    ("ts_ms", T.LongType()), ("txId", T.LongType()), ("lsn", T.LongType()), ("commit_lsn", T.LongType()),
    ("event_serial", T.LongType()), ("schema", T.StringType()), ("table", T.StringType()),
    ("snapshot", T.StringType())]])

T0 = dt.datetime(2026, 11, 20, 9, 0, 0)


def customer(cid, first, email, *, passport=None, evolved=False):
    """One row of the customers table (a tuple in ROW_FIELDS order, plus passport_no when evolved)."""
    row = (cid, "7f3c9a10-canary-uuid" if cid == 1 else f"uuid-{cid}", first, "Xanthippe", "Quibbleworth", email,
           "+1-555-0199-4242", dt.date(1987, 6, 15), "CANARY-123-45", "verified", Decimal("87.65"),
           '{"nickname": "nick-canary"}', ["Zorbie-Alias"], "CHI-01", dt.datetime(2019, 3, 4, 5, 6, 7), T0)
    return (*row, passport) if evolved else row


def row_type(evolved):
    """The row struct, with passport_no once the schema has evolved."""
    return T.StructType(ROW_FIELDS + ([PASSPORT] if evolved else []))


def silver_schema(evolved):
    """Silver layout: the source columns plus the merge's bookkeeping columns."""
    return T.StructType(row_type(evolved).fields + META_FIELDS)


def bronze_schema(evolved):
    """Bronze layout: the change events as the merge stores them."""
    return T.StructType([
        T.StructField("key", T.StructType([T.StructField("customer_id", T.LongType())])),
        T.StructField("before", row_type(evolved)), T.StructField("after", row_type(evolved)),
        T.StructField("op", T.StringType()), T.StructField("source", SOURCE),
        T.StructField("unchanged_cols", T.ArrayType(T.StringType())),
        T.StructField("_kafka_topic", T.StringType()), T.StructField("_kafka_partition", T.IntegerType()),
        T.StructField("_kafka_offset", T.LongType()), T.StructField("_kafka_timestamp", T.TimestampType()),
        T.StructField("_batch_id", T.LongType()),
    ])


def event(op, before, after, tx, serial, offset, minutes):
    """One bronze row; tx None gives a tombstone-like source."""
    ts = int((T0 + dt.timedelta(minutes=minutes)).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    source = (ts, tx, 1000 + offset, 1000 + offset, serial, "bank", "customers", "false" if op != "r" else "true")
    return ((before or after)[:1], before, after, op, source, [], "cdc.bank.bank.customers", 0, offset, T0, offset)


def hash_of(salt, text):
    """What the views should show for a hashed value under salt."""
    return hashlib.sha256((masking.derive_key(salt) + text).encode()).hexdigest()


def texts(spark, view):
    """Every row of a view as (row, to_json of the whole row, every column cast to string)."""
    columns = spark.table(view).columns
    casts = ", ".join(f"coalesce(CAST({masking.quote(c)} AS STRING), '')" for c in columns)
    rows = spark.sql(f"SELECT *, to_json(struct(*)) AS `__json`, concat_ws('|', {casts}) AS `__text` "
                     f"FROM {masking.quote_name(view)}").collect()
    return [(row, row["__json"] + "\n" + row["__text"]) for row in rows]


def view_texts(spark, view):
    """What the metastore shows of a view: SHOW CREATE TABLE, DESCRIBE EXTENDED, SHOW TBLPROPERTIES."""
    name = masking.quote_name(view)
    parts = [spark.sql(f"SHOW CREATE TABLE {name}").collect()[0][0]]
    parts += [" ".join(str(v) for v in row) for row in spark.sql(f"DESCRIBE EXTENDED {name}").collect()]
    parts += [" ".join(str(v) for v in row) for row in spark.sql(f"SHOW TBLPROPERTIES {name}").collect()]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def built(spark_session, conf, run_id, tmp_path_factory):
    """Silver and bronze with canaries, views built before and after a schema change and with a second salt."""
    spark = spark_session
    tiny = {"spark.sql.shuffle.partitions": "1", "spark.databricks.delta.snapshotPartitions": "1"}  # tiny tables
    saved = {key: spark.conf.get(key, None) for key in tiny}
    for key, value in tiny.items():
        spark.conf.set(key, value)
    lake = tmp_path_factory.mktemp("masking_lake")
    test_conf = copy.deepcopy(conf)
    test_conf["lake"] = {"root": str(lake)}
    database, private = f"cdc_views_t{run_id}", f"cdc_private_t{run_id}"
    policy = {**POLICY, "database": database, "privileged_database": private, "key_table": f"{private}.masking_key"}
    for name in (database, private):  # schemas under tmp, so the shared warehouse is left alone
        spark.sql(f"CREATE SCHEMA IF NOT EXISTS {masking.quote(name)} LOCATION '{lake / (name + '.db')}'")
    salt_a = "salt-a-" + random_secrets.token_hex(16)
    salt_b = "salt-b-" + random_secrets.token_hex(16)
    silver = masking.lake_path(test_conf, "silver", TABLE)
    bronze = lake_paths.bronze_path(test_conf)
    c1_old = customer(1, "Zorblatt", "old.canary.zq82@example.net")
    c1 = customer(1, "Zorblatt", "canary.zq81@example.com")
    c2 = customer(2, "Deletedina", "deleted.canary.zq83@example.org")
    meta_live = (2000, 0, "u", False, None, T0)
    meta_deleted = (2001, 0, "d", True, T0, T0)
    spark.createDataFrame([(*c1, *meta_live), (*c2, *meta_deleted)], silver_schema(False)) \
        .write.format("delta").save(silver)
    spark.sql(f"ALTER TABLE delta.`{silver}` SET TBLPROPERTIES ('cdc.key' = 'customer_id')")  # as the merge sets it
    bronze_rows.append(spark.createDataFrame([
        event("r", None, c1_old, 500, -1, 0, 0),
        event("c", None, c2, 501, 0, 1, 1),
        event("u", c1_old, c1, 502, 0, 2, 2),    # REPLICA IDENTITY FULL: before carries the old email
        event("d", c2, None, 503, 0, 3, 3),      # full before of the deleted row
        ((2,), None, None, None, None, None, "cdc.bank.bank.customers", 0, 4, T0, 4),  # tombstone
    ], bronze_schema(False)), TABLE, bronze, 0)

    out = {"spark": spark, "conf": test_conf, "policy": policy, "salt_a": salt_a, "salt_b": salt_b,
           "database": database, "private": private, "view_text": []}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SALT_ENV, salt_a)
        out["build1"] = masking.create_views(test_conf, spark, policy, tables=[TABLE, "bank.accounts"])
        out["clean1"] = texts(spark, f"{database}.customers_clean")
        # schema evolution: a PII column appears in silver and bronze, the policy does not list it
        c3 = customer(3, "Zorblatt", "canary.zq81@example.com", passport="PASSPORT-CANARY-778", evolved=True)
        spark.createDataFrame([(*c3, 2002, 0, "c", False, None, T0)], silver_schema(True)) \
            .write.format("delta").mode("append").option("mergeSchema", "true").save(silver)
        bronze_rows.append(spark.createDataFrame([event("c", None, c3, 504, 0, 5, 4)], bronze_schema(True)), TABLE,
                           bronze, 1)
        out["build2"] = masking.create_views(test_conf, spark, policy, tables=[TABLE, "bank.accounts"])
        for kind in ("clean", "full", "history", "scd2", "fresh"):
            out[kind] = texts(spark, f"{private if kind == 'full' else database}.customers_{kind}")
        out["analyst_views"] = sorted(r["viewName"] for r in spark.sql(f"SHOW VIEWS IN {database}").collect())
        out["view_text"].append(view_texts(spark, f"{database}.customers_clean"))
        out["view_text"].append(view_texts(spark, f"{database}.customers_history"))
        out["view_text"].append(view_texts(spark, f"{private}.customers_full"))
        env.setenv(SALT_ENV, salt_b)
        out["build3"] = masking.create_views(test_conf, spark, policy, tables=[TABLE])
        out["clean_b"] = texts(spark, f"{database}.customers_clean")
        out["view_text"].append(view_texts(spark, f"{database}.customers_clean"))
        out["view_text"].append(view_texts(spark, f"{database}.customers_history"))
    yield out
    for name in (database, private):
        spark.sql(f"DROP SCHEMA IF EXISTS {masking.quote(name)} CASCADE")
    for key, value in saved.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)


def by_id(rows, column="customer_id"):
    """Rows of texts() keyed by a column."""
    return {row[column]: row for row, _ in rows}


def test_no_canary_in_clean_or_history_views(built):
    for kind in ("clean1", "clean", "history", "scd2", "fresh", "clean_b"):
        assert built[kind], kind
        for _, text in built[kind]:
            leaked = [canary for canary in CANARIES if canary.lower() in text.lower()]
            assert not leaked, f"{kind} view shows {leaked}: {text}"


def test_full_view_shows_the_canaries_but_not_deleted_rows(built):
    text = "\n".join(t for _, t in built["full"])
    for canary in ("canary.zq81@example.com", "Zorblatt", "CANARY-123-45", "PASSPORT-CANARY-778", "nick-canary"):
        assert canary in text
    assert sorted(by_id(built["full"])) == [1, 3]
    assert "Deletedina" not in text and "zq82" not in text


def test_clean_view_hides_deleted_rows_and_drops_unlisted_columns(built):
    rows = by_id(built["clean"])
    assert sorted(rows) == [1, 3]
    columns = [c for c in rows[1].asDict() if not c.startswith("__")]
    assert columns == ["customer_id", "customer_uuid", "first_name", "middle_name", "last_name", "email", "phone",
                       "date_of_birth", "national_id", "kyc_status", "risk_score", "aliases", "home_branch",
                       "created_at", "_updated_at"]
    assert "passport_no" in [f.name for f in built["spark"].table(f"{built['private']}.customers_full").schema]


def test_partial_redact_and_null_shapes(built):
    row = by_id(built["clean"])[1]
    assert row["email"] == "***@example.com"
    assert row["phone"] == "***4242"
    assert row["last_name"] == "Q***"
    assert row["date_of_birth"] == dt.date(1987, 1, 1)
    assert row["created_at"] == dt.datetime(2019, 1, 1)
    assert row["national_id"] == masking.REDACTED
    assert row["risk_score"] is None and row["middle_name"] is None
    assert row["kyc_status"] == "verified" and row["home_branch"] == "CHI-01"
    assert row["_updated_at"] == T0


def test_hashes_are_stable_per_salt_and_change_with_another(built):
    a, b = built["salt_a"], built["salt_b"]
    first, second, other = by_id(built["clean1"])[1], by_id(built["clean"])[1], by_id(built["clean_b"])[1]
    assert first["first_name"] == second["first_name"] == hash_of(a, "Zorblatt")
    assert first["customer_uuid"] == second["customer_uuid"] == hash_of(a, "7f3c9a10-canary-uuid")
    assert second["aliases"] == hash_of(a, '["Zorbie-Alias"]')
    assert other["first_name"] == hash_of(b, "Zorblatt") != second["first_name"]
    assert by_id(built["clean"])[3]["first_name"] == second["first_name"]  # same value, same hash: joins work


def test_history_has_every_change_with_transaction_and_masked_before_after(built):
    rows = sorted((row for row, _ in built["history"]), key=lambda r: r["commit_lsn"])
    assert [(r["op"], r["tx_id"]) for r in rows] == [("r", 500), ("c", 501), ("u", 502), ("d", 503), ("c", 504)]
    update = rows[2]
    assert update["commit_ts"] == dt.datetime.fromtimestamp((T0 + dt.timedelta(minutes=2)).replace(
        tzinfo=dt.timezone.utc).timestamp())
    assert update["before_email"] == "***@example.net" and update["after_email"] == "***@example.com"
    assert update["after_first_name"] == by_id(built["clean"])[1]["first_name"]
    assert rows[3]["after_customer_id"] is None and rows[3]["before_customer_id"] == 2
    names = rows[0].asDict()
    assert "after_passport_no" not in names and "after_preferences" not in names and "before_updated_at" not in names


def test_salt_and_key_never_in_view_definitions(built):
    secrets_shown = [built["salt_a"], built["salt_b"], masking.derive_key(built["salt_a"]),
                     masking.derive_key(built["salt_b"])]
    assert len(built["view_text"]) == 5
    for text in built["view_text"]:
        assert "masking_key" in text or "customers_full" in text
        for secret in secrets_shown:
            assert secret not in text


def test_results_name_views_keys_and_skipped_tables(built):
    created = [(r["kind"], r["view"]) for r in built["build2"] if r["status"] == "created"]
    database = built["database"]
    assert created == [("clean", f"{database}.customers_clean"), ("full", f"{built['private']}.customers_full"),
                       ("history", f"{database}.customers_history"), ("scd2", f"{database}.customers_scd2"),
                       ("fresh", f"{database}.customers_fresh")]
    skipped = sorted(r["kind"] for r in built["build2"] if r["status"] == "skipped")
    assert skipped == ["clean", "fresh", "full", "history", "scd2"]  # bank.accounts has no silver/bronze yet
    keys = [r for r in built["build1"] + built["build2"] + built["build3"] if r["kind"] == "key"]
    assert [k["status"] for k in keys] == ["written", "unchanged", "written"]
    assert keys[0]["key_id"] == keys[1]["key_id"] != keys[2]["key_id"]
    persistent = built["spark"].conf.get("spark.sql.catalogImplementation", "in-memory") != "in-memory"
    assert all(r["persistent"] == persistent for r in built["build2"] if r["status"] == "created")


def test_column_rules_list_every_silver_column_with_its_rule(built):
    rows = masking.column_rules(built["conf"], built["spark"], built["policy"], tables=[TABLE, "bank.accounts"])
    rules = {row["column"]: (row["rule"], row["listed"]) for row in rows}
    assert [row["column"] for row in rows][:3] == ["customer_id", "customer_uuid", "first_name"]
    assert rules["email"] == ("partial", True) and rules["middle_name"] == ("null", True)
    assert rules["passport_no"] == ("drop", False) and rules["preferences"] == ("drop", False)
    assert not any(column.startswith("_") for column in rules)
    assert {row["table"] for row in rows} == {TABLE}  # bank.accounts has no silver table


def test_create_views_refuses_a_policy_column_the_table_lacks(built):
    policy = copy.deepcopy(built["policy"])
    policy["tables"][TABLE]["emial"] = "keep"
    with pytest.raises(masking.MaskingError, match="bank.customers.emial"):
        masking.create_views(built["conf"], built["spark"], policy, tables=[TABLE])


COLUMNS = {TABLE: {"customer_id": "bigint", "email": "string", "risk_score": "decimal(5,2)"}}


@pytest.mark.parametrize("policy, named", [
    ({"tables": {"bank.nope": {"x": "keep"}}}, "masking.tables.bank.nope: unknown table"),
    ({"tables": {TABLE: {"emial": "keep"}}}, "masking.tables.bank.customers.emial"),
    ({"tables": {TABLE: {"email": "scramble"}}}, "'scramble'"),
    ({"default": "hide"}, "masking.default: unknown rule 'hide'"),
    ({"defualt": "drop"}, "masking.defualt: unknown setting"),
    ({"tables": {TABLE: {"risk_score": "partial"}}}, "risk_score: partial is defined for strings"),
    ({"tables": {TABLE: {"email": "hash"}}}, "masking.salt is missing"),
    ({"silver_table": "main.cdc.silver"}, "masking.silver_table: 'main.cdc.silver' must contain {table}"),
    ({"salt": "literal-salt", "tables": {TABLE: {"email": "hash"}}}, "masking.salt must be a secret reference"),
])
def test_validate_names_the_unknown_or_unsupported_item(policy, named):
    with pytest.raises(masking.MaskingError) as info:
        masking.validate(policy, COLUMNS)
    assert named in str(info.value)


def test_unlisted_and_yaml_null_rules():
    policy = {"tables": {TABLE: {"email": None}}}
    masking.validate(policy, COLUMNS)
    assert masking.rule_for(policy, TABLE, "email") == "null"
    assert masking.rule_for(policy, TABLE, "passport_no") == "drop"
    assert masking.rule_for({"default": "redact"}, TABLE, "anything") == "redact"


def test_view_names_and_quoting():
    assert masking.view_names(["bank.customers", "crm.customers", "bank.cards"]) == {
        "bank.customers": "bank_customers", "crm.customers": "crm_customers", "bank.cards": "cards"}
    assert masking.quote_name("main.cdc`x.t") == "`main`.`cdc``x`.`t`"
    conf = {"lake": {"root": "/lake"}}
    assert masking.source_ref(conf, {}, "silver", TABLE) == "delta.`/lake/silver/bank/customers`"
    assert masking.source_ref(conf, {}, "bronze", TABLE) == "delta.`/lake/bronze/_log`"  # one log, every table
    assert masking.source_ref(conf, {"bronze_table": "main.cdc.bronze_log"}, "bronze", TABLE) == \
        "`main`.`cdc`.`bronze_log`"


def test_the_analysts_schema_holds_masked_views_only(built):
    # bank.accounts: no silver yet
    assert built["analyst_views"] == ["customers_clean", "customers_fresh", "customers_history", "customers_scd2"]


def test_privileged_views_may_not_share_the_analysts_schema(built):
    policy = {**built["policy"], "privileged_database": built["database"]}
    with pytest.raises(masking.MaskingError, match="must live where analysts have no grant"):
        masking.create_views(built["conf"], built["spark"], policy, tables=[TABLE])
