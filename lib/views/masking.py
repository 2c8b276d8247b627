"""Analyst views over silver and bronze with personal data masked according to conf.

How it works and what it guarantees: docs/masking-policy.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pyspark.sql import types as T

from lib import config, secrets
from lib import spark as spark_lib
from lib.capture import catalog
from lib.lake import lake_paths
from lib.lake.lake_paths import quote
from lib.views.policy import (  # noqa: F401 - REDACTED: part of this module's interface
    DEFAULT_DATABASE,
    DEFAULT_KEY_TABLE,
    DEFAULT_PRIVILEGED_DATABASE,
    REDACTED,
    MaskingError,
    bronze_columns,
    data_fields,
    derive_key,
    field_at,
    key_fingerprint,
    key_join,
    load_policy,
    mask_expr,
    quote_name,
    require_deleted,
    rule_for,
    sql_string,
    uses_hash,
    validate,
)
from lib.views.versions import fresh_select, scd2_select

CLEAN_META = ("_updated_at",)
# history columns taken from bronze: output name -> field path
HISTORY_META = (("op", ("op",)), ("commit_ts", ("source", "ts_ms")), ("tx_id", ("source", "txId")),
                ("commit_lsn", ("source", "commit_lsn")), ("event_serial", ("source", "event_serial")),
                ("snapshot", ("source", "snapshot")), ("unchanged_cols", ("unchanged_cols",)))


def clean_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the clean view and its output columns."""
    require_deleted(schema, table)
    items, names = [], []
    for field in data_fields(schema):
        rule = rule_for(policy, table, field.name)
        expr = mask_expr(rule, f"`s`.{quote(field.name)}", field.dataType, f"masking.tables.{table}.{field.name}")
        if expr is not None:
            items.append(f"{expr} AS {quote(field.name)}")
            names.append(field.name)
    for name in CLEAN_META:
        if name in schema.fieldNames():
            items.append(f"`s`.{quote(name)} AS {quote(name)}")
            names.append(name)
    if not items:
        raise MaskingError(f"clean view of {table}: every column is dropped and the table has no _updated_at")
    join = key_join(items, key_table)
    text = (f"SELECT {', '.join(items)} FROM {source} AS `s`{join} "
            f"WHERE NOT coalesce(`s`.`_deleted`, false)")
    return text, names


def full_select(table: str, schema, source: str) -> tuple[str, list[str]]:
    """SELECT of the full (unmasked) view and its output columns."""
    require_deleted(schema, table)
    names = schema.fieldNames()
    items = ", ".join(f"`s`.{quote(name)} AS {quote(name)}" for name in names)
    return f"SELECT {items} FROM {source} AS `s` WHERE NOT coalesce(`s`.`_deleted`, false)", names


def history_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the history view over bronze and its output columns."""
    items, names = [], []
    for name, path in HISTORY_META:
        if field_at(schema, path) is None:
            continue
        ref = "`b`." + ".".join(quote(part) for part in path)
        items.append(f"{'timestamp_millis(' + ref + ')' if name == 'commit_ts' else ref} AS {quote(name)}")
        names.append(name)
    if "op" not in names:
        raise MaskingError(f"bronze table of {table} has no `op` column; it does not follow the bronze layout")
    columns: dict[str, object] = {}
    for side in ("after", "before"):
        struct = field_at(schema, (side,))
        for field in getattr(struct.dataType, "fields", []) if struct is not None else []:
            columns.setdefault(field.name, field.dataType)
    for side in ("before", "after"):
        if field_at(schema, (side,)) is None:
            continue
        for column, datatype in columns.items():
            rule = rule_for(policy, table, column)
            expr = mask_expr(rule, f"`b`.{quote(side)}.{quote(column)}", datatype, f"masking.tables.{table}.{column}")
            if expr is not None:
                items.append(f"{expr} AS {quote(side + '_' + column)}")
                names.append(f"{side}_{column}")
    join = key_join(items, key_table)
    return f"SELECT {', '.join(items)} FROM {source} AS `b`{join} WHERE `b`.`op` IS NOT NULL", names


def view(conf: dict, table: str, kind: str, policy: dict | None = None) -> str:
    """The name of one of a configured table's views: kind clean, history, scd2 (analysts) or full (privileged)."""
    policy = load_policy(conf, policy)
    if kind == "full":
        database = policy.get("privileged_database") or DEFAULT_PRIVILEGED_DATABASE
    else:
        database = policy.get("database") or DEFAULT_DATABASE
    names = view_names(catalog.qualified(entry) for entry in config.get(conf, "source.tables"))
    return f"{database}.{names[catalog.qualified(table)]}_{kind}"


