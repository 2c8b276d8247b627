"""The local stack: PostgreSQL, Kafka (KRaft) and Apicurio Registry as local processes.

`python -m lib.stack up|down|status|logs|fetch` (the Makefile wraps these). Everything lives
under the folder in stack.dir (.stack/ by default, git-ignored): downloads in cache/, the
services' data, logs/ and run/ (pid files). Ports come from conf/local.yml.
"""

from __future__ import annotations

import secrets as random_secrets
import time
from pathlib import Path

from lib import config, secrets
from lib.stack import fetch, kafka, postgres, process, registry
from lib.stack.process import StackError

__all__ = ["StackError", "down", "fetch_all", "logs", "stack_dir", "status", "up"]

SERVICES = ("postgres", "kafka", "registry")


def stack_dir(conf: dict) -> Path:
    """The stack's folder, from stack.dir."""
    return config.project_path(config.get(conf, "stack.dir"))


def fetch_all(conf: dict, log=print) -> None:
    """Download (or find in the cache) everything the stack and Spark need."""
    fetch.fetch_all(stack_dir(conf), log=log)


def env_references(node) -> list[str]:
    """Names of every {env: NAME} secret reference in a conf tree."""
    if secrets.is_reference(node) and "env" in node:
        return [str(node["env"])]
    if isinstance(node, dict):
        return [name for value in node.values() for name in env_references(value)]
    if isinstance(node, list):
        return [name for value in node for name in env_references(value)]
    return []


def ensure_local_secrets(conf: dict, environ=None, path: Path | None = None, log=print) -> None:
    """Give every env secret of the local conf a random value in conf/secrets.env if unset."""
    import os

    environ = os.environ if environ is None else environ
    path = secrets.SECRETS_FILE if path is None else path
    known = secrets.read_env_file(path)
    missing = [name for name in dict.fromkeys(env_references(conf))
               if not environ.get(name) and not known.get(name)]
    if not missing:
        return
    lines = [f"{name}={random_secrets.token_urlsafe(18)}\n" for name in missing]
    path.touch(mode=0o600, exist_ok=True)
    with open(path, "a") as handle:
        handle.writelines(lines)
    log(f"secrets   wrote random values for {', '.join(missing)} to {path} (git-ignored)")


def up(conf: dict, log=print) -> None:
    """Start every service (reusing what runs) and wait until each answers."""
    began = time.monotonic()
    folder = stack_dir(conf)
    fetch.fetch_all(folder, log=lambda line: None if "cached" in line else log(line))
    ensure_local_secrets(conf, log=log)
    postgres.start(conf, folder, log=log)
    timeout = float(config.get(conf, "stack.start_timeout_s"))
    started = {name: module.start(conf, folder, log=log) for name, module in
               (("kafka", kafka), ("registry", registry))}
    probes = {"kafka": (kafka.ready, kafka.files(folder)["log"]),
              "registry": (registry.ready, registry.files(folder)["log"])}
    for name, (probe, log_file) in probes.items():
        pid = started[name]
        process.wait_ready(name, lambda probe=probe: probe(conf), timeout, log_file, pid)
        if pid:
            log(f"{name:9s} started on port {status_of(conf, name)['port']} (pid {pid})")
    log(f"stack     up in {time.monotonic() - began:.1f} s")


def down(conf: dict, log=print) -> None:
    """Stop every service, newest first; data and logs stay."""
    folder = stack_dir(conf)
    registry.stop(folder, log=log)
    kafka.stop(folder, log=log)
    postgres.stop(conf, folder, log=log)


def status_of(conf: dict, name: str) -> dict:
    """Status row of one service."""
    module = {"postgres": postgres, "kafka": kafka, "registry": registry}[name]
    return module.status(conf, stack_dir(conf))


def status(conf: dict) -> list[dict]:
    """One row per service: state, pid, port, version, log file."""
    return [status_of(conf, name) for name in SERVICES]


def logs(conf: dict, service: str | None = None, lines: int = 40) -> str:
    """The last lines of one service's log, or of all of them."""
    rows = [status_of(conf, service)] if service else status(conf)
    return "\n".join(f"==> {row['log']} <==\n{process.tail(Path(row['log']), lines)}\n" for row in rows)
