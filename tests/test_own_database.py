"""A database that is not the sample (issue 15): a small shop with its own conf file, run the way a user runs it.

The database lives on the newest PostgreSQL major the README claims (18, a server of the version matrix,
lib/local/stack/pg_versions.py), set up as README's "Capture your own database" says: a superuser makes the
reading role (LOGIN REPLICATION) and the owner role, which owns the schema but not the database and gets
CREATE on it. The test makes the tables (a composite key, numeric, jsonb, timestamptz, a TOASTed text, a
table keyed through source.keys), writes conf/<target>.yml into a folder of its own (CDC_CONF_DIR), runs all
five notebooks as a job with `python -m lib.operate.jobs --target <it> -p continuous false` (as the bundle's
job runs them), then writes changes, catches up and
checks that every table is exact, that the views follow the default-drop policy, and that no planted
personal value appears in a view or in an executed notebook.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import uuid

import pytest
import server_roles
import yaml
from psycopg2 import sql

from lib import config, source
from lib.capture import stream
from lib.lake import merge, reconcile, silver_step
from lib.local.stack import pg_versions, postgres
from lib.views import changes, masking

pytestmark = pytest.mark.stack

MAJOR = 18  # the newest major the README claims
CANARIES = ("canary-ada@shop.example", "Canary Lovelace", "canary-clerk-7")
TABLES = ["shop.customers", "shop.orders", "shop.order_lines", "shop.audit_log"]
DDL = """
CREATE SCHEMA shop;
CREATE TABLE shop.customers (customer_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, email text NOT NULL,
    full_name text, tier text, updated_by text, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE shop.orders (order_id bigint PRIMARY KEY, customer_id bigint NOT NULL, placed_at timestamptz NOT NULL,
    total numeric(12,2), details jsonb, note text, updated_by text);
CREATE TABLE shop.order_lines (order_id bigint, line_no int, sku text NOT NULL, qty int NOT NULL,
    price numeric(10,2), PRIMARY KEY (order_id, line_no));
CREATE TABLE shop.audit_log (event_uuid uuid NOT NULL, happened_at timestamptz NOT NULL, action text,
    payload jsonb);
ALTER TABLE shop.audit_log REPLICA IDENTITY FULL;
"""
POLICY = {
    "shop.customers": {"customer_id": "keep", "email": "hash", "tier": "keep", "updated_by": "hash",
                       "created_at": "partial"},  # full_name: not listed, so dropped
    "shop.orders": {"order_id": "keep", "customer_id": "keep", "placed_at": "keep", "total": "keep",
                    "details": "keep", "updated_by": "hash"},  # note: dropped
    "shop.audit_log": {"event_uuid": "keep", "happened_at": "keep", "action": "keep"},
}  # shop.order_lines: not listed at all


def _write_rows(cur, start: int, count: int, actor: str) -> None:
    """Customers with their orders, lines and audit entries; every text a TOAST-sized note on the orders."""
    for n in range(start, start + count):
        cur.execute("INSERT INTO shop.customers (email, full_name, tier, updated_by) VALUES (%s, %s, %s, %s) "
                    "RETURNING customer_id", (f"c{n}.{CANARIES[0]}", f"{CANARIES[1]} {n}", "gold", actor))
        customer = cur.fetchone()[0]
        note = uuid.uuid4().hex * 300  # 9.6 kB of hex: stored out of line (TOAST)
        cur.execute("INSERT INTO shop.orders VALUES (%s, %s, now(), %s, %s, %s, %s)",
                    (n, customer, f"{n}.25", json.dumps({"channel": "web", "items": [n, n + 1]}), note, actor))
        for line in (1, 2):
            cur.execute("INSERT INTO shop.order_lines VALUES (%s, %s, %s, %s, %s)",
                        (n, line, f"SKU-{line}", line, 9.99))
        cur.execute("INSERT INTO shop.audit_log VALUES (gen_random_uuid(), now(), 'order', %s)",
                    (json.dumps({"order": n}),))


def _superuser(server: dict, dbname: str = "postgres"):
    """The version server's superuser over its private socket, autocommit."""
    conn = postgres.superuser_connect(server, postgres.layout(pg_versions.postgres_stack_dir(server), server), dbname)
    conn.autocommit = True
    return conn


@pytest.fixture(scope="module")
def shop(live_stack, tmp_path_factory, drop_slot):
    """The shop database with rows on a PostgreSQL 18 server, its conf file in a folder of its own, the job run."""
    server = pg_versions.up(live_stack, [MAJOR], log=lambda line: None)[MAJOR]
    tag = uuid.uuid4().hex[:8]
    database, target, folder = f"shop_{tag}", f"shop_{tag}", tmp_path_factory.mktemp("own_database")
    reader, owner_role = f"cdc_reader_{tag}", f"shop_owner_{tag}"
    passwords = {f"SHOP_PG_PASSWORD_{tag}": secrets.token_urlsafe(12),
                 f"SHOP_PG_ADMIN_PASSWORD_{tag}": secrets.token_urlsafe(12)}
    (reader_secret, reader_password), (owner_secret, owner_password) = passwords.items()
    os.environ.update(passwords)
    root = _superuser(server)
    with root.cursor() as cur:  # README step 1, as a superuser; the owner makes schema shop below
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD %s").format(sql.Identifier(reader)),
                    (reader_password,))
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(owner_role)), (owner_password,))
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        cur.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(database),
                                                                         sql.Identifier(owner_role)))
    server_conf = config.apply_overrides(server, {
        "CDC__SOURCE__DATABASE": database, "CDC__SOURCE__ADMIN_USER": owner_role,
        "CDC__SOURCE__ADMIN_PASSWORD": f"{{env: {owner_secret}}}"})
    owner = source.connect(server_conf, admin=True)
    owner.autocommit = True
    with owner.cursor() as cur:
        cur.execute(DDL)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA shop TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA shop TO {0}")
                    .format(sql.Identifier(reader)))
        _write_rows(cur, 1, 20, CANARIES[2])
    raw = yaml.safe_load((config.CONF_DIR / "local.yml").read_text())
    raw.pop("stack")  # a user's database: the local stack's own section does not apply
    raw["source"].update(port=server["source"]["port"], database=database, user=reader,
                         password={"env": reader_secret}, admin_user=owner_role, admin_password={"env": owner_secret},
                         slot=target, publication=target, tables=TABLES, keys={"shop.audit_log": ["event_uuid"]})
    raw["kafka"]["topic_prefix"] = f"cdc-test-{tag}-shop"
    raw["lake"]["root"] = str(folder / "lake")
    raw["jobs"]["runs_dir"] = str(folder / "runs")
    raw["service"]["dir"] = str(folder / "pipeline")
    raw["masking"].update(database=f"shop_views_{tag}", privileged_database=f"shop_private_{tag}", tables=POLICY)
    (folder / "conf").mkdir()
    (folder / "conf" / f"{target}.yml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "CDC_CONF_DIR": str(folder / "conf")}
    conf = config.load(target, conf_dir=folder / "conf", environ=env)
    # as the bundle's job runs them: notebook 04 with continuous=False (the services are jobs of their own there;
    # the continuous section runs in the notebooks under nbval and in tests/test_service.py)
    job = subprocess.run([sys.executable, "-m", "lib.operate.jobs", "--target", target, "-p", "continuous", "false"],
                         cwd=config.PROJECT_ROOT,
                         env=env, capture_output=True, text=True, timeout=1500)
    yield {"conf": conf, "owner": owner, "job": job, "runs": sorted((folder / "runs").glob("*/*.ipynb"))}
    drop_slot(conf, target)
    owner.close()
    server_roles.remove(root, conf, database, [reader, owner_role], passwords)


def test_all_five_notebooks_run_as_a_job_on_a_database_that_is_not_the_sample(shop):
    job = shop["job"]
    assert job.returncode == 0, f"job failed:\n{job.stdout[-4000:]}\n{job.stderr[-4000:]}"
    assert [path.stem for path in shop["runs"]] == ["01_bootstrap_slot", "02_snapshot", "03_stream_to_kafka",
                                                     "04_merge_into_delta", "05_masking_views"]
    text = "\n".join(path.read_text() for path in shop["runs"])
    assert "demo writes skipped" in text and "continuous=False" in text and "bank.branches" not in job.stdout
    assert "the sample bank is not configured (source.tables): the exercises below are skipped" in text


def test_no_planted_personal_value_appears_in_an_executed_notebook(shop):
    text = "\n".join(path.read_text() for path in shop["runs"])
    assert [canary for canary in CANARIES if canary in text] == []


def test_changes_after_the_job_show_in_the_fresh_view_while_silver_waits_then_silver_is_exact(shop, spark_session):
    conf, tag = shop["conf"], uuid.uuid4().hex[:6]
    with shop["owner"].cursor() as cur:
        _write_rows(cur, 21, 5, CANARIES[2])
        cur.execute("UPDATE shop.orders SET total = total + 1 WHERE order_id <= 10")  # the TOASTed note unchanged
        cur.execute("UPDATE shop.orders SET total = total * 2 WHERE order_id % 4 = 0")
        cur.execute("UPDATE shop.order_lines SET qty = qty + 3 WHERE line_no = 2 AND order_id % 3 = 0")
        cur.execute("UPDATE shop.order_lines SET line_no = 9 WHERE order_id = 4 AND line_no = 1")  # a key changes
        cur.execute("DELETE FROM shop.order_lines WHERE order_id IN (5, 7)")
        cur.execute("DELETE FROM shop.audit_log WHERE payload->>'order' = '6'")
        cur.execute("INSERT INTO shop.audit_log VALUES (gen_random_uuid(), now(), 'fresh', '{}')")
        cur.execute("UPDATE shop.customers SET tier = 'silver', updated_by = 'canary-clerk-8' WHERE customer_id <= 3")
        _write_rows(cur, 101, 2, CANARIES[2])
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
