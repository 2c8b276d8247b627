"""The stack's schema registry: Apicurio Registry, Confluent API at /apis/ccompat/v7.

Schemas are stored in the stack's PostgreSQL (database stack.registry.database), so they
survive a registry restart while Kafka still holds messages that reference their ids. Besides HTTP on
registry.url it serves HTTPS on stack.registry.https_port with the stack's certificate (tls.py).
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from lib import config, secrets
from lib.local.stack import fetch, kafka, process, tls
from lib.local.stack.process import StackError

MARKER = "apicurio-registry-app"


def files(stack_dir: Path) -> dict[str, Path]:
    """Log and pid locations of the registry."""
    return {"log": stack_dir / "logs" / "registry.log", "pid": stack_dir / "run" / "registry.pid"}


def runner(stack_dir: Path) -> Path:
    """The cached Quarkus runner jar; error says how to fetch it."""
    folder = fetch.paths(stack_dir)["registry"]
    jars = sorted((folder / "app").glob("*-runner.jar")) if fetch.cached(folder) else []
    if not jars:
        raise StackError(f"registry: Apicurio Registry is not in {folder}; run `make install` to fetch it")
    return jars[0]


def endpoint(conf: dict) -> tuple[str, int]:
    """Host and port of the registry, from registry.url."""
    url = urlparse(str(config.get(conf, "registry.url")))
    return url.hostname or "127.0.0.1", url.port or 80


def https_endpoint(conf: dict) -> tuple[str, int, str]:
    """(host, port, setting) of the HTTPS listener."""
    return endpoint(conf)[0], int(config.get(conf, "stack.registry.https_port")), "stack.registry.https_port"


def https_url(conf: dict) -> str:
    """registry.url with https and stack.registry.https_port."""
    url = urlparse(str(config.get(conf, "registry.url")))
    host, port, _ = https_endpoint(conf)
    return url._replace(scheme="https", netloc=f"{host}:{port}").geturl()


def environment(conf: dict, stack_dir: Path) -> dict[str, str]:
    """Process environment: HTTP and HTTPS ports, and SQL storage on the stack's PostgreSQL."""
    host, port = endpoint(conf)
    cert = tls.paths(stack_dir)
    database = config.get(conf, "stack.registry.database")
    jdbc = f"jdbc:postgresql://{config.get(conf, 'source.host')}:{config.get(conf, 'source.port')}/{database}"
    return {
        **os.environ,
        "QUARKUS_HTTP_HOST": host,
        "QUARKUS_HTTP_PORT": str(port),
        "QUARKUS_HTTP_INSECURE_REQUESTS": "enabled",  # plain HTTP stays on registry.url
        "QUARKUS_HTTP_SSL_PORT": str(config.get(conf, "stack.registry.https_port")),
        "QUARKUS_HTTP_SSL_CERTIFICATE_FILES": str(cert["cert"]),
        "QUARKUS_HTTP_SSL_CERTIFICATE_KEY_FILES": str(cert["key"]),
        "QUARKUS_MANAGEMENT_PORT": str(config.get(conf, "stack.registry.management_port")),
        "APICURIO_STORAGE_KIND": "sql",
        "APICURIO_STORAGE_SQL_KIND": "postgresql",
        "APICURIO_DATASOURCE_URL": jdbc,
        "APICURIO_DATASOURCE_USERNAME": config.get(conf, "stack.registry.user"),
        "APICURIO_DATASOURCE_PASSWORD": secrets.setting(conf, "stack.registry.password"),
        "APICURIO_DATASOURCE_JDBC_MAX_SIZE": "5",
        "APICURIO_DATASOURCE_JDBC_MIN_SIZE": "1",
    }


def ready(conf: dict) -> bool:
    """True when the Confluent-compatible API answers."""
    url = str(config.get(conf, "registry.url")).rstrip("/") + "/subjects"
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def start(conf: dict, stack_dir: Path, log=print) -> int | None:
    """Start the registry if it is not running; returns the pid of a new process."""
    where = files(stack_dir)
    host, port = endpoint(conf)
    management = int(config.get(conf, "stack.registry.management_port"))
    ports = [(host, port, "registry.url"), (host, management, "stack.registry.management_port"),
             https_endpoint(conf)]
    if not process.claim("registry", where["pid"], MARKER, ports, log):
        return None
    java_bin = kafka.java()
    jar = runner(stack_dir)
    tls.ensure(stack_dir, log=log)
    heap = config.get(conf, "stack.registry.heap")
    command = [java_bin, f"-Xmx{heap}", "-XX:+UseSerialGC", "-jar", str(jar)]
    return process.start(command, where["log"], where["pid"], env=environment(conf, stack_dir), cwd=jar.parent)


def stop(stack_dir: Path, log=print) -> None:
    """Stop the registry, clearing a stale pid file."""
    process.stop_recorded("registry", files(stack_dir)["pid"], MARKER, timeout=30, log=log)


def status(conf: dict, stack_dir: Path) -> dict:
    """What runs where, for `stack status`."""
    where = files(stack_dir)
    pid, state = process.recorded_state("registry", where["pid"], MARKER)
    return {"service": "registry", "state": state, "pid": pid, "port": endpoint(conf)[1],
            "version": f"apicurio {fetch.APICURIO_VERSION}", "log": where["log"]}
