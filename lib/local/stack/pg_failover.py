"""A PostgreSQL primary and its physical standby with failover slots, beside the stack (issue 30, failover).

Both run zonky's binaries of the major (17 or newer: failover slots), like the version matrix's servers:
the primary in .stack/postgres-<major>-primary on port_base + major + 100, the standby in
.stack/postgres-<major>-standby on port_base + major + 200. The standby is a copy of the primary's data
folder taken while the primary is stopped (zonky ships no pg_basebackup; a cleanly stopped cluster's
folder is a valid base backup), and then streams from a physical slot. The settings are the ones
docs/reliability.md asks of a user's servers:

- primary: ``synchronized_standby_slots`` names the standby's physical slot, so a failover slot never
  sends the capture WAL the standby has not confirmed;
- standby: ``primary_slot_name``, a ``dbname`` in ``primary_conninfo``, ``hot_standby_feedback`` and
  ``sync_replication_slots`` (its slot sync worker keeps a copy of every failover slot).

The pair is single use: after ``promote`` the standby is a primary of its own; ``down`` removes both.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from pathlib import Path

import psycopg2
from psycopg2 import sql

from lib import config, source
from lib.capture.pgoutput import str_to_lsn
from lib.local.stack import pg_versions, postgres
from lib.local.stack.process import StackError

STANDBY_SLOT = "cdc_standby"  # the standby's physical slot on the primary
SHOP_TABLES = ["shop.items", "shop.events"]  # what make_shop creates and write_load writes
SHOP_DDL = """
CREATE SCHEMA shop;
CREATE TABLE shop.items (item_id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL);
CREATE TABLE shop.events (event_id bigserial PRIMARY KEY, item_id int, note text);
INSERT INTO shop.items SELECT g, 'item ' || g, 0 FROM generate_series(1, 2000) g;
"""


def confs(conf: dict, major: int = 18) -> tuple[dict, dict]:
    """(primary conf, standby conf): the major's binaries, each its own folder and port."""
    if major < 17:
        raise StackError(f"failover slots need PostgreSQL 17 or newer, not {major}")
    base = pg_versions.conf_for(conf, major)
    pair = []
    for role, offset in (("primary", 100), ("standby", 200)):
        member = copy.deepcopy(base)
        member["source"]["port"] = int(base["source"]["port"]) + offset
        member["stack"]["postgres"]["folder"] = f"postgres-{major}-{role}"
        pair.append(member)
    return pair[0], pair[1]


def up(conf: dict, major: int = 18, log=print) -> tuple[dict, dict]:
    """Start the primary, make the standby from it once, start the standby and wait until it streams."""
    primary, standby = confs(conf, major)
    stack_dir = pg_versions.postgres_stack_dir(conf)
    pg_versions.ensure_binaries(pg_versions.conf_for(conf, major), log=log)
    postgres.start(primary, stack_dir, log=log)
    if not (postgres.layout(stack_dir, standby)["data"] / "PG_VERSION").is_file():
        _make_standby(primary, standby, stack_dir, log)
    postgres.start(standby, stack_dir, log=log, roles=False)
    _wait_streaming(primary, stack_dir)
    return primary, standby


def promote(standby: dict) -> None:
    """Promote the standby (pg_ctl promote, waiting until it accepts writes)."""
    where = postgres.layout(pg_versions.postgres_stack_dir(standby), standby)
    command = [str(postgres.bin_dir(standby) / "pg_ctl"), "-D", str(where["data"]), "-w", "promote"]
    result = subprocess.run(postgres.as_server_user(command, standby), capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"the standby on port {standby['source']['port']} did not promote; see {where['log']}",
                         details=result.stdout + result.stderr)


def crash(server: dict) -> None:
    """Stop a server as a crash would (pg_ctl stop -m immediate: no shutdown checkpoint, nothing flushed)."""
    where = postgres.layout(pg_versions.postgres_stack_dir(server), server)
    command = [str(postgres.bin_dir(server) / "pg_ctl"), "-D", str(where["data"]), "-m", "immediate", "-w", "stop"]
    subprocess.run(postgres.as_server_user(command, server), capture_output=True, text=True)


def down(conf: dict, major: int = 18, log=print) -> None:
    """Stop both servers and remove their folders (the pair is made anew by the next up)."""
    stack_dir = pg_versions.postgres_stack_dir(conf)
    for member in confs(conf, major):
        link = stack_dir / postgres.folder_name(member)
        if not link.exists():
            continue
        postgres.stop(member, stack_dir, log=log)
        target = link.resolve()
        if link.is_symlink():
            link.unlink()
        shutil.rmtree(target, ignore_errors=True)


def superuser(server: dict, dbname: str = "postgres"):
    """The server's superuser over its private socket, autocommit."""
    conn = postgres.superuser_connect(server, postgres.layout(pg_versions.postgres_stack_dir(server), server), dbname)
    conn.autocommit = True
    return conn


