"""A Kafka Connect worker running Debezium's PostgreSQL connector, for the Debezium interop (docs/debezium.md).

A standalone worker (one JVM, offsets in a file) started as a local process like the stack's other
services, with one connector whose settings come from conf (section ``debezium``, every key optional):

- ``name`` (``cdc-debezium``): connector name; also names the worker's folder ``.stack/connect/<name>``,
  its log ``.stack/logs/connect-<name>.log`` and pid file, so several workers can run side by side.
- ``slot`` (``<source.slot>_debezium``) and ``publication`` (``source.publication``): Debezium creates the
  slot (with an exported snapshot); the publication must exist (``publication.autocreate.mode=disabled``:
  the pipeline role does not own the tables; notebook 01 / lib.capture.bootstrap.ensure_publication creates it).
- ``topic_prefix`` (``kafka.topic_prefix``) and ``tables`` (``source.tables``): topics are
  ``<topic_prefix>.<schema>.<table>``, the names notebook 04 reads.
- ``registry_url``: Apicurio's v2 API (default: ``registry.url`` with ``/apis/ccompat/v7`` replaced by
  ``/apis/registry/v2``); the converter writes content ids, which ``registry.url`` resolves.
- ``heap`` (``384m``), ``rest_port`` (0: a free port is picked), ``settings`` (connector properties that
  override the defaults below).

The pipeline role's password is never written to a file: the connector reads it from the worker's
environment through Kafka's EnvVarConfigProvider (``${env:CDC_CONNECT_SOURCE_PASSWORD}``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from lib import config, secrets
from lib.capture.catalog import split_name
from lib.local.stack import fetch, kafka, process
from lib.local.stack.process import StackError

MAIN_CLASS = "org.apache.kafka.connect.cli.ConnectStandalone"
PASSWORD_ENV = "CDC_CONNECT_SOURCE_PASSWORD"
CONVERTER = "io.apicurio.registry.utils.converter.AvroConverter"

# What the merge (lib/lake/merge.py) expects of Debezium; docs/debezium.md explains each one.
CONNECTOR_DEFAULTS = {
    "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
    "tasks.max": "1",
    "plugin.name": "pgoutput",
    "publication.autocreate.mode": "disabled",
    "snapshot.mode": "initial",
    "decimal.handling.mode": "precise",
    "time.precision.mode": "adaptive_time_microseconds",
    "interval.handling.mode": "string",
    "binary.handling.mode": "bytes",
    "tombstones.on.delete": "true",
    # Avro names: a topic prefix like cdc-x would give the namespace cdc-x.<schema>.<table>, which Apicurio's
    # ccompat API then cannot read back as Avro (GET /schemas/ids/<id> fails); column names likewise
    "schema.name.adjustment.mode": "avro",
    "field.name.adjustment.mode": "avro",
    "provide.transaction.metadata": "false",
    "heartbeat.interval.ms": "10000",
    # topics the worker has to create itself (broker auto-creation is off) are compacted like ours
    "topic.creation.default.replication.factor": "-1",
    "topic.creation.default.cleanup.policy": "compact",
}


def settings(conf: dict) -> dict:
    """The ``debezium`` conf section with its defaults filled in."""
    section = config.get(conf, "debezium") or {}
    registry = str(config.get(conf, "registry.url")).rstrip("/")
    return {
        "name": str(section.get("name", "cdc-debezium")),
        "slot": str(section.get("slot", f"{config.get(conf, 'source.slot')}_debezium")),
        "publication": str(section.get("publication", config.get(conf, "source.publication"))),
        "topic_prefix": str(section.get("topic_prefix", config.get(conf, "kafka.topic_prefix"))),
        "tables": list(section.get("tables", config.get(conf, "source.tables"))),
        "registry_url": str(section.get("registry_url", re.sub(r"/apis/ccompat/v\d+$", "/apis/registry/v2",
                                                               registry))),
        "heap": str(section.get("heap", "384m")),
        "rest_port": int(section.get("rest_port", 0)),
        "settings": {str(k): str(v) for k, v in (section.get("settings") or {}).items()},
    }


def files(stack_dir: Path, name: str) -> dict[str, Path]:
    """Config, offsets, log and pid locations of one worker."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    base = stack_dir / "connect" / safe
    return {"base": base, "worker": base / "worker.properties", "connector": base / "connector.properties",
            "log4j": base / "log4j2.properties", "offsets": base / "offsets.dat",
            "log": stack_dir / "logs" / f"connect-{safe}.log", "pid": stack_dir / "run" / f"connect-{safe}.pid"}


