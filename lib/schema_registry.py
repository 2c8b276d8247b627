"""Register Avro schemas in the Confluent-compatible registry (Apicurio's /apis/ccompat/v7 locally).

Subjects follow TopicNameStrategy: ``<topic>-key`` and ``<topic>-value`` (``subjects(topic)``).
Schemas are always sent as ``canonical_json`` text: Apicurio compares schema
text literally, so any other spelling of the same schema would become a new version.

Apicurio's global compatibility rule is NONE (Confluent's default is BACKWARD), so
``register`` sets the subject's compatibility (default BACKWARD) when it creates the
subject; it never changes the setting of a subject that already exists.
"""

from __future__ import annotations

import json

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from lib import config, secrets, waiting

COMPATIBILITY_LEVELS = ("BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL",
                        "FULL_TRANSITIVE", "NONE")
SUBJECT_NOT_FOUND = 40401
SCHEMA_NOT_FOUND = 40403


class RegistryError(RuntimeError):
    """The schema registry could not be reached or refused a request."""


class IncompatibleSchemaError(RegistryError):
    """The registry rejected a new schema version under the subject's compatibility rule (HTTP 409)."""


def confluent_header(schema_id: int) -> bytes:
    """Confluent wire format: magic byte 0 and the 4-byte big-endian schema id, before the Avro binary."""
    return b"\x00" + int(schema_id).to_bytes(4, "big")


def canonical_json(schema) -> str:
    """The one JSON text of a schema we register and look up (sorted keys, no spaces).

    The registry (Apicurio's ccompat API) compares schema text literally: the same schema
    with different whitespace or key order is a new version there. Always send this form.
    """
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def client(conf: dict, timeout_s: float = 30, retries: int | None = None) -> SchemaRegistryClient:
    """A SchemaRegistryClient for registry.url; basic auth when registry.user/password are in conf, and
    registry.ssl_ca_location as the CA of an https registry whose certificate is not publicly signed.
    ``retries``: the client's retries of a failed request (None: its default, 3)."""
    settings = {"url": config.get(conf, "registry.url"), "timeout": timeout_s}
    if retries is not None:
        settings["max.retries"] = retries
    ca = config.pem_file(conf, "registry.ssl_ca_location", "the registry's certificate")
    if ca:
        settings["ssl.ca.location"] = ca
    user = config.get(conf, "registry.user")
    if user is not None:
        name = secrets.setting(conf, "registry.user") if secrets.is_reference(user) else str(user)
        password = secrets.setting(conf, "registry.password")
        settings["basic.auth.user.info"] = f"{name}:{password}"
    return SchemaRegistryClient(settings)


def subjects(topic: str) -> tuple[str, str]:
    """(key subject, value subject) of a topic under TopicNameStrategy."""
    return f"{topic}-key", f"{topic}-value"


def register(client: SchemaRegistryClient, subject: str, schema_dict: dict,
             compatibility: str | None = "BACKWARD") -> tuple[int, int, str]:
    """Register schema_dict under subject unless it is there: (schema_id, version, 'registered' | 'exists').

    A new subject first gets ``compatibility`` (None leaves the registry's default).
    A 409 from the registry raises IncompatibleSchemaError naming the subject and the remedy.
    """
    if compatibility is not None and compatibility not in COMPATIBILITY_LEVELS:
        raise ValueError(f"compatibility must be one of {', '.join(COMPATIBILITY_LEVELS)}, not {compatibility!r}")
    schema = Schema(canonical_json(schema_dict), "AVRO")
    url = url_of(client)
    with asking(url, subject):
        return _register(client, subject, schema, compatibility, url)


