"""The notebooks' capture and merge steps refuse while the continuous services run (issue 16, point 14)."""

from __future__ import annotations

import pytest

from lib import control
from lib.capture import stream
from lib.lake import lake_paths, merge

pytestmark = pytest.mark.stack


def test_catch_up_steps_refuse_while_a_service_holds_its_lease_and_run_once_it_expired(small_source, spark_session):
    conf = small_source("CREATE TABLE {s}.items (id int PRIMARY KEY)").conf
    control.renew_lease(conf, "capture", 60)
    with pytest.raises(stream.StreamError, match=r"continuous capture of slot .* runs \(pid \d+ on .*renewed until"
                                                 r".*Stop it first \(`make stop`, or pause the cdc_capture job\)"):
        stream.run(conf, until="caught_up", heartbeat_s=0)
    control.renew_lease(conf, "merge", 60)
    with pytest.raises(lake_paths.MergeError, match=r"continuous merge of slot .* runs .* checkpoint .*cdc_merge job"):
        merge.run_until_caught_up(conf, spark_session)
    control.renew_lease(conf, "capture", -1)  # expired: a service that died without stopping
    assert stream.run(conf, until="caught_up", heartbeat_s=0)["events"] == 0
    control.put(conf, control.lease_key(conf, "merge"), None)  # removed: a service that stopped cleanly
    assert control.running_service(conf, "merge") is None
