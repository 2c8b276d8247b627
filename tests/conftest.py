"""Fixtures: the local stack (started once per session), per-run databases and names."""

from __future__ import annotations

import time
import uuid

import psycopg2
import pytest
from psycopg2 import sql

from lib import config, sample_db, source, spark, stack


@pytest.fixture(scope="session")
def conf() -> dict:
    """The local target's configuration."""
    return config.load("local")


@pytest.fixture(scope="session")
def live_stack(conf) -> dict:
    """The local stack, running (started if needed; left running for the next session)."""
    stack.up(conf, log=lambda line: None)
    return conf


@pytest.fixture(scope="session")
def run_id() -> str:
    """A short id that makes slot, topic and folder names unique to this test run."""
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def scratch_database(live_stack, run_id):
    """A throwaway database owned by the admin role, dropped at the end of the session."""
    name = f"cdc_test_{run_id}"
    admin = source.connect(live_stack, admin=True, dbname="postgres")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield name
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    admin.close()


@pytest.fixture(scope="session")
def pg_admin_dsn(live_stack, scratch_database) -> str:
    """libpq DSN of the admin role on the scratch database (may create and drop schema bank)."""
    return source.dsn(live_stack, admin=True, dbname=scratch_database)


@pytest.fixture
def bank_conn(pg_admin_dsn):
    """A connection to the scratch database with a freshly created schema bank (dropped afterwards)."""
    connection = psycopg2.connect(pg_admin_dsn)
    sample_db.create_schema(connection)
    yield connection
    connection.rollback()
    with connection.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS bank CASCADE")
    connection.commit()
    connection.close()


@pytest.fixture(scope="session")
def spark_session(conf, tmp_path_factory):
    """A local Spark session with Delta, the Kafka source and Avro, as conf/local.yml sets it up, with a
    metastore of its own (embedded Derby admits one driver: notebooks use the shared one meanwhile)."""
    test_conf = spark.with_metastore(conf, str(tmp_path_factory.mktemp("metastore")))
    session = spark.from_conf(config.apply_overrides(test_conf, {"CDC__SPARK__APP_NAME": "cdc-tests"}))
    yield session
    session.stop()


def drop_replication_slot(conf: dict, slot: str, timeout: float = 30.0) -> None:
    """Drop a slot of conf's database once its walsender has gone (the pipeline role holds REPLICATION)."""
    conn = source.connect(conf)
    conn.autocommit = True
    deadline = time.monotonic() + timeout
    with conn.cursor() as cur:
        while True:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            row = cur.fetchone()
            if row is None:
                break
            if not row[0]:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                break
            assert time.monotonic() < deadline, f"slot {slot} stayed active"
            time.sleep(0.2)
    conn.close()


@pytest.fixture(scope="session")
def drop_slot():
    """drop_slot(conf, slot): remove a test's replication slot once nothing streams from it."""
    return drop_replication_slot
