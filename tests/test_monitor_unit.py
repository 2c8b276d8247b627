"""Offline parts of the continuous mode: checkpoint offsets, the metrics history and its plot, service state from
pid files, the status report and the teardown's list of losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import pytest

from lib import config
from lib.operate import keeper, metrics, monitor, service, teardown, workers

matplotlib.use("Agg")


@pytest.fixture
def conf(tmp_path):
    return {"source": {"slot": "unit_slot", "tables": ["bank.customers"]}, "kafka": {"topic_prefix": "unit"},
            "service": {"dir": str(tmp_path / "svc"), "metrics_interval_s": 2},
            "monitor": {"warn_retained_wal_bytes": 1000}}


def write_checkpoint(folder, batches: dict[int, list[dict]], committed: list[int]) -> None:
    (folder / "offsets").mkdir(parents=True)
    (folder / "commits").mkdir()
    for batch, sources in batches.items():
        lines = ["v1", json.dumps({"batchWatermarkMs": 0})] + [json.dumps(s) for s in sources]
        (folder / "offsets" / str(batch)).write_text("\n".join(lines))
    for batch in committed:
        (folder / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def test_committed_offsets_are_those_of_the_last_committed_batch(tmp_path):
    folder = tmp_path / "cp"
    write_checkpoint(folder, {0: [{"a": {"0": 5, "1": 7}}], 1: [{"a": {"0": 9, "1": 7}}, {"b": {"0": 3}}],
                              2: [{"a": {"0": 20, "1": 20}}]}, committed=[0, 1])
    assert monitor.committed_offsets(str(folder)) == {"a": {0: 9, 1: 7}, "b": {0: 3}}  # batch 2 still running


def test_committed_offsets_unknown_without_commits_or_for_object_stores(tmp_path):
    write_checkpoint(tmp_path / "cp", {0: [{"a": {"0": 1}}]}, committed=[])
    assert monitor.committed_offsets(str(tmp_path / "cp")) is None
    assert monitor.committed_offsets(str(tmp_path / "missing")) is None
    assert monitor.committed_offsets("s3://bucket/cp") is None


def test_history_reads_every_record_and_plots(conf):
    metrics.record(conf, "capture", {"interval_events_per_s": 12.5, "lag_bytes": 100, "lag_s": 0.2,
                                     "retained_wal_bytes": 5000})
    metrics.record(conf, "merge", {"interval_events_per_s": 10.0, "kafka_lag": 4, "batches": 1,
                                   "dead_letters": {"bank.customers": 2}})
    with open(metrics.metrics_path(conf, "merge"), "a") as handle:
        handle.write('{"cut by a crash')  # a half-written line is skipped
    frame = metrics.history(conf)
    assert list(frame["service"]) == ["capture", "merge"]
    assert frame.loc[0, "retained_wal_bytes"] == 5000 and frame.loc[1, "dead_letters"] == 2
    assert metrics.latest(conf, "merge")["kafka_lag"] == 4
    fig = monitor.plot(conf)
    assert len(fig.axes) == 3


def test_history_rotates_a_large_file(conf, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_HISTORY_BYTES", 200)
    for i in range(10):
        metrics.record(conf, "capture", {"events": i})
    path = metrics.metrics_path(conf, "capture")
    assert path.with_name(path.name + ".1").exists()
    assert [r["events"] for r in metrics.records(conf, "capture")][-1] == 9


def test_capture_record_counts_per_table_since_the_previous_record(conf):
    previous: dict = {}
    first = workers.capture_record(conf, {"events_per_table": {"t": 5}, "elapsed_s": 2.0}, previous)
    second = workers.capture_record(conf, {"events_per_table": {"t": 12, "u": 1}}, previous)
    assert first["interval_events_per_table"] == {"t": 5}
    assert second["interval_events_per_table"] == {"t": 7, "u": 1}
    assert "slot_error" in second  # no database in this conf: reported, not raised


def test_a_dead_process_with_a_pid_file_is_crashed(conf):
    paths = keeper.files(conf, "capture")
    paths["pid"].parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    paths["pid"].write_text(f"{proc.pid}\n")
    paths["log"].write_text("stream started\npython -m lib.operate.service: error: slot x is gone; run notebook 02\n")
    row = keeper.state(conf, "capture")
    assert row["state"] == "crashed" and "slot x is gone" in row["last_line"]
    assert keeper.state(conf, "merge")["state"] == "stopped"
    service.stop(conf, log=lambda line: None)
    assert not paths["pid"].exists()


def test_start_on_databricks_points_to_the_bundle_jobs(conf, monkeypatch):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "18.0")
    with pytest.raises(service.ServiceError, match="cdc_capture and cdc_merge"):
        service.start(conf)


def test_command_line():
    args = service.parser().parse_args(["run", "merge", "--target", "databricks"])
    assert (args.command, args.service, args.run_target) == ("run", "merge", "databricks")
    with pytest.raises(SystemExit):
        service.main(["start", "capturer"])


def test_report_shows_flows_and_warnings():
    st = {"slot": "s", "at": "now", "kafka_lag": 3, "warnings": ["slot s has no consumer attached"],
          "services": [{"service": "capture", "state": "stopped", "pid": None, "log": "c.log"}],
          "slots": [{"slot": "s", "active": False, "active_pid": None, "lag_bytes": 2048, "lag_s": None,
                     "retained_wal_bytes": 3 << 20, "wal_status": "reserved"}],
          "tables": [{"table": "bank.customers", "events_in_per_s": 1.5, "events_out_per_s": 0.0,
                      "kafka_messages": 10, "kafka_lag": 3, "silver_behind": 2, "last_merged_lsn": "0/16B3748",
                      "dead_letters": 1}]}
    text = monitor.report(st)
    assert "NONE" in text and "3.0 MB" in text and "2.0 kB" in text and "0/16B3748" in text
    header, row = [line.split() for line in text.splitlines() if line.startswith(("table ", "bank.customers"))]
    assert header[5:9] == ["bronze", "lag", "silver", "lag"] and row[4:6] == ["3", "2"]
    assert "WARNING   slot s has no consumer attached" in text


def test_frames_keep_their_columns_without_rows():
    st = {"services": [{"service": "capture", "state": "stopped", "pid": None, "log": "c.log", "last_line": None}],
          "slots": [], "tables": [{"table": "bank.customers", "kafka_lag": 0}]}
    parts = monitor.frames(st)
    assert list(parts["services"]["state"]) == ["stopped"] and list(parts["tables"]["kafka_lag"]) == [0]
    assert parts["slots"].empty
    assert {"slot", "lag_bytes", "lag_s", "retained_wal_bytes", "wal_status"} <= set(parts["slots"].columns)
    assert set(monitor.FRAME_COLUMNS["tables"]) >= {"events_in_per_s", "events_out_per_s", "last_merged_lsn"}


def test_teardown_names_what_is_lost():
    plan = {"slot": "s", "slot_row": {"confirmed_flush_lsn": "0/10", "lag_bytes": 4096, "retained_wal_bytes": 1 << 20},
            "publication": "p", "published_tables": ["bank.a"], "snapshot_record": {"state": "complete"},
            "topics": {"x.bank.a": 12}, "subjects": ["x.bank.a-key", "x.bank.a-value"]}
    lines = teardown.losses(plan)
    assert lines[0].startswith("replication slot s: changes committed after 0/10") and "4.0 kB" in lines[0]
    assert "publication p (bank.a)" in lines[1] and "snapshot/s" in lines[2] and "topic x.bank.a: 12" in lines[3]
    assert "x.bank.a-value" in lines[4]


def test_the_target_may_follow_the_subcommand_and_hints_carry_it(conf, capsys):
    args = service.parser().parse_args(["status", "--target", "tpch"])
    assert (args.command, args.sub_target) == ("status", "tpch")
    assert service.main(["status", "--target", "no_such_target"]) == 1
    assert "no configuration for target 'no_such_target'" in capsys.readouterr().err
    assert config.make({**conf, "target": "local"}, "status") == "`make status`"
    assert config.make({**conf, "target": "tpch"}, "stop") == "`CDC_TARGET=tpch make stop`"
    assert config.command({**conf, "target": "tpch"}, "lib.operate.teardown", "--yes") == \
        "`python -m lib.operate.teardown --yes --target tpch`"


def test_the_last_error_is_the_error_not_the_jvm_chatter_after_it(tmp_path):
    log = tmp_path / "merge.log"
    log.write_text("merge     query started\n"
                   "python -m lib.operate.service: error: merge query q stopped in micro-batch 3: boom\n"
                   "26/11/24 21:10:10 WARN ObjectStore: Failed to get database delta, error NoSuchObjectException\n"
                   "26/11/24 21:10:11 WARN Utils: Your hostname resolves to a loopback address\n")
    assert keeper._last_error_line(log, keeper_lines=False) == \
        "python -m lib.operate.service: error: merge query q stopped in micro-batch 3: boom"


@pytest.mark.parametrize("step_s", [0.8, 1.6])
def test_silver_steps_start_every_interval_and_a_long_one_is_not_followed_by_a_wait(monkeypatch, step_s):
    from lib.lake import silver_step

    starts = []

    def step(conf, spark, prog, maintain=True):
        starts.append(time.monotonic())
        time.sleep(step_s)
        return {"seq": len(starts), "tables": {}, "seconds": step_s}

    monkeypatch.setattr(silver_step, "run", step)
    conf = config.apply_overrides(config.load("local"), {"CDC__MERGE__SILVER_INTERVAL_S": "1"})
    cadence = workers.SilverCadence(conf, None, log=lambda line: None)
    time.sleep(6)
    cadence.stopping.set()
    cadence.thread.join(5)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(gaps) >= 2, starts
    # a step every second (polled every 0.2 s), or right after one that took longer than the interval
    assert all(max(1.0, step_s) - 0.05 <= gap <= max(1.0, step_s) + 0.6 for gap in gaps), gaps  # before: step + 1 s


def test_a_silver_step_runs_once_bronze_has_caught_up_with_events_pending_not_only_every_interval(monkeypatch):
    """The end of a burst: bronze logged events and then no batch ran for two triggers (1 s each here), so silver
    steps then instead of at the next interval (60 s); not while a long batch runs, nor with nothing pending."""
    from types import SimpleNamespace

    from lib.lake import decode_step, silver_step

    starts, decodes = [], []

    def step(conf, spark, prog, maintain=True):
        starts.append(time.monotonic())
        return {"seq": len(starts), "tables": {"bank.customers": {"events": 5}}, "seconds": 0.0}

    monkeypatch.setattr(silver_step, "run", step)
    monkeypatch.setattr(decode_step, "run", lambda conf, spark, dec: decodes.append(time.monotonic()))
    upkept = []  # the events still counted pending when the step's upkeep (compaction, prune) begins
    monkeypatch.setattr(silver_step, "upkeep", lambda conf, spark, prog, seq: upkept.append(
        (seq, cadence.record()["silver_pending_events"])))
    conf = config.apply_overrides(config.load("local"), {"CDC__MERGE__SILVER_INTERVAL_S": "60",
                                                         "CDC__SERVICE__MERGE_INTERVAL": "1 second"})
    cadence = workers.SilverCadence(conf, None, log=lambda line: None)
    ctx = SimpleNamespace(history=[], active=False)
    cadence.follow(ctx)
    try:
        time.sleep(3)
        assert starts == []  # nothing pending
        ctx.history.append({"batch_id": 0, "tables": {"bank.customers": {"events": 5, "tombstones": 0}}})
        ctx.active = True  # the next micro-batch runs long: bronze is not idle, however long since the last ended
        time.sleep(3)
        assert starts == []
        ctx.active, logged = False, time.monotonic()
        ctx.history.append({"batch_id": 1, "tables": {"bank.customers": {"events": 2, "tombstones": 0}}})
        time.sleep(3.5)
    finally:
        cadence.stopping.set()
        cadence.thread.join(5)
    assert len(starts) == 1 and 1.8 <= starts[0] - logged <= 2.8, [round(t - logged, 2) for t in starts]
    assert len(decodes) == 2 and decodes[1] - logged < 1.0, decodes  # each trigger decoded at once, not at the step
    assert cadence.changes == 1 and cadence.record()["silver_pending_events"] == 0
    assert upkept == [(1, 0)], upkept  # after the step was counted: its events are not pending during the upkeep


def test_a_failed_silver_step_logs_its_traceback_and_stops_the_service_naming_the_java_error(monkeypatch):
    """py4j's first line only names the call ("An error occurred while calling o62.sql."): the service's error
    names Java's exception instead, and the service's log holds the whole traceback."""
    from lib.lake import merge, silver_step

    java = ("An error occurred while calling o62.sql.\n: io.delta.exceptions.ConcurrentAppendException: [DELTA_"
            "CONCURRENT_APPEND] Files were added to the root of the table by a concurrent update.\n\tat io.delta.x")

    def step(conf, spark, prog, maintain=True):
        raise RuntimeError(java)

    monkeypatch.setattr(silver_step, "run", step)
    conf = config.apply_overrides(config.load("local"), {"CDC__MERGE__SILVER_INTERVAL_S": "0.2"})
    lines = []
    cadence = workers.SilverCadence(conf, None, log=lines.append)
    cadence.thread.join(10)
    cadence.stop()
    with pytest.raises(merge.MergeError, match=r"^silver step failed: RuntimeError: io\.delta\.exceptions\."
                                               r"ConcurrentAppendException: \[DELTA_CONCURRENT_APPEND\] Files were"):
        cadence.raise_failure()
    logged = "\n".join(lines)
    assert "silver step failed: RuntimeError: io.delta.exceptions.ConcurrentAppendException" in logged
    assert "Traceback (most recent call last)" in logged and "in step" in logged


def test_a_lease_is_renewed_once_a_third_of_its_validity_has_passed_not_on_every_record(conf, monkeypatch):
    """Each renewal is a control-topic message the merge reads as a micro-batch: metrics records every 2 s must not
    renew a 36 s lease (3 intervals + 30 s) more often than every 12 s; a service's start renews at once."""
    renewed = []
    monkeypatch.setattr(workers.control, "renew_lease", lambda c, name, valid_s: renewed.append((name, valid_s)))
    monkeypatch.setattr(workers, "_RENEWED", {})
    workers._renew_lease(conf, "merge", log=print, force=True)
    workers._renew_lease(conf, "merge", log=print)  # the next metrics record, at once: not renewed
    assert renewed == [("merge", 36.0)]
    key = workers.control.lease_key(conf, "merge")
    workers._RENEWED[key] -= 11.5  # 11.5 s later: still not
    workers._renew_lease(conf, "merge", log=print)
    assert renewed == [("merge", 36.0)]
    workers._RENEWED[key] -= 0.6  # 12.1 s later: renewed
    workers._renew_lease(conf, "merge", log=print)
    workers._renew_lease(conf, "capture", log=print)  # another service's lease is its own
    workers._renew_lease(conf, "merge", log=print, force=True)
    assert renewed == [("merge", 36.0)] * 2 + [("capture", 36.0), ("merge", 36.0)]


