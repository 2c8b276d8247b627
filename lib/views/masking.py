"""Analyst views over silver and bronze with personal data masked according to conf.

How it works and what it guarantees: docs/masking-policy.md.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping

from lib import config, secrets
from lib import spark as spark_lib
from lib.capture import catalog
from lib.lake.lake_paths import META_COLUMNS, quote

RULES = ("keep", "hash", "partial", "redact", "null", "drop")
POLICY_KEYS = ("database", "privileged_database", "default", "salt", "key_table", "key_location", "silver_table",
               "bronze_table", "tables")
DEFAULT_DATABASE = "cdc_views"
DEFAULT_KEY_TABLE = "cdc_private.masking_key"
DEFAULT_PRIVILEGED_DATABASE = "cdc_private"  # the _full views (and, by default, the key table): never for analysts
# the merge's bookkeeping columns in silver (layout contract): not masked; the clean view keeps _updated_at only
SILVER_META = META_COLUMNS  # the merge's own columns of a silver table
CLEAN_META = ("_updated_at",)
# history columns taken from bronze: output name -> field path
HISTORY_META = (("op", ("op",)), ("commit_ts", ("source", "ts_ms")), ("tx_id", ("source", "txId")),
                ("commit_lsn", ("source", "commit_lsn")), ("event_serial", ("source", "event_serial")),
                ("snapshot", ("source", "snapshot")), ("unchanged_cols", ("unchanged_cols",)))
REDACTED = "[REDACTED]"
KEY_ALIAS = "__k"
KEY_COLUMN = "__masking_key"
KEY_CONTEXT = b"cdc-masking-hash-key-v1"
EMAIL_RE = "^[^@ ]+@[A-Za-z0-9-]+([.][A-Za-z0-9-]+)+$"
PHONE_RE = "^[+]?[0-9 ().-]+$"


class MaskingError(ValueError):
    """A masking policy or a table's schema cannot be turned into views."""


def quote_name(dotted: str) -> str:
    """A dotted multi-part name (db.table or catalog.db.table) with every part quoted."""
    return ".".join(quote(part) for part in str(dotted).split("."))


def sql_string(text: str) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("\\", "\\\\").replace("'", "\\'") + "'"


def derive_key(salt: str) -> str:
    """The hash key stored in the key table: HMAC-SHA256 of a fixed label under the salt, hex."""
    return hmac.new(salt.encode(), KEY_CONTEXT, hashlib.sha256).hexdigest()


def key_fingerprint(key: str) -> str:
    """A short id of a key (shows when hashes changed; reveals nothing usable)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def load_policy(conf: dict, policy: dict | None = None) -> dict:
    """The masking policy: the given dict, else conf's `masking` section (empty = drop everything)."""
    found = dict((config.get(conf, "masking") if policy is None else policy) or {})
    if isinstance(found.get("tables"), Mapping):  # keys read like source.tables: quotes, case, default schema
        tables = {}
        for name, columns in found["tables"].items():
            key = catalog.qualified(name)
            if key in tables:
                raise MaskingError(f"masking.tables lists {key} twice (as {name!r} and another spelling)")
            tables[key] = columns
        found["tables"] = tables
    return found


def normalize_rule(value) -> str:
    """A rule word in lower case; YAML's bare null means the `null` rule."""
    return "null" if value is None else str(value).strip().lower()


def type_kind(datatype) -> str:
    """string / date / timestamp / binary / complex / other for a Spark DataType or a type name."""
    name = datatype if isinstance(datatype, str) else datatype.simpleString()
    name = name.strip().lower()
    if name.startswith(("string", "varchar", "char", "text")):
        return "string"
    if name == "date":
        return "date"
    if name.startswith("timestamp"):
        return "timestamp"
    if name == "binary":
        return "binary"
    if name.startswith(("array", "map", "struct")):
        return "complex"
    return "other"


