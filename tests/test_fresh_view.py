"""The fresh view: silver plus the bronze log's events silver has not applied yet (log commits after silver's
_bronze_seq), newest per key by position; a truncate among them hides every older row."""

from __future__ import annotations

import uuid

import pytest

from lib.views import masking

SILVER = ("id int, email string, note string, qty int, _commit_lsn bigint, _event_serial bigint, _op string, "
          "_deleted boolean, _deleted_at timestamp, _updated_at timestamp, _bronze_seq bigint")
BRONZE = ("key struct<id:int>, op string, after struct<id:int, email:string, note:string, qty:int>, "
          "source struct<commit_lsn:bigint, event_serial:int, ts_ms:bigint, txId:bigint>, "
          "unchanged_cols array<string>, _tombstone boolean, _kafka_offset bigint, _seq bigint")
POLICY = {"default": "drop", "tables": {"shop.items": {"id": "keep", "email": "redact", "note": "keep", "qty": "keep"}}}


def _silver(key, email, note, qty, lsn, deleted=False, applied=3):
    """A silver row written by the silver step that reached bronze log commit `applied`."""
    return (key, email, note, qty, lsn, 0, "d" if deleted else "u", deleted, None, None, applied)


def _event(key, op, after, lsn, seq, offset, unchanged=()):
    """A bronze log row of log commit seq."""
    return ({"id": key} if key is not None else None, op, after,
            {"commit_lsn": lsn, "event_serial": 0, "ts_ms": lsn, "txId": lsn}, list(unchanged), False, offset, seq)


def _row(key, email, note, qty):
    return {"id": key, "email": email, "note": note, "qty": qty}


def _fresh(spark, silver_rows, bronze_rows, policy=POLICY):
    tag = uuid.uuid4().hex[:8]
    silver, bronze = f"silver_{tag}", f"bronze_{tag}"
    spark.createDataFrame(silver_rows, SILVER).createOrReplaceTempView(silver)
    spark.createDataFrame(bronze_rows, BRONZE).createOrReplaceTempView(bronze)
    try:
        select, names = masking.fresh_select("shop.items", spark.table(silver).schema, spark.table(bronze).schema,
                                             policy, silver, bronze, "unused.key")
        return [r.asDict() for r in spark.sql(select).orderBy("id").collect()], names
    finally:  # temporary views show in every SHOW VIEWS of this session
        spark.catalog.dropTempView(silver)
        spark.catalog.dropTempView(bronze)


def test_the_log_commits_after_silvers_show_before_the_silver_step_has_applied_them(spark_session):
    silver = [_silver(1, "a@x.org", "long note", 1, 100), _silver(2, "b@x.org", "n2", 2, 110),
              _silver(3, "c@x.org", "n3", 3, 120, deleted=True), _silver(5, "e@x.org", "n5", 5, 300)]
    bronze = [
        _event(1, "r", _row(1, "a@x.org", "long note", 1), 100, 1, 0),  # log commits silver applied (up to 3)
        _event(5, "c", _row(5, "e@x.org", "n5", 5), 300, 3, 1),
        _event(9, "c", _row(9, "i@x.org", "n9", 9), 90, 2, 7),  # applied (a row since removed): not read again
        _event(1, "u", _row(1, "a2@x.org", None, 9), 200, 4, 2, unchanged=["note"]),  # commit 4: not applied
        _event(1, "u", _row(1, "a2@x.org", None, 9), 200, 4, 3, unchanged=["note"]),  # ... delivered twice
        _event(2, "d", None, 210, 4, 4),
        _event(4, "c", _row(4, "d@x.org", "n4", 4), 220, 4, 5),
        _event(5, "u", _row(5, "old@x.org", "old", 0), 150, 4, 6),  # older than silver's row: silver wins
    ]
    rows, names = _fresh(spark_session, silver, bronze)
    assert names == ["id", "email", "note", "qty", "_commit_lsn", "_event_serial"]
    assert [(r["id"], r["note"], r["qty"]) for r in rows] == [(1, "long note", 9), (4, "n4", 4), (5, "n5", 5)]
    assert {r["email"] for r in rows} == {"[REDACTED]"}  # masked like the clean view


def test_it_agrees_with_silver_once_the_silver_step_has_applied_the_log(spark_session):
    silver = [_silver(1, "a2@x.org", "long note", 9, 200, applied=4),
              _silver(2, "b@x.org", "n2", 2, 210, deleted=True, applied=4),
              _silver(4, "d@x.org", "n4", 4, 220, applied=4)]
    bronze = [_event(1, "u", _row(1, "a2@x.org", None, 9), 200, 4, 2, unchanged=["note"]),
              _event(2, "d", None, 210, 4, 4), _event(4, "c", _row(4, "d@x.org", "n4", 4), 220, 4, 5)]
    rows, _ = _fresh(spark_session, silver, bronze, {"default": "keep"})
    assert rows == [{"id": 1, "email": "a2@x.org", "note": "long note", "qty": 9, "_commit_lsn": 200,
                     "_event_serial": 0},
                    {"id": 4, "email": "d@x.org", "note": "n4", "qty": 4, "_commit_lsn": 220, "_event_serial": 0}]


def test_a_key_deleted_in_the_pending_commits_and_written_again_shows_its_new_row(spark_session):
    silver = [_silver(7, "g@x.org", "n7", 7, 100)]
    bronze = [_event(7, "d", None, 200, 4, 0), _event(7, "c", _row(7, "g2@x.org", "again", 8), 210, 5, 1)]
    rows, _ = _fresh(spark_session, silver, bronze, {"default": "keep"})
    assert [(r["id"], r["note"]) for r in rows] == [(7, "again")]


def test_a_pending_truncate_hides_every_older_row_and_keeps_the_newer(spark_session):
    silver = [_silver(1, "a@x.org", "n1", 1, 100), _silver(2, "b@x.org", "n2", 2, 110)]
    bronze = [_event(3, "c", _row(3, "c@x.org", "n3", 3), 120, 4, 0),  # before the truncate: hidden too
              _event(None, "t", None, 150, 4, None),
              _event(4, "c", _row(4, "d@x.org", "n4", 4), 160, 5, 1)]
    rows, _ = _fresh(spark_session, silver, bronze, {"default": "keep"})
    assert [r["id"] for r in rows] == [4]


def test_a_bronze_log_without_the_layout_is_refused_naming_it(spark_session):
    schema = spark_session.createDataFrame([], BRONZE.replace(", _seq bigint", "")).schema
    silver = spark_session.createDataFrame([], SILVER).schema
    with pytest.raises(masking.MaskingError, match="bronze log rows of shop.items lack key, _seq"):
        masking.fresh_select("shop.items", silver, schema, POLICY, "s", "b", "k")
