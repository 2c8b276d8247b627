"""The local stack: PostgreSQL, Kafka (KRaft) and Apicurio Registry as local processes.

`python -m lib.local.stack up|down|status|logs|fetch` (the Makefile wraps these). Everything lives
under the folder in stack.dir (.stack/ by default, git-ignored): downloads in cache/, the
services' data, logs/ and run/ (pid files), tls/ (the stack's own CA and server certificate). Ports
come from conf/local.yml. Besides their plain ports the services serve TLS: PostgreSQL on its port,
Kafka on SASL_SSL and SSL listeners, the registry on HTTPS (endpoints() lists them).
"""

from __future__ import annotations

import secrets as random_secrets
import time
from pathlib import Path

from lib import config, secrets
from lib.local.stack import (
    fetch,
    kafka,
    kafka_brokers,
    pg_versions,
    postgres,
    process,
    registry,
    spark_cds,
    spark_cluster,
    tls,
)
from lib.local.stack.process import StackError

__all__ = ["StackError", "down", "fetch_all", "logs", "sample", "stack_dir", "status", "up"]

SERVICES = ("postgres", "kafka", "registry")


def stack_dir(conf: dict) -> Path:
    """The stack's folder, from stack.dir, resolved: a worktree whose .stack links to another's starts the same
    services with the same settings (else each would restart the broker for its own paths)."""
    return config.project_path(config.get(conf, "stack.dir")).resolve()


def fetch_all(conf: dict, log=print, archive: bool = True) -> None:
    """Download (or find in the cache) everything the stack and Spark need; the driver's class-data archive unless
    archive is False (it needs pyspark installed, the downloads do not)."""
    fetch.fetch_all(stack_dir(conf), log=log)
    if archive:
        spark_cds.ensure(conf, log=log)


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
    path = secrets.env_file() if path is None else path
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
    """Start every service (reusing what runs) and wait until each answers; one process at a time (a file lock)."""
    folder = stack_dir(conf)
    with process.stack_lock(folder):  # two test workers, or two make commands, start it at once
        _up(conf, folder, log)


def _up(conf: dict, folder: Path, log) -> None:
    began = time.monotonic()
    fetch.fetch_all(folder, log=lambda line: None if "cached" in line else log(line))
    ensure_local_secrets(conf, log=log)
    if tls.ensure(folder, log=log) and process.port_in_use(*registry.https_endpoint(conf)[:2]):
        registry.stop(folder, log=log)  # it serves the previous certificate: start it again below
    postgres.start(conf, folder, log=log)
    timeout = float(config.get(conf, "stack.start_timeout_s"))
    started = {name: module.start(conf, folder, log=log) for name, module in
               (("kafka", kafka), ("registry", registry))}
    probes = {"kafka": (kafka.ready, kafka.files(folder)), "registry": (registry.ready, registry.files(folder))}
    for name, (probe, where) in probes.items():
        pid = started[name]
        process.wait_ready(name, lambda probe=probe: probe(conf), timeout, where["log"], pid, where["pid"])
        if pid:
            log(f"{name:9s} started on port {status_of(conf, name)['port']} (pid {pid})")
    kafka.ensure_user(conf, folder)
    for line in missing_tls(conf, folder):
        log(line)
    log(f"stack     up in {time.monotonic() - began:.1f} s")


def missing_tls(conf: dict, folder: Path) -> list[str]:
    """A line for each running service started before the stack served TLS, with the fix."""
    fix = "it was started before the stack served TLS: `make down && make up` adds it"
    lines = [] if postgres.ssl_on(conf, folder) else [f"postgres  has ssl off; {fix}"]
    for host, port, setting in [*kafka.secure_ports(conf), registry.https_endpoint(conf)]:
        if not process.port_in_use(host, port):
            lines.append(f"{setting.split('.')[1]:9s} nothing listens on {host}:{port} ({setting}); {fix}")
    return lines