def _columns(value) -> dict | None:
    """{column: type or None} from a StructType, a mapping, a list of names, or None (unknown)."""
    if value is None:
        return None
    if hasattr(value, "fields"):
        return {field.name: field.dataType for field in value.fields}
    if isinstance(value, Mapping):
        return dict(value)
    return {str(name): None for name in value}


def uses_hash(policy: dict) -> bool:
    """True when some rule (or the default) hashes, i.e. the salt is needed."""
    rules = [normalize_rule(policy.get("default", "drop"))]
    for columns in (policy.get("tables") or {}).values():
        rules += [normalize_rule(rule) for rule in (columns or {}).values()]
    return "hash" in rules


def validate(policy: dict, tables_columns: Mapping[str, object]) -> None:
    """Raise MaskingError naming the unknown setting, table, column or rule, or an unsupported partial.

    tables_columns maps `schema.table` to its columns: a StructType, {name: type}, a list
    of names, or None when only the table name can be checked.
    """
    if not isinstance(policy, Mapping):
        raise MaskingError(f"masking policy must be a mapping, not {type(policy).__name__}")
    unknown = sorted(set(policy) - set(POLICY_KEYS))
    if unknown:
        raise MaskingError(f"masking.{unknown[0]}: unknown setting; known: {', '.join(POLICY_KEYS)}")
    default = normalize_rule(policy.get("default", "drop"))
    if default not in RULES:
        raise MaskingError(f"masking.default: unknown rule {default!r}; use one of {', '.join(RULES)}")
    if default == "partial":
        raise MaskingError("masking.default: partial is type-dependent; use drop (safe), null, redact or hash")
    if uses_hash(policy):
        if "salt" not in policy:
            raise MaskingError("masking.salt is missing: the hash rule needs a salt reference such as "
                               "{env: CDC_MASKING_SALT} or {scope: cdc, key: masking-salt}")
        if not secrets.is_reference(policy["salt"]):
            raise MaskingError("masking.salt must be a secret reference ({env: NAME} or {scope: S, key: K}), "
                               "not a literal value: secrets are never written in conf")
    for layer in ("silver", "bronze"):
        template = policy.get(f"{layer}_table")
        if template and "{table}" not in str(template):
            raise MaskingError(f"masking.{layer}_table: {template!r} must contain {{table}} (and usually {{schema}})")
    tables = policy.get("tables") or {}
    if not isinstance(tables, Mapping):
        raise MaskingError("masking.tables must map `schema.table` to {column: rule}")
    for table, rules in tables.items():
        if table not in tables_columns:
            raise MaskingError(f"masking.tables.{table}: unknown table; known: {', '.join(sorted(tables_columns))}")
        if rules is not None and not isinstance(rules, Mapping):
            raise MaskingError(f"masking.tables.{table} must map column names to rules")
        columns = _columns(tables_columns[table])
        for column, value in (rules or {}).items():
            rule = normalize_rule(value)
            where = f"masking.tables.{table}.{column}"
            if rule not in RULES:
                raise MaskingError(f"{where}: unknown rule {value!r}; use one of {', '.join(RULES)}")
            if columns is None:
                continue
            if column not in columns:
                raise MaskingError(f"{where}: table {table} has no column {column!r} "
                                   f"(columns: {', '.join(c for c in columns if c not in SILVER_META)})")
            if rule == "partial" and columns[column] is not None:
                kind = type_kind(columns[column])
                if kind not in ("string", "date", "timestamp"):
                    raise MaskingError(_partial_refused(table, column, columns[column]))


def _partial_refused(table: str, column: str, datatype) -> str:
    """The message for partial on a type it does not support."""
    name = datatype if isinstance(datatype, str) else datatype.simpleString()
    return (f"masking.tables.{table}.{column}: partial is defined for strings, dates and timestamps, "
            f"not {name}; use hash, redact or null")


def rule_for(policy: dict, table: str, column: str) -> str:
    """The rule of one column: the table's entry, else the default (drop unless set)."""
    rules = (policy.get("tables") or {}).get(table) or {}
    if column in rules:
        return normalize_rule(rules[column])
    return normalize_rule(policy.get("default", "drop"))


