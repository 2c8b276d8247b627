"""Transactions the server streams while they run (protocol 2): spooled to a file per transaction, replayed at
commit, dropped at rollback; rolled-back subtransactions are skipped."""

from __future__ import annotations

import contextlib
import os
import struct

from lib.capture import (
    changes,
    delivery,
    incremental,
    incremental_chunks,
    relations,
)
from lib.capture.pgoutput import Decoder, lsn_to_str
from lib.capture.stream_state import State, StreamError

SPOOLED = frozenset(b"RYIUDTM")  # messages inside a stream block that belong to the streamed transaction
RECORD = struct.Struct(">QI")  # spool record header: data_start, payload length
_ROW_CHANGES = (b"I", b"U", b"D")
_xid = struct.Struct(">I").unpack_from


def stream_start(st: State, m) -> None:
    st.spools.xid = m.xid
    spool = st.spools.files.get(m.xid)
    if spool is not None and m.first_segment:  # the server starts this transaction over
        _drop_spool(st, m.xid)
        spool = None
    if spool is None:
        path = os.path.join(st.spools.dir, f"xid-{m.xid}.spool")
        try:
            st.spools.files[m.xid] = [open(path, "w+b", buffering=1 << 20), set(), path]  # noqa: SIM115 - see _drop_spool
        except OSError as exc:
            raise spool_error(st, m.xid, exc) from exc


def spool_error(st: State, xid: int, exc: OSError) -> StreamError:
    return StreamError(
        f"cannot write the spool of in-progress transaction {xid} in {st.spools.dir}: {exc.strerror or exc}. The "
        f"server streams transactions larger than logical_decoding_work_mem while they run, and the capture keeps "
        f"them on disk until they commit: free space there, or set source.spool_dir (conf) to a folder with room "
        f"for the largest transaction. The slot stays at {lsn_to_str(st.acks.acked)}; a restart resumes there")


def _drop_spool(st: State, xid: int) -> None:
    spool = st.spools.files.pop(xid, None)
    if spool is not None:
        with contextlib.suppress(OSError):  # buffered bytes that cannot be written any more are not needed
            spool[0].close()
        with contextlib.suppress(OSError):
            os.unlink(spool[2])


def stream_abort(st: State, m) -> None:
    """Rollback of a streamed transaction (drop its spool) or of one of its subtransactions (skip its changes)."""
    if m.subxid == m.xid:
        _drop_spool(st, m.xid)
    elif m.xid in st.spools.files:
        st.spools.files[m.xid][1].add(m.subxid)
        st.spools.subxact_aborts += 1


def stream_commit(st: State, m, tick) -> None:
    """Replay a streamed transaction's spool as one transaction with the commit LSN (tick: the loop's timed work)."""
    delivery.begin(st, m.commit_lsn, m.xid, m.commit_ts)
    spool = st.spools.files.get(m.xid)
    if spool is not None and not _replay(st, spool, tick):
        return  # stopping: the transaction stays unacknowledged and is resent after a restart
    _drop_spool(st, m.xid)
    delivery.commit(st, m.commit_lsn, m.end_lsn)
    st.streamed += 1


def _replay(st: State, spool: list, tick) -> bool:
    """Send the spooled changes in order, skipping rolled-back subtransactions; False when stopped midway."""
    file, aborted = spool[0], spool[1]
    try:
        file.flush()
    except OSError as exc:
        raise spool_error(st, st.tx.txid, exc) from exc
    file.seek(0)
    decoder = Decoder()
    decoder.in_stream = True  # spooled messages carry the xid of their (sub)transaction
    read, unpack, size = file.read, RECORD.unpack, RECORD.size
    count = 0
    while True:
        header = read(size)
        if not header:
            return True
        lsn, length = unpack(header)
        payload = read(length)
        if not (payload[:1] in _ROW_CHANGES and len(payload) >= 5 and _xid(payload, 1)[0] not in aborted
                and changes.change_raw(st, payload, lsn, 5)):  # else sent by the compiled codec
            _replay_one(st, decoder.decode(payload), lsn, aborted)
        count += 1
        if count % 1000 == 0:
            st.producer.poll(0)
            delivery.advance(st)
            delivery.keepalive(st)
            if tick(st) and st.stop_reason != "caught_up":
                return False


def _replay_one(st: State, m, lsn: int, aborted: set) -> None:
    """One decoded spooled message."""
    kind = m.kind
    if kind in "IUD":
        if m.xid not in aborted:
            changes.change(st, m, lsn)
    elif kind == "R":
        # applied even from a rolled-back subtransaction: later changes may rely on it
        relations.remember_relation(st, m)
    elif kind == "T" and m.xid not in aborted:
        changes.truncate(st, m, lsn)
    elif kind == "M" and m.prefix == incremental.WATERMARK_PREFIX and m.xid not in aborted:
        incremental_chunks.watermark(st, m)
