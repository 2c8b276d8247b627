"""The control topic: records written are read back, tombstones remove keys."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from lib import config, control, topics


@pytest.fixture
def control_conf(live_stack, run_id):
    conf = config.apply_overrides(live_stack, {"CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}"})
    assert control.ensure(conf) == "created"
    yield conf
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    admin.delete_topics([control.topic(conf)])[control.topic(conf)].result(30)


def test_records_round_trip_and_tombstones_remove_them(control_conf):
    assert control.read_all(control_conf) == {}
    assert control.snapshot_state(control_conf, "s1") is None
    control.put(control_conf, "snapshot/s1", {"state": "running", "consistent_lsn": 10})
    control.put(control_conf, "snapshot/s1", {"state": "complete", "consistent_lsn": 10})
    control.put(control_conf, "truncate/bank.cards", {"commit_lsn": 99})
    assert control.snapshot_state(control_conf, "s1") == {"state": "complete", "consistent_lsn": 10}
    control.put(control_conf, "truncate/bank.cards", None)
    assert control.read_all(control_conf) == {"snapshot/s1": {"state": "complete", "consistent_lsn": 10}}
    assert control.ensure(control_conf) == "exists"


def test_missing_control_topic_says_to_run_notebook_01(live_stack, run_id):
    conf = config.apply_overrides(live_stack, {"CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-missing"})
    with pytest.raises(control.ControlError, match=r"__cdc_control.*notebook 01"):
        control.read_all(conf, timeout=5)


def _segment_settings(conf: dict, expected: dict, timeout_s: float = 15.0) -> dict:
    """The topic's segment settings once they equal expected (or the last read after timeout_s): a broker answers
    describe_configs from its own copy of the metadata, which can trail an alter the controller already committed."""
    admin = AdminClient({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    resource = ConfigResource(ConfigResource.Type.TOPIC, control.topic(conf))
    deadline = time.monotonic() + timeout_s
    while True:
        found = admin.describe_configs([resource])[resource].result(30)
        settings = {key: int(float(found[key].value)) if key == "segment.ms" else float(found[key].value)
                    for key in control.SEGMENT_SETTINGS}
        if settings == expected or time.monotonic() > deadline:
            return settings
        time.sleep(0.2)


def test_the_topic_rolls_short_segments_so_kafka_compacts_the_records_that_repeat(control_conf):
    assert _segment_settings(control_conf, control.SEGMENT_SETTINGS) == control.SEGMENT_SETTINGS
    admin = AdminClient({"bootstrap.servers": config.get(control_conf, "kafka.bootstrap_servers")})
    older = {**control.SEGMENT_SETTINGS, "segment.ms": 604800000}  # as an older bootstrap made it
    topics.set_configs(admin, control.topic(control_conf), {"segment.ms": 604800000})
    assert _segment_settings(control_conf, older) == older
    assert control.ensure(control_conf) == "exists"
    assert _segment_settings(control_conf, control.SEGMENT_SETTINGS) == control.SEGMENT_SETTINGS
