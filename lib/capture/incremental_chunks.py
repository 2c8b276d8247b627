"""Incremental snapshots inside the capture: chunks read beside the stream and sent at their watermark
(the method is described in lib/capture/incremental.py)."""

from __future__ import annotations

import json
import os
import threading
import time

from lib import control, kafka_client, schema_registry
from lib.capture import avro_schemas, catalog, delivery, events, incremental
from lib.capture.pgoutput import lsn_to_str
from lib.capture.stream_state import DeliveryError, State, StreamError


def check_requests(st: State, catch_up: bool = False) -> None:
    """Pick up new incremental snapshot requests from the control topic (a table added live joins st.relations.topics).

    Reads only what arrived since the last look, without waiting (catch_up: up to the topic's end, a few s).
    """
    try:
        requests = incremental.pending(st.conf, st.control.catch_up(5.0) if catch_up else st.control.poll())
    except control.ControlError as exc:
        st.log(f"incremental cannot read requests: {exc}")
        return
    queued = {r["table"] for r in st.chunks.requests}
    for record in requests:
        table = record["table"]
        if table not in st.relations.topics:  # added live: its changes may arrive from now on
            described = _describe(st, table, record.get("declared_key"))
            st.relations.topics[table] = avro_schemas.topic_for(st.conf, described)
            if record.get("declared_key"):
                st.relations.keys[table] = record["declared_key"]
        if table in queued or record["state"] == "requested":  # 'requested': not published yet, no chunk
            continue
        moved = st.control.records.get(incremental.rekey_key(st.slot, table)) if record["reason"] == "rekey" else None
        if moved and moved["topic"] != st.relations.topics[table]:
            raise StreamError(f"table {table} was re-keyed to topic {moved['topic']}, but this capture's conf sends it "
                              f"to {st.relations.topics[table]}: restart the capture with the conf that names "
                              f"{moved['topic']} under kafka.topics (the slot stays at {lsn_to_str(st.acks.acked)})")
        st.chunks.requests.append(record)
        st.log(f"incremental {table}: {record['state']}, resuming after key {record['last_key']}"
               if record.get("last_key") else f"incremental {table}: starting")


def _describe(st: State, qualified: str, declared: list | None) -> catalog.Table:
    """A table of an incremental request, described and checked like a configured one."""
    schema, _, name = qualified.partition(".")
    ident = catalog.sql_name(schema, name)
    try:
        table = catalog.describe_tables(st.sql, [ident], {ident: declared} if declared else None)[ident]
        catalog.check_capturable(table)
    except catalog.CatalogError as exc:
        raise StreamError(f"incremental snapshot of {qualified}: {exc}") from exc
    return table


def next_chunk(st: State) -> None:
    """Start reading the next chunk when none is under way; report a chunk that failed."""
    chunk = st.chunks.current
    if chunk is not None:
        if chunk["error"] is not None and not chunk["thread"].is_alive():
            st.chunks.current, st.chunks.failures = None, st.chunks.failures + 1
            reason = f"{type(chunk['error']).__name__}: {str(chunk['error']).strip().splitlines()[0]}"
            if st.chunks.failures >= 3:
                raise StreamError(f"incremental snapshot of {chunk['table']}: reading a chunk failed 3 times "
                                  f"({reason}); check that a replication slot and a WAL sender are free "
                                  f"(max_replication_slots, max_wal_senders) and that the role may read the table, "
                                  f"then restart the capture")
            st.log(f"incremental {chunk['table']}: reading a chunk failed ({reason}); retrying in 5 s")
            st.chunks.retry_at = time.monotonic() + 5.0
        return
    if not st.chunks.requests or time.monotonic() < st.chunks.retry_at or st.stop_reason is not None:
        return
    record = st.chunks.requests[0]
    table = _describe(st, record["table"], record.get("declared_key"))
    plan = events.plan(table, st.prefix, st.database, st.unknown_types, st.relations.topics[table.qualified])
    key_subject, value_subject = schema_registry.subjects(plan.topic)
    try:
        key_id = schema_registry.register(st.registry, key_subject, plan.key_schema)[0]
        value_id = schema_registry.register(st.registry, value_subject, plan.value_schema)[0]
    except schema_registry.RegistryError as exc:
        raise StreamError(f"incremental snapshot of {table.qualified}: {exc}") from exc
    plan.set_ids(key_id, value_id)
    st.chunks.seq += 1
    chunk = {"table": table.qualified, "id": f"{os.getpid()}_{st.chunks.seq}", "plan": plan, "record": record,
             "changed": [], "truncated": None, "result": None, "error": None}
    args = (st.conf, table, list(plan.columns), record.get("last_key"), st.chunks.rows, chunk["id"])

    def read(_chunk=chunk, _args=args):
        try:
            _chunk["result"] = incremental.read_chunk(*_args)
        except BaseException as exc:  # noqa: BLE001 - reported by next_chunk in the capture's thread
            _chunk["error"] = exc

    chunk["thread"] = threading.Thread(target=read, name=f"cdc-chunk-{chunk['id']}", daemon=True)
    st.chunks.current = chunk
    chunk["thread"].start()


