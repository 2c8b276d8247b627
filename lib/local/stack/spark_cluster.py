"""A Spark cluster on this machine, off unless asked: a standalone master, its workers and a Spark Connect server.

`python -m lib.local.stack cluster up` starts them as local processes like the stack's other services, from pip's
pyspark (SPARK_HOME is its package folder: ``bin/spark-class`` runs the master and the workers, ``bin/spark-submit``
the Connect server); `cluster down` stops them, `status` shows them. Conf ``stack.cluster``: ``master_port``,
``master_webui_port``, ``workers``, ``worker_cores``, ``worker_memory``, ``worker_webui_port`` (the first
worker's; the next ones count up), ``connect_port``, ``daemon_memory``.

The workers' executors and the Connect server's Python workers (UDFs, ``foreachBatch``) run an interpreter of
their own, ``<dir>/cluster/python-env``: this Python and the project's pinned packages, but not the project itself (the
editable install in .venv is not on its path). Code of lib/ reaches them only as the session ships it, as on a
cluster of other hosts, so an assumption that only holds on one machine fails here first.

The Connect server runs on the master with the stack's jars (Delta, Kafka, Avro, PostgreSQL JDBC) and Delta's SQL
extension and catalog: Delta works through SQL over Connect (no Delta Connect plugin resolves from Maven Central).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pyspark

from lib import config
from lib import spark as spark_lib
from lib.local.stack import process
from lib.local.stack.process import StackError

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
CONNECT_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def spark_home() -> Path:
    """pip's pyspark package folder: its bin/ and jars/ are a Spark distribution."""
    return Path(pyspark.__file__).parent


def files(stack_dir: Path, name: str) -> dict[str, Path]:
    """Log, pid file and work folder of one of the cluster's processes (master, worker-1, ..., connect)."""
    return {"log": stack_dir / "logs" / f"spark-{name}.log", "pid": stack_dir / "run" / f"spark-{name}.pid",
            "dir": stack_dir / "cluster" / name}


def master_url(conf: dict) -> str:
    """spark://host:port of the standalone master."""
    return f"spark://127.0.0.1:{int(config.get(conf, 'stack.cluster.master_port'))}"


def connect_url(conf: dict) -> str:
    """sc://host:port of the Connect server."""
    return f"sc://127.0.0.1:{int(config.get(conf, 'stack.cluster.connect_port'))}"


def python(stack_dir: Path) -> Path:
    """The interpreter executors and the Connect server's Python workers run (made on first use): a virtual
    environment of this Python whose one .pth line adds .venv's packages but none of .venv's own .pth files, so
    the project's editable install is not on its path."""
    env = stack_dir / "cluster" / "python-env"
    interpreter = env / "bin" / "python"
    if not interpreter.exists():
        import venv

        venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (env / "lib" / version / "site-packages" / "cdc_stack_packages.pth").write_text(
            sysconfig.get_paths()["purelib"] + "\n")
    return interpreter


def _environment(conf: dict, stack_dir: Path) -> dict[str, str]:
    interpreter = str(python(stack_dir))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_", "PYTHON"))}
    return {**env, "SPARK_HOME": str(spark_home()), "SPARK_LOG_DIR": str(stack_dir / "logs"),
            "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": str(config.get(conf, "stack.cluster.daemon_memory")),
            "PYSPARK_PYTHON": interpreter, "PYSPARK_DRIVER_PYTHON": interpreter, "SPARK_CONNECT_MODE": "0"}


def master_state(conf: dict) -> dict:
    """The master's own report (its web UI's /json/): status, workers with their state and cores."""
    port = int(config.get(conf, "stack.cluster.master_webui_port"))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=2) as response:
        return json.load(response)


def alive_workers(conf: dict) -> int:
    """How many workers the master counts alive."""
    return sum(1 for w in master_state(conf).get("workers", []) if w.get("state") == "ALIVE")