def as_of(conf: dict, spark, table: str, when, policy: dict | None = None):
    """The table as it was at `when` (a datetime, or text Spark reads as a timestamp), from its SCD2 view: one row
    per key that existed then, masked like the clean view."""
    scd2 = spark.table(view(conf, table, "scd2", policy))
    *data, _op, _tx, _lsn, _serial, valid_from, valid_to, _current = scd2.columns  # scd2_select's order
    at = f"CAST({sql_string(str(when))} AS TIMESTAMP)"
    return scd2.filter(f"{quote(valid_from)} <= {at} AND ({quote(valid_to)} IS NULL OR {quote(valid_to)} > {at})") \
        .select(*[quote(c) for c in data])


def kept_columns(conf: dict, table: str, columns: Iterable[str], policy: dict | None = None) -> list[str]:
    """Those of columns that the policy keeps as they are (safe to show in a kept notebook output)."""
    policy = load_policy(conf, policy)
    name = catalog.qualified(table)
    return [column for column in columns if rule_for(policy, name, column) == "keep"]


def visible(conf: dict, table: str, values: Mapping | None, policy: dict | None = None) -> dict | None:
    """values (a row, a key) with only the columns the policy keeps as they are; None stays None."""
    if values is None:
        return None
    return {column: values[column] for column in kept_columns(conf, table, values, policy)}


def visible_event(conf: dict, table: str, event: Mapping, policy: dict | None = None) -> dict:
    """An event (lib.capture.peek) whose key, before and after show only the columns the policy keeps."""
    policy = load_policy(conf, policy)
    return {**event, **{side: visible(conf, table, event.get(side), policy) for side in ("key", "before", "after")}}


def view_names(tables: Iterable[str]) -> dict[str, str]:
    """Base view name per `schema.table`: the table name, `schema_table` when table names collide; characters
    a metastore refuses in a name (anything but letters, digits and _) become _. Names still shared: error."""
    tables = list(tables)

    def ident(text: str) -> str:
        return re.sub(r"[^0-9A-Za-z_]", "_", text).lower()

    short = [ident(table.split(".", 1)[-1]) for table in tables]
    names = {table: name if short.count(name) == 1 else ident(table)
             for table, name in zip(tables, short, strict=True)}
    shared = [t for t in tables if list(names.values()).count(names[t]) > 1]
    if shared:
        raise MaskingError(f"tables {' and '.join(shared)} would share the view name {names[shared[0]]}_*: "
                           f"a view name keeps only letters, digits and _; rename one of the tables")
    return names


def lake_path(conf: dict, layer: str, table: str) -> str:
    """`<lake.root>/<layer>/<schema>/<table>` of a source.tables entry (lib/lake/merge.py writes there)."""
    schema, name = catalog.normalize(table)
    root = config.location(config.get(conf, "lake.root")).rstrip("/")
    return f"{root}/{layer}/{catalog.path_segment(schema)}/{catalog.path_segment(name)}"


def source_ref(conf: dict, policy: dict, layer: str, table: str) -> str:
    """How the views name a table's silver table (`masking.silver_table`, a catalog name template with {schema}
    and {table}, else the path `delta.`<lake.root>/silver/<schema>/<table>``) or the bronze log (`masking.
    bronze_table`, a catalog name, else `delta.`<lake.root>/bronze/_log``)."""
    template = policy.get(f"{layer}_table")
    if layer == "bronze":
        return quote_name(str(template)) if template else f"delta.{quote(lake_paths.bronze_path(conf))}"
    if template:
        schema, name = catalog.normalize(table)
        return quote_name(str(template).format(schema=schema, table=name))
    return f"delta.{quote(lake_path(conf, layer, table))}"


