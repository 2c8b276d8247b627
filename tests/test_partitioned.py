"""A partitioned table is captured under its own name and topic (issue 16, point 13), on the live stack."""

from __future__ import annotations

import pytest
from psycopg2 import sql
from topic_rows import latest_rows

from lib import config
from lib.capture import bootstrap, catalog, stream

pytestmark = pytest.mark.stack

DDL = ("CREATE TABLE {s}.events (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region); "
       "CREATE TABLE {s}.events_eu PARTITION OF {s}.events FOR VALUES IN ('eu'); "
       "CREATE TABLE {s}.events_us PARTITION OF {s}.events FOR VALUES IN ('us')")


def test_changes_in_every_partition_reach_the_partitioned_tables_topic(small_source):
    src = small_source(DDL)
    assert [catalog.qualified(t) for t in src.tables] == [f"{src.schema}.events"]
    with src.admin.cursor() as cur:
        cur.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = %s",
                    (config.get(src.conf, "source.publication"),))
        assert cur.fetchone()[0] is True
        cur.execute(f"INSERT INTO {src.schema}.events VALUES (1, 'eu', 'a'), (2, 'us', 'b'), (3, 'eu', 'c')")
        cur.execute(f"UPDATE {src.schema}.events SET v = 'b2' WHERE id = 2")
        cur.execute(f"UPDATE {src.schema}.events SET region = 'us' WHERE id = 3")  # moves to the other partition
        cur.execute(f"DELETE FROM {src.schema}.events WHERE id = 1")
    stream.run(src.conf, until="caught_up", heartbeat_s=0)
    assert {k: (r["region"], r["v"]) for k, r in latest_rows(src, "events").items() if k != 1} == {
        2: ("us", "b2"), 3: ("us", "c")}


def test_an_existing_publication_gets_publish_via_partition_root(small_source):
    src = small_source(DDL)
    publication = config.get(src.conf, "source.publication")
    with src.admin.cursor() as cur:
        cur.execute(sql.SQL("ALTER PUBLICATION {} SET (publish_via_partition_root = false)")
                    .format(sql.Identifier(publication)))
        cur.execute(f"INSERT INTO {src.schema}.events VALUES (7, 'eu', 'x')")
    with pytest.raises(stream.StreamError, match=rf"partition of {src.schema}\.events.*publish_via_partition_root"):
        stream.run(src.conf, until="caught_up", heartbeat_s=0)
    tables = catalog.describe_tables(src.admin, src.tables)
    assert bootstrap.ensure_publication(src.conf, tables) == "altered (publish_via_partition_root)"
    assert bootstrap.ensure_publication(src.conf, tables) == "exists"
