"""Tear the pipeline down on the source: drop the slot and the publication (and optionally the topics).

``plan(conf)`` says what exists and what would be lost; ``run(conf, confirm=True)`` drops it
(``make teardown YES=1``, ``python -m lib.operate.teardown --yes``). Without the confirmation it drops
nothing and raises ``TeardownRefused`` naming what would be lost. It refuses while a capture or
merge service of this pipeline runs, or while any process streams from the slot.

What goes: the replication slot (changes it still holds for the capture are lost to the pipeline,
and WAL it retained is released), the publication, the ``snapshot/<slot>`` control record (so the
next notebook 02 takes a full new snapshot instead of expecting the dropped slot), and with
``topics=True`` every table topic, the control topic and their schema registry subjects.
What stays: the Delta tables under ``lake.root`` (bronze, silver, dead letters, checkpoints) and
the services' logs and metrics history.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from psycopg2 import sql

from lib import config, control, kafka_client, schema_registry, source
from lib.capture import incremental, slot_position
from lib.lake import lake_paths
from lib.operate import monitor, service


class TeardownError(RuntimeError):
    """Tearing down is not possible now (something still runs); the message names it and the remedy."""


class TeardownRefused(TeardownError):
    """No confirmation was given; the message lists what would be lost."""


def plan(conf: dict, topics: bool = False) -> dict:
    """What exists and would be dropped: slot, publication, control record, topics and subjects, running services."""

    slot, publication = config.get(conf, "source.slot"), config.get(conf, "source.publication")
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        slot_row = monitor.slot_row(conf, conn)
        with conn.cursor() as cur:
            cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s "
                        "ORDER BY 1", (publication,))
            published = [row[0] for row in cur.fetchall()]
            cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
            has_publication = cur.fetchone() is not None
    finally:
        conn.close()
    try:
        records = control.read_all(conf)
    except control.ControlError:
        records = {}
    record = records.get(f"snapshot/{slot}")
    retired = [t for key, r in records.items() if key.startswith(incremental.rekey_key(slot, ""))
               for t in r["retired_topics"]]
    names = [spec.topic for spec in lake_paths.table_specs(conf)] + retired + [control.topic(conf)]
    found_topics, subjects = {}, []
    if topics:
        found_topics = {t: sum(p.values()) for t, p in monitor.end_offsets(conf, names).items()}
        wanted = {s for t in names for s in schema_registry.subjects(t)}
        subjects = sorted(schema_registry.existing(schema_registry.client(conf), wanted))
    return {"slot": slot, "slot_row": slot_row, "publication": publication if has_publication else None,
            "published_tables": published, "snapshot_record": record, "topics": found_topics, "subjects": subjects,
            "running": [row["service"] for row in service.status(conf) if row["state"] == "running"]}


def losses(p: dict) -> list[str]:
    """One line per thing that would be dropped and what that loses."""
    lines = []
    row = p["slot_row"]
    if row:
        lines.append(
            f"replication slot {p['slot']}: changes committed after {row['confirmed_flush_lsn']} that the capture "
            f"has not delivered ({monitor.human_size(row['lag_bytes'])} of WAL) are lost to the pipeline, and "
            f"{monitor.human_size(row['retained_wal_bytes'])} of retained WAL is released; continuing needs a new "
            f"snapshot (notebook 02)")
    if p["publication"]:
        lines.append(f"publication {p['publication']} ({', '.join(p['published_tables']) or 'no tables'})")
    if p["snapshot_record"]:
        lines.append(f"control record snapshot/{p['slot']} (state {p['snapshot_record'].get('state')}): the next "
                     f"notebook 02 run takes a full new snapshot")
    for topic, messages in p["topics"].items():
        lines.append(f"topic {topic}: {messages} message(s) (a table's change log, or the pipeline's control records)")
    if p["subjects"]:
        lines.append(f"registry subjects: {', '.join(p['subjects'])}")
    return lines


def run(conf: dict, topics: bool = False, confirm: bool = False, log=print) -> dict:
    """Drop what plan() lists, only with confirm=True; returns the plan with 'dropped' (one line per thing)."""
    p = plan(conf, topics)
    lost = losses(p)
    if p["running"]:
        raise TeardownError(f"the {' and '.join(p['running'])} service(s) of slot {p['slot']} still run: stop them "
                            f"first ({config.make(conf, 'stop')}, service.stop(conf)); nothing was dropped")
    row = p["slot_row"]
    if row and row["active"]:
        raise TeardownError(f"replication slot {p['slot']} is in use by process {row['active_pid']} (a capture, a "
                            f"notebook 03 run or a snapshot): stop it first; nothing was dropped")
    if not lost:
        log(f"teardown  nothing to drop for slot {p['slot']} / publication {config.get(conf, 'source.publication')}")
        return {**p, "dropped": []}
    if not confirm:
        raise TeardownRefused(
            "teardown needs confirmation; it would drop:\n" + "\n".join(f"  - {line}" for line in lost)
            + "\nKept: the Delta tables under lake.root and the services' logs and metrics.\nNothing was dropped; to "
              f"go ahead run {config.make(conf, 'teardown YES=1' + (' TOPICS=1' if topics else ''))} ("
            + config.command(conf, "lib.operate.teardown", "--yes" + (" --topics" if topics else ""))
            + ", or teardown.run(conf, confirm=True))")
    dropped = []
    if row:
        _drop_slot(conf, p["slot"])
        dropped.append(f"slot {p['slot']}")
    if p["publication"]:
        admin = source.connect(conf, admin=True)
        admin.autocommit = True
        try:
            with admin.cursor() as cur:
                cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(p["publication"])))
        finally:
            admin.close()
        dropped.append(f"publication {p['publication']}")
    if p["snapshot_record"] and not (topics and control.topic(conf) in p["topics"]):
        control.put(conf, f"snapshot/{p['slot']}", None)
        control.put(conf, slot_position.key(p["slot"]), None)  # the capture's last confirmed position
        dropped.append(f"control records snapshot/{p['slot']} and {slot_position.key(p['slot'])}")
    if p["topics"]:
        _delete_topics(conf, list(p["topics"]))
        dropped.append(f"{len(p['topics'])} topic(s)")
    if p["subjects"]:
        registry = schema_registry.client(conf)
        for subject in p["subjects"]:
            for permanent in (False, True):
                with contextlib.suppress(Exception):  # already soft-deleted, or the registry keeps no versions
                    registry.delete_subject(subject, permanent=permanent)
        dropped.append(f"{len(p['subjects'])} registry subject(s)")
    for line in dropped:
        log(f"teardown  dropped {line}")
    return {**p, "dropped": dropped}


def _drop_slot(conf: dict, slot: str) -> None:
    """Drop the slot (the pipeline role has REPLICATION); an active slot -> TeardownError."""
    import psycopg2

    conn = source.connect(conf)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                        (slot,))
    except psycopg2.errors.ObjectInUse as exc:
        raise TeardownError(f"replication slot {slot} became active while tearing down: stop the process that "
                            f"streams from it, then run the teardown again") from exc
    finally:
        conn.close()


def _delete_topics(conf: dict, names: list[str], timeout: float = 30.0) -> None:
    """Delete topics and wait for Kafka to confirm."""

    admin = kafka_client.admin(conf)
    for topic, future in admin.delete_topics(names, operation_timeout=timeout).items():
        try:
            future.result(timeout)
        except Exception as exc:  # noqa: BLE001 - name the topic and go on with the rest
            raise TeardownError(f"could not delete topic {topic}: {exc}; delete it with kafka-topics.sh or run the "
                                f"teardown again") from exc


def main(argv: list[str] | None = None) -> int:
    """python -m lib.operate.teardown [--target local] [--topics] [--yes]; exit 2 when refused for lack of --yes."""
    parser = argparse.ArgumentParser(prog="python -m lib.operate.teardown", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    parser.add_argument("--topics", action="store_true", help="also delete the topics and their registry subjects")
    parser.add_argument("--yes", action="store_true", help="confirm: without it nothing is dropped")
    args = parser.parse_args(argv)
    try:
        run(config.load(args.target), topics=args.topics, confirm=args.yes)
    except TeardownRefused as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


def delete_prefix(conf: dict, prefix: str) -> list[str]:
    """Delete every topic and registry subject whose name starts with prefix (test and benchmark clean-up)."""
    kafka = kafka_client.admin(conf)
    doomed = [t for t in kafka.list_topics(timeout=10).topics if t.startswith(prefix)]
    for future in (kafka.delete_topics(doomed).values() if doomed else []):
        with contextlib.suppress(Exception):
            future.result(30)
    registry = schema_registry.client(conf)
    named = {s for t in doomed for s in schema_registry.subjects(t)}  # asked by name: the list below is paged
    for subject in sorted(named | {s for s in registry.get_subjects() if s.startswith(prefix)}):
        for permanent in (False, True):
            with contextlib.suppress(Exception):
                registry.delete_subject(subject, permanent=permanent)
    return doomed
