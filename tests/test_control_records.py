"""A malformed control record (issue 16, point 5): named with topic, offset and remedy, never a crash loop."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer

from lib import config, control
from lib.operate import teardown

pytestmark = pytest.mark.stack


@pytest.fixture
def control_conf(live_stack):
    conf = config.apply_overrides(live_stack, {"CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{uuid.uuid4().hex[:8]}-ctl"})
    control.ensure(conf)
    yield conf
    teardown.delete_prefix(conf, config.get(conf, "kafka.topic_prefix"))


def _raw(conf: dict, key: str, value: bytes) -> None:
    producer = Producer({"bootstrap.servers": config.get(conf, "kafka.bootstrap_servers")})
    producer.produce(control.topic(conf), key=key.encode(), value=value)
    assert producer.flush(30) == 0


def test_a_malformed_pipeline_record_names_its_offset_and_the_remedy_and_can_be_removed(control_conf, capsys):
    conf = control_conf
    control.put(conf, "snapshot/s1", {"state": "complete"})
    _raw(conf, "truncate/shop.orders", b"{not json")
    for read in (lambda: control.read_all(conf), lambda: _tail(conf)):
        with pytest.raises(control.ControlError) as raised:
            read()
        message = str(raised.value)
        for part in (control.topic(conf), "offset 1", "truncate/shop.orders", "python -m lib.control delete"):
            assert part in message, f"{part!r} not in: {message}"
    assert control.main(["show", "truncate/shop.orders", "--target", "local"]) == 1  # other prefix: not there
    config_env = {"CDC__KAFKA__TOPIC_PREFIX": config.get(conf, "kafka.topic_prefix")}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in config_env.items():
            patch.setenv(name, value)
        assert control.main(["show", "truncate/shop.orders"]) == 0
        assert "{not json" in capsys.readouterr().out
        assert control.main(["delete", "truncate/shop.orders"]) == 0
    assert control.read_all(conf) == {"snapshot/s1": {"state": "complete"}}


def test_a_malformed_record_under_a_foreign_key_is_ignored_with_a_warning(control_conf, capsys):
    conf = control_conf
    _raw(conf, "someone-else/x", b"\x00\x01")
    control.put(conf, "snapshot/s1", {"state": "complete"})
    assert control.read_all(conf) == {"snapshot/s1": {"state": "complete"}}
    assert "ignoring" in capsys.readouterr().err


def _tail(conf: dict) -> dict:
    tail = control.Tail(conf)
    try:
        return tail.catch_up()
    finally:
        tail.close()
