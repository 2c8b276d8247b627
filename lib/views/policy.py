"""The masking policy: one rule per column (keep, hash, partial, redact, null, drop), how each masks a value in
SQL, and the checks that refuse a policy a table cannot follow. The views are built in lib/views/masking.py.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from lib import config, secrets
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
    template = policy.get("silver_table")
    if template and "{table}" not in str(template):
        raise MaskingError(f"masking.silver_table: {template!r} must contain {{table}} (and usually {{schema}})")
    if policy.get("bronze_table") and "{" in str(policy["bronze_table"]):
        raise MaskingError(f"masking.bronze_table: {policy['bronze_table']!r} names the one bronze log of every "
                           f"table (e.g. main.cdc.bronze_log), not a table per source table")
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


def key_join(items: list[str], key_table: str) -> str:
    """` CROSS JOIN` of the hash key when one of a view's select items hashes, else nothing."""
    return f" CROSS JOIN {key_source(key_table)}" if any(KEY_COLUMN in item for item in items) else ""


def data_fields(schema) -> list:
    """Source columns of a silver schema (the merge's bookkeeping columns left out)."""
    return [field for field in schema.fields if field.name not in SILVER_META]


def require_deleted(schema, table: str) -> None:
    """Refuse a silver table without `_deleted`: its tombstones could not be hidden."""
    if "_deleted" not in schema.fieldNames():
        raise MaskingError(f"silver table of {table} has no `_deleted` column, so deleted rows cannot be hidden; "
                           f"rebuild it with lib/lake/merge.py's layout")


def field_at(schema, path: tuple[str, ...]):
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


def bronze_columns(schema) -> dict | None:
    """{column: type} of a bronze table's row struct (after, else before), None without bronze."""
    if schema is None:
        return None
    for side in ("after", "before"):
        field = field_at(schema, (side,))
        if field is not None and hasattr(field.dataType, "fields"):
            return {f.name: f.dataType for f in field.dataType.fields}
    return None