def _delta_commit(folder, version: int, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    info = {"commitInfo": {"operation": "WRITE", "userMetadata": json.dumps(meta)}}
    (folder / f"{version:020d}.json").write_text(json.dumps(info) + "\n")


def test_silver_is_behind_until_it_holds_bronze_or_the_commits_taken_earlier(conf, tmp_path):
    from lib.lake import lake_paths

    conf = {**conf, "lake": {"root": str(tmp_path / "lake")}}
    bronze = Path(lake_paths.bronze_path(conf)) / "_delta_log"
    silver = Path(lake_paths.silver_path(conf, lake_paths.table_specs(conf)[0])) / "_delta_log"
    _delta_commit(bronze, 0, {"seq": 4, "touched": {"bank.customers": 4}})
    _delta_commit(silver, 0, {"bronze_seq": 4})
    assert monitor.silver_behind(conf) == {}
    holding = monitor.bronze_touched(conf)
    _delta_commit(bronze, 1, {"seq": 7, "touched": {"bank.customers": 7}})  # writes go on after the end offsets
    assert monitor.silver_behind(conf) == {"bank.customers": 3}
    assert monitor.silver_behind(conf, touched=holding) == {}
    assert monitor.silver_behind(conf, touched={"bank.customers": 6}) == {"bank.customers": 2}
