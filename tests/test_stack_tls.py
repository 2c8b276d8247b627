"""The local stack serves TLS with its own CA and Kafka authenticates: the stack's CA and the right password
pass; an unrelated CA or a wrong password are refused. Plain connections keep working beside them."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import psycopg2
import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic, ScramMechanism, UserScramCredentialDeletion
from confluent_kafka.schema_registry import SchemaRegistryClient

from lib import config, secrets
from lib.local import stack
from lib.local.stack import kafka, registry, tls

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def certs(live_stack) -> dict:
    """The stack's TLS files, and an unrelated CA (other_ca); every secure endpoint must answer."""
    folder = stack.stack_dir(live_stack)
    missing = stack.missing_tls(live_stack, folder)
    assert not missing, "\n".join(missing)
    tls.other_ca(folder)
    return tls.paths(folder)


@pytest.fixture(scope="module")
def plain_admin(live_stack):
    return AdminClient({"bootstrap.servers": config.get(live_stack, "kafka.bootstrap_servers")})


@pytest.fixture(scope="module")
def topic(plain_admin, run_id):
    """A topic made over PLAINTEXT that the secure listeners must list too."""
    name = f"cdc-test-{run_id}-tls"
    plain_admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(30)
    yield name
    plain_admin.delete_topics([name])[name].result(30)


def pg_connect(conf: dict, sslmode: str, rootcert=None):
    """A connection as the pipeline role over TCP with the given sslmode."""
    return psycopg2.connect(host=config.get(conf, "source.host"), port=int(config.get(conf, "source.port")),
                            dbname=config.get(conf, "source.database"), user=config.get(conf, "source.user"),
                            password=secrets.setting(conf, "source.password"), sslmode=sslmode,
                            sslrootcert=str(rootcert) if rootcert else None, connect_timeout=10)


def ssl_of_session(conn) -> tuple:
    """(ssl, version) of this session in pg_stat_ssl."""
    with conn.cursor() as cur:
        cur.execute("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        return cur.fetchone()


def test_postgres_verify_full_with_the_stack_ca(live_stack, certs):
    conn = pg_connect(live_stack, "verify-full", certs["ca"])
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT current_user")
            assert cur.fetchone()[0] == config.get(live_stack, "source.user")
        ssl_on, version = ssl_of_session(conn)
        assert ssl_on is True
        assert version.startswith("TLSv1.")
    finally:
        conn.close()


def test_postgres_refuses_a_certificate_from_another_ca(live_stack, certs):
    with pytest.raises(psycopg2.OperationalError, match="certificate verify failed"):
        pg_connect(live_stack, "verify-full", certs["other_ca"]).close()


def test_postgres_still_takes_plain_tcp(live_stack):
    conn = pg_connect(live_stack, "disable")
    try:
        assert ssl_of_session(conn)[0] is False
    finally:
        conn.close()


def secure_client(conf: dict, listener: str, ca, errors: list, **settings) -> AdminClient:
    """An AdminClient on the SASL_SSL or SSL listener that trusts ca and records its errors."""
    host, port, _ = dict(zip(("SASL_SSL", "SSL"), kafka.secure_ports(conf), strict=True))[listener]
    return AdminClient({"bootstrap.servers": f"{host}:{port}", "security.protocol": listener,
                        "ssl.ca.location": str(ca), "error_cb": errors.append, "log_level": 0, **settings})


def sasl(conf: dict, mechanism: str, password: str | None = None) -> dict:
    """SASL settings as stack.kafka.user with the current password (or the given one)."""
    return {"sasl.mechanism": mechanism, "sasl.username": config.get(conf, "stack.kafka.user"),
            "sasl.password": password if password is not None else secrets.setting(conf, "stack.kafka.password")}


def listed_ports(admin: AdminClient) -> tuple[set[str], set[int]]:
    """Topic names and the broker ports that a metadata request over admin returns."""
    metadata = admin.list_topics(timeout=20)
    return set(metadata.topics), {broker.port for broker in metadata.brokers.values()}


def refusal(admin: AdminClient, errors: list) -> set:
    """Codes and texts of the errors that made a metadata request over admin fail."""
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=3)
    admin.poll(1)  # delivers the errors to error_cb
    return {error.code() for error in errors} | {error.str() for error in errors}


def verify_failed(reasons: set) -> bool:
    """True when a TLS handshake failed because the certificate was not trusted."""
    return any(isinstance(reason, str) and "certificate verify failed" in reason for reason in reasons)


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_sasl_ssl_lists_topics_with_the_password(live_stack, certs, topic, mechanism):
    errors = []
    admin = secure_client(live_stack, "SASL_SSL", certs["ca"], errors, **sasl(live_stack, mechanism))
    topics, ports = listed_ports(admin)
    assert topic in topics
    assert ports == {int(config.get(live_stack, "stack.kafka.sasl_ssl_port"))}  # advertised on this listener
    assert errors == []


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_sasl_ssl_refuses_a_wrong_password(live_stack, certs, mechanism):
    errors = []
    admin = secure_client(live_stack, "SASL_SSL", certs["ca"], errors,
                          **sasl(live_stack, mechanism, password="not-the-password"))
    assert KafkaError._AUTHENTICATION in refusal(admin, errors), errors[:1]