def sample(conf: dict, customers: int = 200, seed: int = 7, reset: bool = False, log=print) -> dict:
    """Load the sample bank into the source database (once, or again with reset) and grant reads."""
    from psycopg2 import sql

    from lib import source
    from lib.local import sample_db

    conn = source.connect(conf, admin=True)
    try:
        counts = sample_db.row_counts(conn) if not reset and has_schema(conn, sample_db.SCHEMA) else None
        if counts and any(counts.values()):
            log(f"sample    already loaded ({counts['bank.customers']} customers); "
                "`python -m lib.local.stack sample --reset` reloads it")
        else:
            sample_db.create_schema(conn)
            counts = sample_db.load(conn, customers=customers, seed=seed)
            log(f"sample    loaded {sum(counts.values())} rows into {len(counts)} tables (seed {seed})")
        sample_db.mark(conn)  # also on a sample loaded before the mark existed
        pipeline = sql.Identifier(config.get(conf, "source.user"))
        schema = sql.Identifier(sample_db.SCHEMA)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, pipeline))
            cur.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(schema, pipeline))
        conn.commit()
        return counts
    finally:
        conn.close()


def has_schema(conn, schema: str) -> bool:
    """True when the schema exists in the connected database."""
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        return cur.fetchone() is not None


def down(conf: dict, log=print) -> None:
    """Stop every service, newest first; data and logs stay."""
    folder = stack_dir(conf)
    spark_cluster.stop(conf, folder, log=log)
    kafka_brokers.down(conf, log=log, remove=False)
    registry.stop(folder, log=log)
    kafka.stop(folder, log=log)
    postgres.stop(conf, folder, log=log)
    pg_versions.down(conf, log=log)


def clean(conf: dict, log=print) -> None:
    """Stop the stack and delete its data, logs and pid files; the download cache stays."""
    import shutil

    down(conf, log=log)
    folder = stack_dir(conf)
    for child in folder.iterdir() if folder.is_dir() else []:
        if child.name == "cache":
            continue
        if child.is_symlink():
            shutil.rmtree(child.resolve(), ignore_errors=True)
            child.unlink()
        elif child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    log(f"stack     data and logs removed from {folder} (downloads kept in {folder / 'cache'})")


def endpoints(conf: dict) -> dict[str, str]:
    """Where to connect, for people (passwords are named, never shown)."""
    source = conf["source"]
    ca = tls.paths(stack_dir(conf))["ca"]
    (host, sasl_ssl, _), (_, ssl, _) = kafka.secure_ports(conf)
    kafka_user = config.get(conf, "stack.kafka.user")
    kafka_password = secrets.describe(config.get(conf, "stack.kafka.password"))
    return {
        "psql": f"psql postgresql://{source['admin_user']}@{source['host']}:{source['port']}/{source['database']}"
                f"  (password: {secrets.describe(source['admin_password'])}, in conf/secrets.env locally)",
        "psql tls": f"the same, with ?sslmode=verify-full&sslrootcert={ca}",
        "kafka": str(config.get(conf, "kafka.bootstrap_servers")),
        "kafka sasl": f"{host}:{sasl_ssl}  (SASL_SSL, SCRAM-SHA-512 or PLAIN as {kafka_user}, "
                      f"password: {kafka_password}; CA {ca})",
        "kafka ssl": f"{host}:{ssl}  (SSL, no client certificate; CA {ca})",
        "registry": str(config.get(conf, "registry.url")),
        "registry https": f"{registry.https_url(conf)}  (CA {ca})",
    }


def status_of(conf: dict, name: str) -> dict:
    """Status row of one service."""
    module = {"postgres": postgres, "kafka": kafka, "registry": registry}[name]
    return module.status(conf, stack_dir(conf))


def status(conf: dict) -> list[dict]:
    """One row per service: state, pid, port, version, log file (version servers once started here)."""
    cluster = [row for row in spark_cluster.status(conf, stack_dir(conf)) if row["state"] != "stopped"]
    return [status_of(conf, name) for name in SERVICES] + pg_versions.status(conf) + cluster


def logs(conf: dict, service: str | None = None, lines: int = 40) -> str:
    """The last lines of one service's log, or of all of them."""
    rows = [status_of(conf, service)] if service else status(conf)
    return "\n".join(f"==> {row['log']} <==\n{process.tail(Path(row['log']), lines)}\n" for row in rows)
