"""The pipeline on every PostgreSQL major the README claims (13 to 18), each a real server the project starts.

Per major, the README's own-database path: a superuser makes a reading role with REPLICATION and an owner
role that owns the schema but not the database; notebook 01's checks name the missing CREATE grant, then
bootstrap, the snapshot (jdbc reader), the stream with a large transaction streamed in blocks, a rolled-back
one, deletes, TOAST, a key change and a column added by DDL, the merge and an exact reconcile; then the
copy reader takes the snapshot again and the lake is still exact. `CDC_PG_MAJORS` picks the majors (`make test`:
13 and 18, beside every other test on the stack's own server; `make compat`: all), `CDC_PG_COPY_MAJORS` those of
the copy reader's test (by default the oldest: on 18 it takes test_own_database's snapshot). 15 is
the stack's own server, the others come from lib/local/stack/pg_versions.py.
"""

from __future__ import annotations

import os
import re
import secrets as random
import uuid

import psycopg2
import pytest
import server_roles
from psycopg2 import sql

from lib import config, source
from lib.capture import bootstrap, native, snapshot, stream
from lib.capture.pgoutput import protocol_options
from lib.lake import merge, reconcile
from lib.local.stack import pg_versions, postgres

pytestmark = pytest.mark.stack

MAJORS = [int(m) for m in os.environ.get("CDC_PG_MAJORS", "13,18").split(",") if m.strip()]
# the copy reader's re-snapshot: the oldest major in make test (on 18 it takes test_own_database's snapshot), every
# major in make compat
COPY_MAJORS = [m for m in MAJORS if str(m) in os.environ.get("CDC_PG_COPY_MAJORS", str(MAJORS[0])).split(",")]
STACK_MAJOR = 15
TABLES = ["shop.items", "shop.order_lines", "shop.documents"]
DDL = """
CREATE TABLE shop.items (item_id bigint PRIMARY KEY, name text NOT NULL, price numeric(10,2), tags text[],
    updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE shop.order_lines (order_id bigint, line_no int, sku text NOT NULL, qty int NOT NULL,
    PRIMARY KEY (order_id, line_no));
CREATE TABLE shop.documents (doc_id int PRIMARY KEY, title text, body text);
ALTER TABLE shop.documents ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO shop.items SELECT g, 'item ' || g, g * 0.5, ARRAY['t' || (g % 7)] FROM generate_series(1, 5000) g;
INSERT INTO shop.order_lines SELECT g / 3, g % 3, 'SKU-' || g, g % 5 + 1 FROM generate_series(1, 300) g;
INSERT INTO shop.documents SELECT g, 'doc ' || g, repeat(md5(g::text), 200) FROM generate_series(1, 20) g;
"""


def _superuser(server_conf: dict, dbname: str = "postgres"):
    """The server's superuser over its private socket, autocommit."""
    folder = pg_versions.postgres_stack_dir(server_conf)
    conn = postgres.superuser_connect(server_conf, postgres.layout(folder, server_conf), dbname)
    conn.autocommit = True
    return conn


@pytest.fixture(scope="module", params=MAJORS, ids=lambda major: f"pg{major}")
def server(request, live_stack) -> dict:
    """conf pointed at a running server of the major (15: the stack's own)."""
    major = request.param
    if major == STACK_MAJOR:
        return live_stack
    return pg_versions.up(live_stack, [major], log=lambda line: None)[major]


