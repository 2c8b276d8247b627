"""The local stack's Spark cluster (issue 29, point 1): a standalone master with two one-core workers and a Spark
Connect server on it, started as local processes from pip's pyspark; over Connect, Delta through SQL runs on the
cluster, and the executors' Python does not have the project unless a session ships it.

Runs on ports and a stack folder of its own, so a cluster a user started is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pipeline_on_target
import pytest
import shop_database
from psycopg2 import sql

from lib import config, source
from lib.local import stack
from lib.local.stack import process, spark_cluster

# cluster: make test-cluster runs these in a pytest process of their own, because a remote session cannot start
# where a local one runs (make test's workers hold a shared local session: SESSION_ALREADY_EXIST)
pytestmark = [pytest.mark.stack, pytest.mark.cluster]


@pytest.fixture(scope="module")
def cluster(live_stack, tmp_path_factory):
    conf = config.apply_overrides(live_stack, {
        "CDC__STACK__CLUSTER__MASTER_PORT": "27177", "CDC__STACK__CLUSTER__MASTER_WEBUI_PORT": "27180",
        "CDC__STACK__CLUSTER__WORKER_WEBUI_PORT": "27181", "CDC__STACK__CLUSTER__CONNECT_PORT": "27102",
        "CDC__SPARK__JARS_DIR": str(config.location(str(config.get(live_stack, "spark.jars_dir"))))})
    folder = tmp_path_factory.mktemp("cluster_stack")
    lines: list[str] = []
    try:
        spark_cluster.start(conf, folder, log=lines.append)
        yield conf, folder, lines
    finally:
        spark_cluster.stop(conf, folder, log=lines.append)


def _as_admin(conf: dict, statement: str, database: str) -> None:
    """One statement on a database, such as CREATE DATABASE {}, run by the admin role."""
    admin = source.connect(conf, admin=True, dbname="postgres")
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL(statement).format(sql.Identifier(database)))
    finally:
        admin.close()


def _sample_copy(conf: dict, database: str) -> None:
    """A database of its own holding the sample bank (as `make sample` loads it), owned by the admin role."""
    _as_admin(conf, "CREATE DATABASE {}", database)
    stack.sample({**conf, "source": {**conf["source"], "database": database}}, log=lambda line: None)


def _drop_database(conf: dict, database: str) -> None:
    """Drop the database and a slot a run killed before its teardown left in it (a slot holds its database)."""
    reader = source.connect(conf, dbname="postgres")  # the pipeline role may drop slots (REPLICATION)
    reader.autocommit = True
    try:
        with reader.cursor() as cur:
            deadline = time.monotonic() + 30
            while True:
                cur.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = %s "
                            "AND active_pid IS NOT NULL", (database,))
                if not cur.rowcount or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                        (database,))
    finally:
        reader.close()
    _as_admin(conf, "DROP DATABASE IF EXISTS {} WITH (FORCE)", database)


def _start_pipeline(cluster, target: str, folder) -> dict:
    """tests/pipeline_on_target.py for target in a process of its own, on the test's cluster, with its own source
    database (a copy of the sample), slot, topics, lake and job runs; its output goes to files in folder."""
    tag = uuid.uuid4().hex[:6]
    name = f"cdc_e2e_{target}_{tag}"
    _sample_copy(cluster[0], name)
    env = {**_spark_env(cluster, target), "CDC__SOURCE__DATABASE": name,
           "CDC__SOURCE__SLOT": name, "CDC__SOURCE__PUBLICATION": name, "CDC__KAFKA__TOPIC_PREFIX": name,
           "CDC__LAKE__ROOT": str(folder / "lake"), "CDC__JOBS__RUNS_DIR": str(folder / "runs")}
    with open(folder / "pipeline.stdout", "w") as out, open(folder / "pipeline.stderr", "w") as err:
        child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("pipeline_on_target.py")), target,
                                  *LIB_STEPS[target]], env=env, stdout=out, stderr=err, text=True)
    return {"target": target, "process": child, "folder": folder, "database": name}


def _finish_pipeline(run: dict) -> dict:
    """What the run printed, once its process has ended (its log stays in its folder, kept with pytest's last three
    runs)."""
    try:
        run["process"].wait(timeout=1200)
    except subprocess.TimeoutExpired:
        run["process"].kill()
        run["process"].wait()
    stdout, stderr = ((run["folder"] / f"pipeline.{name}").read_text() for name in ("stdout", "stderr"))
    lines = [line for line in stdout.splitlines() if line.startswith("PIPELINE ")]
    after = stderr.partition(pipeline_on_target.DONE)[2]
    if run["process"].returncode != 0 and lines and "Timeout (" in after:  # it ended; its exit hung, then was bounded
        warnings.warn(f"the {run['target']} run ended, then its exit hung {pipeline_on_target.EXIT_BOUND_S} s in "
                      f"pyspark's Connect client; its threads then: {after}", stacklevel=2)
    else:
        assert run["process"].returncode == 0 and lines, stderr[-12000:]
    return json.loads(lines[-1][len("PIPELINE "):])


E2E = "test_the_pipeline_a_write_load_and_the_continuous_merge_end_exact_on_the_target"
# Connect's run takes the job's first steps from lib: the notebooks job runs through Connect on the own database
# (test_the_own_database_job_runs_through_connect_exact_with_no_planted_value), meanwhile
LIB_STEPS = {"cluster": [], "connect": ["--lib-steps"]}


@pytest.fixture(scope="module", autouse=True)
def pipelines(request, cluster, tmp_path_factory):
    """The end-to-end runs of the targets whose test is selected, started with the module and side by side: one at a
    time kept 1.6 of the machine's 2 cores busy. The cluster target's driver has one worker's core and the Connect
    server the other's; the module's tests that use neither worker (the Connect ones, the misconfigured servers) run
    meanwhile, those that need a worker's core after them. Each run writes its load to a source database of its own,
    so that the other's writes never reach its reconcile."""
    selected = {item.name for item in request.session.items}
    runs = {}
    try:
        for target in ("cluster", "connect"):
            if f"{E2E}[{target}]" in selected:
                runs[target] = _start_pipeline(cluster, target, tmp_path_factory.mktemp(f"e2e_{target}"))
        yield runs
    finally:
        for run in runs.values():
            if run["process"].poll() is None:
                run["process"].kill()
                run["process"].wait()
            _drop_database(cluster[0], run["database"])


