"""SparkSession for the pipeline: Databricks' own session, or a local one with Delta, Kafka and Avro.

Locally the catalog is Spark's Hive catalog over an embedded Derby metastore (conf/local.yml), so the
analyst views of notebook 05 outlive the session. Embedded Derby admits one JVM at a time: the
merge works on Delta paths and asks for ``catalog="in-memory"``, tests point at a metastore of their
own (``with_metastore``), and ``require_catalog`` names the remedy when another driver holds it.
"""
import copy
import fcntl
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading

from pyspark.sql import SparkSession

from lib import config

CATALOG_KEY = "spark.sql.catalogImplementation"
METASTORE_URL_KEY = "spark.hadoop.javax.jdo.option.ConnectionURL"
JAVA_OPTIONS_KEY = "spark.driver.extraJavaOptions"
EXECUTOR_OPTIONS_KEY = "spark.executor.extraJavaOptions"
DERBY_HOME_RE = re.compile(r"-Dderby\.system\.home=(\S+)")


DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
# settings every session gets, a remote one too (they can be set at run time)
SESSION_DEFAULTS = {
    "spark.sql.shuffle.partitions": "4",
    "spark.databricks.delta.snapshotPartitions": "4",
    # Spark 4.1.1 fails (NullPointerException in SparkShreddingUtils.assembleVariantStructBatch) reading a
    # cast of a VARIANT column pushed into the Parquet scan when a file holds rows of several bronze tables
    # (a micro-batch's file, or any file after OPTIMIZE) and one declares a non-nullable field another lacks
    # (tests/test_bronze_log.py); reading the variant whole and casting it after works
    "spark.sql.variant.pushVariantIntoScan": "false",
}


class CatalogError(RuntimeError):
    """The session's catalog (metastore) cannot be opened."""


class TargetError(RuntimeError):
    """The Spark a target's conf asks for (a cluster, a Connect server) is not what this process got."""


def local_jars(jars_dir: str) -> list[str]:
    """Sorted jar paths in jars_dir (filled from lib/local/stack/poms/spark.xml, which leaves out pyspark's jars)."""
    return sorted(glob.glob(os.path.join(jars_dir, "*.jar")))