@pytest.fixture(scope="module")
def shop(server, tmp_path_factory, drop_slot):
    """A database owned by the superuser; roles as README step 1 makes them; a schema owned by the owner role."""
    tag = uuid.uuid4().hex[:8]
    reader, owner, database = f"reader_{tag}", f"owner_{tag}", f"shop_{tag}"
    passwords = {f"CDC_TEST_READER_{tag}": random.token_urlsafe(12), f"CDC_TEST_OWNER_{tag}": random.token_urlsafe(12)}
    os.environ.update(passwords)
    (reader_secret, reader_password), (owner_secret, owner_password) = passwords.items()
    root = _superuser(server)
    with root.cursor() as cur:
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD %s").format(sql.Identifier(reader)),
                    (reader_password,))
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(owner)), (owner_password,))
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    inside = _superuser(server, database)
    with inside.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA shop AUTHORIZATION {}").format(sql.Identifier(owner)))
    folder = tmp_path_factory.mktemp(f"pg{server['source']['port']}")
    conf = config.apply_overrides(server, {
        "CDC__SOURCE__DATABASE": database, "CDC__SOURCE__USER": reader, "CDC__SOURCE__ADMIN_USER": owner,
        "CDC__SOURCE__PASSWORD": f"{{env: {reader_secret}}}", "CDC__SOURCE__ADMIN_PASSWORD": f"{{env: {owner_secret}}}",
        "CDC__SOURCE__SLOT": f"v_{tag}", "CDC__SOURCE__PUBLICATION": f"v_{tag}", "CDC__SOURCE__KEYS": "{}",
        "CDC__SOURCE__TABLES": repr(TABLES), "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{tag}-v",
        "CDC__LAKE__ROOT": str(folder / "lake")})
    owned = source.connect(conf, admin=True)
    owned.autocommit = True
    with owned.cursor() as cur:
        cur.execute(DDL)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA shop TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA shop TO {0}")
                    .format(sql.Identifier(reader)))
    yield {"conf": conf, "owner": owned, "root": inside, "database": database, "admin": owner}
    drop_slot(conf, config.get(conf, "source.slot"))
    owned.close()
    inside.close()
    server_roles.remove(root, conf, database, [reader, owner], passwords)


def _failed(findings) -> dict:
    return {f.check: f for f in findings if not f.ok}


def test_notebook_01_names_the_create_grant_the_publication_needs_then_bootstraps(shop):
    conf, database, admin = shop["conf"], shop["database"], shop["admin"]
    _, findings = bootstrap.check(conf)
    check = f"database {database}: CREATE granted to {admin} (to create publication {conf['source']['publication']})"
    assert list(_failed(findings)) == [check]
    assert _failed(findings)[check].remedy == f'GRANT CREATE ON DATABASE "{database}" TO "{admin}"'
    with pytest.raises(bootstrap.BootstrapError, match="cannot create publication .* needs CREATE on the database"):
        bootstrap.ensure_publication(conf, bootstrap.check(conf)[0])
    with shop["root"].cursor() as cur:
        cur.execute(_failed(findings)[check].remedy)
    _, findings = bootstrap.check(conf)
    assert _failed(findings) == {}
    assert bootstrap.run(conf, log=lambda line: None)["publication"] == "created"


def _changes(cur) -> None:
    """A streamed large transaction, a rolled-back one, deletes, TOAST, a key change and a column added by DDL."""
    cur.execute("UPDATE shop.items SET price = price + 1, updated_at = now()")  # 5,000 rows in one transaction
    cur.execute("BEGIN")
    cur.execute("INSERT INTO shop.items SELECT g, 'never', 1 FROM generate_series(50001, 60000) g")
    cur.execute("ROLLBACK")
    cur.execute("DELETE FROM shop.items WHERE item_id % 10 = 0")
    cur.execute("DELETE FROM shop.order_lines WHERE order_id = 7")
    cur.execute("UPDATE shop.documents SET title = 'renamed' WHERE doc_id <= 5")  # body unchanged: not sent
    cur.execute("INSERT INTO shop.documents VALUES (100, 'new', repeat('x', 50000))")
    cur.execute("UPDATE shop.order_lines SET line_no = 9 WHERE order_id = 4 AND line_no = 1")  # the key changes
    cur.execute("UPDATE shop.items SET item_id = 70001 WHERE item_id = 3")
    cur.execute("ALTER TABLE shop.items ADD COLUMN colour text")
    cur.execute("INSERT INTO shop.items (item_id, name, colour) VALUES (80001, 'painted', 'teal')")
    cur.execute("UPDATE shop.items SET colour = 'red' WHERE item_id BETWEEN 11 AND 19")