def start(conf: dict, stack_dir: Path, log=print) -> None:
    """Start the master, its workers and the Connect server (each unless it runs), and wait until they answer."""
    env, home = _environment(conf, stack_dir), spark_home()
    timeout = float(config.get(conf, "stack.start_timeout_s"))
    port, webui = int(config.get(conf, "stack.cluster.master_port")), int(config.get(conf,
                                                                                   "stack.cluster.master_webui_port"))
    where = files(stack_dir, "master")
    if process.claim("spark-master", where["pid"], MASTER_CLASS, [
            ("127.0.0.1", port, "stack.cluster.master_port"), ("127.0.0.1", webui, "stack.cluster.master_webui_port")],
            log):
        where["dir"].mkdir(parents=True, exist_ok=True)
        pid = process.start([str(home / "bin" / "spark-class"), MASTER_CLASS, "--host", "127.0.0.1", "--port",
                             str(port), "--webui-port", str(webui)], where["log"], where["pid"], env=env,
                            cwd=where["dir"])
        process.wait_ready("spark-master", lambda: master_state(conf).get("status") == "ALIVE", timeout,
                           where["log"], pid, where["pid"])
        log(f"spark-master started on port {port} (pid {pid})")
    workers = int(config.get(conf, "stack.cluster.workers"))
    first_webui = int(config.get(conf, "stack.cluster.worker_webui_port"))
    for n in range(1, workers + 1):
        where = files(stack_dir, f"worker-{n}")
        if not process.claim(f"spark-worker-{n}", where["pid"], WORKER_CLASS,
                             [("127.0.0.1", first_webui + n - 1, "stack.cluster.worker_webui_port")], log):
            continue
        where["dir"].mkdir(parents=True, exist_ok=True)
        process.start([str(home / "bin" / "spark-class"), WORKER_CLASS, "--host", "127.0.0.1", "--cores",
                       str(config.get(conf, "stack.cluster.worker_cores")), "--memory",
                       str(config.get(conf, "stack.cluster.worker_memory")), "--work-dir", str(where["dir"]),
                       "--webui-port", str(first_webui + n - 1), master_url(conf)], where["log"], where["pid"],
                      env=env, cwd=where["dir"])
    process.wait_ready("spark-workers", lambda: alive_workers(conf) >= workers, timeout,
                       files(stack_dir, "worker-1")["log"])
    # the launcher gives the Connect server, as a daemon, SPARK_DAEMON_MEMORY: its driver memory instead
    connect_env = {k: v for k, v in env.items() if k != "SPARK_DAEMON_MEMORY"}
    _start_connect(conf, stack_dir, connect_env, timeout, log)


def _start_connect(conf: dict, stack_dir: Path, env: dict, timeout: float, log) -> None:
    port = int(config.get(conf, "stack.cluster.connect_port"))
    where = files(stack_dir, "connect")
    if not process.claim("spark-connect", where["pid"], CONNECT_CLASS,
                         [("127.0.0.1", port, "stack.cluster.connect_port")], log):
        return
    jars_dir = config.location(str(config.get(conf, "spark.jars_dir")))
    jars = sorted(str(p) for p in Path(jars_dir).glob("*.jar"))
    if not jars:
        raise StackError(f"spark-connect: no jars in {jars_dir} (spark.jars_dir); run `make install` first")
    interpreter = env["PYSPARK_PYTHON"]
    settings = {
        "spark.master": master_url(conf), "spark.app.name": "cdc-connect-server",
        "spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": str(port),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.driver.memory": "1g", "spark.executor.memory": "1g", "spark.ui.enabled": "false",
        "spark.cores.max": "1",  # one worker's core: the other is left for a driver of conf/cluster.yml
        "spark.pyspark.python": interpreter, "spark.pyspark.driver.python": interpreter,
        "spark.sql.shuffle.partitions": "4", "spark.jars": ",".join(jars),
    }
    # the server is a local driver: it starts from the class-data archive and takes the Java options a local driver and
    # a cluster's executors get (spark.driver_java_options, spark.executor_java_options; the tests ask for C1 only)
    settings = spark_lib.with_java_options(settings, config.get(conf, "spark.class_archive_dir"),
                                           config.get(conf, "spark.driver_java_options"))
    settings = spark_lib.with_executor_options(settings, config.get(conf, "spark.executor_java_options"))
    where["dir"].mkdir(parents=True, exist_ok=True)
    command = [str(spark_home() / "bin" / "spark-submit"), "--class", CONNECT_CLASS,
               *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")]]
    pid = process.start(command, where["log"], where["pid"], env=env, cwd=where["dir"])
    process.wait_ready("spark-connect", lambda: process.port_in_use("127.0.0.1", port), timeout, where["log"], pid,
                       where["pid"])
    log(f"spark-connect started on port {port} (pid {pid}): {connect_url(conf)}")


def stop(conf: dict, stack_dir: Path, log=print) -> None:
    """Stop the Connect server, the workers and the master; stale pid files are removed."""
    process.stop_recorded("spark-connect", files(stack_dir, "connect")["pid"], CONNECT_CLASS, timeout=30, log=log)
    for n in range(1, int(config.get(conf, "stack.cluster.workers")) + 1):
        process.stop_recorded(f"spark-worker-{n}", files(stack_dir, f"worker-{n}")["pid"], WORKER_CLASS, timeout=30,
                              log=log)
    process.stop_recorded("spark-master", files(stack_dir, "master")["pid"], MASTER_CLASS, timeout=30, log=log)


def status(conf: dict, stack_dir: Path) -> list[dict]:
    """One row per cluster process, for `stack status`."""
    rows = []
    first_webui = int(config.get(conf, "stack.cluster.worker_webui_port"))
    names = [("master", MASTER_CLASS, int(config.get(conf, "stack.cluster.master_port")))] + [
        (f"worker-{n}", WORKER_CLASS, first_webui + n - 1)
        for n in range(1, int(config.get(conf, "stack.cluster.workers")) + 1)] + [
        ("connect", CONNECT_CLASS, int(config.get(conf, "stack.cluster.connect_port")))]
    for name, marker, port in names:
        where = files(stack_dir, name)
        pid, state = process.recorded_state(f"spark-{name}", where["pid"], marker)
        rows.append({"service": f"spark-{name}", "state": state, "pid": pid, "port": port,
                     "version": f"spark {pyspark.__version__}", "log": where["log"]})
    return rows
