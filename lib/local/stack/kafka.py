"""The stack's single Kafka node in KRaft mode (broker and controller in one JVM).

Listeners: PLAINTEXT on kafka.bootstrap_servers (what the pipeline uses; also between brokers), CONTROLLER,
SASL_SSL (SCRAM-SHA-512 or PLAIN as stack.kafka.user) and SSL (TLS, no client certificate), both with the
stack's own certificate (lib/local/stack/tls.py).
"""

from __future__ import annotations

import base64
import re
import subprocess
import time
import uuid
from pathlib import Path

from lib import config, secrets
from lib.local.stack import fetch, process, tls
from lib.local.stack.process import StackError

MARKER = "kafka.Kafka"
SCRAM_ITERATIONS = 8192


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


def secure_ports(conf: dict) -> list[tuple[str, int, str]]:
    """(host, port, setting) of the SASL_SSL and SSL listeners, on the broker's host."""
    host = endpoint(conf)[0]
    return [(host, int(config.get(conf, "stack.kafka.sasl_ssl_port")), "stack.kafka.sasl_ssl_port"),
            (host, int(config.get(conf, "stack.kafka.ssl_port")), "stack.kafka.ssl_port")]


def user(conf: dict) -> str:
    """The SASL user's name; error when JAAS could not carry it."""
    name = str(config.get(conf, "stack.kafka.user"))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise StackError(f"stack.kafka.user {name!r} may hold only letters, digits, '_', '.' and '-' "
                         f"(it becomes a JAAS option name); change it in conf/local.yml")
    return name


def jaas_string(value: str) -> str:
    """A value quoted for a JAAS option."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def property_value(value) -> str:
    """A value escaped for a Java .properties file (read as ISO-8859-1: others as \\uXXXX)."""
    text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    if text.isascii():
        return text
    units = text.encode("utf-16-be")
    return "".join(chr(c) if c < 128 else f"\\u{c:04x}"
                   for c in (int.from_bytes(units[i:i + 2], "big") for i in range(0, len(units), 2)))


def secure_settings(conf: dict, stack_dir: Path) -> dict[str, object]:
    """The SASL_SSL and SSL listeners' settings (the PLAIN password included)."""
    cert = tls.paths(stack_dir)
    sasl = "listener.name.sasl_ssl."
    plain = (f"org.apache.kafka.common.security.plain.PlainLoginModule required "
             f"user_{user(conf)}={jaas_string(secrets.setting(conf, 'stack.kafka.password'))};")
    settings: dict[str, object] = {
        f"{sasl}sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
        f"{sasl}plain.sasl.jaas.config": plain,
        # SCRAM credentials live in the cluster metadata; `stack up` sets them (ensure_user)
        f"{sasl}scram-sha-512.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
    }
    for listener in ("sasl_ssl", "ssl"):
        prefix = f"listener.name.{listener}."
        settings.update({f"{prefix}ssl.keystore.type": "PEM", f"{prefix}ssl.keystore.location": cert["keystore"],
                         f"{prefix}ssl.client.auth": "none"})
    return settings


def write_config(conf: dict, where: dict[str, Path], stack_dir: Path) -> None:
    """server.properties for a one-node KRaft cluster on loopback, and a console log4j2 config."""
    where["base"].mkdir(parents=True, exist_ok=True)
    # owner-only (0600): the PLAIN listener lists its user and login inside; the stack folder is git-ignored
    where["properties"].touch(mode=0o600, exist_ok=True)
    where["properties"].chmod(0o600)
    where["properties"].write_text(properties(conf, where, stack_dir))
    where["log4j"].write_text(process.console_log4j2("INFO", {"kafka": "WARN", "org.apache.kafka": "WARN"}))


def properties(conf: dict, where: dict[str, Path], stack_dir: Path) -> str:
    """The text of server.properties; a comment records the certificate the broker serves."""
    host, port = endpoint(conf)
    controller = int(config.get(conf, "stack.kafka.controller_port"))
    (_, sasl_ssl, _), (_, ssl, _) = secure_ports(conf)
    secure = f"SASL_SSL://{host}:{sasl_ssl},SSL://{host}:{ssl}"
    settings = {
        "process.roles": "broker,controller",
        "node.id": 1,
        "controller.quorum.voters": f"1@{host}:{controller}",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller},{secure}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port},{secure}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL",
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
        **secure_settings(conf, stack_dir),
    }
    served = f"# server certificate sha256 {tls.fingerprint(tls.paths(stack_dir)['cert'])}\n"
    return served + "".join(f"{k}={property_value(v)}\n" for k, v in settings.items())


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


