"""The pipeline over secure connections on the live stack: Kafka SASL_SSL (SCRAM-SHA-512), PostgreSQL with
sslmode verify-full and the registry over https, each checked against the stack's own CA; snapshot, capture and
merge end exact. Then what a wrong password, a wrong CA or a mechanism the brokers lack says.

The stack serves these next to its plain endpoints (lib/local/stack/tls.py makes the certificates).
"""

from __future__ import annotations

import uuid

import pytest
from psycopg2 import sql

from lib import config, kafka_client, schema_registry, secrets, source
from lib.capture import bootstrap, snapshot, stream
from lib.lake import merge, reconcile
from lib.local import stack
from lib.local.stack import tls
from lib.operate import keeper, teardown

pytestmark = pytest.mark.stack

DDL = """
CREATE SCHEMA ticketing;
CREATE TABLE ticketing.venues (venue_id int PRIMARY KEY, name text NOT NULL, city text, seats int);
CREATE TABLE ticketing.bookings (venue_id int, booking_no bigint, holder text, price numeric(9,2),
    booked_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (venue_id, booking_no));
INSERT INTO ticketing.venues SELECT v, 'hall ' || v, 'city ' || (v % 7), 100 * v FROM generate_series(1, 40) v;
INSERT INTO ticketing.bookings (venue_id, booking_no, holder, price)
    SELECT 1 + n % 40, n, 'holder ' || n, n * 1.5 FROM generate_series(1, 2000) n;
"""
TABLES = ["ticketing.venues", "ticketing.bookings"]


def secure_overrides(conf: dict) -> dict:
    """CDC__ overrides that point conf at the stack's TLS endpoints (SASL_SSL with SCRAM, verify-full, https)."""
    files = tls.paths(stack.stack_dir(conf))
    host = config.get(conf, "source.host")
    return {
        "CDC__SOURCE__SSLMODE": "verify-full", "CDC__SOURCE__SSLROOTCERT": str(files["ca"]),
        "CDC__KAFKA__BOOTSTRAP_SERVERS": f"{host}:{config.get(conf, 'stack.kafka.sasl_ssl_port')}",
        "CDC__KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "CDC__KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "CDC__KAFKA__SASL_USERNAME": str(config.get(conf, "stack.kafka.user")),
        "CDC__KAFKA__SASL_PASSWORD": f"{{env: {config.get(conf, 'stack.kafka.password')['env']}}}",
        "CDC__KAFKA__SSL_CA_LOCATION": str(files["ca"]),
        "CDC__REGISTRY__URL": f"https://{host}:{config.get(conf, 'stack.registry.https_port')}/apis/ccompat/v7",
        "CDC__REGISTRY__SSL_CA_LOCATION": str(files["ca"]),
    }


@pytest.fixture(scope="module")
def secure(live_stack, tmp_path_factory, drop_slot):
    """conf of a pipeline on its own database that reaches PostgreSQL, Kafka and the registry only over TLS."""
    tag = uuid.uuid4().hex[:8]
    database = f"secure_{tag}"
    admin = source.connect(live_stack, admin=True, dbname="postgres")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    owner = source.connect(live_stack, admin=True, dbname=database)
    owner.autocommit = True
    with owner.cursor() as cur:
        cur.execute(DDL)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA ticketing TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA ticketing "
                            "TO {0}").format(sql.Identifier(config.get(live_stack, "source.user"))))
    overrides = {**secure_overrides(live_stack), "CDC__SOURCE__DATABASE": database, "CDC__SOURCE__SLOT": database,
                 "CDC__SOURCE__PUBLICATION": database, "CDC__SOURCE__TABLES": repr(TABLES),
                 "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{tag}-secure",
                 "CDC__LAKE__ROOT": str(tmp_path_factory.mktemp("secure") / "lake")}
    conf = config.apply_overrides(live_stack, overrides)
    yield {"conf": conf, "owner": owner}
    drop_slot(conf, database)
    with owner.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(database)))
    owner.close()
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    admin.close()
    teardown.delete_prefix(live_stack, config.get(conf, "kafka.topic_prefix"))