def session(app_name: str, jars_dir: str | None = None, settings: dict[str, str] | None = None) -> SparkSession:
    """Databricks' session unchanged, else a local[*] session with Delta, Kafka and Avro jars from jars_dir."""
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    interpreter = (settings or {}).get("spark.pyspark.python")
    if interpreter:  # a session started from Python takes its workers' Python from the environment only (spark-submit
        os.environ["PYSPARK_PYTHON"] = interpreter  # maps the setting there): without this the setting did nothing
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers (the snapshot's COPY reader) need this venv
    jars = local_jars(jars_dir) if jars_dir else []
    if not jars:
        raise RuntimeError(f"no Spark jars in {jars_dir or '(no jars_dir given)'}: run `make install` to fetch them")
    conf = {
        "spark.master": "local[*]",
        "spark.app.name": app_name,
        "spark.jars": ",".join(jars),
        "spark.sql.extensions": DELTA_EXTENSION,
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.ui.enabled": "false",
        # what a driver remembers of its finished queries, for a UI that is off: Spark keeps 1,000 SQL executions
        # with their plan texts (a bronze batch's plan holds every table's writer schemas), 1,000 jobs and stages;
        # a merge service held 1,052 executions and a full old generation after 12 minutes (docs/benchmarks.md,
        # "The lake after an hour")
        "spark.sql.ui.retainedExecutions": "50",
        "spark.ui.retainedJobs": "100",
        "spark.ui.retainedStages": "100",
        "spark.ui.retainedTasks": "10000",
        **SESSION_DEFAULTS,
        **(settings or {}),
    }
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    reap_driver_on_exit()
    return spark


def reap_driver_on_exit() -> None:
    """Wait for the local driver JVM in a daemon thread, so that it is reaped the moment it exits.

    A notebook kernel asked to shut down terminates its children and waits until none is left; an exited JVM
    that nobody waited for stays a zombie child, so the kernel waited 2.5 s and was killed by its manager
    (`make demo` logged "KeyboardInterrupt caught in kernel" and "Process ... exited with code 143").
    """
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is None or getattr(proc, "_cdc_reaper", False):
        return
    proc._cdc_reaper = True
    threading.Thread(target=proc.wait, name="cdc-spark-driver-reaper", daemon=True).start()


def log4j2_properties(root_level: str, loggers: dict[str, str],
                      pattern: str = "%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex", target: str = "SYSTEM_ERR") -> str:
    """A log4j2.properties that prints to the console at root_level, with {logger name: level} overrides."""
    lines = ["status = warn", "appender.console.type = Console", "appender.console.name = console",
             f"appender.console.target = {target}", "appender.console.layout.type = PatternLayout",
             f"appender.console.layout.pattern = {pattern}", f"rootLogger.level = {root_level}",
             "rootLogger.appenderRef.console.ref = console"]
    for i, (name, level) in enumerate(loggers.items()):
        lines += [f"logger.l{i}.name = {name}", f"logger.l{i}.level = {level}"]
    return "\n".join(lines) + "\n"


def with_log_levels(settings: dict[str, str], levels: dict[str, str]) -> dict[str, str]:
    """settings whose driver Java options load a log4j2 file with spark.log_levels (WARN otherwise).

    The one place the local driver's log levels are set: loggers that only report what a user
    cannot act on (Hive's metastore bookkeeping, the hostname, native Hadoop) stay quiet in jobs.
    """
    if not levels:
        return settings
    text = log4j2_properties("WARN", {str(k): str(v) for k, v in levels.items()})
    path = os.path.join(tempfile.gettempdir(), f"cdc-spark-log4j2-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
                                               f".properties")
    if not os.path.exists(path):
        with open(path + ".part", "w") as handle:
            handle.write(text)
        os.replace(path + ".part", path)
    options = f"{settings.get(JAVA_OPTIONS_KEY, '')} -Dlog4j2.configurationFile=file:{path}".strip()
    return {**settings, JAVA_OPTIONS_KEY: options}


def derby_path(url: str) -> str | None:
    """The database folder of an embedded Derby JDBC URL (jdbc:derby:;databaseName=X;... or jdbc:derby:X;...)."""
    if not url.startswith("jdbc:derby:") or url.startswith("jdbc:derby://"):
        return None
    parts = url[len("jdbc:derby:"):].split(";")
    named = [part.split("=", 1)[1] for part in parts[1:] if part.startswith("databaseName=")]
    path = named[0] if named else parts[0]
    return path if path and not path.startswith(("memory:", "classpath:", "jar:")) else None


def resolve_locations(settings: dict) -> dict[str, str]:
    """Settings as strings, with the relative local paths in them made absolute (under the project root):
    spark.sql.warehouse.dir, spark.pyspark.python, the Derby metastore folder in the ConnectionURL and
    -Dderby.system.home."""
    out = {key: str(value) for key, value in settings.items()}
    if "spark.sql.warehouse.dir" in out:
        out["spark.sql.warehouse.dir"] = config.location(out["spark.sql.warehouse.dir"])
    path = derby_path(out.get(METASTORE_URL_KEY, ""))
    if path:
        out[METASTORE_URL_KEY] = out[METASTORE_URL_KEY].replace(path, config.location(path), 1)
    if "spark.pyspark.python" in out:
        out["spark.pyspark.python"] = config.location(out["spark.pyspark.python"])
    if JAVA_OPTIONS_KEY in out:
        out[JAVA_OPTIONS_KEY] = DERBY_HOME_RE.sub(lambda m: "-Dderby.system.home=" + config.location(m.group(1)),
                                                  out[JAVA_OPTIONS_KEY])
    return out


def with_metastore(conf: dict, folder: str, warehouse: str | None = None) -> dict:
    """A copy of conf whose local session keeps its Hive metastore and derby.log in folder and its
    warehouse in warehouse (default folder/warehouse): embedded Derby admits one Spark driver at a time."""
    out = copy.deepcopy(conf)
    spark_conf = out.setdefault("spark", {})
    settings = spark_conf["settings"] = dict(spark_conf.get("settings") or {})
    folder = config.location(folder)
    options = DERBY_HOME_RE.sub("", str(settings.get(JAVA_OPTIONS_KEY, ""))).strip()
    settings.update({
        CATALOG_KEY: "hive",
        "spark.sql.warehouse.dir": config.location(warehouse) if warehouse else os.path.join(folder, "warehouse"),
        METASTORE_URL_KEY: f"jdbc:derby:;databaseName={os.path.join(folder, 'metastore_db')};create=true",
        JAVA_OPTIONS_KEY: f"{options} -Dderby.system.home={folder}".strip(),
    })
    return out


def with_lake_metastore(conf: dict) -> dict:
    """conf with `spark.local_metastore: true` made concrete: the Hive metastore in <lake.root>/_metastore and
    the warehouse in <lake.root>/warehouse, so each target keeps its views apart. Settings that name a
    metastore or warehouse themselves win."""
    settings = config.get(conf, "spark.settings") or {}
    if not config.get(conf, "spark.local_metastore") or METASTORE_URL_KEY in settings:
        return conf
    root = config.location(config.get(conf, "lake.root")).rstrip("/")
    if config.is_remote(root):
        raise config.ConfigError(
            f"spark.local_metastore keeps an embedded Derby metastore under lake.root, which must then be a local "
            f"folder, not {root}; in {conf.get('conf_file', 'conf')} set spark.local_metastore: false and point "
            f"spark.settings at your metastore ({METASTORE_URL_KEY}, spark.sql.warehouse.dir)")
    warehouse = settings.get("spark.sql.warehouse.dir") or f"{root}/warehouse"
    return with_metastore(conf, f"{root}/_metastore", warehouse)


def java_binary() -> str | None:
    """The java spark-submit starts: $JAVA_HOME/bin/java, else the one on PATH (resolved), or None."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def class_archive(folder: str) -> str:
    """Path of the class-data archive for this Java and pyspark (a new one for another Java or Spark)."""
    import pyspark

    key = f"{java_binary()}|{pyspark.__version__}|{os.path.dirname(pyspark.__file__)}"
    return os.path.join(folder, f"spark-{pyspark.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsa")


def with_java_options(settings: dict[str, str], archive_dir: str | None, extra: str) -> dict[str, str]:
    """settings whose driver starts from the class-data archive when one was made (make install does), plus extra.

    The archive (Java's dynamic CDS, -XX:SharedArchiveFile) holds Spark's classes already parsed and
    verified: a local driver starts with about a third less CPU. Without it the driver starts as usual.
    """
    archive = class_archive(config.location(archive_dir)) if archive_dir else None
    shared = f"-XX:SharedArchiveFile={archive} -Xshare:auto" if archive and os.path.isfile(archive) else ""
    return _appended(settings, JAVA_OPTIONS_KEY, shared, extra)


def with_executor_options(settings: dict[str, str], extra: str) -> dict[str, str]:
    """settings whose executors (a standalone cluster's; local mode has none apart) also get the Java options extra."""
    return _appended(settings, EXECUTOR_OPTIONS_KEY, extra)


def _appended(settings: dict[str, str], key: str, *options: str) -> dict[str, str]:
    """settings with options appended to the Java options at key (left out when all are empty)."""
    joined = " ".join(o for o in (str(settings.get(key, "")).strip(), *(str(o or "").strip() for o in options)) if o)
    return {**settings, key: joined} if joined else settings


def from_conf(conf: dict, catalog: str | None = None) -> SparkSession:
    """The session a target's conf describes (spark.app_name, spark.jars_dir, spark.settings).

    catalog="in-memory" leaves the persistent metastore alone (for processes that only use Delta
    paths, such as the merge); one session per process, so the first call decides.
    """
    remote = config.get(conf, "spark.remote")
    if remote and not os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        spark = remote_session(remote, dict(config.get(conf, "spark.settings") or {}))
        check_reach(spark, task_endpoints(conf))
        return spark
    settings = resolve_locations(dict(config.get(with_lake_metastore(conf), "spark.settings") or {}))
    if catalog is not None:
        if catalog not in ("hive", "in-memory"):
            raise ValueError(f"catalog must be 'hive' or 'in-memory', not {catalog!r}")
        settings[CATALOG_KEY] = catalog
    home = DERBY_HOME_RE.search(settings.get(JAVA_OPTIONS_KEY, ""))
    if home and not os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        os.makedirs(home.group(1), exist_ok=True)  # derby.log goes there
    if not os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        settings = with_log_levels(settings, config.get(conf, "spark.log_levels"))
        settings = with_java_options(settings, config.get(conf, "spark.class_archive_dir"),
                                     config.get(conf, "spark.driver_java_options"))
    master = settings.get("spark.master", "")
    standalone = master.startswith("spark://") and not os.environ.get("DATABRICKS_RUNTIME_VERSION")
    if standalone:
        settings = with_executor_options(settings, config.get(conf, "spark.executor_java_options"))
    jars_dir = config.get(conf, "spark.jars_dir")
    spark = session(config.get(conf, "spark.app_name"), config.location(jars_dir) if jars_dir else None, settings)
    if standalone:
        require_master(spark, master)
        ship_project(spark)
        check_reach(spark, task_endpoints(conf))
    return spark


def task_endpoints(conf: dict) -> dict[str, list[str]]:
    """The host:port addresses Spark's tasks connect to, by the setting that names them: Kafka's brokers, PostgreSQL."""
    brokers = [b.strip() for b in str(config.get(conf, "kafka.bootstrap_servers") or "").split(",") if b.strip()]
    return {"kafka.bootstrap_servers": brokers,
            "source.host/source.port": [f"{config.get(conf, 'source.host')}:{config.get(conf, 'source.port')}"]}


def check_reach(spark, endpoints: dict[str, list[str]], timeout_s: float = 5.0) -> None:
    """Fail, naming the worker's host, the address and its setting, when Spark's workers cannot open a TCP connection
    to an address their tasks use; the driver reaching it proves nothing for executors on other hosts."""
    from pyspark.sql import functions as F

    def attempt(_):
        import socket as worker_socket

        failed = []
        for setting, addresses in endpoints.items():
            for address in addresses:
                host, _, port = address.rpartition(":")
                try:
                    worker_socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
                except (OSError, ValueError) as exc:
                    failed.append(f"{setting} {address} from {worker_socket.gethostname()}: "
                                  f"{getattr(exc, 'strerror', None) or exc}")
        return "; ".join(failed)

    tasks = cores(spark) or 2
    found = {row[0] for row in spark.range(0, tasks, 1, tasks).select(F.udf(attempt, "string")("id")).collect()
             if row[0]}
    if found:
        raise TargetError(f"Spark's workers cannot reach what their tasks read or write: {'; '.join(sorted(found))}. "
                          f"Give the executors a route to these addresses (firewall rules, security groups); Kafka's "
                          f"advertised listeners must be addresses the executors resolve and reach")


def is_remote(spark) -> bool:
    """Whether spark is a Spark Connect session (no SparkContext, no JVM in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def runs_on(spark) -> str:
    """Where a session's queries run, in words: 'local[2]', 'spark://host:port' or 'Spark Connect, master ...'."""
    try:
        master = spark.conf.get("spark.master")
    except Exception:  # noqa: BLE001 - a server may refuse to show it (Databricks serverless)
        master = "not shown by the server"
    return f"Spark Connect, master {master}" if is_remote(spark) else master


def remote_session(url: str, settings: dict | None = None):
    """A Spark Connect session at url (spark.remote), checked: Delta's SQL, the Kafka source, lib/ shipped, and
    the server's Python the same major.minor as this one. Settings the server lets a session change are set."""
    _require_listening(url)
    try:
        spark = SparkSession.builder.remote(url).getOrCreate()
    except Exception as exc:  # noqa: BLE001 - named with the remedy
        if "SESSION_ALREADY_EXIST" not in str(exc):
            raise
        raise TargetError(f"conf asks for a Spark Connect session at {url} (spark.remote), but this process already "
                          f"runs a local Spark session; start the remote one in a new process (restart the "
                          f"notebook's kernel)") from exc
    if not is_remote(spark):
        raise TargetError(f"conf asks for a Spark Connect session at {url} (spark.remote), but the session builder "
                          f"handed back a local session; restart the notebook's kernel")
    extensions = spark.conf.get("spark.sql.extensions", "") or ""
    if DELTA_EXTENSION not in extensions:
        raise TargetError(f"the Spark Connect server at {url} runs without Delta's SQL extension "
                          f"(spark.sql.extensions is {extensions!r}): start it with --conf spark.sql.extensions="
                          f"{DELTA_EXTENSION} --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta."
                          f"catalog.DeltaCatalog and the delta-spark jar")
    for key, value in {**SESSION_DEFAULTS, **(settings or {})}.items():
        if spark.conf.isModifiable(key):
            spark.conf.set(key, str(value))
    try:
        columns = spark.read.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9") \
            .option("subscribe", "x").load().columns  # analysed on the server, no connection to Kafka
    except Exception as exc:  # noqa: BLE001 - named with the remedy
        raise TargetError(f"the Spark Connect server at {url} cannot read Kafka ({error_line(exc)}): start "
                          f"it with the spark-sql-kafka, spark-avro and PostgreSQL JDBC jars (--jars or --packages; "
                          f"lib/local/stack/poms/spark.xml lists them)") from exc
    if "value" not in columns:
        raise TargetError(f"the Spark Connect server at {url} reads Kafka with columns {columns}, not Spark's Kafka "
                          f"source's: start it with spark-sql-kafka of its Spark version")
    ship_project(spark)
    return spark


def _require_listening(url: str, timeout_s: float = 10.0) -> None:
    """Fail at once, naming url and the remedy, when nothing listens at a Connect URL's host and port (the client
    itself retries for minutes)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url.replace("sc://", "http://", 1))
    host, port = parsed.hostname or "localhost", parsed.port or 15002
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise TargetError(f"no Spark Connect server answers at {url} (spark.remote; {exc.strerror or exc}): start it "
                          f"(locally: `.venv/bin/python -m lib.local.stack cluster up`) or point spark.remote at "
                          f"yours") from exc


def require_master(spark: SparkSession, master: str, timeout_s: float = 60.0) -> None:
    """Fail unless spark runs on master with at least one executor registered (getOrCreate may hand back an
    existing local session without a word)."""
    import time

    got = spark.sparkContext.master
    if got != master:
        raise TargetError(f"conf asks for spark.master {master}, but this process already runs a session on {got}; "
                          f"start a new process (restart the notebook's kernel)")
    deadline = time.monotonic() + timeout_s
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 2:  # the driver counts as one
        if time.monotonic() > deadline:
            raise TargetError(f"no executor registered with the driver on {master} within {timeout_s:.0f} s: are the "
                              f"workers up (`.venv/bin/python -m lib.local.stack cluster up`, or the cluster's UI) "
                              f"with free cores and memory for spark.executor.cores and spark.executor.memory?")
        time.sleep(0.5)


def project_archive() -> str:
    """A zip of the lib package (named by its content's hash), as executors and a Connect server import it."""
    import zipfile

    root = config.PROJECT_ROOT
    sources = sorted(p for p in (root / "lib").rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in sources:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    target = os.path.join(tempfile.gettempdir(), f"cdc-lib-{os.getuid()}", f"cdc_lib_{digest.hexdigest()[:16]}.zip")
    if not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.{os.getpid()}"
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sources:
                archive.write(path, str(path.relative_to(root)))
        os.replace(partial, target)
    return target


def ship_project(spark) -> str:
    """Send lib/ to where this session's Python code runs away from this process (executors, a Connect server's
    Python workers: UDFs, foreachBatch), then check there that it imports and that Python is this one's
    major.minor. Returns where the workers imported lib from, and their Python's major.minor."""
    from pyspark.errors import PythonException
    from pyspark.sql import functions as F

    archive = project_archive()
    shipped = getattr(spark, "_cdc_shipped", None)
    if shipped and shipped[0] == archive:
        return shipped[1]
    if is_remote(spark):
        spark.addArtifacts(archive, pyfile=True)
    else:
        spark.sparkContext.addPyFile(archive)

    def where_lib(_):
        import sys as worker_sys

        import lib as worker_lib

        return f"{worker_sys.version_info[0]}.{worker_sys.version_info[1]} {worker_lib.__file__}"

    wanted = f"{sys.version_info[0]}.{sys.version_info[1]}"
    try:
        found = spark.range(1).select(F.udf(where_lib, "string")("id")).collect()[0][0]
    except Exception as exc:  # noqa: BLE001 - a version mismatch is refused before the function runs
        theirs = re.search(r"worker has different version:? (\d+\.\d+)", str(exc))  # PySpark's message names it
        if theirs or "PYTHON_VERSION_MISMATCH" in str(exc):
            raise TargetError(f"the Spark workers run another Python{f' ({theirs.group(1)})' if theirs else ''} "
                              f"than this process's {wanted}: give them Python {wanted} (spark.pyspark.python, or "
                              f"the Connect server's PYSPARK_PYTHON)") from exc
        if isinstance(exc, PythonException):
            raise TargetError(f"lib/ does not import in the Spark workers' Python after it was shipped "
                              f"({str(exc).strip().splitlines()[-1]}): their interpreter (spark.pyspark.python, or "
                              f"the server's PYSPARK_PYTHON) needs the packages of requirements.txt") from exc
        raise
    version = found.split(" ", 1)[0]
    if version != wanted:
        raise TargetError(f"the Spark workers run Python {version}, this process {wanted}: give them Python {wanted}")
    spark._cdc_shipped = (archive, found)
    return found


def carrying(function):
    """``function`` wrapped to run in a Python process that cannot import lib/ (a Spark Connect server's
    foreachBatch worker): the wrapper carries the project's zip and is pickled without lib (lib/carried_call.py)."""
    import pickle

    from pyspark import cloudpickle

    from lib import carried_call

    cloudpickle.register_pickle_by_value(carried_call)
    archive = project_archive()
    with open(archive, "rb") as source:
        return carried_call.carrying(source.read(), os.path.basename(archive), pickle.dumps(function))


def cores(spark: SparkSession) -> int | None:
    """Spark's default parallelism (the cores it runs tasks on); over Spark Connect, which hides it, the session's
    spark.sql.shuffle.partitions when it is a number; else None."""
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        pass
    try:
        return max(1, int(spark.conf.get("spark.sql.shuffle.partitions")))
    except Exception:  # noqa: BLE001 - "auto" (Databricks) or unreadable
        return None


def derby_in_use(path: str) -> bool:
    """True when another process holds the exclusive lock of an embedded Derby database folder."""
    lock = os.path.join(path, "dbex.lck")
    if not os.path.exists(lock):
        return False
    with open(lock, "a+b") as handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.lockf(handle, fcntl.LOCK_UN)
    return False


def require_catalog(spark: SparkSession) -> dict:
    """Open the session's catalog now; returns its kind, metastore and warehouse. A local metastore that
    another Spark driver holds raises CatalogError with the remedy."""
    kind = spark.conf.get(CATALOG_KEY, "in-memory")
    url = spark.conf.get(METASTORE_URL_KEY, None) if kind == "hive" else None
    info = {"catalog": kind, "metastore": derby_path(url or "") or ("external" if url else None),  # no credentials
            "warehouse": spark.conf.get("spark.sql.warehouse.dir", None)}
    try:
        spark.sql("SHOW DATABASES").collect()
    except Exception as exc:
        path = derby_path(url or "")
        if kind != "hive" or not path:
            raise
        cause = "another process holds it" if derby_in_use(path) else "the Spark log above has the cause"
        raise CatalogError(
            f"the local Hive metastore {path} (embedded Derby: one Spark driver at a time) cannot be opened: {cause}. "
            f"Stop the other driver (a notebook kernel that created views: in Jupyter Kernel > Shut Down; a job or "
            f"test run) and run again, or give this process its own metastore (lib.spark.with_metastore, or "
            f"{METASTORE_URL_KEY} in spark.settings)") from exc
    return info


def error_line(exc: BaseException, limit: int = 500) -> str:
    """The line of an exception that says what went wrong: for an error py4j carried from Spark's JVM, the Java
    exception's own line (py4j's first line only names the call, e.g. 'An error occurred while calling o62.sql.')."""
    lines = [line.strip().removeprefix(": ") for line in str(exc).strip().splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("An error occurred while calling")]
    return ((useful or lines or [type(exc).__name__])[0])[:limit]
