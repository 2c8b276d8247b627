"""The fresh reader's rule and masking on rows in memory (no stack): the silver MERGE's rule one message at a time."""

from __future__ import annotations

import hashlib
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal

import pytest

from lib.capture import events
from lib.lake import fresh_read
from lib.views import policy as masking_policy

KEYS, PAYLOAD = ["id"], ["name", "big"]


def _silver(ident, name, big, lsn, deleted=False, op="u"):
    return {"id": ident, "name": name, "big": big, "_commit_lsn": lsn, "_event_serial": 0, "_op": op,
            "_deleted": deleted, "_updated_at": None}


def _event(op, ident, lsn, serial=0, unchanged=(), before=None, **after):
    return ({"id": ident}, {"op": op, "before": before, "after": None if op == "d" else {"id": ident, **after},
                            "source": {"commit_lsn": lsn, "event_serial": serial, "ts_ms": 1_700_000_000_000},
                            "unchanged_cols": list(unchanged)}, None)


def _apply(state, *messages, wanted=None):
    rule = fresh_read.Rule(KEYS, PAYLOAD, wanted)
    for key, value, headers in messages:
        rule.apply(state, key, value, headers)
    return {k[0]: (r["name"], r["big"], r["_deleted"], r["_commit_lsn"]) for k, r in state.items()}


def test_the_newest_position_wins_whatever_the_arrival_order_and_toast_keeps_the_stored_value():
    state = {(1,): _silver(1, "a", "BIG", 100), (2,): _silver(2, "b", "B2", 300)}
    got = _apply(state, _event("u", 1, 200, unchanged=["big"], name="a2", big=None),
                 _event("u", 1, 150, name="older", big="x"),  # arrives after a newer one: changes nothing
                 _event("u", 2, 250, name="older than silver", big="y"),
                 _event("c", 3, 90, name="new key, old position", big="z"))  # a re-read's row: applied
    assert got == {1: ("a2", "BIG", False, 200), 2: ("b", "B2", False, 300), 3: ("new key, old position", "z",
                                                                                    False, 90)}


def test_a_delete_keeps_a_soft_tombstone_and_an_older_insert_does_not_bring_the_row_back():
    state = {(1,): _silver(1, "a", "A", 100)}
    got = _apply(state, _event("d", 1, 120, before={"id": 1}), _event("c", 1, 110, name="late", big="L"))
    assert got == {1: ("a", "A", True, 120)}


def test_tombstones_with_and_without_the_deletes_position():
    placed = ({"id": 1}, None, events.tombstone_headers(130, 0))
    bare = ({"id": 2}, None, None)
    state = {(1,): _silver(1, "a", "A", 100), (2,): _silver(2, "b", "B", 100)}
    got = _apply(state, placed, bare, _event("u", 2, 90, name="older", big="O"))
    assert got == {1: ("a", "A", True, 130), 2: ("b", "B", True, 100)}
    assert state[(2,)]["_op"] == "tombstone"
    # an event at the tombstone's own position that is no delete revives the row (silver's rule)
    assert _apply(state, _event("u", 2, 100, name="same position", big="S"))[2] == ("same position", "S", False, 100)


def test_a_key_change_deletes_the_old_key_at_the_updates_position():
    state = {(1,): _silver(1, "a", "A", 100)}
    got = _apply(state, _event("u", 5, 140, before={"id": 1, "name": "a", "big": "A"}, name="moved", big="M"))
    assert got == {1: ("a", "A", True, 140), 5: ("moved", "M", False, 140)}


def test_wanted_keys_only_and_a_key_change_away_from_one_still_deletes_it():
    state = {(1,): _silver(1, "a", "A", 100)}
    got = _apply(state, _event("c", 7, 120, name="not asked", big="N"),
                 _event("u", 9, 140, before={"id": 1}, name="moved", big="M"), wanted={(1,)})
    assert got == {1: ("a", "A", True, 140)}


POLICY = {"default": "drop", "tables": {"s.t": {"id": "keep", "email": "partial", "phone": "partial",
                                                "name": "partial", "born": "partial", "seen": "partial",
                                                "amount": "hash", "ref": "hash", "note": "redact", "n": "null"}}}


def test_masking_follows_the_policys_rules_and_drops_what_it_does_not_list(monkeypatch):
    row = {"id": 1, "email": "ann@example.org", "phone": "+1 (555) 010-4477", "name": "Ann", "secret": "s",
           "born": date(1990, 5, 17), "seen": datetime(2024, 3, 4, 5, 6, 7, tzinfo=timezone.utc),
           "amount": Decimal("0.0000001"), "ref": "r-1", "note": "private", "n": 5, "_updated_at": None}
    monkeypatch.setenv("CDC_TEST_UNIT_SALT", "pepper")
    key = masking_policy.derive_key("pepper")
    masked = fresh_read.mask({}, "s.t", [row], {**POLICY, "salt": {"env": "CDC_TEST_UNIT_SALT"}})[0]
    assert masked == {
        "id": 1, "email": "***@example.org", "phone": "***4477", "name": "A***", "born": date(1990, 1, 1),
        "seen": datetime(2024, 1, 1, tzinfo=timezone.utc),
        "amount": hashlib.sha256((key + "0.0000001").encode()).hexdigest(),  # Spark's plain decimal text
        "ref": hashlib.sha256((key + "r-1").encode()).hexdigest(), "note": masking_policy.REDACTED, "n": None,
        "_updated_at": None}


def test_a_value_the_reader_cannot_hash_as_spark_does_is_an_error_naming_the_column():
    with pytest.raises(masking_policy.MaskingError, match=r"s.t.ref: the fresh reader hashes strings"):
        fresh_read._masked("hash", uuid.uuid4().bytes, "k", "s.t.ref")
