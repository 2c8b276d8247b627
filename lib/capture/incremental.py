"""Add a table to a running pipeline, or snapshot one table again, without stopping the capture.

The running capture reads the table in chunks (primary-key order) while it keeps streaming,
like the watermark snapshots of DBLog and Debezium, but with an exact boundary instead of a
low watermark:

1. For each chunk the capture creates a *temporary* replication slot with an exported
   snapshot. PostgreSQL reports the slot's consistent point C: every transaction that
   committed before C is in that snapshot, none after it. The chunk's rows are read inside
   it (``WHERE key > last key ORDER BY key LIMIT chunk_rows``), then the slot is dropped.
2. A transactional logical message (the high watermark) is written after the read. The
   capture sees it in the stream after every transaction that committed before C.
3. When the capture reaches the watermark it sends the chunk's rows as ``r`` events at
   position (C, -1), except the keys that a streamed change committed at or after C has
   already touched: those events are newer than the chunk and were sent before it. So per
   key the topic never ends on an older value than the stream, and the merge's ordering by
   position needs nothing special.

Progress is kept in the control topic under ``incremental/<slot>/<schema.table>`` (state,
last key, rows, chunks), written after Kafka acknowledged the chunk's events; a restarted
capture resumes from the last key. Needs PostgreSQL 14 or later (logical messages in
pgoutput) and one free replication slot and WAL sender while a chunk is read.

``python -m lib.operate.tables add`` (lib/operate/tables.py) also points the local continuous mode at
the new conf.

Operators: a re-snapshot refreshes every row of the table but does not remove keys that
Kafka and silver hold and the source no longer has (only notebook 02's full snapshot
retracts those).
"""

from __future__ import annotations

import json
import time

import psycopg2
from psycopg2 import sql

from lib import config, control, schema_registry, source
from lib.capture import avro_schemas, bootstrap, catalog
from lib.capture.pgoutput import str_to_lsn
from lib.capture.pgtypes import session_options

WATERMARK_PREFIX = "cdc-chunk"


class IncrementalError(RuntimeError):
    """A table cannot be added, removed or snapshotted incrementally; the message says why and what to do."""


def record_key(slot: str, table: str) -> str:
    """The control-topic key of a table's incremental snapshot."""
    return f"incremental/{slot}/{table}"


def rekey_key(slot: str, table: str) -> str:
    """The control-topic key of a table's re-key: the topic it moved to and the one it wrote before."""
    return f"rekey/{slot}/{table}"


def next_topic(topic: str) -> str:
    """A name for a re-keyed table's next topic: '<topic>.v2', or the version after the one topic ends with."""
    base, _, version = topic.rpartition(".v")
    return f"{base}.v{int(version) + 1}" if base and version.isdigit() else f"{topic}.v2"


def progress(conf: dict, records: dict | None = None) -> list[dict]:
    """Every incremental snapshot recorded for conf's slot (state, last key, rows, chunks)."""
    prefix = record_key(config.get(conf, "source.slot"), "")
    records = control.read_all(conf) if records is None else records
    return [record for key, record in sorted(records.items()) if key.startswith(prefix)]


def pending(conf: dict, records: dict | None = None) -> list[dict]:
    """The incremental snapshots of conf's slot not complete yet, oldest request first."""
    waiting = [r for r in progress(conf, records) if r.get("state") != "complete"]
    return sorted(waiting, key=lambda r: r.get("requested_ms", 0))


def _configured(conf: dict, name: str) -> catalog.Table:
    """The table named in source.tables, described and checked as the capture will."""
    names = list(config.get(conf, "source.tables"))
    if name not in names:
        raise IncrementalError(f"{name} is not in source.tables of {conf.get('conf_file', 'conf')}: add it there "
                               f"first (the capture, merge and views read the table set from conf), then call "
                               f"this again")
    keys = config.get(conf, "source.keys") or {}
    conn = source.connect(conf)
    try:
        table = catalog.describe_tables(conn, [name], {name: keys[name]} if name in keys else None)[name]
        catalog.check_capturable(table)
        user = config.get(conf, "source.user")
        with conn.cursor() as cur:
            cur.execute("SELECT has_table_privilege(%s, %s::regclass, 'SELECT'), current_setting('server_version_num')",
                        (user, table.oid))
            readable, version = cur.fetchone()
    except catalog.CatalogError as exc:
        raise IncrementalError(str(exc)) from exc
    finally:
        conn.close()
    if not readable:
        raise IncrementalError(f"role {user} may not read {table.qualified}: GRANT SELECT ON {table.qualified} TO "
                               f"{user}")
    if int(version) < 140000:
        raise IncrementalError(f"adding {table.qualified} live needs PostgreSQL 14 or later (logical messages in "
                               f"pgoutput); on this server run notebooks 01 and 02 again with the new table set")
    return table


