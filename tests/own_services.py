"""A Kafka broker or a schema registry of a test's own: the stack's code and jars (lib/local/stack), with their own
folder, ports and data, so that a test may kill its broker or rely on the registry's next schema id while the
rest of the suite runs beside it on the stack's own services.

    overrides = own_broker(folder)      # conf overrides that point a pipeline at it
    overrides = own_registry(folder)
    stop(overrides)                     # stops whichever was started for those overrides
"""

from __future__ import annotations

import uuid
from pathlib import Path

from psycopg2 import sql

from lib import config
from lib.local import stack
from lib.local.stack import kafka, postgres, process, registry

quiet = lambda *_args, **_kwargs: None  # noqa: E731 - a log that drops lines


def _folder(base: dict, folder: str) -> Path:
    """folder as a stack folder: the stack's cache (jars, runner) linked in, its own certificate, logs and pids."""
    where = Path(folder)
    (where / "cache").symlink_to(stack.stack_dir(base) / "cache")
    return where


def _free_ports(host: str, start: int, count: int) -> int:
    """The first of count free consecutive ports from start on, in steps of 10."""
    return next(port for port in range(start, 32000, 10)
                if not any(process.port_in_use(host, port + i) for i in range(count)))


def _wait(conf: dict, module, where: Path, pid: int | None) -> None:
    paths = module.files(where)
    process.wait_ready(module.__name__.rsplit(".", 1)[-1], lambda: module.ready(conf),
                       float(config.get(conf, "stack.start_timeout_s")), paths["log"], pid, paths["pid"])


def own_broker(folder: str) -> dict:
    """Start a KRaft broker in folder on four free ports; the overrides that point a pipeline at it."""
    base = config.load("local")
    where = _folder(base, folder)
    host, port = kafka.endpoint(base)
    first = _free_ports(host, port + 100, 4)
    overrides = {"CDC__STACK__DIR": str(where), "CDC__KAFKA__BOOTSTRAP_SERVERS": f"{host}:{first}",
                 "CDC__STACK__KAFKA__CONTROLLER_PORT": str(first + 1),
                 "CDC__STACK__KAFKA__SASL_SSL_PORT": str(first + 2), "CDC__STACK__KAFKA__SSL_PORT": str(first + 3)}
    conf = config.apply_overrides(base, overrides)
    try:
        _wait(conf, kafka, where, kafka.start(conf, where, log=quiet))
        kafka.ensure_user(conf, where)
    except BaseException:
        stop(overrides)
        raise
    return overrides


def own_registry(folder: str) -> dict:
    """Start a registry in folder on three free ports, storing its schemas in a database of its own on the stack's
    PostgreSQL (as the stack's registry does); the overrides that point a pipeline at it."""
    base = config.load("local")
    where = _folder(base, folder)
    host, port = registry.endpoint(base)
    first = _free_ports(host, port + 100, 3)
    database = f"registry_{uuid.uuid4().hex[:8]}"
    overrides = {"CDC__STACK__DIR": str(where), "CDC__REGISTRY__URL": f"http://{host}:{first}/apis/ccompat/v7",
                 "CDC__STACK__REGISTRY__MANAGEMENT_PORT": str(first + 1),
                 "CDC__STACK__REGISTRY__HTTPS_PORT": str(first + 2), "CDC__STACK__REGISTRY__DATABASE": database}
    _database(base, database, create=True)
    conf = config.apply_overrides(base, overrides)
    try:
        _wait(conf, registry, where, registry.start(conf, where, log=quiet))
    except BaseException:
        stop(overrides)
        raise
    return overrides


def _database(base: dict, database: str, create: bool) -> None:
    """Create (owned by the registry's role) or drop a registry's storage database."""
    conn = postgres.superuser_connect(base, postgres.layout(stack.stack_dir(base), base))
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            if create:
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(database), sql.Identifier(config.get(base, "stack.registry.user"))))
            else:
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    finally:
        conn.close()


def stop(overrides: dict) -> None:
    """Stop what own_broker or own_registry started for overrides (and drop a registry's database)."""
    where = Path(overrides["CDC__STACK__DIR"])
    if "CDC__KAFKA__BOOTSTRAP_SERVERS" in overrides:
        kafka.stop(where, log=quiet)
    if "CDC__REGISTRY__URL" in overrides:
        registry.stop(where, log=quiet)
        _database(config.load("local"), overrides["CDC__STACK__REGISTRY__DATABASE"], create=False)
