"""Insert, Update, Delete and Truncate messages to Kafka: events for the table's topic, truncates to the control
topic."""

from __future__ import annotations

import struct

from lib import control
from lib.capture import (
    delivery,
    events,
    relations,
)
from lib.capture.pgoutput import lsn_to_str
from lib.capture.stream_state import DeliveryError, State, StreamError


def change(st: State, m, lsn: int) -> None:
    """Turn one Insert/Update/Delete into events and produce them."""
    tx = st.tx
    if tx is None:
        raise StreamError(f"{m.kind} message at LSN {lsn_to_str(lsn)} outside a transaction (protocol error); "
                          f"restart the capture")
    plan = st.relations.plans.get(m.relation_oid) or relations.plan_for(st, m.relation_oid, lsn)
    try:
        pairs, st.serial = events.encoded_events(plan, m, lsn, tx, st.serial)
    except events.EventError as exc:
        raise StreamError(f"{exc} (change at LSN {lsn_to_str(lsn)}, transaction {tx.txid}); the capture stopped "
                          f"before this transaction and the slot stays at {lsn_to_str(st.acks.acked)}") from exc
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise StreamError(f"table {plan.qualified}: an event does not fit its Avro schema ({type(exc).__name__}: "
                          f"{exc}; change at LSN {lsn_to_str(lsn)}); the slot stays at {lsn_to_str(st.acks.acked)}; "
                          f"report this as a bug") from exc
    delivery.produce(st, plan, pairs)


ROW_CHANGES = frozenset(b"IUD")
_RELATION = struct.Struct(">I").unpack_from


def change_raw(st: State, payload: bytes, lsn: int, pos: int = 1) -> bool:
    """Produce an Insert/Update/Delete straight from its payload (relation id at pos) through the compiled codec;
    False when the message is left to change() (no codec yet, no transaction, or anything the codec does not take)."""
    tx = st.tx
    if tx is None or len(payload) < pos + 5:
        return False
    plan = st.relations.plans.get(_RELATION(payload, pos)[0])
    if plan is None or plan.codec is None:
        return False
    result = plan.codec.events(payload, pos, lsn, plan.tx_parts(tx), tx.prev_commit_lsn, tx.commit_lsn, st.serial)
    if result is None:
        return False
    pairs, st.serial = result
    delivery.produce(st, plan, pairs)
    return True


def truncate(st: State, m, lsn: int) -> None:
    """TRUNCATE: one control record per table (it has no key, so it cannot go to the table's topic)."""
    tx = st.tx
    for oid in m.relation_oids:
        relation = st.relations.messages.get(oid)
        qualified = f"{relation.namespace}.{relation.name}" if relation else f"relation {oid}"
        if qualified not in st.relations.topics:
            raise StreamError(f"TRUNCATE of {qualified}, which is in publication {st.publication} but not in "
                              f"source.tables; add it there or remove it from the publication")
        record = {"commit_lsn": tx.commit_lsn, "event_serial": st.serial, "ts_ms": tx.commit_ms, "lsn": lsn,
                  "txId": tx.txid, "cascade": m.cascade, "restart_identity": m.restart_identity}
        if st.chunks.current is not None and st.chunks.current["table"] == qualified:
            st.chunks.current["truncated"] = tx.commit_lsn
        delivery.keepalive(st, quiet=True)
        try:
            control.put(st.conf, f"truncate/{qualified}", record)
        except control.ControlError as exc:
            raise DeliveryError(f"TRUNCATE of {qualified} could not be recorded: {exc}; the slot stays at "
                                f"{lsn_to_str(st.acks.acked)}") from exc
        st.serial += 1
        st.truncates[qualified] += 1
        st.log(f"truncate  {qualified} at commit {lsn_to_str(tx.commit_lsn)} recorded in {control.topic(st.conf)}")
