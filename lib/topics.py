"""Create the per-table Kafka topics: log-compacted, fixed partition count, checked when they exist."""

from __future__ import annotations

import socket
import time

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, OffsetSpec

from lib import config

SEVEN_DAYS_MS = config.DEFAULTS["kafka.delete_retention_ms"]


class TopicError(RuntimeError):
    """Kafka could not be reached or refused to create or describe a topic."""


class TopicMismatchError(TopicError):
    """An existing topic's settings differ from what the pipeline needs."""


def topic_config(delete_retention_ms: int = SEVEN_DAYS_MS, min_compaction_lag_ms: int = 0,
                 extra: dict | None = None) -> dict[str, str]:
    """Topic-level settings of a new topic: compacted, tombstones kept delete_retention_ms."""
    settings = {"cleanup.policy": "compact", "delete.retention.ms": str(int(delete_retention_ms)),
                "min.compaction.lag.ms": str(int(min_compaction_lag_ms))}
    for key, value in (extra or {}).items():
        settings[key] = str(value)
    if settings["cleanup.policy"] != "compact":
        raise ValueError(f"cleanup.policy must stay 'compact' (a per-key topic that deletes by age loses rows), "
                         f"not {settings['cleanup.policy']!r}")
    return settings


def durability(conf: dict) -> dict:
    """ensure_topics' replication_factor and min_insync_replicas from kafka.replication_factor and
    kafka.min_insync_replicas (unset: the brokers' defaults)."""
    factor, insync = config.get(conf, "kafka.replication_factor"), config.get(conf, "kafka.min_insync_replicas")
    return {"replication_factor": int(factor) if factor else -1,
            "min_insync_replicas": int(insync) if insync else None}


def ensure_topics(admin_client: AdminClient, names: list[str], partitions: int, config: dict | None = None, *,
                  delete_retention_ms: int = SEVEN_DAYS_MS, min_compaction_lag_ms: int = 0,
                  replication_factor: int = -1, min_insync_replicas: int | None = None,
                  timeout_s: float = 30.0) -> dict[str, str]:
    """Create missing topics (compacted); per topic 'created' or 'exists'. Mismatch -> TopicMismatchError.

    ``config`` holds extra topic settings for new topics (e.g. {"segment.ms": ...}).
    ``delete.retention.ms`` is how long a delete's tombstone stays readable: it must exceed the
    longest time a consumer (the Delta merge) can be stopped, or a restarted consumer misses
    deletes. Existing topics are never altered; cleanup.policy and partitions are checked, and when given the
    replication factor and min.insync.replicas (an existing topic may not have fewer).
    replication_factor -1 and min_insync_replicas None use the brokers' defaults.
    """
    extra = {**(config or {}), **({"min.insync.replicas": min_insync_replicas} if min_insync_replicas else {})}
    settings = topic_config(delete_retention_ms, min_compaction_lag_ms, extra)
    existing = _partition_counts(admin_client, timeout_s)
    result: dict[str, str] = {}
    to_create = [name for name in dict.fromkeys(names) if name not in existing]
    if to_create:
        futures = admin_client.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=replication_factor, config=settings)
             for name in to_create], request_timeout=timeout_s)
        for name, future in futures.items():
            try:
                future.result(timeout_s)
                result[name] = "created"
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":  # lost a race: check it like any other
                    raise TopicError(f"cannot create topic {name}: {exc.args[0].str()}; check the broker log "
                                     f"and that this client may create topics") from exc
    to_check = [name for name in dict.fromkeys(names) if name not in result]
    deadline = time.monotonic() + timeout_s
    while any(name not in existing for name in to_check):  # created by someone else a moment ago
        if time.monotonic() > deadline:
            raise TopicError(f"topics {', '.join(n for n in to_check if n not in existing)} exist but do not "
                             f"appear in the cluster metadata after {timeout_s:.0f} s; check the brokers")
        time.sleep(0.5)
        existing = _partition_counts(admin_client, timeout_s)
    configs = _topic_configs(admin_client, to_check, timeout_s)
    replicas = _replica_counts(admin_client, to_check, timeout_s) if replication_factor > 0 else {}
    for name in to_check:
        policy = configs[name]["cleanup.policy"]
        if policy != "compact":
            raise TopicMismatchError(
                f"topic {name} exists with cleanup.policy={policy}, but it must be cleanup.policy=compact "
                f"(one row per key, deletes as tombstones); remedy: kafka-configs.sh --alter --entity-type "
                f"topics --entity-name {name} --add-config cleanup.policy=compact, or delete the topic and "
                f"rerun the bootstrap (the table is snapshotted again)")
        if existing[name] != partitions:
            raise TopicMismatchError(
                f"topic {name} exists with partitions={existing[name]}, but it must have partitions={partitions} "
                f"(kafka.partitions); remedy: set kafka.partitions to {existing[name]}, or delete the topic and "
                f"rerun the bootstrap (adding partitions to a keyed topic would move keys and break per-key order)")
        if replication_factor > 0 and replicas[name] < replication_factor:
            raise TopicMismatchError(
                f"topic {name} exists with replication factor {replicas[name]}, but kafka.replication_factor is "
                f"{replication_factor}: a broker's loss could lose acknowledged events; remedy: raise it with "
                f"kafka-reassign-partitions.sh (a reassignment listing {replication_factor} replicas per partition), "
                f"or set kafka.replication_factor to {replicas[name]}")
        insync = int(configs[name]["min.insync.replicas"])
        if min_insync_replicas and insync < min_insync_replicas:
            raise TopicMismatchError(
                f"topic {name} exists with min.insync.replicas={insync}, but kafka.min_insync_replicas is "
                f"{min_insync_replicas}; remedy: kafka-configs.sh --alter --entity-type topics --entity-name {name} "
                f"--add-config min.insync.replicas={min_insync_replicas}, or set kafka.min_insync_replicas to "
                f"{insync}")
        result[name] = "exists"
    return {name: result[name] for name in dict.fromkeys(names)}