def test_the_cluster_starts_with_two_one_core_workers_and_a_connect_server(cluster):
    conf, folder, lines = cluster
    rows = {row["service"]: row for row in spark_cluster.status(conf, folder)}
    assert [rows[name]["state"] for name in ("spark-master", "spark-worker-1", "spark-worker-2", "spark-connect")] \
        == ["running"] * 4, rows
    workers = [w for w in spark_cluster.master_state(conf)["workers"] if w["state"] == "ALIVE"]
    assert len(workers) == 2 and all(w["cores"] == 1 for w in workers), workers
    assert any(line.startswith("spark-connect started on port 27102") for line in lines), lines
    spark_cluster.start(conf, folder, log=lines.append)  # again: everything already runs, nothing new
    assert sum("already running" in line for line in lines) == 4, lines


def test_over_connect_delta_runs_on_the_cluster_and_executors_do_not_have_the_project(cluster, tmp_path):
    from pyspark.errors import PythonException
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    conf = cluster[0]
    spark = SparkSession.builder.remote(spark_cluster.connect_url(conf)).getOrCreate()
    try:
        assert type(spark).__module__ == "pyspark.sql.connect.session"  # not a local session handed back
        assert spark.conf.get("spark.master") == spark_cluster.master_url(conf)
        path = f"delta.`{tmp_path / 't'}`"
        spark.sql(f"CREATE TABLE {path} (id bigint, v string) USING delta")
        spark.sql(f"INSERT INTO {path} VALUES (1, 'a'), (2, 'b')")
        spark.createDataFrame([(2, "B"), (3, "c")], "id bigint, v string").createOrReplaceTempView("cluster_src")
        spark.sql(f"MERGE INTO {path} t USING cluster_src s ON t.id = s.id "
                  "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *")
        assert sorted(tuple(r) for r in spark.sql(f"SELECT * FROM {path}").collect()) == [(1, "a"), (2, "B"),
                                                                                          (3, "c")]
        assert [r["operation"] for r in spark.sql(f"DESCRIBE HISTORY {path}").collect()] == ["MERGE", "WRITE",
                                                                                            "CREATE TABLE"]

        def project_version(_):
            import lib  # noqa: F401 - only importable where the project was shipped

            return 1

        with pytest.raises(PythonException, match="No module named 'lib'"):
            spark.range(1).select(F.udf(project_version, "int")("id")).collect()
    finally:
        spark.stop()