def watermark(st: State, m) -> None:
    """A chunk's high watermark: every change committed before its snapshot was sent; send the chunk now."""
    try:
        mark = json.loads(bytes(m.content).decode())
    except ValueError:
        return
    chunk = st.chunks.current
    if mark.get("slot") != st.slot or chunk is None or mark.get("chunk") != chunk["id"]:
        return  # another capture's, or one from before a restart (its chunk is read again)
    chunk["thread"].join()
    if chunk["error"] is not None:
        return  # next_chunk reports it
    st.chunks.current = None
    st.chunks.failures = 0
    _emit_chunk(st, chunk)


def _emit_chunk(st: State, chunk: dict) -> None:
    """Send the chunk's rows as 'r' events at (consistent point, -1), minus keys changed since; record progress."""
    result, plan, record = chunk["result"], chunk["plan"], dict(chunk["record"])
    consistent = result["consistent_lsn"]
    newer = {body for lsn, body in chunk["changed"] if lsn >= consistent}
    pairs = []
    if chunk["truncated"] is None or chunk["truncated"] < consistent:
        tx = events.Tx(consistent, None, int(time.time() * 1000), None, int(time.time() * 1000))
        for row in result["rows"]:
            converted, _ = events.values(plan, row)
            key = plan.key_bytes(converted)
            if key[5:] in newer:
                continue
            value = plan.encode_value(events.envelope(plan, "r", None, plan.as_dict(converted), [], tx, consistent,
                                                      -1, "incremental"))
            pairs.append((key, value))
    delivery.produce(st, plan, pairs)
    with kafka_client.waiting_on(st.conf, f"acknowledge a chunk of {chunk['table']}'s incremental snapshot"):
        unacknowledged = st.producer.flush(delivery.FLUSH_TIMEOUT_S)
    if unacknowledged:
        raise DeliveryError(f"incremental snapshot of {chunk['table']}: Kafka did not acknowledge a chunk within "
                            f"{delivery.FLUSH_TIMEOUT_S:.0f} s; the slot stays at {lsn_to_str(st.acks.acked)} and the "
                            f"chunk is read again after a restart")
    delivery.advance(st)
    record.update(state="complete" if result["done"] else "running", last_key=result["last_key"],
                  rows=record.get("rows", 0) + len(pairs), chunks=record.get("chunks", 0) + 1,
                  updated_ms=int(time.time() * 1000))
    control.put(st.conf, incremental.record_key(st.slot, chunk["table"]), record)
    st.chunks.requests[0] = record
    if result["done"]:
        st.chunks.requests.pop(0)
    st.log(f"incremental {chunk['table']}: chunk {record['chunks']} sent {len(pairs)} row(s) "
           f"({len(result['rows']) - len(pairs)} newer in the stream), {record['rows']} in all"
           + (", complete" if result["done"] else ""))