def bronze_relation(conf: dict, spark, policy: dict, table: str, silver) -> str | None:
    """A table's rows of the bronze log, typed like its silver table (key, before, after as structs), as SQL;
    None while the log or the table's silver table does not exist (a table the merge has not reached yet)."""
    from lib.lake import bronze_log, silver_table

    log_ref = source_ref(conf, policy, "bronze", table)
    if silver is None or _read_schema(spark, log_ref) is None:
        return None
    keys = silver_table.key_columns(conf, spark, lake_paths.table_spec(conf, table))
    row = T.StructType(data_fields(silver))
    return bronze_log.relation(log_ref, table, T.StructType([f for f in row.fields if f.name in keys]), row)


def _read_schema(spark, source: str):
    """The schema of the table (or parenthesized query) a source names, or None when it does not exist."""
    from pyspark.errors import AnalysisException

    try:
        return spark.sql(f"SELECT * FROM {source} LIMIT 0").schema if source.startswith("(") \
            else spark.table(source).schema
    except AnalysisException as exc:
        if any(word in str(exc) for word in ("PATH_NOT_FOUND", "DELTA_MISSING", "TABLE_OR_VIEW_NOT_FOUND",
                                             "not a Delta table", "doesn't exist", "does not exist")):
            return None
        raise


def ensure_key(conf: dict, spark, policy: dict) -> dict:
    """Create the key table if needed and store derive_key(salt) in it when it differs; returns what it did."""
    salt = secrets.resolve(policy.get("salt"), setting=f"masking.salt in {conf.get('conf_file', 'conf')}")
    key = derive_key(salt)
    fingerprint = key_fingerprint(key)
    key_table = policy.get("key_table") or DEFAULT_KEY_TABLE
    location = policy.get("key_location", config.get(conf, "lake.root").rstrip("/") + "/_private/masking_key")
    namespace = key_table.rpartition(".")[0]
    if namespace:
        spark.sql(f"CREATE SCHEMA IF NOT EXISTS {quote_name(namespace)}")
    where = f" LOCATION {sql_string(config.location(location))}" if location else ""
    stored = []
    if spark.catalog.tableExists(key_table):
        stored = [row["key_id"] for row in spark.table(quote_name(key_table)).select("key_id").collect()]
    else:  # IF NOT EXISTS: another build may have created it meanwhile; a location may hold it already
        spark.sql(f"CREATE TABLE IF NOT EXISTS {quote_name(key_table)} (`key_id` STRING, `key` STRING) "
                  f"USING DELTA{where} COMMENT 'masking hash key derived from masking.salt: privileged readers only'")
    changed = stored != [fingerprint]
    if changed:
        frame = spark.createDataFrame([(fingerprint, key)], "key_id string, key string")
        frame.write.insertInto(quote_name(key_table), overwrite=True)
    return {"kind": "key", "status": "written" if changed else "unchanged", "table": key_table,
            "key_id": fingerprint, "location": config.location(location) if location else None}


