"""The failure matrix's fast subset on the live stack (bench/fault_matrix.py; `make faults` runs all of it).

One pipeline of its own under a running workload, on a Kafka broker of its own (the stack's code and jars, its
own ports and data), so that killing it touches no other test: the broker killed (-9) with capture and merge crashing
while it is down. Capture and merge killed (-9) at random points is `make faults`'s (ten times each); here they are
killed while the workload writes in tests/test_service.py, the capture at random points in tests/test_stream.py and
the merge mid-backlog and mid-silver-step in tests/test_merge_stream.py. After the case silver reconciles exactly with
the source, bronze holds every Kafka offset of the table topics exactly once, no keeper gave up, and during the
outage both keepers waited for Kafka.
"""

from __future__ import annotations

import sys

import own_services
import pytest

from lib import config

sys.path.insert(0, str(config.PROJECT_ROOT / "bench"))
import fault_matrix  # noqa: E402

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def matrix(live_stack, spark_session, tmp_path_factory):
    """A running pipeline of the matrix's own (broker, database, slot, topics, lake, services); removed afterwards."""
    overrides = own_services.own_broker(str(tmp_path_factory.mktemp("broker")))
    try:
        ctx = fault_matrix.new_context(spark_session, seed=7, log=lambda line: None, overrides=overrides)
        yield ctx
        fault_matrix.stop_pipeline(ctx["conf"], ctx["folder"], log=lambda line: None)
    finally:
        own_services.stop(overrides)


def assert_case(row: dict) -> None:
    """The case recovered, reconciled exactly, had bronze complete, and no keeper gave up."""
    assert "error" not in row, row
    assert "caught_up_s" in row, row
    assert not row["gave_up"], row["keeper"]
    assert all("crashed" not in w["states"] for w in row["keeper"].values()), row["keeper"]
    assert row["details"].endswith("rows equal; bronze offsets once"), row["details"]
    assert row["load"]["transactions"] > 50, row["load"]
    assert row["exact"], fault_matrix.line(row)


def test_kafka_killed_while_writing_keepers_wait_then_exact(matrix, monkeypatch):
    monkeypatch.setattr(fault_matrix, "KAFKA_DOWN_S", 8.0)  # and until both keepers wait for it
    monkeypatch.setattr(fault_matrix, "CHILDREN_KILLED_AFTER_S", 3.0)
    row = fault_matrix.run_case("kafka_kill", 1, matrix, log=lambda line: None)
    broker = config.get(matrix["conf"], "kafka.bootstrap_servers")  # the pipeline's own
    for name in ("capture", "merge"):
        watched = row["keeper"][name]
        assert "waiting" in watched["states"], (name, watched)
        assert watched["waiting"].startswith(f"waiting for Kafka at {broker}"), watched
    assert_case(row)


def test_a_table_creation_cut_short_is_cleared_and_a_committed_log_kept(tmp_path):
    """What disk_full found: a _delta_log with Delta's temporary file only is removed before the batch's writes (Delta
    would refuse to create the table there); a log with a commit stays."""
    from lib.lake import delta_io

    cut, kept = tmp_path / "cut" / "_delta_log", tmp_path / "kept" / "_delta_log"
    for log_dir in (cut, kept):
        (log_dir / "_staged_commits").mkdir(parents=True)
        (log_dir / ".00000000000000000000.json.4a985f6a.tmp").write_text("{")
    (kept / "00000000000000000000.json").write_text("{}")
    for path in (cut.parent, kept.parent, tmp_path / "absent"):
        delta_io.clear_failed_creation(str(path))
    assert not cut.exists() and cut.parent.exists()
    assert sorted(p.name for p in kept.iterdir()) == [".00000000000000000000.json.4a985f6a.tmp",
                                                        "00000000000000000000.json", "_staged_commits"]
