"""Kafka clients from conf: the brokers and how to reach them (TLS, SASL), for librdkafka and for Spark.

Conf keys (section ``kafka``), named after the librdkafka settings they set:

- ``security_protocol``: PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL;
- ``sasl_mechanism``: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (for the SASL protocols);
- ``sasl_username`` (a value or a secret reference) and ``sasl_password`` (a secret reference);
- ``ssl_ca_location``: PEM file of the CA that signed the brokers' certificates; without it the
  system's trust store (enough for Confluent Cloud and MSK, whose certificates are public).

Every Kafka client of the pipeline is built here, so one conf reaches a secured cluster everywhere:
the capture's producer, admin and consumers (``settings``, ``admin``, ``consumer``) and Spark's Kafka
source and sink (``spark_options``). ``check`` connects once and turns a refused login, an unknown
CA or a mechanism the brokers lack into an error that names the setting and the remedy.
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from lib import config, secrets, waiting

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


REDACTION_SETTING = "spark.sql.redaction.string.regex"
JAAS_PASSWORD = r'password="(?:[^"\\]|\\.)*"'


# what librdkafka says when the client's protocol does not match the listener's
MISMATCH_HINTS = ("incorrect security.protocol", "plaintext broker listener", "ssl listener?")


class KafkaAccessError(ConnectionError):
    """Kafka refused the connection or login, or the conf cannot describe one."""


class KafkaUnreachableError(KafkaAccessError):
    """No broker answered (down, or a network outage): waiting may help, unlike a refusal."""


def security(conf: dict) -> dict:
    """{protocol, mechanism, username, password, ca_file} from conf, checked; secrets resolved."""
    where = conf.get("conf_file", "conf")
    protocol = str(config.get(conf, "kafka.security_protocol") or "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise KafkaAccessError(f"kafka.security_protocol in {where} is {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    found = {"protocol": protocol, "mechanism": None, "username": None, "password": None, "ca_file": None}
    if protocol.startswith("SASL"):
        mechanism = config.get(conf, "kafka.sasl_mechanism")
        if not mechanism:
            raise KafkaAccessError(
                f"kafka.sasl_mechanism is missing in {where}: kafka.security_protocol {protocol} needs one of "
                f"{', '.join(LOGIN_MODULES)}; set the one your cluster enables (Confluent Cloud: PLAIN, "
                f"Amazon MSK: SCRAM-SHA-512)")
        mechanism = str(mechanism).upper()
        if mechanism not in LOGIN_MODULES:
            raise KafkaAccessError(f"kafka.sasl_mechanism in {where} is {mechanism!r}; the pipeline supports "
                                   f"{', '.join(LOGIN_MODULES)}")
        username = config.get(conf, "kafka.sasl_username")
        if username is None or config.get(conf, "kafka.sasl_password") is None:
            raise KafkaAccessError(f"kafka.sasl_username and kafka.sasl_password must both be set in {where} for "
                                   f"kafka.security_protocol {protocol} (the password as a secret reference, "
                                   f"e.g. {{env: CDC_KAFKA_PASSWORD}})")
        found["mechanism"] = mechanism
        found["username"] = secrets.setting(conf, "kafka.sasl_username") if secrets.is_reference(username) \
            else str(username)
        found["password"] = secrets.setting(conf, "kafka.sasl_password")
    if protocol.endswith("SSL"):
        found["ca_file"] = config.pem_file(conf, "kafka.ssl_ca_location", "the brokers' certificates")
    return found


def settings(conf: dict, **extra) -> dict:
    """librdkafka settings: bootstrap servers and security from conf, then extra (dots as in librdkafka)."""
    found = security(conf)
    result = {"bootstrap.servers": str(config.get(conf, "kafka.bootstrap_servers")),
              "security.protocol": found["protocol"]}
    if found["mechanism"]:
        result.update({"sasl.mechanism": found["mechanism"], "sasl.username": found["username"],
                       "sasl.password": found["password"]})
    if found["ca_file"]:
        result["ssl.ca.location"] = found["ca_file"]
    return {**result, **extra}


def waiting_on(conf: dict, what: str):
    """waiting.on("Kafka at <servers> to <what>"): marks a call that blocks until Kafka answers."""
    return waiting.on(f"Kafka at {config.get(conf, 'kafka.bootstrap_servers')} to {what}")


def admin(conf: dict, **extra) -> AdminClient:
    """An AdminClient for conf's cluster."""
    return AdminClient(settings(conf, **extra))


def consumer(conf: dict, group_prefix: str, **extra) -> Consumer:
    """A Consumer that commits nothing, in a group of its own (it only assigns partitions and reads)."""
    return Consumer(settings(conf, **{"group.id": f"{group_prefix}-{time.monotonic_ns()}",
                                      "enable.auto.commit": False, **extra}))


