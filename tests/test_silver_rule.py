"""The silver rule is one MERGE statement: printed as SQL, it does what the merge does (lib/lake/silver_table.py)."""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import types as T

from lib.lake import delta_io, silver_table

SILVER = T.StructType([T.StructField("id", T.IntegerType()), T.StructField("name", T.StringType()),
                       T.StructField("_commit_lsn", T.LongType()), T.StructField("_event_serial", T.LongType()),
                       T.StructField("_op", T.StringType()), T.StructField("_deleted", T.BooleanType()),
                       T.StructField("_deleted_at", T.TimestampType()), T.StructField("_updated_at", T.TimestampType()),
                       T.StructField("_unknown_cols", T.ArrayType(T.StringType()))])
BATCH = T.StructType([T.StructField("id", T.IntegerType()), T.StructField("name", T.StringType()),
                      T.StructField("__kind", T.StringType()), T.StructField("__op", T.StringType()),
                      T.StructField("__lsn", T.LongType()), T.StructField("__serial", T.LongType()),
                      T.StructField("__ts", T.TimestampType()),
                      T.StructField("__unchanged", T.ArrayType(T.StringType()))])
T0, T1 = datetime(2024, 1, 1), datetime(2024, 1, 2)


def test_the_printed_merge_runs_and_applies_only_newer_changes(spark_session, tmp_path):
    path = str(tmp_path / "silver")
    spark_session.createDataFrame([(1, "one", 10, 0, "c", False, None, T0, None),
                                   (2, "two", 10, 1, "c", False, None, T0, None),
                                   (3, "three", 10, 2, "c", False, None, T0, None),
                                   (4, "four", 30, 0, "u", False, None, T0, None)], SILVER) \
        .write.format("delta").save(path)
    spark_session.createDataFrame([(1, "uno", "event", "u", 20, 0, T1, []),  # newer: applied
                                   (2, None, "event", "d", 20, 1, T1, []),  # a delete keeps the values
                                   (3, None, "tombstone", None, None, None, T1, None),  # marks the live row deleted
                                   (4, "old", "event", "u", 20, 2, T1, []),  # older than the row: ignored
                                   (5, "five", "event", "c", 20, 3, T1, [])], BATCH) \
        .createOrReplaceTempView("batch")
    statement = silver_table.merge_sql(f"delta.`{path}`", "batch", ["id"], ["name"])
    assert statement.startswith(f"MERGE INTO delta.`{path}` AS t\nUSING batch AS s\nON t.`id` = s.`id`")
    assert statement.count("WHEN MATCHED") == 2 and statement.count("WHEN NOT MATCHED AND") == 1
    spark_session.sql(statement)
    rows = {r["id"]: (r["name"], r["_commit_lsn"], r["_op"], r["_deleted"])
            for r in spark_session.read.format("delta").load(path).collect()}
    assert rows == {1: ("uno", 20, "u", False), 2: ("two", 20, "d", True), 3: ("three", 10, "tombstone", True),
                    4: ("four", 30, "u", False), 5: ("five", 20, "c", False)}


def test_the_rule_has_the_insert_clause_only_for_an_empty_table_and_a_truncate_clause_when_asked():
    _, clauses = silver_table.merge_rule(["id"], ["name"], filled=False)
    assert [c.kind for c in clauses] == ["not matched insert"]
    _, clauses = silver_table.merge_rule(["id"], ["name"], filled=True, truncate=(50, 2, None))
    assert [c.kind for c in clauses] == ["matched update", "matched update", "not matched insert",
                                         "not matched by source update"]
    assert "t._commit_lsn < 50" in clauses[-1].condition and clauses[-1].assignments["_deleted"] == "true"


def test_merges_into_a_table_with_silvers_properties_are_compacted_as_small_files_pile_up(spark_session, tmp_path):
    path = str(tmp_path / "silver")
    delta_io.ensure_table(spark_session, path, SILVER, properties=silver_table.AUTO_COMPACT)
    statement = silver_table.merge_sql(f"delta.`{path}`", "batch", ["id"], ["name"])
    spark_session.conf.set("spark.databricks.delta.autoCompact.minNumFiles", "6")  # Delta's default: 50
    try:
        for n in range(5):  # each MERGE inserts rows in up to four new files (four shuffle partitions)
            spark_session.createDataFrame([(n * 10 + i, f"v{n}", "event", "c", 10 + n, i, T1, []) for i in range(8)],
                                          BATCH).createOrReplaceTempView("batch")
            spark_session.sql(statement)
    finally:
        spark_session.conf.unset("spark.databricks.delta.autoCompact.minNumFiles")
    operations = [r["operation"] for r in spark_session.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()]
    assert "OPTIMIZE" in operations and operations.count("MERGE") == 5, operations
    assert delta_io.detail(spark_session, path)["numFiles"] < 6
    assert spark_session.read.format("delta").load(path).count() == 40


def test_an_empty_table_gets_the_insert_clause_as_a_plain_append_with_the_same_rows(spark_session, tmp_path):
    batch = [(1, "uno", "event", "c", 20, 0, T1, []), (2, None, "event", "d", 20, 1, T1, []),
             (3, None, "tombstone", None, None, None, T1, None), (4, "four", "event", "u", 20, 2, T1, ["name"])]
    spark_session.createDataFrame(batch, BATCH).createOrReplaceTempView("batch")
    rows = {}
    for how in ("merge", "insert"):
        path = str(tmp_path / how)
        delta_io.ensure_table(spark_session, path, SILVER)
        make = silver_table.merge_sql if how == "merge" else silver_table.insert_sql
        spark_session.sql(make(f"delta.`{path}`", "batch", ["id"], ["name"], **({"filled": False} if how == "merge"
                                                                                 else {})))
        rows[how] = sorted(tuple(r) for r in spark_session.read.format("delta").load(path).collect())
    assert rows["insert"] == rows["merge"] and [r[0] for r in rows["insert"]] == [1, 2, 4]
    assert rows["insert"][1][5] is True and rows["insert"][2][8] == ["name"]  # the delete, the unchanged column


def test_a_young_tables_detail_is_read_from_its_commits_as_describe_detail_says(spark_session, tmp_path):
    path = str(tmp_path / "young")

    def described():
        row = spark_session.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0]
        return {"numFiles": row["numFiles"], "properties": dict(row["properties"])}

    delta_io.ensure_table(spark_session, path, SILVER, properties={"cdc.key": "id"})
    seen = [delta_io.detail(spark_session, path) == described()]
    spark_session.createDataFrame([(i, "x", 10, i, "c", False, None, T0, None) for i in range(6)], SILVER) \
        .repartition(3).write.format("delta").mode("append").save(path)
    spark_session.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('cdc.topic' = 'cdc.t')")
    spark_session.sql(f"DELETE FROM delta.`{path}` WHERE id < 4")  # removes files, adds one
    seen.append(delta_io.detail(spark_session, path) == described())
    assert seen == [True, True] and described()["properties"]["cdc.topic"] == "cdc.t"
    assert delta_io._replayed(str(tmp_path / "young" / "_delta_log")) is not None  # read without Spark
    (tmp_path / "young" / "_delta_log" / "_last_checkpoint").write_text('{"version": 3, "size": 1}')
    assert delta_io._replayed(str(tmp_path / "young" / "_delta_log")) is None  # a checkpoint: DESCRIBE DETAIL