def _register(client: SchemaRegistryClient, subject: str, schema: Schema, compatibility: str | None,
              url: str | None) -> tuple[int, int, str]:
    found, subject_exists = _lookup(client, subject, schema, url)
    if found is not None:
        return found.schema_id, found.version, "exists"
    if not subject_exists and compatibility is not None:
        _call(lambda: client.set_compatibility(subject_name=subject, level=compatibility), subject, url)
    try:
        registered = client.register_schema_full_response(subject, schema)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 409:
            level = _call(lambda: client.get_compatibility(subject), subject, url)
            raise IncompatibleSchemaError(
                f"schema registry rejected the new schema of subject {subject} as incompatible under its "
                f"{level} rule: {exc.error_message}. Remedy: keep the change compatible (add columns as "
                f"nullable, widen int to bigint; a primary key change needs a new topic), or, once every "
                f"consumer is ready, change the subject's compatibility (PUT /config/{subject}) or start a "
                f"new topic and re-snapshot the table") from exc
        raise _registry_error(exc, subject, url) from exc
    except Exception as exc:
        raise _unreachable(exc, subject, url) from exc
    # the ccompat register response carries only the id; the version comes from a lookup
    found, _ = _lookup(client, subject, schema, url)
    version = found.version if found is not None else None
    return registered.schema_id, version, "registered"


def first_version(client: SchemaRegistryClient, subject: str) -> tuple[int, dict] | None:
    """(id, schema) of the first version under subject (what a topic's first key bytes carry), or None without one."""
    url = url_of(client)
    try:
        with asking(url, subject):
            versions = client.get_versions(subject)
            if not versions:
                return None
            first = client.get_version(subject, versions[0])
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return None
        raise _registry_error(exc, subject, url) from exc
    except Exception as exc:
        raise _unreachable(exc, subject, url) from exc
    return first.schema_id, json.loads(first.schema.schema_str)


def existing(client: SchemaRegistryClient, names) -> list[str]:
    """The subjects among names that the registry holds, each asked by name (a registry's subject list is paged:
    Apicurio's holds the first 1,000)."""
    url, found = url_of(client), []
    for subject in names:
        try:
            with asking(url, subject):
                client.get_versions(subject)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                continue
            raise _registry_error(exc, subject, url) from exc
        except Exception as exc:
            raise _unreachable(exc, subject, url) from exc
        found.append(subject)
    return found


def asking(url: str | None, subject: str | int):
    """Mark this thread as waiting for the registry (lib/waiting.py) while a request runs: a stalled registry holds
    the call for up to the client's timeout and retries, and `make status` says so meanwhile."""
    return waiting.on(f"the schema registry at {url or '?'} to answer (subject {subject})")


def url_of(client) -> str | None:
    """The registry URL the client talks to (for messages; never includes credentials we add)."""
    try:
        return str(client.config().get("url"))
    except Exception:
        return None


def _lookup(client, subject, schema, url):
    """(RegisteredSchema or None, subject exists?) for schema under subject."""
    try:
        return client.lookup_schema(subject, schema), True
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404 and exc.error_code == SUBJECT_NOT_FOUND:
            return None, False
        if exc.http_status_code == 404:
            return None, True
        raise _registry_error(exc, subject, url) from exc
    except Exception as exc:
        raise _unreachable(exc, subject, url) from exc


def _call(fn, subject, url):
    try:
        return fn()
    except SchemaRegistryError as exc:
        raise _registry_error(exc, subject, url) from exc
    except Exception as exc:
        raise _unreachable(exc, subject, url) from exc


def _registry_error(exc: SchemaRegistryError, subject: str, url: str | None) -> RegistryError:
    if exc.http_status_code in (401, 403):
        remedy = "check registry.user and registry.password (secret references) in conf"
    else:
        remedy = "see the registry's log"
    return RegistryError(f"schema registry {url or ''} refused a request for subject {subject} "
                         f"(HTTP {exc.http_status_code}, code {exc.error_code}): {exc.error_message}; {remedy}")


def _unreachable(exc: Exception, subject: str, url: str | None) -> RegistryError:
    return RegistryError(f"cannot reach the schema registry {url or ''} for subject {subject}: "
                         f"{type(exc).__name__}: {exc}; {unreachable_remedy(exc)}")


def unreachable_remedy(exc: Exception) -> str:
    """What to check when a request to the registry failed before any answer."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
        return ("the registry's certificate is not signed by a CA this client trusts: set registry.ssl_ca_location "
                "to the PEM file of the CA that signed it")
    return "check registry.url in conf and that the registry runs (locally `make up`)"