def test_snapshot_stream_and_merge_end_exact(shop, spark_session):
    conf = shop["conf"]
    assert snapshot.run(conf, spark_session, log=lambda line: None)["rows"] == 5000 + 300 + 20
    with shop["owner"].cursor() as cur:
        _changes(cur)
        cur.execute("SELECT current_setting('server_version_num')::int")
        version = cur.fetchone()[0]
    with shop["owner"].cursor() as cur:  # per database: the heartbeat's function, not callable by the reader
        cur.execute("SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message'")
        functions = [row[0] for row in cur.fetchall()]
    with shop["root"].cursor() as cur:
        for function in functions:
            cur.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    with pytest.raises(stream.StreamError, match="may not call pg_logical_emit_message") as refused:
        stream.run(conf, until="caught_up")
    grant = re.search(r"run (GRANT EXECUTE ON FUNCTION \S+ TO \S+);", str(refused.value)).group(1)
    assert grant.startswith("GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(boolean,text,text")
    with shop["root"].cursor() as cur:
        cur.execute(grant)  # the remedy as printed, with this server's signature (17 added a fourth parameter)
    lines = []
    metrics = stream.run(conf, until="caught_up", pg_options="-c logical_decoding_work_mem=64kB", log=lines.append)
    proto = protocol_options(version)
    assert f"(PostgreSQL {version // 10000}, protocol {proto['proto_version']}; {native.REASON})" in "\n".join(lines)
    assert (metrics["streamed_transactions"] > 0) == (version >= 140000), metrics  # in blocks, from protocol 2
    merge.run_until_caught_up(conf, spark_session)
    results = reconcile.reconcile(conf, spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(t, True) for t in TABLES], results


@pytest.mark.parametrize("server", COPY_MAJORS, indirect=True, ids=lambda major: f"pg{major}")
def test_the_copy_reader_takes_the_snapshot_again_and_the_lake_stays_exact(shop, spark_session):
    conf = config.apply_overrides(shop["conf"], {"CDC__SNAPSHOT__READER": "copy"})
    with shop["owner"].cursor() as cur:
        cur.execute("DELETE FROM shop.items WHERE item_id BETWEEN 100 AND 199")  # retracted by the new snapshot
        cur.execute("INSERT INTO shop.order_lines VALUES (999, 1, 'late', 1)")
    done = snapshot.run(conf, spark_session, log=lambda line: None, resnapshot=True)
    assert done["status"] == "complete" and not done["already_complete"]
    stream.run(conf, until="caught_up")
    merge.run_until_caught_up(conf, spark_session)
    results = reconcile.reconcile(conf, spark_session)
    assert [(r["table"], r["equal"]) for r in results] == [(t, True) for t in TABLES], results


def test_connections_use_tls_and_set_only_the_parameters_the_server_has(shop):
    conn = source.connect(shop["conf"], settings={"idle_session_timeout": "0", "statement_timeout": "0",
                                                  "no_such_parameter_anywhere": "1"})
    with conn.cursor() as cur:
        cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        assert cur.fetchone()[0] is True
        cur.execute("SELECT current_setting('server_version_num')::int, current_setting('statement_timeout')")
        version, timeout = cur.fetchone()
        cur.execute("SELECT current_setting('idle_session_timeout', true)")
        assert timeout == "0" and cur.fetchone()[0] == ("0" if version >= 140000 else None)
    conn.close()
    with pytest.raises(psycopg2.Error):  # what a startup option the server lacks does (13: idle_session_timeout)
        psycopg2.connect(source.dsn(shop["conf"]), options="-c no_such_parameter_anywhere=1")
