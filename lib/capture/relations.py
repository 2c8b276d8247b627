"""Relation messages to event plans: the table as the change describes it, its schemas registered, its key kept
stable, and a backfill requested when DDL gave existing rows values no change will carry."""

from __future__ import annotations

import dataclasses
import json

from lib import schema_registry
from lib.capture import (
    avro_schemas,
    catalog,
    delivery,
    events,
    incremental,
    incremental_chunks,
    pgtypes,
)
from lib.capture.pgoutput import lsn_to_str, str_to_lsn
from lib.capture.stream_state import SchemaChangeError, State, StreamError


def remember_relation(st: State, m) -> None:
    """A table's (new) shape: the plan is rebuilt at its next change."""
    st.relations.messages[m.relation_oid] = m
    st.relations.plans.pop(m.relation_oid, None)


def plan_for(st: State, oid: int, lsn: int) -> events.Plan:
    """The plan of a relation's current shape (catalog read and schemas registered on first use) for a change at lsn."""
    relation = st.relations.messages.get(oid)
    if relation is None:
        raise StreamError(f"change for relation {oid} before its Relation message (protocol error); restart the "
                          f"capture (it resumes from {lsn_to_str(st.acks.acked)})")
    shape = (relation.namespace, relation.name, relation.replica_identity, relation.columns)
    plan = st.relations.shapes.get(shape)
    if plan is None:
        plan = _build_plan(st, relation, lsn)
        if plan.topic == st.relations.topics[plan.qualified]:  # a plan for a retired topic holds only until the DDL
            st.relations.shapes[shape] = plan
    st.relations.plans[oid] = plan
    return plan


def _build_plan(st: State, relation, lsn: int) -> events.Plan:
    qualified = f"{relation.namespace}.{relation.name}"
    stopped = f"the capture stopped before this change; the slot stays at {lsn_to_str(st.acks.acked)}"
    if qualified not in st.relations.topics:
        incremental_chunks.check_requests(st, catch_up=True)  # a table added live is known once its request is read
    if qualified not in st.relations.topics:
        root = _partition_root(st, relation)
        if root in st.relations.topics:
            raise StreamError(
                f"a change to {qualified}, a partition of {root}, came under the partition's name: publication "
                f"{st.publication} lacks publish_via_partition_root. Run notebook 01 (bootstrap) again, which sets it, "
                f"or ALTER PUBLICATION {st.publication} SET (publish_via_partition_root = true), then restart the "
                f"capture; {stopped}")
        raise StreamError(
            f"table {qualified} is in publication {st.publication} but not in source.tables "
            f"({st.conf.get('conf_file', 'conf')}): add it there (and run notebooks 01 and 02 for it) or remove it "
            f"from the publication (ALTER PUBLICATION {st.publication} DROP TABLE {qualified}); {stopped}")
    delivery.keepalive(st, quiet=True)  # catalog and registry calls block: keep the walsender's timeout away
    name = catalog.sql_name(relation.namespace, relation.name)
    try:
        declared = {name: st.relations.keys[qualified]} if qualified in st.relations.keys else None
        table = catalog.describe_tables(st.sql, [name], declared)[name]
        catalog.check_capturable(table)
        table = _key_as_sent(st, _match_relation(st, table, relation), relation)
        plan = events.plan(table, st.prefix, st.database, st.unknown_types, st.relations.topics[qualified])
    except (catalog.CatalogError, pgtypes.UnsupportedTypeError, ValueError) as exc:
        raise StreamError(f"{exc}; {stopped}") from exc
    retired = _retired_topic(st, plan, lsn)
    if retired is not None:
        st.log(f"rekey     {qualified}: a change under the key it had before it was re-keyed goes to {retired}, the "
               f"topic of that key ({plan.topic} holds the new key and reads the table anew)")
        plan.topic = retired
    subjects = schema_registry.subjects(plan.topic)
    known = st.relations.tables.get(qualified)
    previous = _columns(known) if known is not None else _registered_columns(st, subjects[1])
    _request_backfill(st, table, previous, stopped)  # before the new schema exists: a crash between keeps it
    try:
        key_id, wide_key_id, widened = _key_ids(st, plan, subjects[0], stopped)
        value_id, version, status = schema_registry.register(st.registry, subjects[1], plan.value_schema)
    except schema_registry.IncompatibleSchemaError as exc:
        raise SchemaChangeError(
            f"table {qualified} changed ({_describe_change(previous, table)}) and the schema registry refused the "
            f"new schema: {exc}. {stopped[0].upper()}{stopped[1:]} (nothing is lost): once the change is made "
            f"compatible or the subject's compatibility is relaxed, restart the capture and it resumes there") from exc
    except schema_registry.RegistryError as exc:
        raise StreamError(f"table {qualified}: {exc}; {stopped}") from exc
    delivery.keepalive(st, quiet=True)
    plan.set_ids(key_id, value_id, wide_key_id, widened)
    st.relations.tables[qualified] = table
    entry = {"table": qualified, "subject": subjects[1], "version": version, "id": value_id, "status": status}
    if status == "registered":
        entry["change"] = _describe_change(previous, table)
    st.relations.registered.append(entry)
    st.log(f"schema    {subjects[1]} version {version} ({status})" + (f": {entry['change']}" if "change" in entry
                                                                      else ""))
    return plan