def mask_expr(rule: str, ref: str, datatype, where: str = "column") -> str | None:
    """SQL for one masked value (ref is the quoted column expression); None for drop."""
    kind = type_kind(datatype)
    typename = datatype if isinstance(datatype, str) else datatype.simpleString()
    if rule == "drop":
        return None
    if rule == "keep":
        return ref
    if rule == "null":
        return f"CAST(NULL AS {typename})"
    if rule == "redact":
        if kind == "string":
            return f"CASE WHEN {ref} IS NULL THEN NULL ELSE {sql_string(REDACTED)} END"
        return f"CAST(NULL AS {typename})"
    if rule == "hash":
        text = {"string": ref, "binary": f"hex({ref})", "complex": f"to_json({ref})"}.get(
            kind, f"CAST({ref} AS STRING)")
        return f"sha2(concat({quote(KEY_ALIAS)}.{quote(KEY_COLUMN)}, {text}), 256)"
    if rule == "partial":
        if kind == "string":
            digits = f"regexp_replace({ref}, '[^0-9]', '')"
            return (f"CASE WHEN {ref} IS NULL THEN NULL "
                    f"WHEN {ref} RLIKE {sql_string(EMAIL_RE)} THEN concat('***@', substring_index({ref}, '@', -1)) "
                    f"WHEN {ref} RLIKE {sql_string(PHONE_RE)} AND length({digits}) >= 7 "
                    f"THEN concat('***', right({digits}, 4)) "
                    f"ELSE concat(left({ref}, 1), '***') END")
        if kind == "date":
            return f"trunc({ref}, 'YEAR')"
        if kind == "timestamp":
            return f"CAST(date_trunc('YEAR', {ref}) AS {typename})"
        raise MaskingError(f"{where}: partial is defined for strings, dates and timestamps, not {typename}; "
                           f"use hash, redact or null")
    raise MaskingError(f"{where}: unknown rule {rule!r}; use one of {', '.join(RULES)}")


def key_source(key_table: str) -> str:
    """The one-row relation the views join to get the hash key (NULL key if the table is empty)."""
    return f"(SELECT max(`key`) AS {quote(KEY_COLUMN)} FROM {quote_name(key_table)}) AS {quote(KEY_ALIAS)}"


def _data_fields(schema) -> list:
    """Source columns of a silver schema (the merge's bookkeeping columns left out)."""
    return [field for field in schema.fields if field.name not in SILVER_META]


def _require_deleted(schema, table: str) -> None:
    """Refuse a silver table without `_deleted`: its tombstones could not be hidden."""
    if "_deleted" not in schema.fieldNames():
        raise MaskingError(f"silver table of {table} has no `_deleted` column, so deleted rows cannot be hidden; "
                           f"rebuild it with lib/lake/merge.py's layout")


