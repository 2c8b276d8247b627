"""The stack's throwaway PostgreSQL cluster: logical replication on, its own port and folder."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg2
from psycopg2 import sql

from lib import config, secrets
from lib.local.stack import process, tls
from lib.local.stack.process import StackError

DEBIAN_BINARIES = Path("/usr/lib/postgresql")


def bin_dir(conf: dict) -> Path:
    """The server binaries (initdb, pg_ctl, postgres): stack.postgres.bin_dir, else the newest Debian major."""
    configured = config.get(conf, "stack.postgres.bin_dir", None)
    installed = sorted(DEBIAN_BINARIES.glob("*/bin/pg_ctl"), key=lambda path: int(path.parts[-3])
                       if path.parts[-3].isdigit() else 0)
    folder = Path(configured) if configured else installed[-1].parent if installed else DEBIAN_BINARIES / "N/bin"
    if not (folder / "pg_ctl").is_file():
        raise StackError(
            f"postgres: no server binaries in {folder}: install them with "
            f"`apt-get install -y postgresql` (`make install` does this as root) or set "
            f"stack.postgres.bin_dir"
        )
    return folder


def as_server_user(command: list[str], conf: dict) -> list[str]:
    """initdb and pg_ctl refuse root: run them as the postgres OS user when we are root."""
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", config.get(conf, "stack.postgres.superuser"), "--", *command]


def folder_name(conf: dict) -> str:
    """The cluster's folder under the stack's: postgres, or postgres-<major> for the version matrix's servers."""
    return config.get(conf, "stack.postgres.folder", "postgres")


def home(stack_dir: Path, conf: dict) -> Path:
    """The cluster's folder (.stack/<folder_name>, or a linked folder the server user can reach)."""
    name = folder_name(conf)
    link = stack_dir / name
    if link.exists():
        return link.resolve()
    link.parent.mkdir(parents=True, exist_ok=True)
    target = link
    if os.geteuid() == 0:
        user = config.get(conf, "stack.postgres.superuser")
        link.mkdir()
        shutil.chown(link, user=user)
        reachable = subprocess.run(["runuser", "-u", user, "--", "test", "-w", str(link)]).returncode == 0
        if not reachable:
            # a parent folder (e.g. /root) is closed to the postgres user: keep the data in
            # a folder it can reach and link it from the project
            link.rmdir()
            digest = hashlib.sha1(str(stack_dir.resolve()).encode()).hexdigest()[:10]
            target = Path(tempfile.gettempdir()) / f"cdc-stack-{digest}" / name
            target.mkdir(parents=True, exist_ok=True)
            shutil.chown(target.parent, user=user)
            shutil.chown(target, user=user)
            link.symlink_to(target, target_is_directory=True)
    else:
        link.mkdir()
    return target


def layout(stack_dir: Path, conf: dict) -> dict[str, Path]:
    """Data folder, log file, socket folder and TLS certificate and key of the cluster."""
    base = home(stack_dir, conf)
    socket_dir = base / "sock"
    if len(str(socket_dir)) > 80:  # Unix socket paths are limited to ~107 bytes
        digest = hashlib.sha1(str(base).encode()).hexdigest()[:10]
        socket_dir = Path(tempfile.gettempdir()) / f"cdc-pg-{digest}"
    return {"data": base / "data", "log": base / "postgres.log", "socket": socket_dir,
            "tls": base / "tls", "cert": base / "tls" / "server.pem", "key": base / "tls" / "server-key.pem"}


def superuser_connect(conf: dict, where: dict[str, Path], dbname: str = "postgres"):
    """A superuser connection over the private Unix socket (trusted locally only)."""
    return psycopg2.connect(
        host=str(where["socket"]), port=int(config.get(conf, "source.port")),
        user=config.get(conf, "stack.postgres.superuser"), dbname=dbname, connect_timeout=5,
    )


def running_pid(where: dict[str, Path]) -> int | None:
    """Postmaster pid when the cluster runs (postgres itself handles stale lock files)."""
    pid = process.read_pid(where["data"] / "postmaster.pid")
    if pid and process.pid_alive(pid) and "postgres" in process.cmdline(pid):
        return pid
    return None


def version(conf: dict) -> str:
    """Server version, from the postgres binary."""
    try:
        binary = bin_dir(conf) / "postgres"
    except StackError:
        return "not installed"
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"\)\s+(\S+)", out)
    return found.group(1) if found else "?"


def init_cluster(conf: dict, where: dict[str, Path]) -> None:
    """initdb once: trust on the private socket, SCRAM passwords over TCP."""
    if (where["data"] / "PG_VERSION").is_file():
        return
    command = [str(bin_dir(conf) / "initdb"), "-D", str(where["data"]), "-U",
               config.get(conf, "stack.postgres.superuser"), "--auth-local=trust",
               "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"]
    result = subprocess.run(as_server_user(command, conf), capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"postgres: initdb into {where['data']} failed; fix the cause below and "
                         f"run `make up` again", details=result.stdout + result.stderr)


def install_certificate(conf: dict, stack_dir: Path, where: dict[str, Path]) -> bool:
    """Copy the stack's server certificate and key where the server user owns them; True when they changed.

    The server refuses a key that others may read or that another user owns (stack up runs as root, the
    server as stack.postgres.superuser).
    """
    source = tls.paths(stack_dir)
    changed = False
    for name in ("cert", "key"):
        data = source[name].read_bytes()
        if where[name].is_file() and where[name].read_bytes() == data:
            continue
        where["tls"].mkdir(mode=0o700, exist_ok=True)
        tls.write(where[name], data, private=True)
        changed = True
    if os.geteuid() == 0:
        owner = config.get(conf, "stack.postgres.superuser")
        for path in (where["tls"], where["cert"], where["key"]):
            shutil.chown(path, user=owner)
    return changed


