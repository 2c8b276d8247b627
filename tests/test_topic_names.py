"""Two tables may not share a topic (issue 16, point 9)."""

from __future__ import annotations

import uuid

import pytest
from psycopg2 import sql

from lib import config, source
from lib.capture import avro_schemas, bootstrap

pytestmark = pytest.mark.stack


def test_names_that_meet_in_one_topic_are_found():
    shared = avro_schemas.shared_topics("cdc", ["shop.a b", "shop.a_b", "shop.c"])
    assert shared == {"cdc.shop.a_b": ["shop.a b", "shop.a_b"]}


def test_bootstrap_refuses_two_tables_that_would_write_one_topic_naming_both(live_stack, scratch_database):
    schema = f"tn_{uuid.uuid4().hex[:8]}"
    conf = config.apply_overrides(live_stack, {
        "CDC__SOURCE__DATABASE": scratch_database, "CDC__SOURCE__SLOT": schema, "CDC__SOURCE__PUBLICATION": schema,
        "CDC__SOURCE__TABLES": f"['{schema}.\"a b\"', '{schema}.a_b']", "CDC__SOURCE__KEYS": "{}"})
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    user = sql.Identifier(config.get(conf, "source.user"))
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL('CREATE SCHEMA {0}; CREATE TABLE {0}."a b" (id int PRIMARY KEY); '
                                'CREATE TABLE {0}.a_b (id int PRIMARY KEY); GRANT USAGE ON SCHEMA {0} TO {1}; '
                                'GRANT SELECT ON ALL TABLES IN SCHEMA {0} TO {1}').format(sql.Identifier(schema), user))
        _, findings = bootstrap.check(conf)
        failed = [f for f in findings if not f.ok]
        assert [f.check for f in failed] == [f"one topic per table (cdc.{schema}.a_b)"]
        assert f"{schema}.a b and {schema}.a_b" in failed[0].seen and "rename one table" in failed[0].remedy
        with pytest.raises(bootstrap.BootstrapError, match="would both write topic"):
            bootstrap.require(findings)
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.close()