def slot_row(server: dict, slot: str) -> tuple | None:
    """(failover, synced, confirmed_flush_lsn) of a slot on that server, or None."""
    conn = superuser(server)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT failover, synced, confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (slot,))
            return cur.fetchone()
    finally:
        conn.close()


def wait_synced(standby: dict, slot: str, past: str, timeout_s: float = 90.0) -> None:
    """Until the standby's copy of the slot (its slot sync worker's) is confirmed past the LSN given."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = slot_row(standby, slot)
        if row and row[1] and row[2] and str_to_lsn(row[2]) > str_to_lsn(past):
            return
        if time.monotonic() > deadline:
            raise StackError(f"slot {slot} was not synchronised past {past} on the standby within {timeout_s:.0f} s "
                             f"(found {row}): check sync_replication_slots and the standby's log")
        time.sleep(0.5)


def make_shop(primary: dict, database: str) -> None:
    """A database owned by the admin role with SHOP_TABLES, readable by the pipeline's role."""
    admin, user = config.get(primary, "source.admin_user"), config.get(primary, "source.user")
    root = superuser(primary)
    try:
        with root.cursor() as cur:
            cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(admin)))
            cur.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database),
                                                                            sql.Identifier(user)))
    finally:
        root.close()
    owner = source.connect(primary, admin=True, dbname=database)
    owner.autocommit = True
    try:
        with owner.cursor() as cur:
            cur.execute(SHOP_DDL)
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA shop TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA shop TO {0}")
                        .format(sql.Identifier(user)))
    finally:
        owner.close()


def write_load(conf: dict, stop, done: list, rows: int = 2000) -> None:
    """Small transactions on conf's source as the admin role until stop is set or the server goes away.

    Each updates shop.items and inserts into shop.events, every seventh also deletes the oldest event;
    done gets the number of each committed one.
    """
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    n = 0
    try:
        with conn.cursor() as cur:
            while not stop.is_set():
                n += 1
                cur.execute("BEGIN")
                cur.execute("UPDATE shop.items SET qty = qty + 1 WHERE item_id = %s", (n % rows + 1,))
                cur.execute("INSERT INTO shop.events (item_id, note) VALUES (%s, %s)", (n % rows + 1, f"n{n}"))
                if n % 7 == 0:
                    cur.execute("DELETE FROM shop.events WHERE event_id = (SELECT min(event_id) FROM shop.events)")
                cur.execute("COMMIT")
                done.append(n)
                time.sleep(0.005)
    except psycopg2.Error:
        pass  # the server crashed under it: what a failover drill does
    finally:
        conn.close()


def _make_standby(primary: dict, standby: dict, stack_dir: Path, log) -> None:
    """The standby's folder: the stopped primary's, with the standby's settings and no slots of its own."""
    source_where, target_where = postgres.layout(stack_dir, primary), postgres.layout(stack_dir, standby)
    conn = superuser(primary)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (STANDBY_SLOT,))
            if cur.fetchone() is None:
                cur.execute("SELECT pg_create_physical_replication_slot(%s, true)", (STANDBY_SLOT,))
            cur.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'")
    finally:
        conn.close()
    postgres.stop(primary, stack_dir, log=log)
    try:
        shutil.copytree(source_where["data"], target_where["data"], symlinks=True,
                        ignore=shutil.ignore_patterns("postmaster.pid", "postmaster.opts"))
    finally:
        postgres.start(primary, stack_dir, log=log)
    for slot in (target_where["data"] / "pg_replslot").iterdir():
        shutil.rmtree(slot)
    conninfo = (f"host={source_where['socket']} port={primary['source']['port']} "
                f"user={config.get(primary, 'stack.postgres.superuser')} dbname=postgres application_name=standby")
    settings = {"primary_conninfo": conninfo, "primary_slot_name": STANDBY_SLOT, "hot_standby_feedback": "on",
                "sync_replication_slots": "on", "synchronized_standby_slots": ""}  # that slot is the primary's
    with open(target_where["data"] / "postgresql.auto.conf", "a") as auto:
        auto.writelines(f"{name} = '{value}'\n" for name, value in settings.items())
    (target_where["data"] / "standby.signal").touch()
    user = config.get(standby, "stack.postgres.superuser")
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", f"{user}:", str(target_where["data"])], check=True)
    log(f"postgres  standby made from the primary on port {primary['source']['port']}")


def _wait_streaming(primary: dict, stack_dir: Path, timeout_s: float = 60.0) -> None:
    """Until the primary sees its standby streaming from the physical slot."""
    deadline = time.monotonic() + timeout_s
    conn = superuser(primary)
    try:
        with conn.cursor() as cur:
            while True:
                cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (STANDBY_SLOT,))
                row = cur.fetchone()
                if row and row[0]:
                    return
                if time.monotonic() > deadline:
                    raise StackError(f"the standby did not stream from slot {STANDBY_SLOT} within {timeout_s:.0f} s; "
                                     f"see {postgres.layout(stack_dir, primary)['log'].parent}")
                time.sleep(0.2)
    finally:
        conn.close()