def spark_options(conf: dict) -> dict[str, str]:
    """Spark's Kafka source and sink options (``kafka.`` prefixed) for conf's cluster and security.

    The CA goes inline as PEM text (kafka.ssl.truststore.certificates): executors on a cluster need
    no file. The JAAS line holds the password: call hide_login(spark) before passing these to Spark.
    """
    found = security(conf)
    options = {"kafka.bootstrap.servers": str(config.get(conf, "kafka.bootstrap_servers")),
               "kafka.security.protocol": found["protocol"]}
    if found["mechanism"]:
        options["kafka.sasl.mechanism"] = found["mechanism"]
        options["kafka.sasl.jaas.config"] = (f'{LOGIN_MODULES[found["mechanism"]]} required '
                                             f'username="{_jaas_quote(found["username"])}" '
                                             f'password="{_jaas_quote(found["password"])}";')
    if found["ca_file"]:
        with open(found["ca_file"]) as handle:
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.certificates"] = handle.read()
    return options


def hide_login(spark) -> None:
    """Have spark redact the JAAS password wherever it prints a plan (explain, errors, the UI, event logs).

    Spark redacts options by key, and the key kafka.sasl.jaas.config does not look secret to it: without
    this a streaming query's plan shows the password. Extends spark.sql.redaction.string.regex, keeping
    what is set there.
    """
    current = spark.conf.get(REDACTION_SETTING, None) or ""
    if JAAS_PASSWORD not in current:
        spark.conf.set(REDACTION_SETTING, f"{current}|{JAAS_PASSWORD}" if current else JAAS_PASSWORD)


def _jaas_quote(value: str) -> str:
    """value inside a JAAS double-quoted string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def check(conf: dict, timeout_s: float = 15.0):
    """The cluster's metadata (topics), read once; a refusal raises KafkaAccessError naming setting and remedy."""
    errors: list[KafkaError] = []
    client = admin(conf, error_cb=errors.append, **{"socket.connection.setup.timeout.ms": int(timeout_s * 1000)})
    deadline = time.monotonic() + timeout_s
    while True:  # short asks, so a refusal (login, TLS) is named as soon as it arrives, not after timeout_s
        try:
            metadata = client.list_topics(timeout=max(0.1, min(0.5, deadline - time.monotonic())))
            break
        except KafkaException as exc:
            client.poll(0.1)  # the reason (login, TLS) reaches error_cb only when the client is polled
            refused = _refusals(errors)
            if refused or time.monotonic() >= deadline:
                if not refused:
                    client.poll(1.0)
                    refused = _refusals(errors)
                kind = KafkaAccessError if refused else KafkaUnreachableError
                raise kind(explain(conf, refused or [*errors, exc.args[0]])) from exc
    client.poll(0)
    if _refusals(errors):
        raise KafkaAccessError(explain(conf, _refusals(errors)))
    return metadata


def _refusals(errors: list) -> list:
    """The errors that say the brokers refused us (login, TLS, protocol), as opposed to not answering."""
    return [e for e in errors if e.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL)
            or any(hint in e.str().lower() for hint in MISMATCH_HINTS)]


def explain(conf: dict, errors: list) -> str:
    """One message for what the client reported: the cause, the settings involved and the remedy."""
    servers = config.get(conf, "kafka.bootstrap_servers")
    text = " ".join(e.str() if isinstance(e, KafkaError) else str(e) for e in errors)
    reason = (errors[0].str() if isinstance(errors[0], KafkaError) else str(errors[0])) if errors else "?"
    lowered = text.lower()
    protocol = str(config.get(conf, "kafka.security_protocol") or "PLAINTEXT").upper()
    if "unsupported sasl mechanism" in lowered or "mechanism" in lowered and "not supported" in lowered:
        remedy = (f"the brokers do not enable kafka.sasl_mechanism {config.get(conf, 'kafka.sasl_mechanism')}; set "
                  f"it to one they list above (Confluent Cloud: PLAIN, Amazon MSK: SCRAM-SHA-512)")
    elif "authentication failed" in lowered or "invalid credentials" in lowered or "sasl authentication" in lowered:
        remedy = (f"the brokers refused the login: check kafka.sasl_username, the secret "
                  f"{secrets.describe(config.get(conf, 'kafka.sasl_password'))} (kafka.sasl_password) and "
                  f"kafka.sasl_mechanism")
    elif "certificate verify failed" in lowered or "could not be verified" in lowered:
        remedy = ("the brokers' certificate is not signed by a CA this client trusts: set kafka.ssl_ca_location to "
                  "the PEM file of the CA that signed it (without it the system's trust store is used)")
    elif any(hint in lowered for hint in MISMATCH_HINTS):
        remedy = (f"check kafka.security_protocol ({protocol}): it must match the listener at {servers} "
                  f"(a TLS listener needs SSL or SASL_SSL, a plain one PLAINTEXT or SASL_PLAINTEXT)")
    else:
        remedy = (f"check kafka.bootstrap_servers and kafka.security_protocol ({protocol}) in "
                  f"{conf.get('conf_file', 'conf')} and that the brokers run (locally `make up`)")
    return f"cannot use Kafka at {servers}: {reason}; {remedy}"