def _spark_env(cluster, target: str) -> dict:
    """This process's environment for a process of target's own on the test's cluster (its ports): the session
    settings as CDC__ overrides, without the Connect mode flags this process's own session set."""
    conf = cluster[0]
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")}
    return {**inherited, "CDC__SPARK__JARS_DIR": str(config.get(conf, "spark.jars_dir")),
            "CDC__SPARK__REMOTE": spark_cluster.connect_url(conf) if target == "connect" else "",
            "CDC__SPARK__SETTINGS__SPARK.MASTER": spark_cluster.master_url(conf),
            "CDC__SPARK__SETTINGS__SPARK.PYSPARK.PYTHON": str(spark_cluster.python(cluster[1]))}


def _target(cluster, target: str, folder) -> dict:
    """tests/spark_target.py for target in a process of its own, on the test's cluster (its ports)."""
    env = {**_spark_env(cluster, target), "CDC__SPARK__LOCAL_METASTORE": "false"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("spark_target.py")), target, str(folder)],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TARGET ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("TARGET "):])


def test_the_connect_target_is_remote_with_delta_and_lib_shipped_to_the_server(cluster, tmp_path):
    facts = _target(cluster, "connect", tmp_path)
    assert facts["remote"] is True and facts["master"] == spark_cluster.master_url(cluster[0])
    assert "cdc_lib_" in facts["workers_lib"], facts
    assert facts["delta_rows"] == 1000
    assert_unreachable_named(facts["unreachable"])


