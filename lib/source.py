"""Connections to the source PostgreSQL, as the pipeline role or the setup (admin) role."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading

import psycopg2
import psycopg2.extras

from lib import config, secrets


class SourceError(ConnectionError):
    """The source database could not be reached or refused the credentials."""


def dsn(conf: dict, admin: bool = False, dbname: str | None = None) -> str:
    """A libpq connection string with the resolved password (for tools that want a DSN)."""
    user_key, password_key = _keys(admin)
    return psycopg2.extensions.make_dsn(
        host=config.get(conf, "source.host"), port=config.get(conf, "source.port"),
        user=config.get(conf, user_key), dbname=dbname or config.get(conf, "source.database"),
        password=secrets.setting(conf, password_key), **tls(conf))


SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def tls(conf: dict) -> dict[str, str]:
    """sslmode and sslrootcert from conf (source.sslmode, source.sslrootcert), for libpq and for JDBC alike."""
    mode = config.get(conf, "source.sslmode")
    root = config.pem_file(conf, "source.sslrootcert", "the server's certificate")
    where = conf.get("conf_file", "conf")
    params = {}
    if mode:
        if str(mode) not in SSLMODES:
            raise SourceError(f"source.sslmode in {where} is {mode!r}; use one of {', '.join(SSLMODES)} "
                              f"(verify-full checks the server's certificate and name)")
        params["sslmode"] = str(mode)
    if root:
        params["sslrootcert"] = root
    return params


def _keys(admin: bool) -> tuple[str, str]:
    """Conf keys of the role's name and password."""
    return ("source.admin_user", "source.admin_password") if admin else ("source.user", "source.password")


def connect(conf: dict, admin: bool = False, dbname: str | None = None, replication: bool = False,
            settings: dict[str, str] | None = None, **options):
    """A psycopg2 connection; replication=True gives a LogicalReplicationConnection.

    settings are session parameters set after connecting, each only where the server has it (e.g.
    idle_session_timeout exists from PostgreSQL 14): a startup option the server does not know fails the login.
    """
    user_key, password_key = _keys(admin)
    host, port = config.get(conf, "source.host"), int(config.get(conf, "source.port"))
    user = config.get(conf, user_key)
    database = dbname or config.get(conf, "source.database")
    params = dict(host=host, port=port, user=user, dbname=database, connect_timeout=options.pop("connect_timeout", 10),
                  application_name=config.get(conf, "spark.app_name"), **tls(conf), **options)
    if replication:
        params["connection_factory"] = psycopg2.extras.LogicalReplicationConnection
    try:
        conn = psycopg2.connect(password=secrets.setting(conf, password_key), **params)
    except psycopg2.OperationalError as exc:
        # libpq's message: 'connection to server at ... failed: <cause>', sometimes a hint line after it
        reason = ". ".join(line.strip() for line in str(exc).strip().splitlines()) or type(exc).__name__
        if "password authentication failed" in str(exc):
            remedy = (f"check the secret {secrets.describe(config.get(conf, password_key))} "
                      f"({password_key}) and the role {user}")
        elif "certificate verify failed" in str(exc) or "root certificate" in str(exc):
            remedy = ("the server's certificate is not signed by the CA in source.sslrootcert; set it to the PEM "
                      "file of the CA that signed it (managed services publish theirs)")
        elif "does not support SSL" in str(exc):
            remedy = (f"source.sslmode {config.get(conf, 'source.sslmode')} needs TLS, which the server at "
                      f"{host}:{port} does not offer; turn ssl on there, or lower source.sslmode")
        elif "does not exist" in str(exc):
            remedy = f"check {user_key} and source.database in {conf.get('conf_file')}"
        else:
            remedy = (f"check that PostgreSQL runs at {host}:{port} (source.host, source.port; "
                      f"locally `make up`)")
        raise SourceError(f"cannot connect to PostgreSQL {host}:{port}/{database} as {user}: "
                          f"{reason}; {remedy}") from exc
    if settings:
        set_known(conn, settings)
    return conn


@contextlib.contextmanager
def bounded(conn, seconds: float):
    """Cut conn's socket (psycopg2 then raises OperationalError) if the block inside runs longer than seconds.

    libpq waits for a reply as long as the network keeps the connection open; a link that stalls instead of
    failing would block the caller for good."""
    def cut() -> None:
        with contextlib.suppress(OSError, psycopg2.Error):
            socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield conn
    finally:
        timer.cancel()


def set_known(conn, settings: dict[str, str]) -> list[str]:
    """Set each session parameter the server has (outside a transaction); the names it set."""
    names = list(settings)
    with conn.cursor() as cur:  # also on a replication connection: its walsender takes SQL (replication=database)
        cur.execute("SELECT name, set_config(name, (%s::jsonb ->> name), false) FROM pg_settings "
                    "WHERE name = ANY(%s)", (json.dumps({k: str(v) for k, v in settings.items()}), names))
        done = [row[0] for row in cur.fetchall()]
    if not getattr(conn, "autocommit", True) and conn.get_transaction_status():
        conn.commit()
    return done
