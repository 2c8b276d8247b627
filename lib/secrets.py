"""The one place where secret references in conf become secret values.

A reference is a mapping in conf, never the value itself:

- ``{env: NAME}``: the environment variable NAME; locally, when it is not set, the line
  ``NAME=...`` of conf/secrets.env (git-ignored; `make up` writes one with random values).
- ``{scope: S, key: K}``: Databricks secret scope S, key K (``dbutils.secrets.get``).

Resolved values are returned to the caller and never logged; use ``describe`` in messages.
"""

from __future__ import annotations

import os
from pathlib import Path

from lib import config


def env_file() -> Path:
    """conf/secrets.env of the project (config.use_project_root moves it with the project's root)."""
    return config.CONF_DIR / "secrets.env"


class SecretError(LookupError):
    """A secret reference could not be resolved."""


def is_reference(value) -> bool:
    """True for a mapping shaped like a secret reference."""
    return isinstance(value, dict) and ("env" in value or ("scope" in value and "key" in value))


def describe(ref) -> str:
    """A loggable name for a reference (never the value)."""
    if isinstance(ref, dict) and "env" in ref:
        return f"env:{ref['env']}"
    if isinstance(ref, dict) and "scope" in ref:
        return f"databricks secret {ref['scope']}/{ref['key']}"
    return "<not a secret reference>"


def read_env_file(path: Path) -> dict[str, str]:
    """NAME=value lines of a dotenv-style file (no interpolation, # comments).

    Refuses a file that users other than its owner may read or write (as ssh does with keys).
    """
    values = {}
    if not path.is_file():
        return values
    mode = path.stat().st_mode & 0o777
    if os.name == "posix" and mode & 0o077:
        raise SecretError(f"{path} holds secrets but its permissions are {mode:o} (group or others may read or "
                          f"change it); run chmod 600 {path} and try again")
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        values[name.strip()] = value.strip().strip("'\"")
    return values


def resolve(ref, setting: str = "a setting", environ=None, secrets_file: Path | None = None,
            dbutils=None) -> str:
    """The secret value behind ref; the error names the setting, reference and where it looked."""
    environ = os.environ if environ is None else environ
    secrets_file = env_file() if secrets_file is None else secrets_file
    if not is_reference(ref):
        raise SecretError(
            f"{setting} must be a secret reference ({{env: NAME}} or {{scope: S, key: K}}), "
            f"not a literal value: secrets are never written in conf"
        )
    if "env" in ref:
        name = str(ref["env"])
        if environ.get(name):
            return environ[name]
        from_file = read_env_file(secrets_file).get(name)
        if from_file:
            return from_file
        raise SecretError(
            f"secret for {setting} not found: looked for environment variable {name} and for "
            f"{name}= in {secrets_file}; export {name} or add it to that file "
            f"(on the local stack `make up` writes it)"
        )
    if dbutils is None:
        from lib import runtime

        dbutils = runtime.dbutils()
    if dbutils is None:
        raise SecretError(
            f"secret for {setting} is {describe(ref)}, which only resolves on Databricks; "
            f"run there or use an {{env: NAME}} reference for this target"
        )
    try:
        return dbutils.secrets.get(scope=str(ref["scope"]), key=str(ref["key"]))
    except Exception as exc:  # dbutils raises its own exception types
        raise SecretError(
            f"secret for {setting} not found: {describe(ref)} could not be read ({exc}); "
            f"create it with `databricks secrets put-secret {ref['scope']} {ref['key']}`"
        ) from exc


def setting(conf: dict, dotted: str, **kwargs) -> str:
    """Resolve the secret reference stored at a dotted conf path."""
    return resolve(config.get(conf, dotted), setting=f"{dotted} in {conf.get('conf_file', 'conf')}", **kwargs)