def clean_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the clean view and its output columns."""
    _require_deleted(schema, table)
    items, names = [], []
    for field in _data_fields(schema):
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
    join = f" CROSS JOIN {key_source(key_table)}" if any(KEY_COLUMN in item for item in items) else ""
    text = (f"SELECT {', '.join(items)} FROM {source} AS `s`{join} "
            f"WHERE NOT coalesce(`s`.`_deleted`, false)")
    return text, names


def full_select(table: str, schema, source: str) -> tuple[str, list[str]]:
    """SELECT of the full (unmasked) view and its output columns."""
    _require_deleted(schema, table)
    names = schema.fieldNames()
    items = ", ".join(f"`s`.{quote(name)} AS {quote(name)}" for name in names)
    return f"SELECT {items} FROM {source} AS `s` WHERE NOT coalesce(`s`.`_deleted`, false)", names


def _field(schema, path: tuple[str, ...]):
    """The StructField at a path in a schema, or None."""
    node = schema
    found = None
    for name in path:
        fields = {field.name: field for field in getattr(node, "fields", [])}
        if name not in fields:
            return None
        found = fields[name]
        node = found.dataType
    return found


def history_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the history view over bronze and its output columns."""
    items, names = [], []
    for name, path in HISTORY_META:
        if _field(schema, path) is None:
            continue
        ref = "`b`." + ".".join(quote(part) for part in path)
        items.append(f"{'timestamp_millis(' + ref + ')' if name == 'commit_ts' else ref} AS {quote(name)}")
        names.append(name)
    if "op" not in names:
        raise MaskingError(f"bronze table of {table} has no `op` column; it does not follow the bronze layout")
    columns: dict[str, object] = {}
    for side in ("after", "before"):
        struct = _field(schema, (side,))
        for field in getattr(struct.dataType, "fields", []) if struct is not None else []:
            columns.setdefault(field.name, field.dataType)
    for side in ("before", "after"):
        if _field(schema, (side,)) is None:
            continue
        for column, datatype in columns.items():
            rule = rule_for(policy, table, column)
            expr = mask_expr(rule, f"`b`.{quote(side)}.{quote(column)}", datatype, f"masking.tables.{table}.{column}")
            if expr is not None:
                items.append(f"{expr} AS {quote(side + '_' + column)}")
                names.append(f"{side}_{column}")
    join = f" CROSS JOIN {key_source(key_table)}" if any(KEY_COLUMN in item for item in items) else ""
    return f"SELECT {', '.join(items)} FROM {source} AS `b`{join} WHERE `b`.`op` IS NOT NULL", names


def scd2_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the SCD type 2 view over bronze: one row per version of a key (c, u, r events; a duplicate
    delivery counted once), valid from its commit until the key's next event, masked like the clean view.
    The version's own columns (op, tx_id, commit_lsn, event_serial, valid_from, valid_to, is_current) get a
    leading _ where the table has a column of that name."""
    columns = bronze_columns(schema)
    if columns is None or _field(schema, ("key",)) is None or _field(schema, ("source", "commit_lsn")) is None:
        raise MaskingError(f"bronze table of {table} lacks key, after or source.commit_lsn; it does not follow "
                           f"the bronze layout")
    order = "PARTITION BY `e`.`__key` ORDER BY `e`.`__lsn`, `e`.`__serial`"
    carried, items, names = [], [], []
    for column, datatype in columns.items():
        ref = f"`e`.`__after`.{quote(column)}"
        if type_kind(datatype) in ("string", "binary", "complex"):  # TOASTable: an unchanged value is not sent
            ref = (f"last(CASE WHEN array_contains(`e`.`__unchanged`, {sql_string(column)}) THEN NULL "
                   f"ELSE named_struct('v', {ref}) END, true) OVER ({order} ROWS BETWEEN UNBOUNDED PRECEDING "
                   f"AND CURRENT ROW).`v`")
        carried.append(f"{ref} AS {quote(column)}")
        expr = mask_expr(rule_for(policy, table, column), f"`v`.{quote(column)}", datatype,
                         f"masking.tables.{table}.{column}")
        if expr is not None:
            items.append(f"{expr} AS {quote(column)}")
            names.append(column)
    meta = [("op", "`v`.`__op`"), ("tx_id", "`v`.`__tx`"), ("commit_lsn", "`v`.`__lsn`"),
            ("event_serial", "`v`.`__serial`"), ("valid_from", "`v`.`__ts`"), ("valid_to", "`v`.`__to`"),
            ("is_current", "`v`.`__to` IS NULL")]
    for name, expr in meta:  # a source column of the same name keeps it: the version's column gets a leading _
        while name in names:
            name = "_" + name
        items.append(f"{expr} AS {quote(name)}")
        names.append(name)
    events = (f"SELECT `b`.`key` AS `__key`, `b`.`op` AS `__op`, `b`.`after` AS `__after`, "
              f"coalesce(`b`.`unchanged_cols`, array()) AS `__unchanged`, `b`.`source`.`commit_lsn` AS `__lsn`, "
              f"`b`.`source`.`event_serial` AS `__serial`, timestamp_millis(`b`.`source`.`ts_ms`) AS `__ts`, "
              f"`b`.`source`.`txId` AS `__tx`, row_number() OVER (PARTITION BY `b`.`key`, `b`.`source`.`commit_lsn`, "
              f"`b`.`source`.`event_serial` ORDER BY `b`.`_kafka_offset`) AS `__copy` "
              f"FROM {source} AS `b` WHERE `b`.`op` IS NOT NULL")
    versions = (f"SELECT `e`.`__op`, `e`.`__tx`, `e`.`__lsn`, `e`.`__serial`, `e`.`__ts`, "
                f"lead(`e`.`__ts`) OVER ({order}) AS `__to`, {', '.join(carried)} "
                f"FROM ({events}) AS `e` WHERE `e`.`__copy` = 1")
    join = f" CROSS JOIN {key_source(key_table)}" if any(KEY_COLUMN in item for item in items) else ""
    return f"SELECT {', '.join(items)} FROM ({versions}) AS `v`{join} WHERE `v`.`__op` <> 'd'", names


def view(conf: dict, table: str, kind: str, policy: dict | None = None) -> str:
    """The name of one of a configured table's views: kind clean, history, scd2 (analysts) or full (privileged)."""
    policy = load_policy(conf, policy)
    if kind == "full":
        database = policy.get("privileged_database") or DEFAULT_PRIVILEGED_DATABASE
    else:
        database = policy.get("database") or DEFAULT_DATABASE
    names = view_names(catalog.qualified(entry) for entry in config.get(conf, "source.tables"))
    return f"{database}.{names[catalog.qualified(table)]}_{kind}"


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
    """How the views name a layer's table: `masking.<layer>_table` (a catalog name template with
    {schema} and {table}) when set, else the path `delta.`<lake.root>/<layer>/<schema>/<table>``."""
    template = policy.get(f"{layer}_table")
    if template:
        schema, name = catalog.normalize(table)
        return quote_name(str(template).format(schema=schema, table=name))
    return f"delta.{quote(lake_path(conf, layer, table))}"


