"""The pgoutput decoder on each PostgreSQL major's real output, recorded with the options the capture asks of it.

tests/fixtures/pgoutput/pg<major>/ was recorded by `tests/fixtures/record_pgoutput.py --major <major>` from a
server of that major (13 to 18), with lib.capture.pgoutput.protocol_options: protocol 1 on 13, 2 with streaming
on 14, 3 on 15, 4 with parallel streaming from 16. No server is needed here.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from lib.capture.pgoutput import (
    UNCHANGED_TOAST,
    Decoder,
    Delete,
    Insert,
    Message,
    StreamAbort,
    StreamCommit,
    Update,
    protocol_options,
)

FIXTURES = Path(__file__).parent / "fixtures" / "pgoutput"
MAJORS = [13, 14, 15, 16, 17, 18]


def recording(major: int, name: str) -> tuple[dict, list]:
    """A scenario's header and its messages, decoded in order by one Decoder."""
    lines = [json.loads(line) for line in (FIXTURES / f"pg{major}" / f"{name}.jsonl").read_text().splitlines()]
    decoder = Decoder()
    return lines[0], [decoder.decode(base64.b64decode(line["payload"])) for line in lines[1:]]


def kinds(messages: list) -> str:
    return "".join(message.kind for message in messages)


@pytest.mark.parametrize("major", MAJORS)
def test_each_major_was_recorded_with_the_options_the_capture_asks_of_it(major):
    header, _ = recording(major, "insert_multirow")
    version = int(header["server_version"].split(".")[0])
    assert version == major
    number = major * 10000 + int(header["server_version"].split(".")[1].split()[0])
    expected = {**protocol_options(number), "publication_names": "rec_pub"}
    assert header["options"] == expected
    assert expected["proto_version"] == {13: "1", 14: "2", 15: "3"}.get(major, "4")


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("name, pattern", [
    ("insert_multirow", "BRIIIC"),
    ("update_no_key", "BUC"),
    ("update_key", "BUC"),
    ("delete", "BDC"),
    ("replica_full", "BRIICBUCBDC"),
    ("toast_unchanged", "BRICBUC"),
    ("add_column", "BR?IRIC"),  # the first Relation is sent again or not, as the server's cache has it
    ("enum_type", "BYRIIC"),
    ("truncate", "BRRTCBYRTC"),
])
def test_every_major_decodes_the_same_changes(major, name, pattern):
    _, messages = recording(major, name)
    assert re.fullmatch(pattern, kinds(messages)), (major, kinds(messages))


@pytest.mark.parametrize("major", MAJORS)
def test_values_keys_and_unchanged_toast_read_the_same_on_every_major(major):
    inserted = [m.new for m in recording(major, "insert_multirow")[1] if isinstance(m, Insert)]
    assert inserted == [("1", "Ada", "100.50", "2024-01-31", "first"), ("2", "Grace", None, "2024-02-29", None),
                        ("3", "Линус ☃", "-0.01", None, "it's \"quoted\"")]
    update = next(m for m in recording(major, "update_key")[1] if isinstance(m, Update))
    assert (update.old_kind, update.old[0], update.new[:2]) == ("K", "2", ("20", "Grace"))
    delete = next(m for m in recording(major, "delete")[1] if isinstance(m, Delete))
    assert (delete.old_kind, delete.old[0]) == ("K", "3")
    toast = [m for m in recording(major, "toast_unchanged")[1] if isinstance(m, Update)][0]
    assert toast.new == ("1", "final", UNCHANGED_TOAST)


@pytest.mark.parametrize("major", MAJORS)
def test_logical_messages_arrive_from_14_on(major):
    messages = [m for m in recording(major, "messages")[1] if isinstance(m, Message)]
    if major == 13:  # protocol 1 has no messages option: heartbeats only move the slot
        assert messages == []
    else:
        assert [(m.transactional, m.prefix, m.content) for m in messages] == [
            (False, "cdc-heartbeat", b""), (True, "cdc", b"hello"), (False, "cdc-heartbeat", b"")]


@pytest.mark.parametrize("major", [14, 15, 16, 17, 18])
def test_a_large_transaction_arrives_in_blocks_and_commits(major):
    header, messages = recording(major, "streamed_commit")
    assert header["trimmed"]["dropped_stream_inserts"] > 3000
    assert re.fullmatch(r"SRI+E(SE)+BRIC(SE)+SI+MU+DEc", kinds(messages)), kinds(messages)
    commit = messages[-1]
    assert isinstance(commit, StreamCommit) and commit.commit_lsn > 0


@pytest.mark.parametrize("major", [14, 15, 16, 17, 18])
def test_a_rolled_back_large_transaction_is_aborted_or_never_sent(major):
    _, messages = recording(major, "streamed_abort")
    if major >= 18 and not messages:  # 18 skips decoding a transaction it knows was rolled back
        return
    assert re.fullmatch(r"SRI+E(SE)+SI+EAA", kinds(messages)), kinds(messages)
    aborts = [m for m in messages if isinstance(m, StreamAbort)]
    assert aborts[0].subxid != aborts[0].xid and aborts[1].subxid == aborts[1].xid  # the savepoint, then all
    if major >= 16:  # parallel streaming: the abort carries its position and time
        assert all(a.abort_lsn and a.abort_ts for a in aborts)
    else:
        assert all(a.abort_lsn is None for a in aborts)