def end_offsets(admin_client: AdminClient, names: list[str], timeout_s: float = 10.0) -> dict[str, dict[int, int]]:
    """{topic: {partition: end offset}} of the named topics that exist, asked in one request."""
    metadata = admin_client.list_topics(timeout=timeout_s).topics
    found = [t for t in names if t in metadata and metadata[t].error is None]
    wanted = {TopicPartition(t, p): OffsetSpec.latest() for t in found for p in metadata[t].partitions}
    ends: dict[str, dict[int, int]] = {t: {} for t in found}
    if wanted:
        for partition, future in admin_client.list_offsets(wanted, request_timeout=timeout_s).items():
            ends[partition.topic][partition.partition] = future.result().offset
    return {t: dict(sorted(p.items())) for t, p in ends.items()}


def unavailable(admin_client: AdminClient, metadata, prefix: str, writes: bool, timeout_s: float = 5.0) -> str | None:
    """Why the topics named <prefix>.* cannot be read now (no leader answers) or, with writes, written (fewer
    in-sync replicas answer than their min.insync.replicas); None when they can.

    Brokers are asked on their ports too: a cluster that lost its controller quorum keeps listing, in the
    metadata its last broker serves, the leaders and in-sync replicas that are gone."""
    owned = sorted(t for t in metadata.topics if t.startswith(prefix + "."))
    answering = {b.id for b in metadata.brokers.values() if _answers(b.host, b.port, min(timeout_s, 2.0))}
    insync_needed = _min_insync(admin_client, owned, timeout_s) if writes and owned else {}
    for name in owned:
        for number, part in sorted(metadata.topics[name].partitions.items()):
            down = sorted(set(part.isrs) - answering)
            if part.leader not in answering:
                return (f"topic {name} partition {number} has no leader that answers (leader: broker "
                        f"{part.leader}; in-sync replicas that do not answer: {', '.join(map(str, down)) or 'none'}): "
                        f"start the brokers that are down")
            needed = insync_needed.get(name)
            # its min.insync.replicas unread (a cluster that lost its quorum may not answer in time)
            if writes and needed is None and down:
                return (f"topic {name} partition {number} may not take writes: its in-sync replicas "
                        f"{', '.join(map(str, down))} do not answer, and the brokers that do did not say its "
                        f"min.insync.replicas: start the brokers that are down")
            if writes and len(part.isrs) - len(down) < (needed or 1):
                return (f"topic {name} partition {number} cannot take writes: {len(part.isrs) - len(down)} of its "
                        f"in-sync replicas answer (brokers {', '.join(map(str, down))} do not), min.insync.replicas "
                        f"is {needed}: start the brokers that are down")
    return None