def test_a_connect_target_with_no_server_names_the_address_and_the_remedy(tmp_path):
    script = ("import sys; from lib import spark as s\n"
              "try:\n    s.remote_session('sc://127.0.0.1:27999')\n"
              "except s.TargetError as e:\n    print('ERR', e); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "no Spark Connect server answers at sc://127.0.0.1:27999" in done.stdout
    assert "lib.local.stack cluster up" in done.stdout


@pytest.mark.parametrize(("lacks", "expected"), [
    ("delta", "runs without Delta's SQL extension"),
    ("kafka", "cannot read Kafka"),
])
def test_a_connect_server_without_delta_or_the_kafka_jar_is_named_with_the_remedy(cluster, lacks, expected, tmp_path):
    """A Connect server started as a user might start theirs, without Delta's extension, or with Delta but without
    Spark's Kafka jars: the session is refused with what is missing and how to start the server."""
    conf = cluster[0]
    jars = sorted(Path(config.location(str(config.get(conf, "spark.jars_dir")))).glob("*.jar"))
    settings = {"spark.master": "local[1]", "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": "27103", "spark.driver.memory": "512m", "spark.ui.enabled": "false",
                "spark.driver.extraJavaOptions": config.get(conf, "spark.driver_java_options")}  # conftest's: C1 only
    if lacks == "kafka":
        settings.update({"spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
                         "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
                         "spark.jars": ",".join(str(j) for j in jars if j.name.startswith("delta-"))})
    command = [str(spark_cluster.spark_home() / "bin" / "spark-submit"), "--class", spark_cluster.CONNECT_CLASS,
               *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")]]
    env = {**os.environ, "SPARK_HOME": str(spark_cluster.spark_home()), "SPARK_CONNECT_MODE": "0"}
    log, pid_file = tmp_path / "connect.log", tmp_path / "connect.pid"
    pid = process.start(command, log, pid_file, env=env, cwd=tmp_path)
    try:
        process.wait_ready("bad-connect", lambda: process.port_in_use("127.0.0.1", 27103), 120, log, pid, pid_file)
        script = ("import sys; from lib import spark as s\n"
                  "try:\n    s.remote_session('sc://127.0.0.1:27103')\n"
                  "except s.TargetError as e:\n    print('ERR', e); sys.exit(3)\n")
        clean = {k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=clean)
        assert done.returncode == 3, done.stderr[-3000:]
        assert f"the Spark Connect server at sc://127.0.0.1:27103 {expected}" in done.stdout, done.stdout
        assert "start it with" in done.stdout, done.stdout
    finally:
        process.stop_recorded("bad-connect", pid_file, spark_cluster.CONNECT_CLASS, timeout=30, log=lambda line: None)


def test_the_own_database_job_runs_through_connect_exact_with_no_planted_value(cluster, tmp_path, drop_slot):
    """All five notebooks as the bundle's job runs them, on a database that is not the sample (issue 15; on local Spark
    tests/test_own_database.py takes the same steps from lib)."""
    environ = {**_spark_env(cluster, "connect"), "CDC__SPARK__LOCAL_METASTORE": "false"}
    with shop_database.job(cluster[0], tmp_path, drop_slot, environ=environ) as shop:
        text = shop_database.executed(shop)
        assert f"(Spark Connect, master {spark_cluster.master_url(cluster[0])})" in text  # notebooks 02 and 04
        assert f"source == silver in all {len(shop_database.TABLES)} tables" in text  # notebook 04's reconcile
        assert "demo writes skipped" in text and "continuous=False" in text
        assert "bank.branches" not in shop["job"].stdout
        assert "the sample bank is not configured (source.tables): the exercises below are skipped" in text


@pytest.mark.parametrize("target", ["cluster", "connect"])
def test_the_pipeline_a_write_load_and_the_continuous_merge_end_exact_on_the_target(cluster, pipelines, target):
    facts = _finish_pipeline(pipelines[target])
    if LIB_STEPS[target]:
        assert "job" not in facts and facts["snapshot"] == "complete", facts
    else:
        assert facts["job"] == {name: True for name in ("01_bootstrap_slot", "02_snapshot", "03_stream_to_kafka",
                                                         "04_merge_into_delta", "05_masking_views")}, facts["job"]
    assert facts["remote"] is (target == "connect") and facts["master"] == spark_cluster.master_url(cluster[0])
    assert facts["load"]["transactions"] == 80 and facts["stream"] > 80, facts
    assert facts["merge"]["silver_tables"] >= 1, facts["merge"]
    assert len(facts["silver"]) == 7 and all(equal for equal, _ in facts["silver"].values()), facts["silver"]
    assert facts["fresh"] == {table: True for table in facts["silver"]}, facts["fresh"]
    letter = facts["dead_letter"]  # set aside while its schema id was unknown, replayed once it was registered
    assert letter["set_aside"] == ["unknown_schema_id"] and letter["registered_id"] == letter["late_id"], letter
    assert (letter["replay"]["replayed"], letter["replay"]["still_dead"], letter["left"]) == (1, 0, 0), letter
    service = facts["service"]  # the continuous merge service, while a second load arrives and a table is added
    assert "error" not in service and service["load"]["transactions"] == 80, service
    assert service["totals"]["batches"] >= 1 and service["added"] == "ready", service
    assert service["stopped"] == [True, True], service  # each stop of the service ended its thread within 180 s
    assert facts["after_service"] == {table: True for table in [*facts["silver"], "bank.statements"]}, \
        facts["after_service"]
    name = facts["one_run"]["name"]
    assert facts["one_run"] == {"first_active": False, "second_active": True, "name": name, "active": [name],
                                "after_stop": []}, facts["one_run"]  # one run per checkpoint, stopped by name
    expected, *differences = facts["drift"]  # reconcile reads the source on the executors, names the changed column
    assert differences == [{"branch_code": expected["expected"], "kind": "different", "columns": ["city"]}]


def test_the_cluster_target_runs_on_the_master_with_lib_shipped_to_its_executors(cluster, tmp_path):
    facts = _target(cluster, "cluster", tmp_path)
    assert facts["remote"] is False and facts["master"] == spark_cluster.master_url(cluster[0])
    assert facts["executors"] >= 1
    version, where = facts["workers_lib"].split(" ", 1)
    assert version == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert "cdc_lib_" in where and not where.startswith(str(config.PROJECT_ROOT / "lib")), where  # the shipped zip
    assert facts["delta_rows"] == 1000
    assert_unreachable_named(facts["unreachable"])


# A stand-in for workers on another Python: the same interpreter telling PySpark's worker it is 3.10 (this machine has
# one Python; what is checked is Spark's own version handshake and the error the project turns it into).
_OTHER_PYTHON = """
import runpy
import sys

class Version(tuple):
    major, minor, micro = (property(lambda self, i=i: self[i]) for i in range(3))


sys.version_info = Version((3, 10, 0, "final", 0))
module, sys.argv = sys.argv[2], [sys.argv[0], *sys.argv[3:]]  # called as: <this> -m pyspark.daemon
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def test_workers_on_another_python_are_refused_naming_both_versions_and_the_setting(cluster, tmp_path):
    other = tmp_path / "python3.10"
    other.write_text(f"#!{spark_cluster.python(cluster[1])}\n{_OTHER_PYTHON}")
    other.chmod(0o755)
    env = {**_spark_env(cluster, "cluster"), "CDC__SPARK__LOCAL_METASTORE": "false",
           "CDC__SPARK__SETTINGS__SPARK.PYSPARK.PYTHON": str(other)}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("spark_target.py")), "cluster", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    wanted = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert done.returncode != 0 and not done.stdout.strip(), done.stdout
    assert (f"the Spark workers run another Python (3.10) than this process's {wanted}: give them Python {wanted} "
            f"(spark.pyspark.python, or the Connect server's PYSPARK_PYTHON)") in done.stderr, done.stderr[-3000:]


def assert_unreachable_named(message: str) -> None:
    """An address the executors cannot reach is named with its setting, the worker's host and the remedy."""
    assert message.startswith("Spark's workers cannot reach what their tasks read or write: kafka.bootstrap_servers "
                              "127.0.0.1:9 from "), message
    assert "Connection refused" in message and "Give the executors a route" in message, message


def test_up_after_a_kill_9_of_a_worker_starts_that_worker_alone(cluster):
    conf, folder, _ = cluster
    pid_file = spark_cluster.files(folder, "worker-2")["pid"]
    pid = process.read_pid(pid_file)
    os.kill(pid, signal.SIGKILL)  # the pid file stays behind, as after a crash or a machine restart
    rows = lambda: {row["service"]: row["state"] for row in spark_cluster.status(conf, folder)}  # noqa: E731
    deadline = time.monotonic() + 30
    while rows()["spark-worker-2"] != "stale pid file":
        assert time.monotonic() < deadline, rows()
        time.sleep(0.2)
    lines: list[str] = []
    spark_cluster.start(conf, folder, log=lines.append)  # at once: the killed JVM may still hold its ports
    said = "\n".join(lines)
    assert f"cleared a stale pid file {pid_file} (pid {pid} no longer runs spark-worker-2" in said, said
    assert sum("already running" in line for line in lines) == 3, said  # the master, worker 1, Connect: left alone
    deadline = time.monotonic() + 90
    while sum(w["state"] == "ALIVE" for w in spark_cluster.master_state(conf)["workers"]) < 2:
        assert time.monotonic() < deadline, spark_cluster.master_state(conf)["workers"]
        time.sleep(1)
    assert set(rows().values()) == {"running"}, rows()


def test_down_stops_every_process_and_frees_the_ports(cluster):
    conf, folder, lines = cluster
    spark_cluster.stop(conf, folder, log=lines.append)
    assert [row["state"] for row in spark_cluster.status(conf, folder)] == ["stopped"] * 4
    assert not any(process.port_in_use("127.0.0.1", port) for port in (27177, 27180, 27102))
