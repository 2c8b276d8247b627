"""Pipeline configuration: conf/<target>.yml plus environment overrides.

The override rule: an environment variable ``CDC__<SECTION>__<KEY>`` replaces the value at
``section.key`` (any depth, ``__`` between levels, case-insensitive), parsed as YAML so
``CDC__KAFKA__PARTITIONS=6`` is a number and ``CDC__STACK__POSTGRES__FSYNC=false`` a bool.
``CDC_TARGET`` picks the file when the caller does not, and ``CDC_CONF_DIR`` the folder (on
Databricks, where lib/ is installed as a wheel, the bundle points it at the synced conf/).
Secrets never live here: a value that is a secret is a reference (see lib/secrets.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"
ENV_PREFIX = "CDC__"


class ConfigError(ValueError):
    """A configuration file or override is missing or malformed."""


def load(target: str | None = None, conf_dir: Path | str | None = None, environ=None) -> dict:
    """Read conf/<target>.yml and apply CDC__ environment overrides."""
    environ = os.environ if environ is None else environ
    target = target or environ.get("CDC_TARGET") or "local"
    folder = Path(conf_dir or environ.get("CDC_CONF_DIR") or CONF_DIR)
    path = folder / f"{target}.yml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yml"))
        raise ConfigError(
            f"no configuration for target {target!r}: {path} does not exist "
            f"(known targets: {', '.join(known) or 'none'}); pass one of them or add the file"
        )
    conf = apply_overrides(_read(folder, target, ()), environ)
    conf["target"] = target
    conf["conf_file"] = str(path)
    return conf


def _read(folder: Path, target: str, seen: tuple[str, ...]) -> dict:
    """conf/<target>.yml as a mapping; ``extends: <other target>`` at its top starts from that target's file, and
    this file's values replace the other's (mappings merged key by key, anything else replaced whole)."""
    path = folder / f"{target}.yml"
    if target in seen:
        raise ConfigError(f"{path}: 'extends' goes round in a circle ({' -> '.join((*seen, target))})")
    if not path.is_file():
        raise ConfigError(f"{folder / (seen[-1] + '.yml')} extends {target!r}, but {path} does not exist")
    try:
        conf = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(conf, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    base = conf.pop("extends", None)
    if base is None:
        return conf
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must name one target (a file of {folder} without .yml), not {base!r}")
    return _merged(_read(folder, base, (*seen, target)), conf)


def _merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(conf: dict, environ) -> dict:
    """Return a copy of conf with every CDC__A__B=value applied at a.b."""
    result = copy.deepcopy(conf)
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or len(name) <= len(ENV_PREFIX):
            continue
        keys = name[len(ENV_PREFIX):].split("__")
        if any(not key for key in keys):
            raise ConfigError(f"environment override {name} has an empty level; use CDC__SECTION__KEY")
        node = result
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(_existing_key(node, key), {})
            if not isinstance(child, dict):
                where = ".".join(k.lower() for k in keys[: depth + 1])
                raise ConfigError(f"environment override {name}: {where} is a value, not a section")
            node = child
        node[_existing_key(node, keys[-1])] = yaml.safe_load(environ[name]) if environ[name] != "" else ""
    return result


def _existing_key(node: dict, key: str) -> str:
    """The key of node that matches key case-insensitively (keeps e.g. Spark's camelCase), else key lower-cased."""
    for existing in node:
        if str(existing).lower() == key.lower():
            return existing
    return key.lower()


# Every optional setting and its value when conf leaves it out: the one place defaults live.
# (merge.query_name defaults to merge_<kafka.topic_prefix>: lake_paths.query_name computes it.)
DEFAULTS: dict[str, object] = {
    "source.keys": {},  # key columns of tables without a primary key (docs/events.md)
    "source.unknown_types": "error",  # or "text": capture values of unsupported types as their text
    "source.failover_slot": False,  # create the slot with FAILOVER (PostgreSQL 17+; docs/reliability.md "Failover")
    "source.stall_timeout_s": 60.0,  # the capture drops a connection that sends nothing this long (a network stall)
    "source.spool_dir": None,  # where in-progress streamed transactions are spooled (None: the temp dir)
    "source.incremental_chunk_rows": 10_000,  # rows per chunk of an incremental snapshot
    "source.incremental_check_s": 10.0,  # how often the capture looks for incremental snapshot requests
    "source.sslmode": None,  # libpq's sslmode (None: libpq's default, prefer); verify-full for a managed server
    "source.sslrootcert": None,  # PEM file of the server's CA, for sslmode verify-ca / verify-full
    "kafka.partitions": 1,
    "kafka.topics": {},  # schema.table -> its topic, when not <topic_prefix>.<schema>.<table> (a re-keyed table)
    "kafka.replication_factor": None,  # of the topics the pipeline creates (None: the brokers' default)
    "kafka.min_insync_replicas": None,  # their min.insync.replicas (None: the brokers' default)
    "kafka.delete_retention_ms": 7 * 24 * 3600 * 1000,  # how long a tombstone stays before compaction drops it
    "kafka.producer": None,  # librdkafka settings over the capture's defaults
    "kafka.security_protocol": "PLAINTEXT",  # SSL, SASL_PLAINTEXT or SASL_SSL (lib/kafka_client.py)
    "kafka.sasl_mechanism": None,  # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
    "kafka.sasl_username": None,
    "kafka.sasl_password": None,  # a secret reference
    "kafka.ssl_ca_location": None,  # PEM file of the brokers' CA (None: the system's trust store)
    "registry.user": None,
    "registry.ssl_ca_location": None,  # PEM file of the registry's CA (None: the system's trust store)
    "snapshot.reader": "jdbc",  # key ranges through Spark's JDBC reader, or "copy": block ranges (snapshot_copy.py)
    "snapshot.fetch_size": 10_000,
    "snapshot.partition_rows": 250_000,  # rows per Spark partition when a table is split by key range
    "snapshot.max_partitions": 200,
    "snapshot.progress_s": 10.0,
    "snapshot.jdbc_options": {},
    "snapshot.kafka_options": {},
    "merge.max_offsets_per_trigger": 1_000_000,
    # silver's cadence (lib/lake/silver_step.py): the fresh view answers "now" meanwhile (docs/merge.md)
    "merge.silver_interval_s": 30.0,
    "merge.silver_pending_events": 200_000,  # a step sooner once the bronze query logged this many events
    # a trigger touching at most this many tables decodes them into bronze itself (a trickle waits for one commit,
    # not two); a trigger of more tables leaves that to the decode step beside it (lib/lake/decode_step.py); 0: never
    "merge.decode_in_trigger_tables": 4,
    "merge.compact_interval_minutes": 10,  # OPTIMIZE of the bronze log (one small file per trigger otherwise)
    "merge.parallelism": 4,  # a silver step's MERGEs run side by side (sessions of their own)
    "merge.tombstone_retention_hours": 168,
    "merge.cleanup_interval_minutes": 60,
    "merge.control_timeout_s": 30,
    "merge.fail_on_data_loss": True,
    "merge.kafka_options": {},
    "merge.restart_attempts": 2,
    "merge.unknown_schema_ids": "fail",  # or "dead_letter"
    "merge.unknown_schema_wait_s": 30.0,
    "service.dir": ".stack/pipeline",
    "service.heartbeat_s": 10,
    "service.metrics_interval_s": 10,
    "service.merge_interval": "10 seconds",
    "service.merge_restarts": 3,
    "service.max_restarts": 5,
    "service.restart_window_s": 600.0,
    "service.restart_backoff_s": 2.0,
    "service.outage_probe_max_s": 10.0,  # while a dependency is down, it is asked again at most this often
    "service.stop_grace_s": 45.0,  # how long the merge waits for a running micro-batch before stopping
    "monitor.warn_retained_wal_bytes": 1 << 30,
    "masking": {},
    "views.actors": {},  # schema.table -> the column that says who changed a row (lib/views/changes.py)
    "views.actor_columns": ["updated_by", "modified_by", "changed_by", "last_modified_by", "created_by"],
    "debezium": {},
    "spark.app_name": "cdc-pipeline",
    "spark.remote": None,  # sc://host:port: a Spark Connect session instead of a local driver (conf/connect.yml)
    "spark.jars_dir": None,
    "spark.settings": {},
    "spark.local_metastore": False,  # true: Hive metastore and warehouse under lake.root (lib/spark.py)
    "spark.log_levels": {},  # logger -> level for the local driver (lib/spark.py); WARN for the rest
    "spark.class_archive_dir": None,  # the local driver's class-data archives (lib/spark.py class_archive)
    "spark.driver_java_options": "",  # more Java options for the local driver and the stack's Connect server (the
    # tests ask for C1 only)
    "spark.executor_java_options": "",  # more Java options for a standalone cluster's executors (likewise)
}


def get(conf: dict, dotted: str, default=...):
    """Value at a dotted path like 'kafka.bootstrap_servers', else its DEFAULTS entry; error names the path and file."""
    node = conf
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            if default is not ...:
                return default
            if dotted in DEFAULTS:
                return copy.deepcopy(DEFAULTS[dotted])
            override = ENV_PREFIX + dotted.upper().replace(".", "__")
            raise ConfigError(
                f"setting {dotted} is missing in {conf.get('conf_file', 'the configuration')}; "
                f"add it there or set {override}"
            )
        node = node[key]
    return node


def make(conf: dict, goal: str) -> str:
    """`make <goal>` as a hint to print, for conf's target: the Makefile reads the target from CDC_TARGET."""
    target = conf.get("target", "local")
    return f"`make {goal}`" if target == "local" else f"`CDC_TARGET={target} make {goal}`"


def command(conf: dict, module: str, args: str = "") -> str:
    """`python -m <module> ... --target <target>` as a hint to print, for conf's target."""
    return f"`python -m {module} {args + ' ' if args else ''}--target {conf.get('target', 'local')}`"


def use_project_root(root: str | os.PathLike) -> None:
    """Resolve conf's relative paths against root from now on, in a process that imported lib from an archive (a
    Spark Connect server's foreachBatch worker: lib.carried_call) rather than from the project's folder."""
    global PROJECT_ROOT, CONF_DIR
    PROJECT_ROOT, CONF_DIR = Path(root), Path(root) / "conf"


def project_path(value: str | os.PathLike) -> Path:
    """A path from conf: absolute as given, relative to the project root otherwise."""
    path = Path(os.path.expanduser(str(value)))
    return path if path.is_absolute() else PROJECT_ROOT / path


def pem_file(conf: dict, dotted: str, signer: str) -> str | None:
    """The CA file a setting names (None when unset), resolved like project_path; error when it is not a file."""
    value = get(conf, dotted)
    if not value:
        return None
    path = project_path(value)
    if not path.is_file():
        raise ConfigError(f"{dotted} in {conf.get('conf_file', 'conf')} names {path}, which is not a file; give the "
                          f"PEM file of the CA that signed {signer}")
    return str(path)


def is_remote(location: str) -> bool:
    """True for a storage URI (abfss://, s3://, dbfs:/), False for a local path."""
    return "://" in str(location) or str(location).startswith("dbfs:")


def location(value: str) -> str:
    """A storage location from conf: URIs (abfss://, s3://, dbfs:/) and absolute paths as given,
    relative paths under the project root."""
    text = str(value)
    if is_remote(text):
        return text
    return str(project_path(text))
