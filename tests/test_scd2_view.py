"""The SCD type 2 view over bronze: one row per version, closed by the key's next event, masked like the clean view."""

from __future__ import annotations

import uuid

import pytest

from lib.views import changes, masking

BRONZE = ("key struct<id:int>, op string, after struct<id:int, email:string, note:string, qty:int, updated_by:string>, "
          "source struct<commit_lsn:bigint, event_serial:int, ts_ms:bigint, txId:bigint>, "
          "unchanged_cols array<string>, _tombstone boolean, _kafka_offset bigint")
CANARY = "canary-scd2@example.org"


def _event(key, op, after, lsn, serial, ts, tx, offset, unchanged=()):
    return ({"id": key}, op, after, {"commit_lsn": lsn, "event_serial": serial, "ts_ms": ts, "txId": tx},
            list(unchanged), False, offset)


def _row(key, email, note, qty, who="alice"):
    return {"id": key, "email": email, "note": note, "qty": qty, "updated_by": who}


@pytest.fixture(scope="module")
def versions(spark_session):
    events = [
        _event(1, "r", _row(1, CANARY, "long note", 1), 100, -1, 1_000, None, 0),
        _event(1, "u", _row(1, CANARY, None, 2, "bob"), 200, 0, 2_000, 7, 1, unchanged=["note"]),  # TOAST unchanged
        _event(1, "u", _row(1, CANARY, None, 2, "bob"), 200, 0, 2_000, 7, 5, unchanged=["note"]),  # delivered twice
        _event(1, "d", None, 300, 0, 3_000, 8, 2),
        _event(1, "c", _row(1, "b@example.com", "new", 5), 400, 0, 4_000, 9, 3),
        _event(2, "c", _row(2, "c@example.com", None, 3), 250, 1, 2_500, 7, 4),
    ]
    tombstone = ({"id": 1}, None, None, None, [], True, 6)
    view = f"bronze_{uuid.uuid4().hex[:8]}"
    spark_session.createDataFrame(events + [tombstone], BRONZE).createOrReplaceTempView(view)
    policy = {"default": "drop", "tables": {"shop.items": {"id": "keep", "email": "redact", "note": "keep",
                                                           "qty": "keep", "updated_by": "keep"}}}
    select, names = masking.scd2_select("shop.items", spark_session.table(view).schema, policy, view, "unused.key")
    rows = [r.asDict() for r in spark_session.sql(select).orderBy("id", "commit_lsn").collect()]
    spark_session.catalog.dropTempView(view)  # temporary views show in every SHOW VIEWS of this session
    return rows, names


def test_one_row_per_version_closed_by_the_next_event_of_its_key(versions):
    rows, _ = versions
    assert [(r["id"], r["op"], r["commit_lsn"], r["is_current"]) for r in rows] == [
        (1, "r", 100, False), (1, "u", 200, False), (1, "c", 400, True), (2, "c", 250, True)]
    spans = {r["commit_lsn"]: (r["valid_from"].timestamp(), r["valid_to"] and r["valid_to"].timestamp())
             for r in rows}
    assert spans == {100: (1.0, 2.0), 200: (2.0, 3.0), 400: (4.0, None), 250: (2.5, None)}  # 3.0: the delete


def test_an_unchanged_toasted_value_is_carried_from_the_previous_version(versions):
    rows, _ = versions
    assert [(r["commit_lsn"], r["note"], r["qty"], r["updated_by"]) for r in rows if r["id"] == 1] == [
        (100, "long note", 1, "alice"), (200, "long note", 2, "bob"), (400, "new", 5, "alice")]


def test_masked_like_the_clean_view_with_no_planted_value_left(versions):
    rows, names = versions
    assert names == ["id", "email", "note", "qty", "updated_by", "op", "tx_id", "commit_lsn", "event_serial",
                     "valid_from", "valid_to", "is_current"]
    assert {r["email"] for r in rows} == {"[REDACTED]"}
    assert CANARY not in repr(rows)


def test_a_source_column_named_like_a_version_column_keeps_its_name(spark_session):
    schema = spark_session.createDataFrame([], BRONZE.replace("updated_by:string", "valid_from:date")).schema
    policy = {"default": "keep"}
    _, names = masking.scd2_select("shop.items", schema, policy, "unused", "unused.key")
    assert names[4:] == ["valid_from", "op", "tx_id", "commit_lsn", "event_serial", "_valid_from", "valid_to",
                         "is_current"]


def test_who_is_the_actor_column_when_the_view_shows_it_and_the_transaction_otherwise():
    conf = {"source": {"tables": ["shop.items"]}, "masking": {"tables": {"shop.items": {"updated_by": "hash"}}}}
    assert changes.actor(conf, "shop.items", ["op", "after_updated_by", "before_updated_by"]) == (
        "after_updated_by", "who: column updated_by of shop.items, as the masking policy shows it (hash)")
    column, why = changes.actor(conf, "shop.items", ["op", "after_qty"])
    assert column is None and why.startswith("who: the transaction id, because shop.items has no actor column")
    named = {**conf, "views": {"actors": {"shop.items": "clerk"}}}
    column, why = changes.actor(named, "shop.items", ["op", "after_updated_by"])
    assert column is None and "views.actors names clerk" in why
