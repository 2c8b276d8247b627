"""ensure_topics against the live Kafka broker: compacted topics, idempotent, mismatches refused."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from lib import config, topics
from lib.topics import TopicMismatchError

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def admin(live_stack):
    return AdminClient({"bootstrap.servers": config.get(live_stack, "kafka.bootstrap_servers")})


@pytest.fixture
def names(admin, run_id, request):
    """Topic names unique to this run and test; every one is deleted afterwards."""
    base = f"cdc-test-{run_id}.{request.node.name[5:30]}"
    created = [f"{base}.a", f"{base}.b", f"{base}.c"]
    yield created
    present = set(admin.list_topics(timeout=30).topics)
    doomed = [name for name in created if name in present]
    if doomed:
        for future in admin.delete_topics(doomed, operation_timeout=30).values():
            future.result(60)


def describe(admin, name) -> dict[str, str]:
    """Topic configs; retried while a just-created topic is unknown to the broker that answers."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    deadline = time.monotonic() + 30
    while True:
        try:
            entries = admin.describe_configs([resource])[resource].result(30)
            return {key: entry.value for key, entry in entries.items()}
        except KafkaException as exc:
            if exc.args[0].name() != "UNKNOWN_TOPIC_OR_PART" or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_creates_compacted_topics_then_reports_exists(admin, names):
    first, second = names[:2]
    result = topics.ensure_topics(admin, [first, second], 3, {"segment.ms": 3_600_000},
                                  delete_retention_ms=2 * 86_400_000, min_compaction_lag_ms=60_000)
    assert result == {first: "created", second: "created"}
    for name in (first, second):
        settings = describe(admin, name)
        assert settings["cleanup.policy"] == "compact"
        assert settings["delete.retention.ms"] == str(2 * 86_400_000)
        assert settings["min.compaction.lag.ms"] == "60000"
        assert settings["segment.ms"] == "3600000"
        assert len(admin.list_topics(name, timeout=30).topics[name].partitions) == 3
    again = topics.ensure_topics(admin, [first, second, names[2]], 3)
    assert again == {first: "exists", second: "exists", names[2]: "created"}
    assert describe(admin, names[2])["delete.retention.ms"] == str(topics.SEVEN_DAYS_MS)


def test_topic_with_delete_policy_is_refused(admin, names):
    name = names[0]
    admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1,
                                  config={"cleanup.policy": "delete"})])[name].result(30)
    with pytest.raises(TopicMismatchError) as err:
        topics.ensure_topics(admin, [names[1], name], 3)
    message = str(err.value)
    assert name in message and "cleanup.policy=delete" in message and "cleanup.policy=compact" in message
    assert "kafka-configs.sh" in message


def test_topic_with_other_partition_count_is_refused(admin, names):
    name = names[0]
    assert topics.ensure_topics(admin, [name], 2) == {name: "created"}
    with pytest.raises(TopicMismatchError) as err:
        topics.ensure_topics(admin, [name], 3)
    message = str(err.value)
    assert name in message and "partitions=2" in message and "partitions=3" in message
    assert "kafka.partitions" in message


def test_an_existing_topic_with_less_durability_than_conf_asks_is_refused(admin, names):
    name = names[0]
    assert topics.ensure_topics(admin, [name], 1, min_insync_replicas=1) == {name: "created"}
    assert describe(admin, name)["min.insync.replicas"] == "1"
    with pytest.raises(TopicMismatchError, match=rf"topic {name} exists with replication factor 1, but "
                                                 r"kafka.replication_factor is 3: .*kafka-reassign-partitions"):
        topics.ensure_topics(admin, [name], 1, replication_factor=3)
    with pytest.raises(TopicMismatchError, match=rf"topic {name} exists with min.insync.replicas=1, but "
                                                 r"kafka.min_insync_replicas is 2; remedy: kafka-configs.sh"):
        topics.ensure_topics(admin, [name], 1, min_insync_replicas=2)
    assert topics.ensure_topics(admin, [name], 1, replication_factor=1, min_insync_replicas=1) == {name: "exists"}


def test_cleanup_policy_override_is_rejected(admin, names):
    with pytest.raises(ValueError, match="cleanup.policy must stay 'compact'"):
        topics.ensure_topics(admin, [names[0]], 3, {"cleanup.policy": "delete"})


def test_unreachable_kafka_is_named():
    dead = AdminClient({"bootstrap.servers": "127.0.0.1:9", "socket.connection.setup.timeout.ms": 1000})
    with pytest.raises(topics.TopicError, match="kafka.bootstrap_servers"):
        topics.ensure_topics(dead, ["x"], 1, timeout_s=3)