def _partition_root(st: State, relation) -> str | None:
    """schema.table of the partitioned table a relation belongs to (None when it is no partition)."""
    with st.sql.cursor() as cur:
        cur.execute("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = "
                    "c.relnamespace WHERE c.oid = pg_partition_root(%s::oid::regclass) AND c.oid <> %s",
                    (relation.relation_oid, relation.relation_oid))
        row = cur.fetchone()
    return row[0] if row else None


def _request_backfill(st: State, table: catalog.Table, previous: dict[str, str] | None, stopped: str) -> None:
    """Read a table again (incremental snapshot) when a new column holds values in rows no change will carry.

    DDL is not in the WAL stream: ADD COLUMN with a default gives every existing row a value without
    writing it, and a rename looks like a dropped column plus a new one. Rows that never change again
    would keep null (or the old name's column) in silver while the source holds values.
    """
    if previous is None:
        return
    added = [c.name for c in table.columns if not c.generated and c.name not in previous]
    if not added:
        return
    renamed = any(name not in {c.name for c in table.columns} for name in previous)
    if not renamed:
        with st.sql.cursor() as cur:
            cur.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s AND attname = ANY(%s) "
                        "AND (atthasdef OR atthasmissing OR attnotnull)", (table.oid, added))
            added = [row[0] for row in cur.fetchall()]
    if not added:
        return  # new nullable columns without a default: existing rows hold null there, as silver will
    why = f"column(s) {', '.join(added)} {'renamed or ' if renamed else ''}added with values in existing rows"
    if st.repl.server_version < 140000:
        raise SchemaChangeError(f"table {table.qualified}: {why}, which rows that do not change again would never "
                                f"carry; reading the table again live needs PostgreSQL 14: run notebook 02 again for "
                                f"it (re-snapshot), then restart the capture; {stopped}")
    incremental.request(st.conf, table, f"{why}: existing rows are read again")
    incremental_chunks.check_requests(st, catch_up=True)
    st.log(f"schema    {table.qualified}: {why}; reading the table again (incremental snapshot)")


