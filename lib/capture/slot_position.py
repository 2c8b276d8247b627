"""What the capture last confirmed to its slot, recorded in the control topic before the slot hears of it.

The record (``position/<slot>``: the position, and the server's system identifier and timeline) is
what lets a starting capture tell a slot that continues its stream from one that does not:

- a slot confirmed past the record was moved by something else: created again (by hand, or by a
  failover tool, after a failover to a standby without failover slots), read by another client, or
  advanced with pg_replication_slot_advance. The changes in between are in no topic;
- a server of another system (a restored backup, a logical replica) has another history;
- a promoted standby whose timeline forked below the record never received some transactions the
  capture delivered (the primary ran without synchronized_standby_slots), so silver may keep rows
  that do not exist there.

Each stops the capture with the remedy (a new snapshot) instead of streaming on with a gap. A slot
confirmed below the record (a failover slot synchronised a moment before the failover) only replays
events Kafka has already: harmless, silver applies each position once.
"""

from __future__ import annotations

import json
import time

from lib import config, control, kafka_client
from lib.capture.pgoutput import lsn_to_str, str_to_lsn
from lib.capture.stream_state import State, StreamError

RECORD_INTERVAL_S = 1.0  # how often a moving position is recorded: the cadence of the slot's feedback
REMEDY = ("take a new snapshot (notebook 02 with resnapshot=True, or lib.capture.snapshot.run(conf, spark, "
          "resnapshot=True)); to keep a capture across failovers use failover slots (docs/reliability.md, "
          "\"Failover\")")


def failover_refusal(conf: dict, server_version: int) -> str | None:
    """Why source.failover_slot cannot be honoured on this server, or None (failover slots: PostgreSQL 17+)."""
    if not config.get(conf, "source.failover_slot") or server_version >= 170000:
        return None
    return (f"source.failover_slot is true, but failover slots need PostgreSQL 17 or newer (this server is "
            f"{server_version}): upgrade, or set source.failover_slot: false (after a failover the capture then "
            f"stops and asks for a new snapshot)")


def key(slot: str) -> str:
    return f"position/{slot}"


def identify(repl) -> dict:
    """The server's system identifier and timeline (IDENTIFY_SYSTEM on a replication connection)."""
    with repl.cursor() as cur:
        cur.execute("IDENTIFY_SYSTEM")
        system_identifier, timeline, _, _ = cur.fetchone()
    return {"system_identifier": str(system_identifier), "timeline": int(timeline)}


def record(identity: dict, lsn: int) -> dict:
    return {**identity, "lsn": lsn_to_str(lsn)}


def history(repl, timeline: int) -> str:
    """The timeline's history file (TIMELINE_HISTORY): a line per ancestor, 'parent switchpoint reason'."""
    with repl.cursor() as cur:
        cur.execute(f"TIMELINE_HISTORY {int(timeline)}")
        content = cur.fetchone()[1]
    return bytes(content).decode() if not isinstance(content, str) else content


def fork_point(history_text: str, timeline: int) -> int | None:
    """Where the history says timeline ended (a standby's promotion), or None when it is not an ancestor."""
    for line in history_text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit() and int(fields[0]) == timeline:
            return str_to_lsn(fields[1])
    return None


def check(slot: str, recorded: dict | None, confirmed: int, identity: dict, read_history, server: str) -> None:
    """Refuse a slot that does not continue what the capture confirmed (see the module's docstring)."""
    if not recorded:
        return  # recorded from this run on (a pipeline that began before records existed)
    lsn = str_to_lsn(recorded["lsn"])
    where = f"slot {slot} on {server}"
    if recorded.get("system_identifier") not in (None, identity["system_identifier"]):
        raise StreamError(
            f"{where}: this server is PostgreSQL system {identity['system_identifier']}, but the capture confirmed "
            f"{recorded['lsn']} on system {recorded['system_identifier']}: a restored backup or another server has "
            f"another WAL history, and its slot cannot continue this stream. Point source.host and source.port at "
            f"the server the snapshot was taken on (or its promoted standby), or {REMEDY}")
    if confirmed > lsn:
        raise StreamError(
            f"{where} is confirmed to {lsn_to_str(confirmed)}, past {recorded['lsn']}, the last position this "
            f"capture confirmed: something else created the slot again (after a failover to a standby without "
            f"failover slots, or by hand), read from it, or advanced it, and the changes in between are in no "
            f"topic. Do not stream from it: {REMEDY}")
    before = int(recorded.get("timeline", identity["timeline"]))
    if before < identity["timeline"]:
        fork = fork_point(read_history(identity["timeline"]), before)
        if fork is None or lsn > fork:
            found = (f"its history forked from timeline {before} at {lsn_to_str(fork)}" if fork is not None else
                     f"timeline {before} is not in its history")
            raise StreamError(
                f"{where} is on timeline {identity['timeline']} (a promoted standby) and {found}, but the "
                f"capture confirmed {recorded['lsn']} on timeline {before}: transactions it delivered to Kafka may "
                f"never have reached this server (the old primary ran without synchronized_standby_slots), so "
                f"silver may hold rows that do not exist here. Set synchronized_standby_slots on the primary, "
                f"then {REMEDY}")


# ---------------------------------------------------------------------------------------------
# in the capture's loop: the slot hears of a position only after Kafka acknowledged its record


def release(st: State) -> None:
    """Tell the replication cursor the newest position that Kafka acknowledged, events and record both."""
    st.cursor.acknowledge(min(st.acks.acked, st.acks.recorded))


def maybe_record(st: State, now: float, force: bool = False) -> None:
    """Send a record of the acknowledged position when it moved (every RECORD_INTERVAL_S, or now with force)."""
    acks = st.acks
    if acks.recording is not None or (acks.acked <= acks.recorded and not acks.record_due):
        return
    if not force and now - acks.last_record < RECORD_INTERVAL_S:
        return
    acks.recording, acks.last_record, lsn = acks.acked, now, acks.acked
    value = json.dumps(record(st.identity, lsn), sort_keys=True).encode()
    st.producer.produce(control.topic(st.conf), key=key(st.slot).encode(), value=value,
                        on_delivery=lambda err, msg: _recorded(st, lsn, err, msg))


def _recorded(st: State, lsn: int, err, msg) -> None:
    st.acks.recording = None
    if err is not None:
        st.acks.delivery_errors.append((msg.topic(), msg.partition(), err))
        return
    st.acks.recorded, st.acks.record_due = max(st.acks.recorded, lsn), False
    release(st)


def record_now(st: State, timeout_s: float) -> None:
    """At the capture's stop: record the acknowledged position and wait for Kafka (bounded)."""
    with kafka_client.waiting_on(st.conf, "acknowledge the slot's position record"):
        _record_now(st, timeout_s)


def _record_now(st: State, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if st.acks.recording is None:  # none in flight (or one for a smaller position came back): send the newest
            if st.acks.acked <= st.acks.recorded and not st.acks.record_due:
                return
            maybe_record(st, time.monotonic(), force=True)
        st.producer.poll(0.1)

