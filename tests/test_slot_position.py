"""The capture refuses a slot that does not continue what it confirmed (issue 30, point 1), and says why.

Unit tests of the check's rules, then the live cases on the stack's server: a slot advanced or created again
by hand, a slot that is gone, a server of another system. The failover itself (a promoted standby, with and
without failover slots) is in test_failover.py.
"""

from __future__ import annotations

import pytest
from slots import confirmed_lsn, wait_released

from lib import config, control, source
from lib.capture import slot_position, stream
from lib.capture.pgoutput import lsn_to_str, str_to_lsn
from lib.capture.stream_state import StreamError

IDENTITY = {"system_identifier": "7000", "timeline": 2}
HISTORY = "1\t0/3000000\tno recovery target specified\n"


def _check(recorded: dict | None, confirmed: int, identity: dict = IDENTITY, history: str = HISTORY) -> None:
    slot_position.check("s1", recorded, confirmed, identity, lambda timeline: history, "db:5432")


def test_a_slot_behind_the_record_replays_and_one_past_it_is_refused():
    recorded = slot_position.record(IDENTITY, str_to_lsn("0/5000000"))
    _check(recorded, str_to_lsn("0/4000000"))  # a failover slot synced a moment before: a replay, harmless
    _check(recorded, str_to_lsn("0/5000000"))
    with pytest.raises(StreamError, match=r"slot s1 on db:5432 is confirmed to 0/5000001, past 0/5000000, the last "
                                          r"position this capture confirmed.*resnapshot=True"):
        _check(recorded, str_to_lsn("0/5000001"))
    _check(None, str_to_lsn("9/0"))  # nothing recorded yet: the record starts now


def test_another_system_is_refused_with_where_to_point():
    recorded = slot_position.record({"system_identifier": "6999", "timeline": 2}, 1)
    with pytest.raises(StreamError, match=r"system 7000, but the capture confirmed 0/1 on system 6999.*source\.host"):
        _check(recorded, 0)


def test_a_promotion_is_accepted_only_when_the_record_is_below_the_fork():
    assert slot_position.fork_point(HISTORY, 1) == str_to_lsn("0/3000000")
    assert slot_position.fork_point(HISTORY, 2) is None
    below = slot_position.record({**IDENTITY, "timeline": 1}, str_to_lsn("0/3000000"))
    _check(below, str_to_lsn("0/2000000"))
    above = slot_position.record({**IDENTITY, "timeline": 1}, str_to_lsn("0/3000100"))
    with pytest.raises(StreamError, match=r"timeline 2 \(a promoted standby\) and its history forked from timeline 1 "
                                          r"at 0/3000000, but the capture confirmed 0/3000100.*synchronized_standby_"
                                          r"slots"):
        _check(above, str_to_lsn("0/2000000"))
    unrelated = slot_position.record({**IDENTITY, "timeline": 5}, 1)
    with pytest.raises(StreamError, match="timeline 5 is not in its history"):
        _check(unrelated, 0, identity={**IDENTITY, "timeline": 7})


def _run(conf: dict) -> None:
    stream.run(conf, until="caught_up", heartbeat_s=0)


def _write(src, *statements: str) -> None:
    with src.admin.cursor() as cur:
        for statement in statements:
            cur.execute(statement.format(s=src.schema))


def _recorded(conf: dict) -> dict | None:
    return control.read_all(conf).get(slot_position.key(config.get(conf, "source.slot")))


def _as_pipeline(conf: dict, statement: str, *args) -> None:
    """A statement as the pipeline's role (REPLICATION: it may create, advance and drop slots)."""
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(statement, args)
    finally:
        conn.close()


@pytest.mark.stack
def test_the_capture_records_what_it_confirmed_before_the_slot_hears_of_it(small_source):
    src = small_source("CREATE TABLE {s}.t (id int PRIMARY KEY, v text)")
    _write(src, "INSERT INTO {s}.t VALUES (1, 'a')")
    _run(src.conf)
    wait_released(src.conf)
    recorded = _recorded(src.conf)
    assert recorded is not None and str_to_lsn(recorded["lsn"]) == confirmed_lsn(src.conf), recorded
    assert set(recorded) == {"lsn", "system_identifier", "timeline"} and recorded["timeline"] >= 1


@pytest.mark.stack
def test_a_slot_advanced_by_hand_stops_the_capture_and_stays_where_it_was(small_source):
    src = small_source("CREATE TABLE {s}.t (id int PRIMARY KEY, v text)")
    _run(src.conf)
    wait_released(src.conf)
    _write(src, "INSERT INTO {s}.t VALUES (1, 'a')")
    slot = config.get(src.conf, "source.slot")
    _as_pipeline(src.conf, "SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", slot)
    advanced = confirmed_lsn(src.conf)
    with pytest.raises(StreamError, match=rf"slot {slot} on .* is confirmed to {lsn_to_str(advanced)}, past .*the "
                                          r"changes in between are in no topic.*resnapshot=True"):
        _run(src.conf)
    assert confirmed_lsn(src.conf) == advanced


@pytest.mark.stack
def test_a_slot_created_again_by_hand_stops_the_capture(small_source):
    src = small_source("CREATE TABLE {s}.t (id int PRIMARY KEY, v text)")
    _write(src, "INSERT INTO {s}.t VALUES (1, 'a')")
    _run(src.conf)
    wait_released(src.conf)
    slot = config.get(src.conf, "source.slot")
    _as_pipeline(src.conf, "SELECT pg_drop_replication_slot(%s)", slot)
    with pytest.raises(StreamError, match=rf"replication slot {slot} \(source.slot\) does not exist on .*its snapshot "
                                          r"is complete.*lost in a failover.*Do not create it by hand.*resnapshot"):
        _run(src.conf)
    _write(src, "INSERT INTO {s}.t VALUES (2, 'b')")  # committed while no slot existed: in no slot now
    _as_pipeline(src.conf, "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", slot)
    with pytest.raises(StreamError, match=r"past .*the last position this capture confirmed: something else created "
                                          r"the slot again"):
        _run(src.conf)


@pytest.mark.stack
def test_a_record_from_another_system_stops_the_capture(small_source):
    src = small_source("CREATE TABLE {s}.t (id int PRIMARY KEY, v text)")
    _run(src.conf)
    wait_released(src.conf)
    recorded = _recorded(src.conf)
    control.put(src.conf, slot_position.key(config.get(src.conf, "source.slot")),
                {**recorded, "system_identifier": "42"})
    with pytest.raises(StreamError, match=r"but the capture confirmed .* on system 42: a restored backup or another "
                                          r"server has another WAL history"):
        _run(src.conf)
