"""One reading of a table name everywhere (issue 16, point 12): quotes, case, schema, paths, SQL literals."""

from __future__ import annotations

import uuid

import pytest

from lib import config
from lib.capture import catalog, stream
from lib.lake import lake_paths, merge, reconcile
from lib.views import masking


@pytest.mark.parametrize("name, expected", [
    ("bank.customers", ("bank", "customers")), ("Bank.Customers", ("bank", "customers")),
    ('"Shop"."My Table"', ("Shop", "My Table")), ("customers", ("public", "customers")),
    ('"a.b".c', ("a.b", "c")), ('s."it""s"', ("s", 'it"s'))])
def test_a_configured_name_reads_as_postgresql_reads_it(name, expected):
    assert catalog.normalize(name) == expected


@pytest.mark.parametrize("name", ["a.b.c", '"open.x', "s.", ".t"])
def test_a_malformed_name_is_refused_naming_it(name):
    with pytest.raises(catalog.CatalogError, match="must be schema.table"):
        catalog.normalize(name)


def test_every_lake_path_stays_in_its_folder_and_the_merge_and_the_views_agree_on_it(tmp_path):
    conf = config.apply_overrides(config.load("local"), {"CDC__LAKE__ROOT": str(tmp_path),
                                                         "CDC__SOURCE__TABLES": '[\'"x"."../../etc"\', \'"a/b".c\', '
                                                                                '\'"a_b".c\', \'"Shop"."My Table"\']'})
    paths = [lake_paths.silver_path(conf, spec) for spec in lake_paths.table_specs(conf)]
    assert len(set(paths)) == 4
    for path, entry in zip(paths, config.get(conf, "source.tables"), strict=True):
        assert path.startswith(f"{tmp_path}/silver/") and "/../" not in path and path.count("/") == \
            f"{tmp_path}/silver/s/t".count("/")
        assert masking.lake_path(conf, "silver", entry) == path
    assert paths[3] == f"{tmp_path}/silver/Shop/My Table"  # ordinary names keep their folders


@pytest.mark.stack
def test_a_quoted_mixed_case_table_with_a_quote_in_a_column_goes_end_to_end(small_source, spark_session, tmp_path):
    src = small_source('CREATE TABLE {s}."My Table" (id int PRIMARY KEY, "it\'s" text, tags text[]); '
                       'INSERT INTO {s}."My Table" VALUES (1, \'a\'\'b\', ARRAY[\'x\']), (2, \'c\', NULL); '
                       'CREATE TABLE {s}.plain (code text PRIMARY KEY, amount numeric(8,2))',
                       CDC__LAKE__ROOT=str(tmp_path / "lake"))
    conf = src.conf
    assert [catalog.normalize(t) for t in config.get(conf, "source.tables")] == [(src.schema, "My Table"),
                                                                                 (src.schema, "plain")]
    with src.admin.cursor() as cur:  # the rows existed before the empty snapshot: stream them once
        cur.execute(f'UPDATE {src.schema}."My Table" SET tags = tags')
        cur.execute(f'INSERT INTO {src.schema}."My Table" VALUES (3, \'d\', ARRAY[\'y\', \'z\'])')
        cur.execute(f'DELETE FROM {src.schema}."My Table" WHERE id = 2')
        cur.execute(f"INSERT INTO {src.schema}.plain VALUES ('k1', 1.50), ('k2', NULL)")
    stream.run(conf, until="caught_up", heartbeat_s=0)
    merge.run_until_caught_up(conf, spark_session)
    results = reconcile.reconcile(conf, spark_session)  # two tables whose columns differ
    assert [(r["table"], r["equal"], r["source_rows"]) for r in results] == [(f"{src.schema}.My Table", True, 2),
                                                                             (f"{src.schema}.plain", True, 2)]
    tag = uuid.uuid4().hex[:6]
    policy = {"database": f"names_v_{tag}", "privileged_database": f"names_p_{tag}", "default": "drop",
              "tables": {f'{src.schema}."My Table"': {"id": "keep", "it_s": "redact"}}}  # silver: Avro names
    built = masking.create_views(conf, spark_session, policy)
    assert sorted((r["kind"], r["status"]) for r in built) == [("clean", "created")] * 2 + [
        ("fresh", "created")] * 2 + [("full", "created")] * 2 + [("history", "created")] * 2 + [("scd2", "created")] * 2
    clean = spark_session.table(f"names_v_{tag}.my_table_clean").orderBy("id").collect()
    assert [(r["id"], r["it_s"]) for r in clean] == [(1, "[REDACTED]"), (3, "[REDACTED]")]
    for schema in (policy["database"], policy["privileged_database"]):
        spark_session.sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
