"""Notebook 01: check that the source can be captured, then prepare the publication, topics and schemas.

Every check returns a Finding (what was checked, whether it holds, what was seen, the remedy),
so a notebook can show them as a table and a job can fail with all of them at once. Setup
steps are idempotent: what exists is checked and reported, a mismatch is an error naming it.
The replication slot is not created here: notebook 02 creates it together with the snapshot
it exports (the snapshot lives only as long as the connection that created the slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.errors
from psycopg2 import sql

from lib import config, control, kafka_client, schema_registry, source, topics
from lib.capture import avro_schemas, catalog, pgtypes, slot_position


class BootstrapError(RuntimeError):
    """The source or the Kafka side is not ready; the message lists every failed check with its remedy."""


@dataclass(frozen=True)
class Finding:
    """One prerequisite check."""

    check: str
    ok: bool
    seen: str
    remedy: str = ""


def server_findings(conn) -> list[Finding]:
    """Server version, wal_level, free replication slots and WAL senders."""
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
                    "current_setting('max_replication_slots')::int, current_setting('max_wal_senders')::int, "
                    "(SELECT count(*) FROM pg_replication_slots), "
                    "(SELECT count(*) FROM pg_stat_replication)")
        version, wal_level, max_slots, max_senders, slots, senders = cur.fetchone()
    return [
        Finding("PostgreSQL version >= 13", version >= 130000, f"server_version_num = {version}",
                "upgrade the server: pgoutput with the features used here needs PostgreSQL 13 or newer"),
        Finding("wal_level = logical", wal_level == "logical", f"wal_level = {wal_level}",
                "ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL (managed services: enable "
                "logical replication in the parameter group, e.g. rds.logical_replication = 1)"),
        Finding("a free replication slot", slots < max_slots, f"{slots} of max_replication_slots = {max_slots} used",
                "raise max_replication_slots (restart needed) or drop an unused slot"),
        Finding("a free WAL sender", senders < max_senders, f"{senders} of max_wal_senders = {max_senders} busy",
                "raise max_wal_senders (restart needed)"),
    ]


def role_findings(conn, user: str) -> list[Finding]:
    """The pipeline role may replicate."""
    with conn.cursor() as cur:
        cur.execute("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = %s", (user,))
        row = cur.fetchone()
        ok = bool(row and row[0])
        if not ok and role_exists(conn, "rds_replication"):
            cur.execute("SELECT pg_has_role(%s, 'rds_replication', 'MEMBER')", (user,))
            ok = bool(cur.fetchone()[0])
    return [Finding(f"role {user} has REPLICATION", ok, "yes" if ok else "no",
                    f"ALTER ROLE {user} REPLICATION (RDS/Aurora: GRANT rds_replication TO {user})")]


def role_exists(conn, role: str) -> bool:
    """True when a role of that name exists."""
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
        return cur.fetchone() is not None


def table_findings(conn, conf: dict, user: str) -> tuple[dict[str, catalog.Table], list[Finding]]:
    """Every configured table exists, is readable by the pipeline role, has a key and mappable types."""
    names = list(config.get(conf, "source.tables"))
    try:
        findings = schema_findings(conn, names, user)
        if not all(finding.ok for finding in findings):  # the tables cannot even be looked up
            return {}, findings
        tables = catalog.describe_tables(conn, names, config.get(conf, "source.keys"))
    except catalog.CatalogError as exc:
        return {}, [Finding("configured tables exist", False, str(exc), "fix source.tables (and source.keys) in conf")]
    unknown_types = config.get(conf, "source.unknown_types")
    prefix = config.get(conf, "kafka.topic_prefix")
    with conn.cursor() as cur:
        for name, table in tables.items():
            cur.execute("SELECT has_table_privilege(%s, %s::regclass, 'SELECT')", (user, table.oid))
            readable = cur.fetchone()[0]
            findings.append(Finding(f"{name}: SELECT granted to {user}", readable, "yes" if readable else "no",
                                    f"GRANT SELECT ON {table.qualified} TO {user}"))
            try:
                catalog.check_capturable(table)
                key = ", ".join(table.primary_key)
                findings.append(Finding(f"{name}: keyed", True, f"{table.key_source} ({key}), replica identity "
                                        f"{table.replica_identity}"))
                if table.key_source == "source.keys" and readable:
                    findings.append(declared_key_unique(conn, name, table))
            except catalog.CatalogError as exc:
                findings.append(Finding(f"{name}: keyed", False, str(exc),
                                        "publishing UPDATE/DELETE for a table without a key makes those "
                                        "statements FAIL ON THE SOURCE: add a primary key, key it by a replica "
                                        "identity index, declare its key in source.keys with REPLICA IDENTITY "
                                        "FULL, or remove it from source.tables"))
            try:
                avro_schemas.value_schema(table, prefix, unknown_types)
                findings.append(Finding(f"{name}: column types mapped to Avro", True, f"{len(table.columns)} columns"))
            except pgtypes.UnsupportedTypeError as exc:
                findings.append(Finding(f"{name}: column types mapped to Avro", False, str(exc),
                                        "cast the column or set source.unknown_types: string"))
    shared = avro_schemas.shared_topics(prefix, tables.values(), config.get(conf, "kafka.topics"))
    for topic, names in shared.items():
        findings.append(Finding(
            f"one topic per table ({topic})", False, f"{' and '.join(names)} would both write topic {topic}",
            "Kafka topic names allow only letters, digits, '.', '_' and '-', so these names meet: rename one table, "
            "or capture one of them with another conf (its own kafka.topic_prefix, slot and publication)"))
    if tables and not shared:
        findings.append(Finding("one topic per table", True, f"{len(tables)} distinct topics"))
    return tables, findings


def schema_findings(conn, names: list[str], user: str) -> list[Finding]:
    """The pipeline role may use each schema of the configured tables (else it cannot even name them)."""
    findings = []
    with conn.cursor() as cur:
        for schema in sorted({catalog.normalize(name)[0] for name in names}):
            cur.execute("SELECT has_schema_privilege(%s, oid, 'USAGE') FROM pg_namespace WHERE nspname = %s",
                        (user, schema))
            row = cur.fetchone()
            if row is None:
                continue  # no such schema: the table lookup names the missing tables
            findings.append(Finding(f"schema {schema}: USAGE granted to {user}", row[0], "yes" if row[0] else "no",
                                    sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                                        sql.Identifier(schema), sql.Identifier(user)).as_string(conn)))
    return findings


def declared_key_unique(conn, name: str, table: catalog.Table) -> Finding:
    """A key declared in source.keys is unique in the rows there now (PostgreSQL does not enforce it)."""
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in table.primary_key)
    query = sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {}.{} GROUP BY {} HAVING count(*) > 1) d").format(
        sql.Identifier(table.schema), sql.Identifier(table.name), columns)
    with conn.cursor() as cur:
        cur.execute(query)
        duplicated = cur.fetchone()[0]
    key = ", ".join(table.primary_key)
    return Finding(f"{name}: declared key ({key}) unique", duplicated == 0,
                   "yes" if duplicated == 0 else f"{duplicated} key value(s) occur more than once",
                   f"choose columns that identify a row in source.keys.{name}, or add a primary key; rows sharing "
                   f"a key would collapse into one in Kafka and Delta")


def publication_findings(conn, conf: dict, tables: dict[str, catalog.Table]) -> list[Finding]:
    """The setup role (source.admin_user) may create the publication: CREATE on the database, owner of each table.

    Asked of the catalog as the pipeline role; once the publication exists, nothing more is needed.
    """
    name = config.get(conf, "source.publication")
    admin = config.get(conf, "source.admin_user")
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        if cur.fetchone():
            return [Finding(f"publication {name}", True, "exists (notebook 01 checks that it lists every table)")]
        cur.execute("SELECT current_database(), (SELECT oid FROM pg_roles WHERE rolname = %s)", (admin,))
        database, admin_oid = cur.fetchone()
        if admin_oid is None:
            return [Finding(f"role {admin} (source.admin_user) exists", False, "no such role",
                            "set source.admin_user to the role that owns the captured tables")]
        cur.execute("SELECT has_database_privilege(%s, current_database(), 'CREATE')", (admin_oid,))
        may_create = cur.fetchone()[0]
        findings = [Finding(f"database {database}: CREATE granted to {admin} (to create publication {name})",
                            may_create, "yes" if may_create else "no",
                            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                                sql.Identifier(database), sql.Identifier(admin)).as_string(conn))]
        for table_name, table in tables.items():
            cur.execute("SELECT pg_has_role(%s, relowner, 'USAGE'), relowner::regrole::text FROM pg_class "
                        "WHERE oid = %s", (admin_oid, table.oid))
            owns, owner = cur.fetchone()
            if not owns:  # only a table's owner may publish it
                findings.append(Finding(f"{table_name}: owned by {admin} (to publish it)", False, f"owner is {owner}",
                                        f"set source.admin_user to {owner}, or GRANT {owner} TO {admin}"))
    return findings


def slot_findings(conn, conf: dict) -> list[Finding]:
    """The slot, if it exists already, uses pgoutput on this database."""
    slot = config.get(conf, "source.slot")
    with conn.cursor() as cur:
        cur.execute("SELECT plugin, database, active, confirmed_flush_lsn::text, wal_status "
                    "FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        row = cur.fetchone()
        cur.execute("SELECT current_database()")
        database = cur.fetchone()[0]
    if row is None:
        return [Finding(f"slot {slot}", True, "not created yet: notebook 02 creates it with its snapshot")]
    plugin, slot_db, active, flushed, wal_status = row
    if plugin != "pgoutput" or slot_db != database:
        return [Finding(f"slot {slot}", False, f"exists with plugin {plugin} on database {slot_db}",
                        f"this pipeline needs a pgoutput slot on {database}: choose another source.slot, or "
                        f"drop it (SELECT pg_drop_replication_slot('{slot}')) if nothing else uses it")]
    return [Finding(f"slot {slot}", True, f"exists (pgoutput, confirmed to {flushed}, "
                    f"{'active' if active else 'idle'}, wal_status {wal_status})")]


def failover_findings(conn, conf: dict) -> list[Finding]:
    """With source.failover_slot: PostgreSQL 17+, and the primary holds back WAL its standbys have not confirmed."""
    if not config.get(conf, "source.failover_slot"):
        return []
    refusal = slot_position.failover_refusal(conf, conn.server_version)
    if refusal:
        return [Finding("failover slots (source.failover_slot)", False, f"server_version_num = {conn.server_version}",
                        refusal)]
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('synchronized_standby_slots')")
        standby_slots = cur.fetchone()[0]
    return [Finding("synchronized_standby_slots is set (source.failover_slot)", bool(standby_slots.strip()),
                    f"synchronized_standby_slots = '{standby_slots}'",
                    "set synchronized_standby_slots on the primary to the physical slots of the standbys that may "
                    "be promoted (primary_slot_name on each), then reload: otherwise the capture can receive "
                    "transactions a standby never got, and after its promotion silver keeps rows that do not "
                    "exist (docs/reliability.md, \"Failover\")")]


def check(conf: dict) -> tuple[dict[str, catalog.Table], list[Finding]]:
    """All source prerequisites, checked as the pipeline role."""
    user = config.get(conf, "source.user")
    conn = source.connect(conf)
    try:
        findings = server_findings(conn) + failover_findings(conn, conf) + role_findings(conn, user)
        tables, table_checks = table_findings(conn, conf, user)
        return tables, findings + table_checks + publication_findings(conn, conf, tables) + slot_findings(conn, conf)
    finally:
        conn.close()


def require(findings: list[Finding]) -> None:
    """Raise BootstrapError listing every failed check and its remedy."""
    failed = [f for f in findings if not f.ok]
    if failed:
        lines = "\n".join(f"- {f.check}: {f.seen}. Remedy: {f.remedy}" for f in failed)
        raise BootstrapError(f"{len(failed)} prerequisite(s) failed:\n{lines}")


def ensure_publication(conf: dict, tables: dict[str, catalog.Table]) -> str:
    """Create the publication for exactly the configured tables; 'created', 'exists' or 'altered (...)'.

    A partitioned table needs publish_via_partition_root (set on an existing publication too); any
    other mismatch is an error naming it.
    """
    name = config.get(conf, "source.publication")
    if not tables:
        raise BootstrapError(f"publication {name}: no tables to publish; the prerequisite checks must pass first")
    wanted = {t.qualified for t in tables.values()}
    # a partitioned table's changes must come under its own name (its topic), not its partitions' names
    via_root = any(t.kind == "p" for t in tables.values())
    result = "exists"
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT puballtables, pubinsert AND pubupdate AND pubdelete AND pubtruncate, pubviaroot "
                        "FROM pg_publication WHERE pubname = %s", (name,))
            row = cur.fetchone()
            if row is None:
                idents = sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in tables.values())
                options = sql.SQL(" WITH (publish_via_partition_root = true)" if via_root else "")
                try:
                    cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}{}").format(sql.Identifier(name), idents,
                                                                                       options))
                except psycopg2.errors.InsufficientPrivilege as exc:
                    raise BootstrapError(
                        f"cannot create publication {name} as {config.get(conf, 'source.admin_user')} "
                        f"(source.admin_user): {str(exc).strip().splitlines()[0]}. Remedy: the role needs CREATE on "
                        f"the database and must own every table (notebook 01's checks print the GRANT)") from exc
                return "created"
            if via_root and not row[2]:
                cur.execute(sql.SQL("ALTER PUBLICATION {} SET (publish_via_partition_root = true)")
                            .format(sql.Identifier(name)))
                result = "altered (publish_via_partition_root)"
            cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
                        (name,))
            present = {r[0] for r in cur.fetchall()}
    finally:
        conn.close()
    all_tables, all_ops, _ = row
    if all_tables or not all_ops or present != wanted:
        problems = []
        if all_tables:
            problems.append("it is FOR ALL TABLES")
        if not all_ops:
            problems.append("it does not publish all of insert, update, delete, truncate")
        if wanted - present:
            problems.append(f"it lacks {', '.join(sorted(wanted - present))}")
        if present - wanted:
            problems.append(f"it also has {', '.join(sorted(present - wanted))}")
        raise BootstrapError(
            f"publication {name} exists but {'; '.join(problems)}. Remedy: make it list exactly source.tables "
            f"(ALTER PUBLICATION {name} SET TABLE ...; a table added to a running pipeline also needs its "
            f"snapshot), or choose another source.publication")
    return result


def ensure_topics(conf: dict, tables: dict[str, catalog.Table]) -> dict[str, str]:
    """One compacted topic per table plus the control topic; per topic 'created' or 'exists'."""
    kafka_client.check(conf)  # a refused login or an unknown CA, named, before any topic call
    admin = kafka_client.admin(conf)
    names = [avro_schemas.topic_for(conf, t) for t in tables.values()]
    retention_ms = int(config.get(conf, "kafka.delete_retention_ms"))
    report = topics.ensure_topics(admin, names, int(config.get(conf, "kafka.partitions")),
                                  delete_retention_ms=retention_ms, **topics.durability(conf))
    report[control.topic(conf)] = control.ensure(conf)
    return report


def register_schemas(conf: dict, tables: dict[str, catalog.Table]) -> list[dict]:
    """Key and value schema of every table under TopicNameStrategy subjects; one row per subject."""
    client = schema_registry.client(conf)
    prefix = config.get(conf, "kafka.topic_prefix")
    unknown_types = config.get(conf, "source.unknown_types")
    rows = []
    for table in tables.values():
        topic = avro_schemas.topic_for(conf, table)
        key_subject, value_subject = schema_registry.subjects(topic)
        for subject, schema in ((key_subject, avro_schemas.key_schema(table, prefix, unknown_types)),
                                (value_subject, avro_schemas.value_schema(table, prefix, unknown_types))):
            schema_id, version, status = schema_registry.register(client, subject, schema)
            rows.append({"subject": subject, "schema_id": schema_id, "version": version, "status": status})
    return rows


def run(conf: dict, log=print) -> dict:
    """Check everything, then create (or verify) publication, topics and schemas; raise on any failure."""
    tables, findings = check(conf)
    require(findings)
    log(f"bootstrap all {len(findings)} checks passed")
    publication = ensure_publication(conf, tables)
    log(f"bootstrap publication {config.get(conf, 'source.publication')}: {publication}")
    topic_report = ensure_topics(conf, tables)
    log(f"bootstrap topics: {sum(s == 'created' for s in topic_report.values())} created, "
        f"{sum(s == 'exists' for s in topic_report.values())} existed")
    subjects = register_schemas(conf, tables)
    log(f"bootstrap schemas: {sum(r['status'] == 'registered' for r in subjects)} registered, "
        f"{sum(r['status'] == 'exists' for r in subjects)} existed")
    return {"tables": tables, "findings": findings, "publication": publication, "topics": topic_report,
            "subjects": subjects}
