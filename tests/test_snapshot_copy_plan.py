"""How the snapshot splits its work (the COPY reader's block ranges and column types, the one job's failed task)
without the stack."""

from __future__ import annotations

import pytest

from lib.capture import catalog, snapshot, snapshot_copy


def test_a_big_relation_is_split_into_contiguous_ranges_the_last_open_ended():
    ranges = snapshot_copy.split_blocks({"s.big": 10_000}, parts=4, min_blocks=128)
    assert ranges == [("s.big", 0, 2500), ("s.big", 2500, 5000), ("s.big", 5000, 7500), ("s.big", 7500, None)]


def test_small_and_empty_relations_get_one_range_each_and_parts_follow_the_sizes():
    ranges = snapshot_copy.split_blocks({"s.p1": 3000, "s.p2": 100, "s.p3": 0}, parts=8, min_blocks=128)
    assert [r for r in ranges if r[0] != "s.p1"] == [("s.p2", 0, None), ("s.p3", 0, None)]
    p1 = [r for r in ranges if r[0] == "s.p1"]
    assert len(p1) == 8 and p1[0][1] == 0 and p1[-1][2] is None
    assert all(a[2] == b[1] for a, b in zip(p1, p1[1:], strict=False))


def test_a_range_reads_only_its_blocks_from_the_relation_itself():
    assert snapshot_copy.range_sql("c0", '"S"."t"', 128, 256) == (
        "COPY (SELECT c0 FROM ONLY \"S\".\"t\" WHERE ctid >= '(128,0)'::tid AND ctid < '(256,0)'::tid) "
        "TO STDOUT WITH (FORMAT csv)")
    assert snapshot_copy.range_sql("c0", "s.t", 0, None).endswith("WHERE ctid >= '(0,0)'::tid) TO STDOUT WITH "
                                                                  "(FORMAT csv)")


@pytest.mark.parametrize(("spark_type", "wire", "arrow", "read_type"), [
    ("int", None, "int32", "int"), ("bigint", None, "int64", "bigint"), ("double", None, "float64", "double"),
    ("boolean", None, "bool_", "boolean"), ("string", None, "string", "string"),
    ("decimal(14,2)", None, "decimal128(14,2)", "decimal(14,2)"), ("binary", None, "string", "string"),
    ("binary", "bytes", "string", "string"), ("array<int>", None, "string", "string"),
])
def test_each_transport_type_has_a_csv_form(spark_type, wire, arrow, read_type):
    field = {"sql": "x", "spark_type": spark_type, "wire": wire, "post": lambda c: c}
    carried = snapshot_copy.copy_field(field)
    assert (carried["arrow"], carried["read_type"]) == (arrow, read_type)
    assert carried["sql"] == {"binary": "encode(x, 'hex')" if wire is None else "x",
                              "array<int>": "to_json(x)"}.get(spark_type, "x")


def test_the_failed_task_of_the_union_names_its_table():
    """The snapshot's one job is the union of the tables' partitions, in order: task n belongs to the table whose
    partitions cover n."""
    small, large, other = (catalog.Table("s", name, oid, (), ("id",), "d")
                           for oid, name in enumerate(("small", "large", "other")))
    parts = [(small, 1), (large, 3), (other, 2)]
    failure = RuntimeError("Job aborted due to stage failure: Task 3 in stage 7.0 failed 1 times, most recent "
                           "failure: Lost task 3.0 in stage 7.0 (TID 41) (host executor driver): boom")
    assert snapshot._failed_table(failure, parts) is large
    assert snapshot._failed_table(RuntimeError("Lost task 4.1 in stage 2.0 (TID 9)"), parts) is other
    assert snapshot._failed_table(RuntimeError("Lost task 0.0 in stage 2.0"), parts) is small
    assert snapshot._failed_table(RuntimeError("Lost task 6.0 in stage 2.0"), parts) is None  # beyond the union
    assert snapshot._failed_table(RuntimeError("connection refused"), parts) is None