def test_sasl_ssl_refuses_a_certificate_from_another_ca(live_stack, certs):
    errors = []
    admin = secure_client(live_stack, "SASL_SSL", certs["other_ca"], errors, **sasl(live_stack, "SCRAM-SHA-512"))
    assert verify_failed(refusal(admin, errors)), errors[:1]


def test_ssl_listener_lists_topics_with_the_stack_ca(live_stack, certs, topic):
    errors = []
    topics, ports = listed_ports(secure_client(live_stack, "SSL", certs["ca"], errors))
    assert topic in topics
    assert ports == {int(config.get(live_stack, "stack.kafka.ssl_port"))}
    assert errors == []


def test_ssl_listener_refuses_a_certificate_from_another_ca(live_stack, certs):
    errors = []
    admin = secure_client(live_stack, "SSL", certs["other_ca"], errors)
    assert verify_failed(refusal(admin, errors)), errors[:1]


def test_scram_credential_follows_the_configured_password(live_stack, certs, run_id, monkeypatch, plain_admin):
    """ensure_user (run by `stack up`) sets the SCRAM credential from conf: a new user and password log in."""
    name = f"cdc_test_{run_id}"
    monkeypatch.setenv("CDC_TEST_KAFKA_PASSWORD", f"pw-{run_id}")
    conf = config.apply_overrides(live_stack, {"CDC__STACK__KAFKA__USER": name,
                                               "CDC__STACK__KAFKA__PASSWORD": "{env: CDC_TEST_KAFKA_PASSWORD}"})
    kafka.ensure_user(conf, stack.stack_dir(conf))
    try:
        errors = []
        admin = secure_client(conf, "SASL_SSL", certs["ca"], errors, **sasl(conf, "SCRAM-SHA-512"))
        assert listed_ports(admin)[1] == {int(config.get(conf, "stack.kafka.sasl_ssl_port"))}
        monkeypatch.setenv("CDC_TEST_KAFKA_PASSWORD", f"pw-{run_id}-changed")
        kafka.ensure_user(conf, stack.stack_dir(conf))
        errors = []
        stale = secure_client(conf, "SASL_SSL", certs["ca"], errors, **sasl(conf, "SCRAM-SHA-512", f"pw-{run_id}"))
        assert KafkaError._AUTHENTICATION in refusal(stale, errors), errors[:1]
        errors = []
        fresh = secure_client(conf, "SASL_SSL", certs["ca"], errors, **sasl(conf, "SCRAM-SHA-512"))
        assert listed_ports(fresh)[1] == {int(config.get(conf, "stack.kafka.sasl_ssl_port"))}
    finally:
        deletion = UserScramCredentialDeletion(name, ScramMechanism.SCRAM_SHA_512)
        plain_admin.alter_user_scram_credentials([deletion])[name].result(30)


def test_registry_answers_over_https_with_the_stack_ca(live_stack, certs):
    url = registry.https_url(live_stack).rstrip("/") + "/subjects"
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        assert response.status == 200
        assert isinstance(json.load(response), list)
    client = SchemaRegistryClient({"url": registry.https_url(live_stack), "ssl.ca.location": str(certs["ca"])})
    assert isinstance(client.get_subjects(), list)


def test_registry_https_refuses_a_certificate_from_another_ca(live_stack, certs):
    url = registry.https_url(live_stack).rstrip("/") + "/subjects"
    context = ssl.create_default_context(cafile=str(certs["other_ca"]))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(url, timeout=10, context=context)


def test_broker_settings_hold_the_plain_password_owner_only(tmp_path, conf, monkeypatch):
    """server.properties carries the PLAIN user with the password escaped for JAAS and .properties, mode 0600,
    and a changed password changes it (so `stack up` restarts a broker started with the old one)."""
    folder = tmp_path / "stack"
    tls.ensure(folder, log=lambda line: None)
    where = kafka.files(folder)
    monkeypatch.setenv("CDC_KAFKA_PASSWORD", 'a"b\\c')
    kafka.write_config(conf, where, folder)
    text = where["properties"].read_text()
    assert oct(where["properties"].stat().st_mode & 0o777) == "0o600"
    user = config.get(conf, "stack.kafka.user")
    assert f'user_{user}="a\\\\"b\\\\\\\\c";' in text  # JAAS: a\"b\\c, then each backslash doubled for .properties
    assert "SASL_SSL://" in text and "listener.name.ssl.ssl.keystore.type=PEM" in text
    monkeypatch.setenv("CDC_KAFKA_PASSWORD", "other")
    assert kafka.properties(conf, where, folder) != text
