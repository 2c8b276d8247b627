"""The stack's single Kafka node in KRaft mode (broker and controller in one JVM)."""

from __future__ import annotations

import base64
import re
import subprocess
import uuid
from pathlib import Path

from lib import config
from lib.local.stack import fetch, process
from lib.local.stack.process import StackError

MARKER = "kafka.Kafka"


def endpoint(conf: dict) -> tuple[str, int]:
    """Host and port of the broker, from kafka.bootstrap_servers."""
    first = str(config.get(conf, "kafka.bootstrap_servers")).split(",")[0].strip()
    host, _, port = first.rpartition(":")
    return host or "127.0.0.1", int(port)


def java(min_major: int = 17) -> str:
    """Path of a java at least min_major; error says how to install one."""
    path = fetch.require_tool("java", "install a JDK 17 or newer (apt-get install -y "
                                      "openjdk-17-jre-headless) or put its bin folder on PATH")
    out = subprocess.run([path, "-version"], capture_output=True, text=True).stderr
    found = re.search(r'version "(\d+)', out)
    if not found or int(found.group(1)) < min_major:
        raise StackError(f"java at {path} is too old ({out.splitlines()[0] if out else '?'}): "
                         f"Kafka and the registry need Java {min_major}+; install openjdk-17")
    return path


def files(stack_dir: Path) -> dict[str, Path]:
    """Config, data, log and pid locations of the broker."""
    base = stack_dir / "kafka"
    return {"base": base, "properties": base / "server.properties", "log4j": base / "log4j2.properties",
            "data": base / "data", "log": stack_dir / "logs" / "kafka.log",
            "pid": stack_dir / "run" / "kafka.pid"}


def write_config(conf: dict, where: dict[str, Path]) -> None:
    """server.properties for a one-node KRaft cluster on loopback, and a console log4j2 config."""
    host, port = endpoint(conf)
    controller = int(config.get(conf, "stack.kafka.controller_port"))
    settings = {
        "process.roles": "broker,controller",
        "node.id": 1,
        "controller.quorum.voters": f"1@{host}:{controller}",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": where["data"],
        "num.partitions": 1,
        # topics are created by the pipeline with their compaction settings, never by accident
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": 1,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
    }
    where["base"].mkdir(parents=True, exist_ok=True)
    where["properties"].write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    where["log4j"].write_text(process.console_log4j2("INFO", {"kafka": "WARN", "org.apache.kafka": "WARN"}))


def classpath(stack_dir: Path) -> str:
    """The cached broker jars; error says how to fetch them."""
    jars = fetch.paths(stack_dir)["kafka"]
    if not fetch.cached(jars):
        raise StackError(f"kafka: broker jars are not in {jars}; run `make install` to fetch them")
    return f"{jars}/*"


def version(stack_dir: Path) -> str:
    """Broker version, from the cached jar's name."""
    for jar in fetch.paths(stack_dir)["kafka"].glob("kafka_2.13-*.jar"):
        return jar.stem.split("-", 1)[1]
    return "?"


def format_storage(java_bin: str, stack_dir: Path, where: dict[str, Path]) -> None:
    """Format the metadata log once, with a fresh cluster id."""
    if (where["data"] / "meta.properties").is_file():
        return
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    command = [java_bin, "-cp", classpath(stack_dir), f"-Dlog4j2.configurationFile={where['log4j']}",
               "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(where["properties"])]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"kafka: formatting storage in {where['data']} failed; remove that folder "
                         f"and run `make up` again", details=result.stdout + result.stderr)


def ready(conf: dict) -> bool:
    """True when the broker answers a metadata request."""
    from confluent_kafka.admin import AdminClient

    if not process.port_in_use(*endpoint(conf)):
        return False
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"), "log_level": 0})
    admin.list_topics(timeout=5)
    return True


def start(conf: dict, stack_dir: Path, log=print) -> int | None:
    """Start the broker if it is not running; returns the pid of a new process."""
    where = files(stack_dir)
    host, port = endpoint(conf)
    controller = int(config.get(conf, "stack.kafka.controller_port"))
    ports = [(host, port, "kafka.bootstrap_servers"), (host, controller, "stack.kafka.controller_port")]
    if not process.claim("kafka", where["pid"], MARKER, ports, log):
        return None
    java_bin = java()
    write_config(conf, where)
    format_storage(java_bin, stack_dir, where)
    heap = config.get(conf, "stack.kafka.heap")
    command = [java_bin, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={where['log4j']}", "-cp", classpath(stack_dir),
               MARKER, str(where["properties"])]
    return process.start(command, where["log"], where["pid"])


def stop(stack_dir: Path, log=print) -> None:
    """Stop the broker, clearing a stale pid file."""
    process.stop_recorded("kafka", files(stack_dir)["pid"], MARKER, timeout=60, log=log)


def status(conf: dict, stack_dir: Path) -> dict:
    """What runs where, for `stack status`."""
    where = files(stack_dir)
    pid, state = process.recorded_state("kafka", where["pid"], MARKER)
    return {"service": "kafka", "state": state, "pid": pid, "port": endpoint(conf)[1],
            "version": version(stack_dir), "log": where["log"]}