def request(conf: dict, table: catalog.Table, reason: str, state: str = "ready") -> dict:
    """Ask the capture of conf's slot to snapshot a table in chunks.

    State 'requested' only tells the capture the table exists (its changes may start to arrive);
    chunks start once the state is 'ready', which must be written after the table is published:
    a chunk read before that could miss a change committed between the two.
    """
    keys = config.get(conf, "source.keys") or {}
    record = {"table": table.qualified, "state": state, "reason": reason, "last_key": None, "rows": 0,
              "chunks": 0, "key_columns": list(table.primary_key),
              "declared_key": next((keys[n] for n in keys if n in (table.qualified, table.name)), None),
              "requested_ms": int(time.time() * 1000)}
    control.put(conf, record_key(config.get(conf, "source.slot"), table.qualified), record)
    return record


def add_table(conf: dict, name: str, log=print) -> dict:
    """Publish a table listed in source.tables, create its topic and schemas, and request its snapshot."""
    table = _configured(conf, name)
    tables = {name: table}
    topics = bootstrap.ensure_topics(conf, tables)
    subjects = bootstrap.register_schemas(conf, tables)
    publication = config.get(conf, "source.publication")
    request(conf, table, "added")  # first: the capture must know the table before its first change arrives
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s AND "
                        "tablename = %s", (publication, table.schema, table.name))
            published = cur.fetchone() is not None
            if not published:
                cur.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                    sql.Identifier(publication), sql.Identifier(table.schema, table.name)))
    except psycopg2.Error as exc:
        raise IncrementalError(f"cannot add {table.qualified} to publication {publication}: "
                               f"{str(exc).strip().splitlines()[0]}; run notebook 01 first") from exc
    finally:
        conn.close()
    record = request(conf, table, "added", state="ready")
    log(f"incremental {table.qualified}: publication {publication} {'had' if published else 'now has'} it, "
        f"{len(topics) - 1} topic(s) checked, {len(subjects)} subject(s) registered; snapshot requested")
    return record


def resnapshot_table(conf: dict, name: str, log=print) -> dict:
    """Request a chunked snapshot of a table the pipeline already captures."""
    table = _configured(conf, name)
    record = request(conf, table, "resnapshot", state="ready")
    log(f"incremental {table.qualified}: snapshot requested")
    return record


def rekey_table(conf: dict, name: str, log=print) -> dict:
    """Move a table whose key changed by DDL to the new topic conf names for it (kafka.topics) and read it anew there.

    Operators: the table's old topic keeps its old key's messages (changes made before the key's
    DDL still go there) and is no longer merged, but the merge still subscribes to it (Spark
    fails a checkpoint whose topic disappears): keep it while that checkpoint is in use. The
    merge empties the table's silver table when it starts with this conf and rebuilds it from
    the new topic, so silver lacks rows until the table's chunked snapshot has been merged.
    """
    table = _configured(conf, name)
    slot = config.get(conf, "source.slot")
    topic = avro_schemas.topic_for(conf, table)
    earlier = control.read_all(conf).get(rekey_key(slot, table.qualified))
    if earlier and earlier["topic"] == topic:
        retired = earlier["retired_topic"]  # run again: the same move
    else:
        retired = earlier["topic"] if earlier else avro_schemas.topic_name(config.get(conf, "kafka.topic_prefix"),
                                                                           table)
    if retired == topic or topic in (earlier or {}).get("retired_topics", []):
        raise IncrementalError(f"re-keying {table.qualified} needs a topic it never wrote before (a merge checkpoint "
                               f"has read {topic} already), and conf names none: add it under kafka.topics in "
                               f"{conf.get('conf_file', 'conf')} ({table.qualified}: {next_topic(retired)}), then run "
                               f"this again")
    _require_key_room(conf, table, topic)
    bootstrap.ensure_topics(conf, {name: table})
    bootstrap.register_schemas(conf, {name: table})  # the new key first: the capture routes the old one by it
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")  # every change under the old key was made before it
            before = cur.fetchone()[0]
    finally:
        conn.close()
    every = list(dict.fromkeys([*(earlier or {}).get("retired_topics", []), retired]))  # a merge checkpoint holds all
    record = {"table": table.qualified, "topic": topic, "retired_topic": retired, "retired_topics": every,
              "before_lsn": before, "key_columns": list(table.primary_key), "requested_ms": int(time.time() * 1000)}
    control.put(conf, rekey_key(slot, table.qualified), record)
    request(conf, table, "rekey", state="ready")
    log(f"rekey {table.qualified}: key ({', '.join(table.primary_key)}) now goes to topic {topic}, read anew in "
        f"chunks; {retired} keeps the old key's messages and is no longer merged (the merge still subscribes to it: "
        f"keep it while its checkpoint is in use)")
    return record