def _retired_topic(st: State, plan: events.Plan, lsn: int) -> str | None:
    """The topic a re-keyed table wrote before (python -m lib.operate.tables rekey) when a change at lsn still has the
    old key and was made before the re-key (so before the key's DDL: it belongs there); None otherwise."""
    record = st.control.records.get(incremental.rekey_key(st.slot, plan.qualified)) if st.control else None
    if not record or record.get("topic") != plan.topic or lsn >= str_to_lsn(record["before_lsn"]):
        return None
    new = schema_registry.first_version(st.registry, schema_registry.subjects(plan.topic)[0])
    if new is None or _key_signature(new[1]) == _key_signature(plan.key_schema):
        return None
    old = schema_registry.first_version(st.registry, schema_registry.subjects(record["retired_topic"])[0])
    return record["retired_topic"] if old and _key_signature(old[1]) == _key_signature(plan.key_schema) else None


def _key_ids(st: State, plan: events.Plan, subject: str, stopped: str) -> tuple[int, int | None, tuple]:
    """Registry ids for the table's keys such that a row's key bytes never change while it keeps its topic.

    A compacted topic forgets a key only when a tombstone with the same bytes arrives; the schema id is
    part of those bytes. So the topic's first key schema stays in use while the key encodes the same:
    annotations (pg.type) may change, int may widen to long (wider values get the long schema's id).
    Anything else (other key columns, another type) is refused: it needs a new topic.
    Returns (first key id, id for widened values or None, positions of widened fields).
    """
    first = schema_registry.first_version(st.registry, subject)
    if first is None:
        key_id, _, _ = schema_registry.register(st.registry, subject, plan.key_schema)
        return key_id, None, ()
    first_id, old = first[0], _key_signature(first[1])
    new = _key_signature(plan.key_schema)
    remedy = (f"{stopped}. Compaction keeps a key only under the exact bytes it was written with, so a new key needs "
              f"a new topic: restore the key, or re-key the table: name a new topic for it in conf (kafka.topics: "
              f"{{{plan.qualified}: {incremental.next_topic(plan.topic)}}}), then run python -m lib.operate.tables "
              f"rekey {plan.qualified}, which reads the table anew into that topic and rebuilds its silver table")
    if [name for name, _ in old] != [name for name, _ in new]:
        was, now = ", ".join(n for n, _ in old), ", ".join(n for n, _ in new)
        raise SchemaChangeError(f"table {plan.qualified}: the primary key changed from ({was}) to ({now}); {remedy}")
    widened = []
    for i, ((name, was), (_, now)) in enumerate(zip(old, new, strict=True)):
        if was == now:
            continue
        if (was, now) != ('"int"', '"long"'):
            raise SchemaChangeError(f"table {plan.qualified}: key column {name} changed type ({was} -> {now} in "
                                    f"Avro), which changes every key's bytes; {remedy}")
        widened.append(i)
    if not widened:
        return first_id, None, ()
    wide_id, _, _ = schema_registry.register(st.registry, subject, plan.key_schema)
    return first_id, wide_id, tuple(widened)


def _key_signature(schema: dict) -> list[tuple[str, str]]:
    """(field, Avro type without annotations) per key field: what decides a key's bytes besides the schema id."""
    def bare(avro):
        if isinstance(avro, dict):
            return {k: bare(v) for k, v in avro.items() if not k.startswith("pg.") and k not in ("doc", "default")}
        if isinstance(avro, list):
            return [bare(v) for v in avro]
        return avro
    return [(f["name"], json.dumps(bare(f["type"]), sort_keys=True)) for f in schema["fields"]]


def _match_relation(st: State, table: catalog.Table, relation) -> catalog.Table:
    """The table as the Relation message describes it (the catalog may already show later DDL)."""
    plain = [c for c in table.columns if not c.generated]
    wanted = [(c.name, c.type_oid, c.type_modifier) for c in relation.columns]
    if [(c.name, c.type_oid, c.typmod) for c in plain] == wanted:
        return table
    by_name = {c.name: c for c in table.columns}
    columns = []
    for attnum, rc in enumerate(relation.columns, 1):
        known = by_name.get(rc.name)
        if known is not None and known.type_oid == rc.type_oid and known.typmod == rc.type_modifier:
            columns.append(known)
        else:
            columns.append(_column_from_relation(st, table, rc, known, attnum))
    sent = {rc.name for rc in relation.columns}
    missing = [k for k in table.primary_key if k not in sent]
    if missing:
        raise StreamError(f"table {table.qualified}: primary key column(s) {', '.join(missing)} are not in the "
                          f"change's Relation message (the key changed since): the topic's key must change, which "
                          f"needs a new topic: name one under kafka.topics and run python -m lib.operate.tables "
                          f"rekey {table.qualified}")
    return dataclasses.replace(table, columns=tuple(columns))


