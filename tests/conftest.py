"""Fixtures: the local stack (started once per session), per-run databases and names."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import psycopg2
import pytest
from psycopg2 import sql

from lib import config, control, source, spark
from lib.capture import bootstrap
from lib.capture.pgoutput import str_to_lsn
from lib.local import sample_db, stack
from lib.operate import teardown

# Spark drivers the tests start (this process's, the notebooks' kernels, the services) compile with C1 only:
# a test's driver lives minutes, so the optimizing compiler's CPU never pays back; C1 alone keeps a 48 MB code
# cache, which a driver fills in about 40 s (then its compiler is off), hence the 240 MB; the serial collector
# costs a small test heap less CPU than G1; their projections and predicates run interpreted, as Spark does when
# code generation fails: a test's tasks hold a few rows, and generating each task's projection code cost more than
# running it (test_merge_unit alone 14 % faster; whole-stage code generation stays on; docs/testing.md); and they
# keep 2000 compiled query classes (Spark: 100), as a test driver merges many small tables (test_merge_unit 6 %
# faster). Not for users' drivers: a merge service running for an hour filled all 2000 with their class loaders
# and kept G1 collecting without pause (docs/benchmarks.md, "The lake after an hour")
os.environ.setdefault("CDC__SPARK__DRIVER_JAVA_OPTIONS",
                      "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC"
                      " -Dspark.sql.codegen.factoryMode=NO_CODEGEN -Dspark.sql.codegen.cache.maxEntries=2000")
# the executors of the tests' standalone cluster (and the Connect server's, which also takes the options above) live a
# notebook or a test long: C1 only and the serial collector, for the same reasons
os.environ.setdefault("CDC__SPARK__EXECUTOR_JAVA_OPTIONS",
                      "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC")


# the longest modules first in the collection (worker seconds in docs/testing.md); xdist then hands out the modules
# with the most tests first, so this orders those of equal count (pytest_xdist_make_scheduler below)
FIRST = ["notebooks", "test_merge_unit", "test_own_database", "test_faults", "test_pg_versions", "test_service",
         "test_merge_stream", "test_snapshot", "test_masking", "test_views_persist", "test_stream", "test_incremental",
         "test_debezium_interop", "test_secure_pipeline", "test_key_changes", "test_brokers", "test_failover"]


def _scope(path) -> str:
    """What stays on one worker: a test module, or all the notebooks (they run in order on one pipeline)."""
    return "notebooks" if str(path).endswith(".ipynb") else Path(str(path)).stem


def pytest_collection_modifyitems(config, items):
    """Every test that uses the live stack, and every notebook, is marked stack; the longest modules go first."""
    for item in items:
        if item.path.suffix == ".ipynb" or "live_stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.stack)
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(_scope(item.path), len(FIRST)))  # stable: order inside a module kept


# The notebooks under nbval run on a pipeline of their own, torn down before the first one runs, so whatever an
# earlier `make demo` or benchmark left on the stack (an invalidated slot cdc_bank, a used lake) cannot fail them
NOTEBOOK_PIPELINE = {"CDC__SOURCE__SLOT": "cdc_nbtest", "CDC__SOURCE__PUBLICATION": "cdc_nbtest",
                     "CDC__KAFKA__TOPIC_PREFIX": "nbtest", "CDC__LAKE__ROOT": ".stack/nbtest/lake",
                     "CDC__SERVICE__DIR": ".stack/nbtest/pipeline"}


def _fresh_notebook_pipeline() -> None:
    """Tear down the notebooks' own pipeline (slot, publication, topics, subjects, lake) left by an earlier run."""
    conf = config.load("local", environ={**os.environ, **NOTEBOOK_PIPELINE})
    stack.up(conf, log=lambda line: None)
    teardown.run(conf, topics=True, confirm=True, log=lambda line: None)
    for key in ("lake.root", "service.dir"):
        shutil.rmtree(config.location(config.get(conf, key)), ignore_errors=True)


class NotebookPipeline:
    """Before a notebook's kernel starts, its environment names the notebooks' pipeline (fresh on the first);
    after each cell the worker's own environment is back. A plugin, not conftest hooks: those see tests/ only."""

    def __init__(self):
        self.fresh, self.saved = False, None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        if item.path.suffix != ".ipynb":
            return
        if not self.fresh:
            _fresh_notebook_pipeline()
            self.fresh = True
        self.saved = {key: os.environ.get(key) for key in NOTEBOOK_PIPELINE}
        os.environ.update(NOTEBOOK_PIPELINE)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item):
        for key, value in (self.saved or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved = None


def pytest_configure(config):
    config.pluginmanager.register(NotebookPipeline(), "cdc-notebook-pipeline")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (make test: -n 3) keeps each module, and the notebooks together, on one worker. xdist hands out
    the modules with the most tests first (FIRST orders those of equal count): tried at 14:07, handing out the
    longest first ran the service-heavy modules side by side and took a minute longer (docs/testing.md)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::", 1)[0])

    return ByModule(config, log)


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


@pytest.fixture
def small_source(live_stack, scratch_database, drop_slot):
    """small_source(ddl) -> (conf, admin connection, schema): tables made by ddl in a fresh schema, published,
    with topics, schemas, a slot and a complete (empty) snapshot, so the capture streams every later change.

    ddl is SQL with {s} for the schema; every table it creates is captured. Dropped afterwards.
    """
    made = []

    def make(ddl: str, **overrides) -> SimpleNamespace:
        tag = uuid.uuid4().hex[:8]
        schema = f"src_{tag}"
        admin = source.connect(live_stack, admin=True, dbname=scratch_database)
        admin.autocommit = True
        user = sql.Identifier(config.get(live_stack, "source.user"))
        with admin.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            cur.execute(ddl.format(s=schema))
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {0} TO {1}; GRANT SELECT ON ALL TABLES IN SCHEMA {0} TO {1}")
                        .format(sql.Identifier(schema), user))
            cur.execute("SELECT relname FROM pg_class WHERE relnamespace = %s::regnamespace AND relkind IN ('r', 'p') "
                        "AND NOT relispartition ORDER BY relname", (schema,))
            tables = [sql.Identifier(schema, row[0]).as_string(admin) if row[0] != row[0].lower() or not
                      row[0].replace("_", "a").isalnum() else f"{schema}.{row[0]}" for row in cur.fetchall()]
        env = {"CDC__SOURCE__DATABASE": scratch_database, "CDC__SOURCE__SLOT": f"src_{tag}",
               "CDC__SOURCE__PUBLICATION": f"src_{tag}", "CDC__SOURCE__TABLES": repr(tables),
               "CDC__SOURCE__KEYS": "{}", "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{tag}-src", **overrides}
        conf = config.apply_overrides(live_stack, env)
        made.append((conf, admin, schema))
        bootstrap.run(conf, log=lambda *a, **k: None)
        slot = config.get(conf, "source.slot")
        repl = source.connect(conf, replication=True)
        with repl.cursor() as cur:
            cur.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput')
            consistent = cur.fetchone()[1]
        repl.close()
        control.put(conf, f"snapshot/{slot}", {"state": "complete", "consistent_lsn": str_to_lsn(consistent),
                                               "rows": {}})
        return SimpleNamespace(conf=conf, admin=admin, schema=schema, tables=tables)

    yield make
    for conf, admin, schema in made:
        drop_slot(conf, config.get(conf, "source.slot"))
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
                sql.Identifier(config.get(conf, "source.publication"))))
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.close()
        with contextlib.suppress(Exception):
            teardown.delete_prefix(conf, config.get(conf, "kafka.topic_prefix"))