def _require_key_room(conf: dict, table: catalog.Table, topic: str) -> None:
    """Refuse a new topic whose key subject already holds another key than the table's."""
    subject = schema_registry.subjects(topic)[0]
    registry = schema_registry.client(conf)
    wanted = avro_schemas.key_schema(table, config.get(conf, "kafka.topic_prefix"),
                                     config.get(conf, "source.unknown_types"))
    try:
        found = schema_registry.first_version(registry, subject)
    except schema_registry.RegistryError:
        return  # any problem with the registry shows when the schemas are registered
    first = found[1] if found else None
    if first is not None and [f["name"] for f in first["fields"]] != [f["name"] for f in wanted["fields"]]:
        raise IncrementalError(f"topic {topic} already carries keys ({', '.join(f['name'] for f in first['fields'])}) "
                               f"that are not {table.qualified}'s key ({', '.join(table.primary_key)}): name another "
                               f"topic under kafka.topics")


def remove_table(conf: dict, name: str, log=print) -> dict:
    """Stop capturing a table: drop it from the publication and forget its incremental snapshot.

    Its topic, bronze and silver tables stay (remove it from source.tables so the merge and
    views leave it alone); changes made to it from now on are not captured.
    """
    publication = config.get(conf, "source.publication")
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        table = catalog.describe_tables(conn, [name])[name]
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s AND "
                        "tablename = %s", (publication, table.schema, table.name))
            published = cur.fetchone() is not None
            if published:
                cur.execute(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                    sql.Identifier(publication), sql.Identifier(table.schema, table.name)))
    except catalog.CatalogError as exc:
        raise IncrementalError(str(exc)) from exc
    finally:
        conn.close()
    control.put(conf, record_key(config.get(conf, "source.slot"), table.qualified), None)
    log(f"incremental {table.qualified}: {'dropped from' if published else 'was not in'} publication {publication}; "
        f"remove it from source.tables too")
    return {"table": table.qualified, "was_published": published}


# ---------------------------------------------------------------------------------------------
# what the capture calls


def chunk_query(table: catalog.Table, columns: list[catalog.Column], after: bool, limit: int) -> sql.Composed:
    """SELECT of the next chunk: every column, keys greater than the last key (if any), in key order."""
    keys = [sql.Identifier(k) for k in table.primary_key]
    where = sql.SQL("")
    if after:
        where = sql.SQL(" WHERE ({}) > ({})").format(sql.SQL(", ").join(keys), sql.SQL(", ").join(
            sql.SQL("%s::{}").format(sql.SQL(table.column(k).type_name)) for k in table.primary_key))
    return sql.SQL("SELECT {}, {} FROM {}{} ORDER BY {} LIMIT {}").format(
        sql.SQL(", ").join(sql.Identifier(c.name) for c in columns), sql.SQL(", ").join(keys),
        sql.Identifier(table.schema, table.name), where, sql.SQL(", ").join(keys), sql.Literal(limit))


def fetch_text(cur, query, params=None) -> list[tuple]:
    """Rows of a query as the text PostgreSQL's output functions write (what pgoutput sends), not Python objects.

    A ::text cast is not the same (booleans, inet, char(n) differ), so the result's types get a
    pass-through typecaster, registered after a LIMIT 0 run tells their oids.
    """
    cur.execute(sql.SQL("SELECT * FROM ({}) q LIMIT 0").format(query), params)
    oids = tuple({d.type_code for d in cur.description})
    psycopg2.extensions.register_type(psycopg2.extensions.new_type(oids, "CDC_TEXT", lambda value, _: value), cur)
    cur.execute(query, params)
    return cur.fetchall()


def read_chunk(conf: dict, table: catalog.Table, columns: list[catalog.Column], last_key: list | None,
               limit: int, chunk_id: str) -> dict:
    """Read one chunk in a temporary slot's exported snapshot, then write the high watermark.

    Returns {consistent_lsn, rows (text tuples in column order), last_key, done}.
    """
    slot = f"cdc_chunk_{chunk_id}"
    repl = source.connect(conf, replication=True)
    try:
        with repl.cursor() as cur:
            if repl.server_version >= 150000:
                cur.execute(f'CREATE_REPLICATION_SLOT "{slot}" TEMPORARY LOGICAL pgoutput (SNAPSHOT \'export\')')
            else:
                cur.execute(f'CREATE_REPLICATION_SLOT "{slot}" TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT')
            _, consistent, snapshot_name, _ = cur.fetchone()
        conn = source.connect(conf, options=session_options())
        try:
            with conn.cursor() as cur:
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
                fetched = fetch_text(cur, chunk_query(table, columns, last_key is not None, limit), last_key or None)
                cur.execute("COMMIT")
        finally:
            conn.close()
    finally:
        repl.close()  # drops the temporary slot
    width = len(columns)
    rows = [row[:width] for row in fetched]
    new_last = list(fetched[-1][width:]) if fetched else last_key
    conn = source.connect(conf)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_logical_emit_message(true, %s, %s)",
                        (WATERMARK_PREFIX, json.dumps({"slot": config.get(conf, "source.slot"), "chunk": chunk_id})))
    finally:
        conn.close()
    return {"consistent_lsn": str_to_lsn(consistent), "rows": rows, "last_key": new_last,
            "done": len(rows) < limit}