def new_cluster_id() -> str:
    """A random cluster id in Kafka's form; never one starting with '-', which the format tool reads as an option."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def format_storage(java_bin: str, stack_dir: Path, where: dict[str, Path]) -> None:
    """Format the metadata log once, with a fresh cluster id."""
    if (where["data"] / "meta.properties").is_file():
        return
    command = [java_bin, "-cp", classpath(stack_dir), f"-Dlog4j2.configurationFile={where['log4j']}",
               "kafka.tools.StorageTool", "format", "-t", new_cluster_id(), "-c", str(where["properties"])]
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
    """Start the broker if it is not running (again if its settings changed); returns the pid of a new process."""
    where = files(stack_dir)
    host, port = endpoint(conf)
    controller = int(config.get(conf, "stack.kafka.controller_port"))
    ports = [(host, port, "kafka.bootstrap_servers"), (host, controller, "stack.kafka.controller_port"),
             *secure_ports(conf)]
    tls.ensure(stack_dir, log=log)
    if outdated(conf, where, stack_dir):
        log("kafka     restarting: its PLAIN password, certificate or ports changed since it started")
        stop(stack_dir, log=log)
    if not process.claim("kafka", where["pid"], MARKER, ports, log):
        return None
    java_bin = java()
    write_config(conf, where, stack_dir)
    format_storage(java_bin, stack_dir, where)
    heap = config.get(conf, "stack.kafka.heap")
    command = [java_bin, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={where['log4j']}", "-cp", classpath(stack_dir),
               MARKER, str(where["properties"])]
    return process.start(command, where["log"], where["pid"])


def outdated(conf: dict, where: dict[str, Path], stack_dir: Path) -> bool:
    """True when the running broker has secure listeners but was started with other settings than conf's.

    A broker started before the secure listeners existed keeps running: `stack up` says how to add them.
    """
    pid, _ = process.recorded_state("kafka", where["pid"], MARKER)
    if not pid or not where["properties"].is_file():
        return False
    started_with = where["properties"].read_text()
    return "SASL_SSL://" in started_with and started_with != properties(conf, where, stack_dir)


def ensure_user(conf: dict, stack_dir: Path, wait_s: float = 30.0) -> None:
    """Give stack.kafka.user the current password as its SCRAM-SHA-512 credential, then wait until a login works.

    A credential that already logs in is left alone (an upsert would re-salt it). After an upsert the
    broker applies the credential from its metadata log a moment later, so a client connecting right
    away can be refused; this returns only once the new password logs in.
    """
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    name = user(conf)
    password = secrets.setting(conf, "stack.kafka.password")
    listening = process.port_in_use(*secure_ports(conf)[0][:2])  # not on a broker started before TLS (missing_tls)
    if listening and scram_login_works(conf, stack_dir, name, password):
        return
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers"), "log_level": 0})
    try:
        upsert = UserScramCredentialUpsertion(name, info, password.encode())
        admin.alter_user_scram_credentials([upsert])[name].result(30)
    except Exception as exc:  # KafkaException, or a timeout of the future
        raise StackError(f"kafka: setting the SCRAM-SHA-512 credential of stack.kafka.user {name} failed ({exc}); "
                         f"see {files(stack_dir)['log']}, then run `make up` again") from exc
    deadline = time.monotonic() + wait_s
    while listening and not scram_login_works(conf, stack_dir, name, password):
        if time.monotonic() > deadline:
            raise StackError(f"kafka: the SCRAM-SHA-512 credential of stack.kafka.user {name} was set but the "
                             f"SASL_SSL listener still refuses it after {wait_s:.0f} s; see {files(stack_dir)['log']}, "
                             f"then run `make up` again")
        time.sleep(0.5)


def scram_login_works(conf: dict, stack_dir: Path, name: str, password: str) -> bool:
    """True when the SASL_SSL listener takes name and password with SCRAM-SHA-512 (a metadata request)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    host, port, _ = secure_ports(conf)[0]
    admin = AdminClient({"bootstrap.servers": f"{host}:{port}", "security.protocol": "SASL_SSL",
                         "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": name, "sasl.password": password,
                         "ssl.ca.location": str(tls.paths(stack_dir)["ca"]), "log_level": 0})
    try:
        admin.list_topics(timeout=5)
        return True
    except KafkaException:
        return False


def stop(stack_dir: Path, log=print) -> None:
    """Stop the broker, clearing a stale pid file."""
    process.stop_recorded("kafka", files(stack_dir)["pid"], MARKER, timeout=60, log=log)


def status(conf: dict, stack_dir: Path) -> dict:
    """What runs where, for `stack status`."""
    where = files(stack_dir)
    pid, state = process.recorded_state("kafka", where["pid"], MARKER)
    return {"service": "kafka", "state": state, "pid": pid, "port": endpoint(conf)[1],
            "version": version(stack_dir), "log": where["log"]}