def server_options(conf: dict, where: dict[str, Path]) -> str:
    """Start options: own port and socket, loopback only, logical decoding, TLS with the stack's certificate."""
    fsync = "on" if config.get(conf, "stack.postgres.fsync") else "off"
    options = {
        "port": config.get(conf, "source.port"),
        "listen_addresses": config.get(conf, "source.host"),
        "unix_socket_directories": where["socket"],
        "wal_level": "logical",
        "max_replication_slots": 40,  # make test runs two workers, each with its own slots
        "max_wal_senders": 40,
        "max_slot_wal_keep_size": config.get(conf, "stack.postgres.max_slot_wal_keep_size"),
        "fsync": fsync,
        # TLS for clients that ask (sslmode=require/verify-full); pg_hba's host lines take plain TCP too
        "ssl": "on",
        "ssl_cert_file": where["cert"],
        "ssl_key_file": where["key"],
    }
    return " ".join(f"-c {key}={value}" for key, value in options.items())


def start(conf: dict, stack_dir: Path, log=print, roles: bool = True) -> None:
    """Start the cluster (initialising it on first use) and make the roles and databases (not on a standby)."""
    where = layout(stack_dir, conf)
    port = int(config.get(conf, "source.port"))
    tls.ensure(stack_dir, log=log)
    renewed = install_certificate(conf, stack_dir, where)
    if running_pid(where):
        log(f"postgres  already running on port {port}")
        if renewed:
            reload(conf, where)
    else:
        process.require_free_port("postgres", config.get(conf, "source.host"), port, "source.port")
        init_cluster(conf, where)
        where["socket"].mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(where["socket"], user=config.get(conf, "stack.postgres.superuser"))
        timeout = int(config.get(conf, "stack.start_timeout_s"))
        command = [str(bin_dir(conf) / "pg_ctl"), "-D", str(where["data"]), "-l", str(where["log"]),
                   "-w", "-t", str(timeout), "-o", server_options(conf, where), "start"]
        result = subprocess.run(as_server_user(command, conf), capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"postgres did not start on port {port}; see {where['log']}",
                             details=process.tail(where["log"], 15))
        log(f"postgres  started on port {port}")
    if roles:
        ensure_roles(conf, where)


def reload(conf: dict, where: dict[str, Path]) -> None:
    """Make the running server read its configuration and certificate files again."""
    conn = superuser_connect(conf, where)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()


def ssl_on(conf: dict, stack_dir: Path) -> bool:
    """True when the running server accepts TLS (one started before the stack had TLS does not)."""
    conn = superuser_connect(conf, layout(stack_dir, conf))
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW ssl")
            return cur.fetchone()[0] == "on"
    finally:
        conn.close()


def ensure_roles(conf: dict, where: dict[str, Path]) -> None:
    """Admin, pipeline and registry roles with the current secrets; their databases."""
    admin = config.get(conf, "source.admin_user")
    pipeline = config.get(conf, "source.user")
    registry = config.get(conf, "stack.registry.user")
    roles = [
        (admin, "LOGIN CREATEDB", secrets.setting(conf, "source.admin_password")),
        (pipeline, "LOGIN REPLICATION", secrets.setting(conf, "source.password")),
        (registry, "LOGIN", secrets.setting(conf, "stack.registry.password")),
    ]
    databases = [(config.get(conf, "source.database"), admin),
                 (config.get(conf, "stack.registry.database"), registry)]
    conn = superuser_connect(conf, where)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for role, options, password in roles:
                cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                verb = "ALTER" if cur.fetchone() else "CREATE"
                cur.execute(sql.SQL(f"{verb} ROLE {{}} {options} PASSWORD %s").format(sql.Identifier(role)),
                            (password,))
            for database, owner in databases:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
                if not cur.fetchone():
                    cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(database), sql.Identifier(owner)))
            cur.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                sql.Identifier(config.get(conf, "source.database")), sql.Identifier(pipeline)))
            # locally the admin may end the pipeline's sessions (DROP DATABASE ... WITH (FORCE) of a test database)
            cur.execute(sql.SQL("GRANT pg_signal_backend TO {}").format(sql.Identifier(admin)))
    finally:
        conn.close()


def stop(conf: dict, stack_dir: Path, log=print) -> None:
    """Fast shutdown (rolls back open transactions, keeps the data)."""
    if not (stack_dir / folder_name(conf)).exists():
        return
    where = layout(stack_dir, conf)
    if not running_pid(where):
        return
    command = [str(bin_dir(conf) / "pg_ctl"), "-D", str(where["data"]), "-m", "fast", "-w", "stop"]
    result = subprocess.run(as_server_user(command, conf), capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"postgres did not stop; see {where['log']}", details=result.stderr)
    log("postgres  stopped")


def status(conf: dict, stack_dir: Path) -> dict:
    """What runs where, for `stack status`."""
    name = folder_name(conf)
    exists = (stack_dir / name).exists()
    where = layout(stack_dir, conf) if exists else {"log": stack_dir / name / "postgres.log"}
    pid = running_pid(where) if exists else None
    return {"service": name, "state": "running" if pid else "stopped", "pid": pid,
            "port": config.get(conf, "source.port"), "version": version(conf), "log": where["log"]}