def _read_schema(spark, source: str):
    """The schema of the table a source_ref names, or None when it does not exist."""
    from pyspark.errors import AnalysisException

    try:
        return spark.table(source).schema
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
    """(Re)create the clean, full, history and scd2 views of every table; returns one dict per view (and the key).

    tables defaults to conf's source.tables; a table whose silver (or bronze) Delta table
    does not exist yet gets `status: skipped` entries instead of views.
    """
    persistent = spark_lib.require_catalog(spark)["catalog"] != "in-memory"  # a held local metastore: remedy
    policy = load_policy(conf, policy)
    entries = {catalog.qualified(e): e for e in (tables if tables is not None else config.get(conf, "source.tables"))}
    tables = list(entries)
    validate(policy, {table: None for table in tables})
    sources = {(layer, table): source_ref(conf, policy, layer, entries[table]) for layer in ("silver", "bronze")
               for table in tables}
    silver = {table: _read_schema(spark, sources["silver", table]) for table in tables}
    bronze = {table: _read_schema(spark, sources["bronze", table]) for table in tables}
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
    where = {"clean": database, "history": database, "scd2": database, "full": private}
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
        for field in _data_fields(schema) if schema is not None else []:
            rows.append({"table": table, "column": field.name, "type": field.dataType.simpleString(),
                         "rule": rule_for(policy, table, field.name), "listed": field.name in listed})
    return rows


def bronze_columns(schema) -> dict | None:
    """{column: type} of a bronze table's row struct (after, else before), None without bronze."""
    if schema is None:
        return None
    for side in ("after", "before"):
        field = _field(schema, (side,))
        if field is not None and hasattr(field.dataType, "fields"):
            return {f.name: f.dataType for f in field.dataType.fields}
    return None


def _skipped(database: str, base: str, kind: str, table: str, source: str) -> dict:
    """The result entry of a view not built because its Delta table does not exist."""
    return {"kind": kind, "status": "skipped", "view": f"{database}.{base}_{kind}", "table": table,
            "source": source, "reason": f"no Delta table at {source}"}
