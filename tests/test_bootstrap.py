"""Notebook 01's logic on the live stack: checks, publication, topics, schemas, and each bad input."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg2 import sql

from lib import config, control, schema_registry, source, topics
from lib.capture import bootstrap
from lib.local import sample_db
from lib.source import SourceError


@pytest.fixture(scope="module")
def bank_conf(live_stack, scratch_database, run_id):
    """The local conf pointed at a scratch copy of the sample bank, with names unique to this run."""
    conf = config.apply_overrides(live_stack, {
        "CDC__SOURCE__DATABASE": scratch_database,
        "CDC__SOURCE__PUBLICATION": f"boot_{run_id}",
        "CDC__SOURCE__SLOT": f"boot_{run_id}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-boot",
    })
    conn = source.connect(conf, admin=True)
    if not bootstrap_has_bank(conn):
        sample_db.create_schema(conn)
        sample_db.load(conn, customers=20)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA bank TO {0}")
                    .format(sql.Identifier(config.get(conf, "source.user"))))
    conn.commit()
    conn.close()
    yield conf
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    prefix = config.get(conf, "kafka.topic_prefix")
    doomed = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    for future in admin.delete_topics(doomed).values() if doomed else []:
        future.result(30)
    client = schema_registry.client(conf)
    for subject in client.get_subjects():
        if subject.startswith(prefix):
            client.delete_subject(subject)


def bootstrap_has_bank(conn) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'bank'")
        return cur.fetchone() is not None


def failed(findings):
    return {f.check: f for f in findings if not f.ok}


def test_checks_pass_then_setup_is_created_and_a_second_run_reports_it_exists(bank_conf):
    tables, findings = bootstrap.check(bank_conf)
    assert failed(findings) == {}
    assert set(tables) == set(config.get(bank_conf, "source.tables"))

    first = bootstrap.run(bank_conf, log=lambda line: None)
    assert first["publication"] == "created"
    assert set(first["topics"].values()) == {"created"} and len(first["topics"]) == len(tables) + 1
    assert {row["status"] for row in first["subjects"]} == {"registered"}
    assert len(first["subjects"]) == 2 * len(tables)

    second = bootstrap.run(bank_conf, log=lambda line: None)
    assert second["publication"] == "exists"
    assert set(second["topics"].values()) == {"exists"}
    assert {row["status"] for row in second["subjects"]} == {"exists"}
    assert [r["schema_id"] for r in second["subjects"]] == [r["schema_id"] for r in first["subjects"]]
    assert control.read_all(bank_conf) == {}

    conn = source.connect(bank_conf)
    with conn.cursor() as cur:
        cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
                    (config.get(bank_conf, "source.publication"),))
        assert {r[0] for r in cur.fetchall()} == set(config.get(bank_conf, "source.tables"))
    conn.close()


def test_table_without_key_is_refused_by_name_with_remedies(bank_conf):
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__TABLES": "[bank.customers, bank.branch_visits]"})
    _, findings = bootstrap.check(conf)
    problems = failed(findings)
    assert list(problems) == ["bank.branch_visits: keyed"]
    assert "has no primary key" in problems["bank.branch_visits: keyed"].seen
    assert "FAIL ON THE SOURCE" in problems["bank.branch_visits: keyed"].remedy
    with pytest.raises(bootstrap.BootstrapError, match=r"1 prerequisite\(s\) failed:\n- bank.branch_visits: keyed"):
        bootstrap.require(findings)


def test_missing_table_and_missing_grant_are_named(bank_conf, scratch_database):
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__TABLES": "[bank.customers, bank.nope]"})
    _, findings = bootstrap.check(conf)
    assert "bank.nope" in failed(findings)["configured tables exist"].seen

    admin = source.connect(bank_conf, admin=True)
    user = sql.Identifier(config.get(bank_conf, "source.user"))
    with admin.cursor() as cur:
        cur.execute(sql.SQL("REVOKE SELECT ON bank.cards FROM {}").format(user))
    admin.commit()
    try:
        _, findings = bootstrap.check(bank_conf)
        problem = failed(findings)["bank.cards: SELECT granted to cdc_pipeline"]
        assert problem.remedy == "GRANT SELECT ON bank.cards TO cdc_pipeline"
        with admin.cursor() as cur:
            cur.execute(sql.SQL("REVOKE USAGE ON SCHEMA bank FROM {}").format(user))
        admin.commit()
        _, findings = bootstrap.check(bank_conf)
        assert failed(findings)["schema bank: USAGE granted to cdc_pipeline"].remedy == \
            'GRANT USAGE ON SCHEMA "bank" TO "cdc_pipeline"'
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA bank TO {}").format(user))
            cur.execute(sql.SQL("GRANT SELECT ON bank.cards TO {}").format(user))
        admin.commit()
        admin.close()


def test_topic_with_delete_policy_is_a_mismatch_naming_topic_and_setting(bank_conf, run_id):
    conf = config.apply_overrides(bank_conf, {"CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-mismatch",
                                              "CDC__SOURCE__TABLES": "[bank.branches]"})
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    name = f"cdc-test-{run_id}-mismatch.bank.branches"
    admin.create_topics([NewTopic(name, 3, 1, config={"cleanup.policy": "delete"})])[name].result(30)
    try:
        tables, _ = bootstrap.check(conf)
        with pytest.raises(topics.TopicMismatchError, match=rf"{name}.*cleanup.policy"):
            bootstrap.ensure_topics(conf, tables)
    finally:
        admin.delete_topics([name])[name].result(30)


def test_publication_with_other_tables_is_a_mismatch(bank_conf, run_id):
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__PUBLICATION": f"other_{run_id}"})
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE bank.customers, bank.branch_visits")
                    .format(sql.Identifier(f"other_{run_id}")))
    try:
        tables, _ = bootstrap.check(conf)
        with pytest.raises(bootstrap.BootstrapError, match=r"publication other_\w+ exists but it lacks "
                                                           r"bank.account_holders.*it also has bank.branch_visits"):
            bootstrap.ensure_publication(conf, tables)
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(f"other_{run_id}")))
        admin.close()


def test_slot_with_another_plugin_is_named(bank_conf, run_id):
    slot = f"other_plugin_{run_id}"
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__SLOT": slot})
    conn = source.connect(conf)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
    try:
        _, findings = bootstrap.check(conf)
        problem = failed(findings)[f"slot {slot}"]
        assert "plugin test_decoding" in problem.seen and "pg_drop_replication_slot" in problem.remedy
    finally:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.close()


def test_wrong_password_names_role_server_and_secret(bank_conf, monkeypatch):
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__PASSWORD": "{env: CDC_TEST_WRONG_PASSWORD}"})
    monkeypatch.setenv("CDC_TEST_WRONG_PASSWORD", "definitely-not-it")
    with pytest.raises(SourceError, match=r"cannot connect to PostgreSQL 127.0.0.1:\d+/\S+ as cdc_pipeline: .*"
                                          r"password authentication failed.*env:CDC_TEST_WRONG_PASSWORD"):
        bootstrap.check(conf)


def test_unreachable_server_says_what_to_check(bank_conf):
    conf = config.apply_overrides(bank_conf, {"CDC__SOURCE__PORT": "1"})
    with pytest.raises(SourceError, match=r"127.0.0.1:1.*check that PostgreSQL runs at 127.0.0.1:1"):
        bootstrap.check(conf)
