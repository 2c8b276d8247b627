"""What a local Delta table's commits recorded, read from its _delta_log files (no Spark): newest first, counted up
from the last checkpoint, stopping where the log's cleanup removed older commits."""

from __future__ import annotations

import json

from lib.lake import delta_io


def _commit(folder, version: int, meta: dict | None, with_info: bool = True) -> None:
    actions = [{"add": {"path": f"part-{version}.parquet", "stats": '{"note": "\\"commitInfo\\""}'}}]
    if with_info:
        info = {"operation": "WRITE", **({"userMetadata": json.dumps(meta)} if meta else {})}
        actions.insert(0, {"commitInfo": info})
    (folder / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")


def test_newest_first_up_to_the_limit_from_the_last_checkpoint(tmp_path):
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    for version in range(0, 13):
        _commit(log, version, {"seq": version} if version % 2 == 0 else None)
    (log / "00000000000000000010.checkpoint.parquet").write_bytes(b"")
    (log / "00000000000000000010.00000000000000000012.compacted.json").write_text("{}\n")
    (log / "_last_checkpoint").write_text(json.dumps({"version": 10, "size": 3}))
    texts = list(delta_io.commit_metadata(None, str(tmp_path / "t"), limit=5))
    assert [json.loads(t)["seq"] if t else None for t in texts] == [12, None, 10, None, 8]
    assert delta_io.newest_metadata(None, str(tmp_path / "t"), "seq") == {"seq": 12}
    assert delta_io.newest_metadata(None, "file:" + str(tmp_path / "t"), "seq") == {"seq": 12}


def test_a_log_without_checkpoint_is_listed_and_cleaned_up_commits_end_the_search(tmp_path):
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    for version in (5, 6, 7):  # 0-4 removed by the log's cleanup
        _commit(log, version, {"bronze_seq": version})
    _commit(log, 8, None, with_info=False)
    assert [json.loads(t)["bronze_seq"] for t in delta_io.commit_metadata(None, str(tmp_path / "t"))] == [7, 6, 5]
    assert list(delta_io.commit_metadata(None, str(tmp_path / "missing"))) == []
    assert delta_io.newest_metadata(None, str(tmp_path / "missing"), "seq") is None