def include_list(tables: list[str]) -> str:
    """Debezium's table.include.list (regular expressions on schema.table) for conf table names."""
    out = []
    for name in tables:
        schema, table = split_name(name)
        if '"' not in name:
            schema, table = (schema.lower() if schema else None), table.lower()
        out.append(re.escape(f"{schema or 'public'}.{table}"))
    return ",".join(out)


def converter_settings(registry_url: str) -> dict[str, str]:
    """Apicurio's Avro converter writing the Confluent wire format with content ids (what registry.url serves)."""
    out = {}
    for side in ("key", "value"):
        out[f"{side}.converter"] = CONVERTER
        for key, value in (("url", registry_url), ("auto-register", "true"), ("use-id", "contentId"),
                           ("id-handler", "io.apicurio.registry.serde.Legacy4ByteIdHandler"),
                           ("headers.enabled", "false")):
            out[f"{side}.converter.apicurio.registry.{key}"] = value
    return out


def connector_config(conf: dict) -> dict[str, str]:
    """The connector's properties (the password as a ${env:...} reference, never its value)."""
    s = settings(conf)
    props = {"name": s["name"], **CONNECTOR_DEFAULTS,
             "database.hostname": str(config.get(conf, "source.host")),
             "database.port": str(config.get(conf, "source.port")),
             "database.user": str(config.get(conf, "source.user")),
             "database.password": "${env:" + PASSWORD_ENV + "}",
             "database.dbname": str(config.get(conf, "source.database")),
             "topic.prefix": s["topic_prefix"], "slot.name": s["slot"], "publication.name": s["publication"],
             "table.include.list": include_list(s["tables"]),
             "topic.creation.default.partitions": str(config.get(conf, "kafka.partitions")),
             **converter_settings(s["registry_url"])}
    props.update(s["settings"])
    return props


def free_port(host: str) -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def write_config(conf: dict, stack_dir: Path, where: dict[str, Path], port: int) -> None:
    """worker.properties, connector.properties and a console log4j2 config (no secrets in any of them)."""
    plugins = fetch.connect_paths(stack_dir)["plugins"]
    worker = {
        "bootstrap.servers": str(config.get(conf, "kafka.bootstrap_servers")),
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "offset.storage.file.filename": str(where["offsets"]),
        "offset.flush.interval.ms": "1000",
        "plugin.path": str(plugins),
        "plugin.discovery": "only_scan",
        "listeners": f"http://127.0.0.1:{port}",
        "config.providers": "env",
        "config.providers.env.class": "org.apache.kafka.common.config.provider.EnvVarConfigProvider",
        "config.providers.env.param.allowlist.pattern": f"^{PASSWORD_ENV}$",
    }
    where["base"].mkdir(parents=True, exist_ok=True)
    where["worker"].write_text(_properties(worker))
    where["connector"].write_text(_properties(connector_config(conf)))
    where["log4j"].write_text(process.console_log4j2("WARN", {"io.debezium": "INFO",
                                                              "org.apache.kafka.connect.runtime.Worker": "INFO"}))


def _properties(values: dict) -> str:
    """A Java properties file (backslashes and separators escaped)."""
    def esc(text: str) -> str:
        return str(text).replace("\\", "\\\\").replace("\n", "\\n").replace("=", "\\=").replace(":", "\\:")
    return "".join(f"{esc(k)}={esc(v)}\n" for k, v in values.items())


def classpath(stack_dir: Path) -> str:
    """The cached worker jars; error says how to fetch them."""
    where = fetch.connect_paths(stack_dir)
    missing = [name for name in ("connect", "debezium", "converter") if not fetch.cached(where[name])]
    if missing:
        raise StackError(f"connect: {', '.join(missing)} not in {where['connect'].parent}; run "
                         f"`python -m lib.local.stack.connect fetch` (Maven Central)")
    return f"{where['connect']}/*"


def rest_url(where: dict[str, Path]) -> str:
    """The worker's REST endpoint, from its worker.properties."""
    try:
        text = where["worker"].read_text()
    except OSError:
        return ""
    found = re.search(r"^listeners=(.*)$", text, re.M)
    return found.group(1).replace("\\:", ":") if found else ""


