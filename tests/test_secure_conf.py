"""Secure connections from conf, without services: Kafka security for librdkafka and Spark, PostgreSQL sslmode
and sslrootcert, the registry's CA, and the errors a wrong or missing setting gives."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from lib import config, kafka_client, schema_registry, source
from lib.capture import snapshot_read

PASSWORD = "s3cr\"et\\pw"


@pytest.fixture
def secure(tmp_path, monkeypatch):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", PASSWORD)
    monkeypatch.setenv("TEST_PG_PASSWORD", "pg-pw")
    return {"conf_file": "conf/test.yml", "spark": {"app_name": "t"},
            "source": {"host": "db", "port": 5432, "database": "d", "user": "u",
                       "password": {"env": "TEST_PG_PASSWORD"}},
            "kafka": {"bootstrap_servers": "b1:9094,b2:9094", "security_protocol": "SASL_SSL",
                      "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "cdc",
                      "sasl_password": {"env": "TEST_KAFKA_PASSWORD"}, "ssl_ca_location": str(ca)}}


def test_plaintext_is_the_default_and_sets_nothing_else():
    conf = {"kafka": {"bootstrap_servers": "k:9092"}}
    assert kafka_client.settings(conf) == {"bootstrap.servers": "k:9092", "security.protocol": "PLAINTEXT"}
    assert kafka_client.spark_options(conf) == {"kafka.bootstrap.servers": "k:9092",
                                                "kafka.security.protocol": "PLAINTEXT"}


def test_sasl_ssl_reaches_librdkafka_with_the_resolved_password_and_the_ca(secure):
    settings = kafka_client.settings(secure, **{"acks": "all"})
    assert settings == {"bootstrap.servers": "b1:9094,b2:9094", "security.protocol": "SASL_SSL",
                        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "cdc", "sasl.password": PASSWORD,
                        "ssl.ca.location": secure["kafka"]["ssl_ca_location"], "acks": "all"}


def test_spark_gets_a_quoted_jaas_line_and_the_ca_inline(secure):
    options = kafka_client.spark_options(secure)
    assert options["kafka.security.protocol"] == "SASL_SSL" and options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="cdc" '
        'password="s3cr\\"et\\\\pw";')
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.certificates"].startswith("-----BEGIN CERTIFICATE-----")
    secure["kafka"]["sasl_mechanism"] = "plain"
    assert kafka_client.spark_options(secure)["kafka.sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.plain.PlainLoginModule required")


def test_a_missing_mechanism_names_the_setting_and_what_to_set(secure):
    del secure["kafka"]["sasl_mechanism"]
    with pytest.raises(kafka_client.KafkaAccessError, match=r"kafka.sasl_mechanism is missing in conf/test.yml: "
                                                            r"kafka.security_protocol SASL_SSL needs one of PLAIN"):
        kafka_client.settings(secure)


def test_unknown_protocol_mechanism_and_ca_file_are_refused_by_name(secure, tmp_path):
    secure["kafka"]["sasl_mechanism"] = "GSSAPI"
    with pytest.raises(kafka_client.KafkaAccessError, match="kafka.sasl_mechanism in conf/test.yml is 'GSSAPI'"):
        kafka_client.settings(secure)
    secure["kafka"].update(sasl_mechanism="PLAIN", security_protocol="TLS")
    with pytest.raises(kafka_client.KafkaAccessError, match="kafka.security_protocol .* is 'TLS'; use one of"):
        kafka_client.settings(secure)
    secure["kafka"].update(security_protocol="SSL", ssl_ca_location=str(tmp_path / "absent.pem"))
    with pytest.raises(config.ConfigError, match=r"kafka.ssl_ca_location .*absent.pem, which is not a "
                                                            r"file; give the PEM file of the CA"):
        kafka_client.spark_options(secure)


def test_the_password_must_be_a_secret_reference(secure):
    secure["kafka"]["sasl_password"] = "literal"
    with pytest.raises(Exception, match="kafka.sasl_password .* must be a secret reference"):
        kafka_client.settings(secure)
    del secure["kafka"]["sasl_password"]
    with pytest.raises(kafka_client.KafkaAccessError, match="kafka.sasl_username and kafka.sasl_password must both"):
        kafka_client.settings(secure)


@pytest.mark.parametrize(("reported", "named"), [
    ("SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL "
     "mechanism SCRAM-SHA-512", "the brokers refused the login: check kafka.sasl_username, the secret "
                                "env:TEST_KAFKA_PASSWORD (kafka.sasl_password)"),
    ("SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be "
     "verified", "set kafka.ssl_ca_location to the PEM file of the CA"),
    ("SASL handshake failed (start (-4)): SASL mechanism SCRAM-SHA-256 not supported by broker",
     "the brokers do not enable kafka.sasl_mechanism SCRAM-SHA-512"),
    ("Failed to get metadata: Local: Broker transport failure", "check kafka.bootstrap_servers and "
                                                                "kafka.security_protocol (SASL_SSL)"),
    ("sasl_ssl://b1:9094/bootstrap: Connect to ipv4#10.0.0.1:9094 failed: Connection refused",
     "check kafka.bootstrap_servers and kafka.security_protocol (SASL_SSL) in conf/test.yml and that the brokers run"),
    ("sasl_ssl://b1:9094/bootstrap: SSL handshake failed: Disconnected: SSL connection closed by peer: connecting to "
     "a PLAINTEXT broker listener?", "check kafka.security_protocol (SASL_SSL): it must match the listener"),
])
def test_what_the_client_reports_becomes_the_setting_to_fix(secure, reported, named):
    message = kafka_client.explain(secure, [KafkaError(KafkaError._AUTHENTICATION, reported)])
    assert message.startswith(f"cannot use Kafka at b1:9094,b2:9094: {reported}; ")
    assert named in message


def test_postgres_sslmode_and_root_certificate_reach_libpq_and_jdbc(secure):
    secure["source"].update(sslmode="verify-full", sslrootcert=secure["kafka"]["ssl_ca_location"])
    assert source.tls(secure) == {"sslmode": "verify-full", "sslrootcert": secure["kafka"]["ssl_ca_location"]}
    assert "sslmode=verify-full" in source.dsn(secure)
    options = snapshot_read.jdbc_options(secure, "00000003-1")
    assert (options["sslmode"], options["sslrootcert"]) == ("verify-full", secure["kafka"]["ssl_ca_location"])


def test_postgres_ssl_settings_are_checked_by_name(secure, tmp_path):
    secure["source"]["sslmode"] = "on"
    with pytest.raises(source.SourceError, match="source.sslmode in conf/test.yml is 'on'; use one of disable"):
        source.tls(secure)
    secure["source"].update(sslmode="verify-ca", sslrootcert=str(tmp_path / "none.pem"))
    with pytest.raises(config.ConfigError, match="source.sslrootcert .*none.pem, which is not a file"):
        source.tls(secure)


def test_registry_gets_basic_auth_and_its_ca(secure, monkeypatch):
    monkeypatch.setenv("TEST_REGISTRY_PASSWORD", "reg-pw")
    secure["registry"] = {"url": "https://registry.example:8443", "user": "reader",
                          "password": {"env": "TEST_REGISTRY_PASSWORD"},
                          "ssl_ca_location": "/nowhere/ca.pem"}
    with pytest.raises(config.ConfigError, match="registry.ssl_ca_location .* /nowhere/ca.pem, which is "
                                                            "not a file"):
        schema_registry.client(secure)
    del secure["registry"]["ssl_ca_location"]
    client = schema_registry.client(secure)
    assert client._rest_client.auth == ("reader", "reg-pw")


class FakeConf(dict):
    def get(self, key, default=None):
        return super().get(key, default)

    def set(self, key, value):
        self[key] = value


def test_spark_is_told_to_redact_the_jaas_password_keeping_what_was_set(secure):
    import re
    from types import SimpleNamespace

    spark = SimpleNamespace(conf=FakeConf({"spark.sql.redaction.string.regex": "token=\\w+"}))
    kafka_client.hide_login(spark)
    kafka_client.hide_login(spark)  # once only
    pattern = spark.conf["spark.sql.redaction.string.regex"]
    assert pattern == "token=\\w+|" + kafka_client.JAAS_PASSWORD
    line = kafka_client.spark_options(secure)["kafka.sasl.jaas.config"]
    assert PASSWORD not in re.sub(pattern, "*********(redacted)", line) and 'username="cdc"' in line


def test_the_keeper_does_not_wait_on_a_conf_error(secure, tmp_path):
    from lib.operate import keeper

    secure["kafka"]["ssl_ca_location"] = str(tmp_path / "gone.pem")  # a conf error, not an outage
    assert keeper.unreachable(secure, "merge", timeout_s=1) is None
    secure["source"]["sslrootcert"] = str(tmp_path / "gone.pem")
    assert keeper.unreachable(secure, "capture", timeout_s=1) is None