def _answers(host: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connection to host:port opens."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _min_insync(admin_client: AdminClient, names: list[str], timeout_s: float) -> dict[str, int]:
    """Topic name -> min.insync.replicas; {} when the brokers do not say (refused, or no answer in time)."""
    try:
        return {name: int(settings["min.insync.replicas"])
                for name, settings in _topic_configs(admin_client, names, timeout_s).items()}
    except (TopicError, KafkaException, TimeoutError):
        return {}


def set_configs(admin_client: AdminClient, name: str, settings: dict, timeout_s: float = 30.0) -> None:
    """Set topic-level settings of an existing topic (incremental: the others stay as they are)."""
    entries = [ConfigEntry(key, str(value), incremental_operation=AlterConfigOpType.SET)
               for key, value in settings.items()]
    resource = ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=entries)
    try:
        for future in admin_client.incremental_alter_configs([resource], request_timeout=timeout_s).values():
            future.result(timeout_s)
    except KafkaException as exc:
        raise TopicError(f"cannot set {', '.join(settings)} of topic {name}: {exc.args[0].str()}; check that this "
                         f"client may alter topic configs") from exc


def _partition_counts(admin_client: AdminClient, timeout_s: float) -> dict[str, int]:
    """Topic name -> partition count, from cluster metadata."""
    try:
        metadata = admin_client.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise TopicError(f"cannot list Kafka topics: {exc.args[0].str()}; check kafka.bootstrap_servers in conf "
                         f"and that the brokers run (locally `make up`)") from exc
    return {name: len(topic.partitions) for name, topic in metadata.topics.items()}


def _replica_counts(admin_client: AdminClient, names: list[str], timeout_s: float) -> dict[str, int]:
    """Topic name -> the fewest replicas any of its partitions has."""
    metadata = admin_client.list_topics(timeout=timeout_s).topics
    return {name: min(len(p.replicas) for p in metadata[name].partitions.values()) for name in names}


def _topic_configs(admin_client: AdminClient, names: list[str], timeout_s: float) -> dict[str, dict[str, str]]:
    """Topic name -> {setting: value} (cleanup.policy, min.insync.replicas, ...)."""
    policies: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(policies) < len(names):
        pending = [name for name in names if name not in policies]
        futures = admin_client.describe_configs(
            [ConfigResource(ConfigResource.Type.TOPIC, name) for name in pending], request_timeout=timeout_s)
        for resource, future in futures.items():
            try:
                policies[resource.name] = {k: e.value for k, e in future.result(timeout_s).items()}
            except KafkaException as exc:
                # a topic created a moment ago may not have reached every broker yet
                if exc.args[0].name() == "UNKNOWN_TOPIC_OR_PART" and time.monotonic() < deadline:
                    continue
                raise TopicError(f"cannot read the configuration of topic {resource.name}: {exc.args[0].str()}; "
                                 f"check that this client may describe topic configs") from exc
        if len(policies) < len(names):
            time.sleep(0.5)
    return policies