def start(conf: dict, stack_dir: Path, log=print) -> int | None:
    """Start the worker with its connector if not running; returns the pid of a new process."""
    s = settings(conf)
    where = files(stack_dir, s["name"])
    marker = str(where["worker"])
    if process.running_pid(f"connect {s['name']}", where["pid"], marker):
        log(f"connect   {s['name']} already running ({rest_url(where)})")
        return None
    fetch.fetch_connect(stack_dir, log=lambda line: None if "cached" in line else log(line))
    port = s["rest_port"] or free_port("127.0.0.1")
    process.require_free_port(f"connect {s['name']}", "127.0.0.1", port, "debezium.rest_port")
    env = {**os.environ, PASSWORD_ENV: secrets.setting(conf, "source.password")}
    write_config(conf, stack_dir, where, port)
    command = [kafka.java(), f"-Xms{s['heap']}", f"-Xmx{s['heap']}", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={where['log4j']}", "-cp", classpath(stack_dir), MAIN_CLASS,
               marker, str(where["connector"])]
    pid = process.start(command, where["log"], where["pid"], env=env)
    log(f"connect   {s['name']} starting (pid {pid}, REST {rest_url(where)}, log {where['log']})")
    return pid


def connector_status(where: dict[str, Path], name: str) -> dict | None:
    """GET /connectors/<name>/status, or None while the worker does not answer."""
    url = rest_url(where)
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url}/connectors/{name}/status", timeout=2) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_running(conf: dict, stack_dir: Path, timeout: float = 120.0) -> dict:
    """Wait until the connector and its task run; a failed task raises with its trace and the log."""
    s = settings(conf)
    where = files(stack_dir, s["name"])
    pid = process.read_pid(where["pid"])
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        if pid is not None:
            process.reap(pid)
            if not process.pid_alive(pid):
                raise StackError(f"connect {s['name']} exited during start-up; its log is {where['log']}",
                                 details=process.tail(where["log"], 30))
        state = connector_status(where, s["name"])
        tasks = (state or {}).get("tasks", [])
        failed = [t for t in tasks if t.get("state") == "FAILED"]
        if failed or (state or {}).get("connector", {}).get("state") == "FAILED":
            trace = (failed[0] if failed else state["connector"]).get("trace", "")
            raise StackError(f"connect {s['name']}: the Debezium connector failed: "
                             f"{trace.splitlines()[0] if trace else 'no trace'}; see {where['log']}",
                             details=trace[:3000])
        if tasks and all(t.get("state") == "RUNNING" for t in tasks):
            return state
        time.sleep(0.5)
    raise StackError(f"connect {s['name']} did not reach RUNNING within {timeout:.0f} s (last status: {state}); "
                     f"see {where['log']}", details=process.tail(where["log"], 30))


def stop(conf: dict, stack_dir: Path, log=print) -> None:
    """Stop the worker (the connector's slot stays; drop it when Debezium is retired)."""
    s = settings(conf)
    where = files(stack_dir, s["name"])
    process.stop_recorded(f"connect {s['name']}", where["pid"], str(where["worker"]), timeout=60, log=log)


def status(conf: dict, stack_dir: Path) -> dict:
    """What runs where: pid, REST endpoint, connector and task states, log file."""
    s = settings(conf)
    where = files(stack_dir, s["name"])
    pid, state = process.recorded_state(f"connect {s['name']}", where["pid"], str(where["worker"]))
    remote = connector_status(where, s["name"]) if pid else None
    return {"service": f"connect {s['name']}", "state": state, "pid": pid, "rest": rest_url(where) if pid else "",
            "connector": (remote or {}).get("connector", {}).get("state"),
            "tasks": [t.get("state") for t in (remote or {}).get("tasks", [])], "log": where["log"]}


def main(argv: list[str] | None = None) -> int:
    """python -m lib.local.stack.connect {fetch,start,stop,status} [--target local]."""
    import argparse
    import sys

    from lib.local import stack

    parser = argparse.ArgumentParser(prog="python -m lib.local.stack.connect", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("fetch", "start", "stop", "status"))
    parser.add_argument("--target", default="local", help="conf/<target>.yml (default: local)")
    args = parser.parse_args(argv)
    try:
        conf = config.load(args.target)
        folder = stack.stack_dir(conf)
        if args.command == "fetch":
            fetch.fetch_connect(folder)
        elif args.command == "start":
            start(conf, folder)
            wait_running(conf, folder)
            print(f"connect   {settings(conf)['name']} running")
        elif args.command == "stop":
            stop(conf, folder)
        else:
            print(json.dumps(status(conf, folder), default=str, indent=1))
    except (StackError, config.ConfigError, secrets.SecretError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
