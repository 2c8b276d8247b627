"""A database that is not the sample (issue 15): a small shop with its own conf file, run the way a user runs it.

tests/shop_database.py sets it up as README's "Capture your own database" says (on PostgreSQL 18, the newest major
the README claims) and runs all five notebooks as a job with `python -m lib.operate.jobs --target <it> -p
continuous false`, as the bundle's job runs them. Here, on local Spark: then it writes changes, catches up and
checks that every table is exact, that the views follow the default-drop policy, and that no planted personal
value appears in a view or in an executed notebook. tests/test_spark_cluster.py runs the same job through Spark
Connect.
"""

from __future__ import annotations

import uuid

import pytest
import shop_database
from shop_database import CANARIES, TABLES, write_rows

from lib.capture import stream
from lib.lake import merge, reconcile, silver_step
from lib.views import changes, masking

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def shop(live_stack, tmp_path_factory, drop_slot):
    """The shop database with rows, its conf file in a folder of its own, the job run on local Spark."""
    with shop_database.job(live_stack, tmp_path_factory.mktemp("own_database"), drop_slot) as shop:
        yield shop


def test_all_five_notebooks_run_as_a_job_on_a_database_that_is_not_the_sample_with_no_planted_value(shop):
    text = shop_database.executed(shop)
    assert "demo writes skipped" in text and "continuous=False" in text and "bank.branches" not in shop["job"].stdout
    assert "the sample bank is not configured (source.tables): the exercises below are skipped" in text


def test_changes_after_the_job_show_in_the_fresh_view_while_silver_waits_then_silver_is_exact(shop, spark_session):
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
