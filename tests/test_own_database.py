"""A database that is not the sample (issue 15): a small shop with its own conf file, set up the way a user sets it up.

tests/shop_database.py makes it as README's "Capture your own database" says (on PostgreSQL 18, the newest major the
README claims). Here, on local Spark in the test's process, the steps the five notebooks take (bootstrap, snapshot,
capture, merge), then changes: every table exact, the fresh view ahead of silver, the views following the default-drop
policy with no planted personal value. The notebooks themselves run on this database as the bundle's job runs them
in tests/test_spark_cluster.py (through Spark Connect, `make test-cluster`: CI runs it after `make test`); on local
Spark they run under nbval on the sample.
"""

from __future__ import annotations

import uuid

import pytest
import shop_database
from shop_database import CANARIES, TABLES, write_rows

from lib import config
from lib.capture import bootstrap, snapshot, stream
from lib.lake import merge, reconcile, silver_step
from lib.views import changes, masking

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def shop(live_stack, tmp_path_factory, drop_slot, spark_session):
    """The shop database with rows and its conf file in a folder of its own, taken through the notebooks' steps."""
    with shop_database.database(live_stack, tmp_path_factory.mktemp("own_database"), drop_slot) as shop:
        conf = shop["conf"]
        shop["bootstrap"] = bootstrap.run(conf, log=lambda line: None)
        # the copy reader (the job's notebooks take the default, jdbc): tests/test_pg_versions.py runs it on the oldest
        # major only, so this is where it reads PostgreSQL 18
        copy = config.apply_overrides(conf, {"CDC__SNAPSHOT__READER": "copy"})
        shop["snapshot"] = snapshot.run(copy, spark_session, log=lambda line: None)
        stream.run(conf, until="caught_up", heartbeat_s=0)
        shop["merged"] = merge.run_until_caught_up(conf, spark_session)
        yield shop


def test_the_owner_role_bootstraps_and_the_lake_starts_exact_on_a_database_that_is_not_the_sample(shop, spark_session):
    assert shop["bootstrap"]["publication"] == "created" and sorted(shop["bootstrap"]["tables"]) == sorted(TABLES)
    assert shop["snapshot"]["status"] == "complete" and shop["merged"]["silver_tables"] == len(TABLES)
    results = reconcile.reconcile(shop["conf"], spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(table, True) for table in TABLES], results


def test_later_changes_show_in_the_fresh_view_while_silver_waits_then_silver_is_exact(shop, spark_session):
    conf, tag = shop["conf"], uuid.uuid4().hex[:6]
    with shop["owner"].cursor() as cur:
        write_rows(cur, 21, 5, CANARIES[2])
        cur.execute("UPDATE shop.orders SET total = total + 1 WHERE order_id <= 10")  # the TOASTed note unchanged
        cur.execute("UPDATE shop.orders SET total = total * 2 WHERE order_id % 4 = 0")
        cur.execute("UPDATE shop.order_lines SET qty = qty + 3 WHERE line_no = 2 AND order_id % 3 = 0")
        cur.execute("UPDATE shop.order_lines SET line_no = 9 WHERE order_id = 4 AND line_no = 1")  # a key changes
        cur.execute("DELETE FROM shop.order_lines WHERE order_id IN (5, 7)")
        cur.execute("DELETE FROM shop.audit_log WHERE payload->>'order' = '6'")
        cur.execute("INSERT INTO shop.audit_log VALUES (gen_random_uuid(), now(), 'fresh', '{}')")
        cur.execute("UPDATE shop.customers SET tier = 'silver', updated_by = 'canary-clerk-8' WHERE customer_id <= 3")
        write_rows(cur, 101, 2, CANARIES[2])
    stream.run(conf, until="caught_up", heartbeat_s=0)

    merge.run_until_caught_up(conf, spark_session, silver=False)  # bronze gets the changes, silver waits
    keep = {"database": f"fresh_v_{tag}", "privileged_database": f"fresh_p_{tag}", "default": "keep"}
    masking.create_views(conf, spark_session, keep)
    fresh = {table: spark_session.table(masking.view(conf, table, "fresh", keep)) for table in TABLES}
    assert [r["equal"] for r in reconcile.reconcile(conf, spark_session, against=fresh)] == [True] * len(TABLES)
    assert not all(r["equal"] for r in reconcile.reconcile(conf, spark_session))  # silver is behind
    silver_step.run(conf, spark_session)  # bronze holds every change already: silver's own step applies them
    results = reconcile.reconcile(conf, spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(table, True) for table in TABLES], results
    for table in TABLES:  # and once merged, the fresh view holds what the clean view holds
        clean = spark_session.table(masking.view(conf, table, "clean", keep)).drop("_updated_at")
        now = fresh[table].drop("_commit_lsn", "_event_serial")
        assert now.exceptAll(clean).count() == clean.exceptAll(now).count() == 0, table


@pytest.fixture(scope="module")
def default_views(shop, spark_session):
    """The views of the shop with its conf's policy (unlisted columns dropped), built once for the tests below."""
    return masking.create_views(shop["conf"], spark_session)


def test_views_follow_the_default_drop_policy_with_no_planted_value(shop, default_views, spark_session):
    conf, built = shop["conf"], default_views
    assert sorted((r["kind"], r["status"]) for r in built if r["kind"] != "key") == sorted(
        [(kind, "created") for kind in ("clean", "full", "history", "scd2", "fresh")] * len(TABLES))
    clean = {table: spark_session.table(masking.view(conf, table, "clean")) for table in TABLES}
    assert clean["shop.customers"].columns == ["customer_id", "email", "tier", "updated_by", "created_at",
                                               "_updated_at"]  # full_name: dropped by default
    assert "note" not in clean["shop.orders"].columns and clean["shop.order_lines"].columns == ["_updated_at"]
    scd2 = spark_session.table(masking.view(conf, "shop.customers", "scd2"))
    assert "full_name" not in scd2.columns
    for kind in ("clean", "history", "scd2", "fresh"):
        for table in TABLES:
            rows = repr(spark_session.table(masking.view(conf, table, kind)).collect())
            assert [c for c in CANARIES if c in rows] == [], (kind, table)
    for table in TABLES:  # the current versions are the clean view's rows
        current = spark_session.table(masking.view(conf, table, "scd2")).filter("is_current").count()
        assert current == clean[table].count(), table


def test_what_changed_today_names_who_by_the_actor_column_or_the_transaction(shop, default_views, spark_session):
    conf = shop["conf"]
    customers = changes.today(conf, spark_session, "shop.customers").collect()
    assert customers and all(len(row["who"]) == 64 for row in customers)  # updated_by, hashed by the policy
    lines = changes.today(conf, spark_session, "shop.order_lines").collect()
    assert lines and all(row["who"] == str(row["tx_id"]) for row in lines)  # no actor column: the transaction
    assert {row["op"] for row in lines} >= {"u", "d", "c"}