def create_views(conf: dict, spark, policy: dict | None = None, tables: Iterable[str] | None = None) -> list[dict]:
    """(Re)create the clean, full, history, scd2 and fresh views of every table; one dict per view (and the key).

    tables defaults to conf's source.tables; a table whose silver (or bronze) Delta table
    does not exist yet gets `status: skipped` entries instead of views.
    """
    persistent = spark_lib.require_catalog(spark)["catalog"] != "in-memory"  # a held local metastore: remedy
    policy = load_policy(conf, policy)
    entries = {catalog.qualified(e): e for e in (tables if tables is not None else config.get(conf, "source.tables"))}
    tables = list(entries)
    validate(policy, {table: None for table in tables})
    sources = {("silver", table): source_ref(conf, policy, "silver", entries[table]) for table in tables}
    silver = {table: _read_schema(spark, sources["silver", table]) for table in tables}
    for table in tables:
        sources["bronze", table] = bronze_relation(conf, spark, policy, table, silver[table]) or \
            source_ref(conf, policy, "bronze", table)
    bronze = {table: _read_schema(spark, sources["bronze", table]) if sources["bronze", table].startswith("(")
              else None for table in tables}
    validate(policy, {table: silver[table] if silver[table] is not None else bronze_columns(bronze[table])
                      for table in tables})
    database = policy.get("database") or DEFAULT_DATABASE
    private = policy.get("privileged_database") or DEFAULT_PRIVILEGED_DATABASE
    if private.lower() == database.lower():
        raise MaskingError(f"masking.privileged_database and masking.database are both {database}: the unmasked "
                           f"_full views must live where analysts have no grant; name another schema")
    key_table = policy.get("key_table") or DEFAULT_KEY_TABLE
    results = [ensure_key(conf, spark, policy)] if uses_hash(policy) else []
    for schema in (database, private):
        spark.sql(f"CREATE SCHEMA IF NOT EXISTS {quote_name(schema)}")
    where = {"clean": database, "history": database, "scd2": database, "fresh": database, "full": private}
    names = view_names(tables)
    for table in tables:
        plans = []
        silver_source, bronze_source = sources["silver", table], sources["bronze", table]
        if silver[table] is not None:
            plans.append(("clean", silver_source,
                          *clean_select(table, silver[table], policy, silver_source, key_table)))
            plans.append(("full", silver_source, *full_select(table, silver[table], silver_source)))
        else:
            results += [_skipped(where[kind], names[table], kind, table, silver_source) for kind in ("clean", "full")]
        if bronze[table] is not None:
            plans.append(("history", bronze_source,
                          *history_select(table, bronze[table], policy, bronze_source, key_table)))
            plans.append(("scd2", bronze_source, *scd2_select(table, bronze[table], policy, bronze_source, key_table)))
        else:
            results += [_skipped(database, names[table], kind, table, bronze_source) for kind in ("history", "scd2")]
        if silver[table] is not None and bronze[table] is not None:
            plans.append(("fresh", silver_source, *fresh_select(table, silver[table], bronze[table], policy,
                                                                silver_source, bronze_source, key_table)))
        else:
            results.append(_skipped(database, names[table], "fresh", table,
                                    bronze_source if silver[table] is not None else silver_source))
        for kind, source, select, columns in plans:
            view = f"{where[kind]}.{names[table]}_{kind}"
            spark.sql(f"CREATE OR REPLACE VIEW {quote_name(view)} AS {select}")
            results.append({"kind": kind, "status": "created", "view": view, "table": table, "source": source,
                            "columns": columns, "persistent": persistent})
    return results


def column_rules(conf: dict, spark, policy: dict | None = None, tables: Iterable[str] | None = None) -> list[dict]:
    """Per table and silver column: type, rule, and whether the policy lists it (else the default applies)."""
    policy = load_policy(conf, policy)
    entries = {catalog.qualified(e): e for e in (tables if tables is not None else config.get(conf, "source.tables"))}
    rows = []
    for table, entry in entries.items():
        schema = _read_schema(spark, source_ref(conf, policy, "silver", entry))
        listed = (policy.get("tables") or {}).get(table) or {}
        for field in data_fields(schema) if schema is not None else []:
            rows.append({"table": table, "column": field.name, "type": field.dataType.simpleString(),
                         "rule": rule_for(policy, table, field.name), "listed": field.name in listed})
    return rows


def _skipped(database: str, base: str, kind: str, table: str, source: str) -> dict:
    """The result entry of a view not built because its Delta table does not exist."""
    return {"kind": kind, "status": "skipped", "view": f"{database}.{base}_{kind}", "table": table,
            "source": source, "reason": f"no Delta table at {source}"}
