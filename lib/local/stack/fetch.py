"""Downloads for the local stack, from Maven Central through Maven, cached under .stack/cache."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from lib.local.stack.process import StackError

POMS = Path(__file__).parent / "poms"
APICURIO_VERSION = "3.0.9"  # 3.1+ needs Java 21; 3.0.x runs on the Java 17 we target
DONE = ".complete"


def paths(stack_dir: Path) -> dict[str, Path]:
    """Where each cached download lives."""
    cache = stack_dir / "cache"
    return {
        "m2": cache / "m2",
        "kafka": cache / "kafka-jars",
        "spark": cache / "spark-jars",
        "registry": cache / f"apicurio-registry-{APICURIO_VERSION}",
        "logs": stack_dir / "logs",
    }


def cached(folder: Path, stamp: str | None = None) -> bool:
    """True when a download finished into folder (marker written last) from the same recipe."""
    marker = folder / DONE
    return marker.is_file() and (stamp is None or marker.read_text() == stamp)


def require_tool(name: str, remedy: str) -> str:
    """Path of an executable, or an error saying how to install it."""
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} not found on PATH: {remedy}")
    return found


def maven(args: list[str], m2: Path, log_file: Path, what: str) -> None:
    """Run Maven in batch mode with the project's own local repository; fail naming the log."""
    mvn = require_tool("mvn", "install Maven (apt-get install -y maven), then `make install`")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    command = [mvn, "-B", "-ntp", f"-Dmaven.repo.local={m2}", *args]
    with open(log_file, "wb") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise StackError(
            f"download of {what} failed (mvn exit {result.returncode}; see {log_file}); check "
            f"that Maven Central is reachable, then run `make install` again"
        )


def copy_dependencies(pom: Path, target: Path, m2: Path, log_file: Path, what: str) -> Path:
    """Copy the runtime jars of a pom into target, atomically; reuse the cache when complete."""
    if cached(target, pom.read_text()):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        maven(["-f", str(pom), "dependency:copy-dependencies", f"-DoutputDirectory={staging}",
               "-DincludeScope=runtime"], m2, log_file, what)
        (staging / DONE).write_text(pom.read_text())
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def registry_distribution(target: Path, m2: Path, log_file: Path) -> Path:
    """Fetch and unpack Apicurio Registry's distribution; reuse the cache when complete."""
    artifact = registry_artifact()
    if cached(target, artifact + "\n"):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        maven(["dependency:copy", f"-Dartifact={artifact}", f"-DoutputDirectory={staging}"],
              m2, log_file, f"Apicurio Registry {APICURIO_VERSION}")
        archive = next(staging.glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(staging / "app", filter="data")
        archive.unlink()
        (staging / DONE).write_text(artifact + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def registry_artifact() -> str:
    """Maven coordinates of the registry distribution."""
    return f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"


def fetch_all(stack_dir: Path, log=print) -> dict[str, Path]:
    """Make sure every download is in the cache (Kafka, Apicurio, Spark's extra jars)."""
    where = paths(stack_dir)
    logs = where["logs"]
    jobs = [
        ("kafka", (POMS / "kafka.xml").read_text(),
         lambda: copy_dependencies(POMS / "kafka.xml", where["kafka"], where["m2"],
                                   logs / "fetch-kafka.log", "the Kafka broker jars")),
        ("registry", registry_artifact() + "\n",
         lambda: registry_distribution(where["registry"], where["m2"], logs / "fetch-registry.log")),
        ("spark", (POMS / "spark.xml").read_text(),
         lambda: copy_dependencies(POMS / "spark.xml", where["spark"], where["m2"],
                                   logs / "fetch-spark.log", "the Delta, Kafka and Avro jars for Spark")),
    ]
    for name, stamp, job in jobs:
        if cached(where[name], stamp):
            log(f"{name:9s} cached in {where[name]}")
        else:
            log(f"{name:9s} downloading into {where[name]} (log: {logs})")
            job()
    return where


def connect_paths(stack_dir: Path) -> dict[str, Path]:
    """Where the Kafka Connect worker and its plugins (Debezium interop only) are cached."""
    plugins = stack_dir / "cache" / "connect-plugins"
    return {"connect": stack_dir / "cache" / "connect-jars", "plugins": plugins,
            "debezium": plugins / "debezium-postgres", "converter": plugins / "apicurio-converter"}


def fetch_connect(stack_dir: Path, log=print) -> dict[str, Path]:
    """Make sure the Connect worker, Debezium's PostgreSQL connector and Apicurio's converter are cached.

    Not part of fetch_all: only the Debezium interop (lib/local/stack/connect.py, docs/debezium.md) needs them.
    """
    where = connect_paths(stack_dir)
    logs = paths(stack_dir)["logs"]
    m2 = paths(stack_dir)["m2"]
    jobs = [("connect", "connect.xml", "the Kafka Connect worker jars"),
            ("debezium", "debezium-postgres.xml", "Debezium's PostgreSQL connector"),
            ("converter", "apicurio-converter.xml", "Apicurio's Avro converter for Kafka Connect")]
    for name, pom, what in jobs:
        if cached(where[name], (POMS / pom).read_text()):
            log(f"{name:9s} cached in {where[name]}")
        else:
            log(f"{name:9s} downloading into {where[name]} (log: {logs})")
            copy_dependencies(POMS / pom, where[name], m2, logs / f"fetch-{name}.log", what)
    return where
