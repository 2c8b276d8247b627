"""A database that is not the sample, set up as README's "Capture your own database" says, with its own conf file,
and the five notebooks run on it as a job through Spark Connect (tests/test_spark_cluster.py);
tests/test_own_database.py runs the same steps from lib on local Spark.

The database lives on the newest PostgreSQL major the README claims (18, a server of the version matrix,
lib/local/stack/pg_versions.py): a superuser makes the reading role (LOGIN REPLICATION) and the owner role, which
owns the schema but not the database and gets CREATE on it. The owner makes the tables (a composite key, numeric,
jsonb, timestamptz, a TOASTed text, a table keyed through source.keys) and rows with planted personal values.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import uuid

import server_roles
import yaml
from psycopg2 import sql

from lib import config, source
from lib.local.stack import pg_versions, postgres

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


def write_rows(cur, start: int, count: int, actor: str) -> None:
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


def superuser(server: dict, dbname: str = "postgres"):
    """The version server's superuser over its private socket, autocommit."""
    conn = postgres.superuser_connect(server, postgres.layout(pg_versions.postgres_stack_dir(server), server), dbname)
    conn.autocommit = True
    return conn



@contextlib.contextmanager
def database(live_stack: dict, folder, drop_slot, environ: dict | None = None):
    """The shop database with rows and conf/<target>.yml in folder (environ: the environment the conf is read in,
    CDC__ overrides included); yields {conf, owner, target, env}. Drops the database, roles, slot and topics
    afterwards."""
    server = pg_versions.up(live_stack, [MAJOR], log=lambda line: None)[MAJOR]
    tag = uuid.uuid4().hex[:8]
    database, target = f"shop_{tag}", f"shop_{tag}"
    reader, owner_role = f"cdc_reader_{tag}", f"shop_owner_{tag}"
    passwords = {f"SHOP_PG_PASSWORD_{tag}": secrets.token_urlsafe(12),
                 f"SHOP_PG_ADMIN_PASSWORD_{tag}": secrets.token_urlsafe(12)}
    (reader_secret, reader_password), (owner_secret, owner_password) = passwords.items()
    os.environ.update(passwords)
    root = superuser(server)
    with root.cursor() as cur:  # README step 1, as a superuser; the owner makes schema shop below
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD %s").format(sql.Identifier(reader)),
                    (reader_password,))
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(owner_role)), (owner_password,))
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        cur.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(database),
                                                                         sql.Identifier(owner_role)))
    prefix = f"cdc-test-{tag}-shop"
    server_conf = config.apply_overrides(server, {
        "CDC__SOURCE__DATABASE": database, "CDC__SOURCE__ADMIN_USER": owner_role,
        "CDC__SOURCE__ADMIN_PASSWORD": f"{{env: {owner_secret}}}", "CDC__KAFKA__TOPIC_PREFIX": prefix})
    owner = source.connect(server_conf, admin=True)
    owner.autocommit = True
    conf = None
    try:
        with owner.cursor() as cur:
            cur.execute(DDL)
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA shop TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA shop TO {0}")
                        .format(sql.Identifier(reader)))
            write_rows(cur, 1, 20, CANARIES[2])
        raw = yaml.safe_load((config.CONF_DIR / "local.yml").read_text())
        raw.pop("stack")  # a user's database: the local stack's own section does not apply
        raw["source"].update(port=server["source"]["port"], database=database, user=reader,
                             password={"env": reader_secret}, admin_user=owner_role,
                             admin_password={"env": owner_secret}, slot=target, publication=target, tables=TABLES,
                             keys={"shop.audit_log": ["event_uuid"]})
        raw["kafka"]["topic_prefix"] = prefix
        raw["lake"]["root"] = str(folder / "lake")
        raw["jobs"]["runs_dir"] = str(folder / "runs")
        raw["service"]["dir"] = str(folder / "pipeline")
        raw["masking"].update(database=f"shop_views_{tag}", privileged_database=f"shop_private_{tag}",
                              tables=POLICY)
        (folder / "conf").mkdir()
        (folder / "conf" / f"{target}.yml").write_text(yaml.safe_dump(raw, sort_keys=False))
        env = {**(environ or os.environ), **passwords, "CDC_CONF_DIR": str(folder / "conf")}
        conf = config.load(target, conf_dir=folder / "conf", environ=env)
        yield {"conf": conf, "owner": owner, "target": target, "env": env}
    finally:
        if conf is not None:
            drop_slot(conf, target)
        owner.close()
        server_roles.remove(root, server_conf, database, [reader, owner_role], passwords)


@contextlib.contextmanager
def job(live_stack: dict, folder, drop_slot, environ: dict | None = None):
    """The shop database, and `python -m lib.operate.jobs --target <it> -p continuous false` run on it (as the bundle's
    job runs them); yields the database's dict with the job's outcome and its executed notebooks (runs)."""
    with database(live_stack, folder, drop_slot, environ) as shop:
        # notebook 04 with continuous=False: the services are jobs of their own there (the continuous section runs
        # in the notebooks under nbval and in tests/test_service.py)
        done = subprocess.run([sys.executable, "-m", "lib.operate.jobs", "--target", shop["target"], "-p",
                               "continuous", "false"], cwd=config.PROJECT_ROOT, env=shop["env"], capture_output=True,
                              text=True, timeout=1500)
        yield {**shop, "job": done, "runs": sorted((folder / "runs").glob("*/*.ipynb"))}


def executed(shop: dict) -> str:
    """The executed notebooks' text, once the job succeeded with all five in order; no planted value in it."""
    done = shop["job"]
    assert done.returncode == 0, f"job failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert [path.stem for path in shop["runs"]] == ["01_bootstrap_slot", "02_snapshot", "03_stream_to_kafka",
                                                     "04_merge_into_delta", "05_masking_views"]
    text = "\n".join(path.read_text() for path in shop["runs"])
    assert [canary for canary in CANARIES if canary in text] == []
    return text