def _key_as_sent(st: State, table: catalog.Table, relation) -> catalog.Table:
    """The table with the key its change was made under: the Relation message flags the key columns as they were
    then, the catalog shows them as they are now (a change made before a key's DDL keeps the old key)."""
    sent = [rc.name for rc in relation.columns if rc.key]
    if relation.replica_identity not in ("d", "i") or not sent or set(sent) == set(table.primary_key) \
            or table.key_source == "source.keys":
        return table
    record = st.control.records.get(incremental.rekey_key(st.slot, table.qualified)) if st.control else None
    retired = schema_registry.subjects(record["retired_topic"])[0] if record else None
    first = schema_registry.first_version(st.registry, retired) if retired else None
    order = [f.get("pg.column", f["name"]) for f in first[1]["fields"]] if first else []
    key = order if set(order) == set(sent) else sent  # the old key's own order when its topic knows it
    return dataclasses.replace(table, primary_key=tuple(key))


def _column_from_relation(st: State, table: catalog.Table, rc, known, attnum: int) -> catalog.Column:
    """A catalog Column for a Relation column whose type the current catalog no longer shows."""
    with st.sql.cursor() as cur:
        pgtype = catalog.type_of(cur, rc.type_oid, rc.type_modifier)
        cur.execute("SELECT format_type(%s, %s), typlen = -1 FROM pg_type WHERE oid = %s",
                    (rc.type_oid, rc.type_modifier, rc.type_oid))
        row = cur.fetchone()
    if row is None or pgtype is None:
        raise StreamError(f"column {table.qualified}.{rc.name}: its type (oid {rc.type_oid}) no longer exists, so "
                          f"changes made before the type was dropped cannot be converted; re-snapshot the table "
                          f"(notebook 02)")
    return catalog.Column(table=table.qualified, name=rc.name, attnum=attnum, type_name=row[0],
                          type=pgtype,
                          not_null=known.not_null if known is not None else False, toastable=row[1])


def _columns(table: catalog.Table) -> dict[str, str]:
    """Column name -> SQL type of the columns pgoutput sends."""
    return {c.name: c.type_name for c in table.columns if not c.generated}


def _registered_columns(st: State, subject: str) -> dict[str, str] | None:
    """Column name -> SQL type ('pg.type') of the subject's latest registered version; None if unknown."""
    try:
        with schema_registry.asking(schema_registry.url_of(st.registry), subject):
            latest = json.loads(st.registry.get_latest_version(subject).schema.schema_str)
        value = avro_schemas.value_record(latest)
        return {f.get("pg.column", f["name"]): f.get("pg.type", "?") for f in value["fields"]}
    except Exception:  # noqa: BLE001 - only used to describe a change
        return None


def _describe_change(old: dict[str, str] | None, table: catalog.Table) -> str:
    """'added x (text); dropped y; qty integer -> text' between the previous and the new table version."""
    new = _columns(table)
    if old is None:
        return "columns now: " + ", ".join(f"{n} {t}" for n, t in new.items())
    parts = [f"added {n} ({t})" for n, t in new.items() if n not in old]
    parts += [f"dropped {n}" for n in old if n not in new]
    parts += [f"{n} {old[n]} -> {t}" for n, t in new.items() if n in old and old[n] != t]
    return "; ".join(parts) or "column properties changed"