def test_snapshot_stream_and_merge_over_tls_end_exact_and_log_no_password(secure, spark_session):
    conf, lines = secure["conf"], []
    log = lambda *args, **_kwargs: lines.append(" ".join(str(a) for a in args))  # noqa: E731
    bootstrap.run(conf, log=log)
    snapshot.run(conf, spark_session, log=log)
    with secure["owner"].cursor() as cur:
        cur.execute("UPDATE ticketing.bookings SET price = price + 1 WHERE booking_no % 3 = 0")
        cur.execute("DELETE FROM ticketing.bookings WHERE booking_no % 10 = 0")
        cur.execute("UPDATE ticketing.bookings SET booking_no = booking_no + 100000 WHERE booking_no % 97 = 0")
        cur.execute("INSERT INTO ticketing.venues VALUES (41, 'new hall', 'city 1', 50)")
        cur.execute("UPDATE ticketing.venues SET seats = seats + 1 WHERE venue_id <= 5")
    stream.run(conf, until="caught_up", heartbeat_s=0, log=log)
    merge.run_until_caught_up(conf, spark_session)
    results = reconcile.reconcile(conf, spark_session)
    assert [(r["table"], r["equal"], r["source_rows"]) for r in results] == [
        ("ticketing.venues", True, 41), ("ticketing.bookings", True, 1800)], results
    password = secrets.setting(conf, "kafka.sasl_password")
    plan = merge.read_stream(conf, spark_session)._jdf.queryExecution().toString()
    assert password not in plan, "Spark printed the Kafka password"
    assert [line for line in lines if password in line] == []


def test_every_connection_of_the_pipeline_role_is_encrypted(secure):
    conn = source.connect(secure["conf"])
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            encrypted, version = cur.fetchone()
    finally:
        conn.close()
    assert encrypted is True and version.startswith("TLS")


def test_plain_and_the_ssl_listener_answer_too(live_stack):
    conf = config.apply_overrides(live_stack, {**secure_overrides(live_stack), "CDC__KAFKA__SASL_MECHANISM": "PLAIN"})
    assert kafka_client.check(conf).brokers
    ssl_only = config.apply_overrides(live_stack, {
        **secure_overrides(live_stack), "CDC__KAFKA__SECURITY_PROTOCOL": "SSL",
        "CDC__KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{config.get(live_stack, 'stack.kafka.ssl_port')}"})
    assert kafka_client.check(ssl_only).brokers


def test_a_wrong_password_names_the_secret_and_stops_notebook_01(live_stack, secure, monkeypatch):
    monkeypatch.setenv("CDC_TEST_WRONG_KAFKA_PASSWORD", "not-the-password")
    conf = config.apply_overrides(secure["conf"], {"CDC__KAFKA__SASL_PASSWORD": "{env: CDC_TEST_WRONG_KAFKA_PASSWORD}"})
    expected = (r"invalid credentials with SASL mechanism SCRAM-SHA-512 .*\); the brokers refused the login: "
                r"check kafka.sasl_username, the secret env:CDC_TEST_WRONG_KAFKA_PASSWORD \(kafka.sasl_password\)")
    with pytest.raises(kafka_client.KafkaAccessError, match=expected):
        bootstrap.ensure_topics(conf, {})
    assert keeper.unreachable(conf, "merge") is None  # a refusal: the service fails with the reason, not waited on
    down = config.apply_overrides(secure["conf"], {"CDC__KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9"})
    assert keeper.unreachable(down, "merge", timeout_s=3).startswith("Kafka at 127.0.0.1:9 (")  # an outage: waited


def test_a_wrong_ca_names_the_ca_setting_of_each_service(secure):
    other = str(tls.paths(stack.stack_dir(secure["conf"]))["other_ca"])
    conf = config.apply_overrides(secure["conf"], {"CDC__KAFKA__SSL_CA_LOCATION": other})
    with pytest.raises(kafka_client.KafkaAccessError, match="not signed by a CA this client trusts: set "
                                                            "kafka.ssl_ca_location to the PEM file"):
        kafka_client.check(conf)
    conf = config.apply_overrides(secure["conf"], {"CDC__SOURCE__SSLROOTCERT": other})
    with pytest.raises(source.SourceError, match="certificate verify failed.*not signed by the CA in "
                                                 "source.sslrootcert"):
        source.connect(conf)
    conf = config.apply_overrides(secure["conf"], {"CDC__REGISTRY__SSL_CA_LOCATION": other})
    with pytest.raises(schema_registry.RegistryError, match="set registry.ssl_ca_location to the PEM file"):
        schema_registry.register(schema_registry.client(conf), "cdc-test-secure-probe-value", {"type": "string"})


def test_a_mechanism_the_brokers_do_not_enable_is_named(secure):
    conf = config.apply_overrides(secure["conf"], {"CDC__KAFKA__SASL_MECHANISM": "SCRAM-SHA-256"})
    with pytest.raises(kafka_client.KafkaAccessError, match="the brokers do not enable kafka.sasl_mechanism "
                                                            "SCRAM-SHA-256; set it to one they list"):
        kafka_client.check(conf)
