"""Table metadata from pg_catalog: columns, types, primary keys, replica identity.

``describe_tables(conn, ["bank.accounts", ...])`` returns one frozen ``Table`` per configured
name. Names are resolved by PostgreSQL itself (``to_regclass``), so quoting and case folding
follow SQL rules: ``bank.accounts``, ``"Bank"."My Table"``. The primary key is read from
``pg_index.indisprimary`` (never inferred from replica identity). Works on PostgreSQL >= 13
with the pipeline role (SELECT on pg_catalog is enough).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

# pg_type.typtype -> our kind (arrays are base types with an element; see _kind)
_TYPTYPE = {"b": "base", "c": "composite", "d": "domain", "e": "enum", "p": "pseudo", "r": "range",
            "m": "multirange"}
# base types in category 'A' whose text form is not '{...}'
_VECTOR_TYPES = {"int2vector", "oidvector"}


class CatalogError(LookupError):
    """A configured table is missing, is not a table, or cannot be captured as configured."""


@dataclass(frozen=True)
class PgType:
    """A PostgreSQL type; domains, arrays and enums carry what the mapping needs."""

    oid: int
    schema: str
    name: str  # pg_type.typname: 'int4', 'numeric', '_text', 'kyc_status'
    kind: str  # base | array | enum | domain | composite | range | multirange | pseudo
    category: str = "U"  # pg_type.typcategory
    typmod: int = -1
    element: PgType | None = None  # arrays: the element type (carries the column's typmod)
    base: PgType | None = None  # domains: the base type (carries the domain's typmod)
    labels: tuple[str, ...] = ()  # enums, in sort order

    @property
    def qualified(self) -> str:
        """schema.name, e.g. 'pg_catalog.int4' or 'bank.kyc_status'."""
        return f"{self.schema}.{self.name}"

    def resolved(self) -> PgType:
        """The type with every domain unwrapped to its base type."""
        t = self
        while t.kind == "domain" and t.base is not None:
            t = t.base
        return t


@dataclass(frozen=True)
class Column:
    """One column of a table, in attnum order."""

    table: str  # 'schema.table' the column belongs to (for messages)
    name: str
    attnum: int
    type_name: str  # format_type(atttypid, atttypmod): 'numeric(14,2)', 'text[]', 'bank.kyc_status'
    type: PgType
    not_null: bool
    toastable: bool = False  # variable-length and not STORAGE PLAIN: may arrive as 'unchanged TOAST'
    generated: bool = False  # GENERATED ALWAYS AS (...) STORED: pgoutput (PG <= 17) does not send it

    @property
    def qualified(self) -> str:
        """schema.table.column, for messages."""
        return f"{self.table}.{self.name}"

    @property
    def type_oid(self) -> int:
        """pg_attribute.atttypid."""
        return self.type.oid

    @property
    def typmod(self) -> int:
        """pg_attribute.atttypmod (-1 when none)."""
        return self.type.typmod

    @property
    def precision(self) -> int | None:
        """numeric(p,s): p (through domains and for arrays of numeric); None when unconstrained."""
        return numeric_precision_scale(self.type)[0]

    @property
    def scale(self) -> int | None:
        """numeric(p,s): s (may be negative or exceed p on PostgreSQL >= 15); None when unconstrained."""
        return numeric_precision_scale(self.type)[1]

    @property
    def element_type(self) -> PgType | None:
        """Arrays: the element type (after unwrapping domains over the array)."""
        return self.type.resolved().element

    @property
    def base_type(self) -> PgType | None:
        """Domains: the fully unwrapped base type."""
        return self.type.resolved() if self.type.kind == "domain" else None

    @property
    def enum_labels(self) -> tuple[str, ...]:
        """Enums: the labels in sort order."""
        return self.type.resolved().labels


@dataclass(frozen=True)
class Table:
    """A source table: columns, primary key and replica identity."""

    schema: str
    name: str
    oid: int
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]  # the key (see key_source), column names in key order; () when there is none
    replica_identity: str  # d (default = PK), f (full), i (index), n (nothing)
    identity_index: str | None = None  # replica identity 'i': the index name
    identity_index_columns: tuple[str, ...] = ()  # replica identity 'i': its key columns
    kind: str = "r"  # pg_class.relkind: r table, p partitioned table
    key_source: str = "primary key"  # where primary_key comes from: primary key, replica identity index, source.keys

    @property
    def qualified(self) -> str:
        """schema.table."""
        return f"{self.schema}.{self.name}"

    def column(self, name: str) -> Column:
        """The column called name; KeyError names the table."""
        for col in self.columns:
            if col.name == name:
                return col
        raise KeyError(f"{self.qualified} has no column {name!r}")

    @property
    def identity_columns(self) -> tuple[str, ...]:
        """Columns an UPDATE/DELETE's old tuple carries: PK (d), index (i), all (f), none (n)."""
        if self.replica_identity == "d":
            return self.primary_key
        if self.replica_identity == "i":
            return self.identity_index_columns
        if self.replica_identity == "f":
            return tuple(c.name for c in self.columns)
        return ()


def numeric_precision_scale(t: PgType) -> tuple[int | None, int | None]:
    """(precision, scale) of a numeric typmod (through domains and arrays); (None, None) if unconstrained."""
    t = t.resolved()
    if t.kind == "array" and t.element is not None:
        t = t.element.resolved()
    if t.name != "numeric" or t.schema != "pg_catalog" or t.typmod < 4:
        return None, None
    mod = t.typmod - 4
    precision = (mod >> 16) & 0xFFFF
    scale = mod & 0x7FF
    scale = scale - 0x800 if scale & 0x400 else scale  # 11-bit two's complement (PG >= 15)
    return precision, scale


def _parts(name: str) -> tuple[list[tuple[str, bool]], bool]:
    """The dot-separated parts of a name, each with whether it was quoted, and whether a quote is left open."""
    parts, buf, quoted, was_quoted, i = [], [], False, False, 0
    while i < len(name):
        ch = name[i]
        if ch == '"':
            if quoted and i + 1 < len(name) and name[i + 1] == '"':
                buf.append('"')
                i += 1
            else:
                quoted, was_quoted = not quoted, True
        elif ch == "." and not quoted:
            parts.append(("".join(buf), was_quoted))
            buf, was_quoted = [], False
        else:
            buf.append(ch)
        i += 1
    parts.append(("".join(buf), was_quoted))
    return parts, quoted


def split_name(name: str) -> tuple[str | None, str]:
    """'schema.table' -> ('schema', 'table') honouring double quotes; no dot -> (None, name)."""
    parts = [part for part, _ in _parts(name)[0]]
    if len(parts) == 1:
        return None, parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise CatalogError(f"table name {name!r} must be schema.table (quote names that contain dots)")


def normalize(name: str) -> tuple[str, str]:
    """A source.tables entry as (schema, table) the way PostgreSQL reads it: unquoted parts fold to lower case,
    quoted ones keep their case, no schema means public. The one reading of a configured name."""
    parts, open_quote = _parts(name)
    if len(parts) > 2 or open_quote or any(not part for part, _ in parts):
        raise CatalogError(f"table name {name!r} must be schema.table or table, with double quotes around a name "
                           f"that has dots, capitals or other special characters")
    folded = [part if was else part.lower() for part, was in parts]
    return ("public", folded[0]) if len(folded) == 1 else (folded[0], folded[1])


def sql_ident(name: str) -> str:
    """A double-quoted SQL identifier (PostgreSQL reads it back exactly: case, spaces and quotes kept)."""
    return '"' + name.replace('"', '""') + '"'


def sql_literal(text: str) -> str:
    """A single-quoted SQL string literal (standard_conforming_strings)."""
    return "'" + text.replace("'", "''") + "'"


def sql_name(schema: str, table: str) -> str:
    """"schema"."table" as SQL reads it back exactly (case, spaces and quotes kept)."""
    return f"{sql_ident(schema)}.{sql_ident(table)}"


def qualified(name: str) -> str:
    """'schema.table' of a source.tables entry after normalize (no quotes: the form control keys and logs use)."""
    return ".".join(normalize(name))


def path_segment(name: str) -> str:
    """A schema or table name as one folder of a lake path: as it is, unless it could leave its folder or
    confuse a Hadoop path ('/', '\\', ':', a leading '.'), then made safe and suffixed with a hash of the name
    so that two names never share a folder."""
    if name and not any(ch in name for ch in "/\\:") and not name.startswith("."):
        return name
    safe = "".join(ch if ch.isalnum() or ch in " _-" else "_" for ch in name).strip() or "_"
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


_TABLES_SQL = """
SELECT c.oid, n.nspname, c.relname, c.relkind, c.relreplident
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%s)
"""

_COLUMNS_SQL = """
SELECT a.attrelid, a.attnum, a.attname, a.atttypid, a.atttypmod, a.attnotnull,
       format_type(a.atttypid, a.atttypmod), a.attlen = -1 AND a.attstorage <> 'p',
       a.attgenerated <> ''
FROM pg_attribute a
WHERE a.attrelid = ANY(%s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attrelid, a.attnum
"""

_INDEX_SQL = """
SELECT i.indrelid, i.indisprimary, i.indisreplident, ic.relname, i.indkey::int2[], i.indnkeyatts
FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = ANY(%s) AND (i.indisprimary OR i.indisreplident)
"""

_TYPES_SQL = """
SELECT t.oid, n.nspname, t.typname, t.typtype, t.typcategory, t.typelem, t.typlen, t.typbasetype,
       t.typtypmod
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid = ANY(%s)
"""

_ENUM_SQL = """
SELECT enumtypid, enumlabel FROM pg_enum WHERE enumtypid = ANY(%s) ORDER BY enumtypid, enumsortorder
"""


def describe_tables(conn, tables: list[str], keys: dict[str, list[str]] | None = None) -> dict[str, Table]:
    """Table metadata for each configured name (key = the name as given); unknown name -> CatalogError.

    A table without a primary key is keyed by its REPLICA IDENTITY USING INDEX columns, or by the
    columns conf declares for it in `keys` (source.keys; docs/events.md, "Tables without a primary key").
    """
    keys = keys or {}
    with conn.cursor() as cur:
        found: dict[str, tuple] = {}
        missing = []
        for name in tables:
            schema, _ = split_name(name)
            cur.execute(_TABLES_SQL, (name if schema else f"public.{name}",))
            row = cur.fetchone()
            if row is None:
                missing.append(name)
            elif row[3] not in ("r", "p"):
                kind = {"v": "a view", "m": "a materialized view", "f": "a foreign table"}.get(row[3], "not a table")
                raise CatalogError(
                    f"configured table {name} is {kind}; logical replication publishes tables only: "
                    f"remove it from source.tables or list the underlying table")
            else:
                found[name] = row
        if missing:
            raise CatalogError(
                f"configured table(s) not found in database {conn.get_dsn_parameters().get('dbname')}: "
                f"{', '.join(missing)}; check source.tables (schema.table) and source.database, "
                f"and that the role {conn.get_dsn_parameters().get('user')} may see the schema")
        oids = sorted({row[0] for row in found.values()})
        cur.execute(_COLUMNS_SQL, (oids,))
        column_rows = cur.fetchall()
        cur.execute(_INDEX_SQL, (oids,))
        index_rows = cur.fetchall()
        types = _load_types(cur, {r[3] for r in column_rows})

    by_table: dict[int, list[tuple]] = {}
    for r in column_rows:
        by_table.setdefault(r[0], []).append(r)
    result = {}
    for name, (oid, schema, relname, relkind, ident) in found.items():
        qualified = f"{schema}.{relname}"
        rows = by_table.get(oid, [])
        attname = {r[1]: r[2] for r in rows}
        columns = tuple(
            Column(table=qualified, name=r[2], attnum=r[1], type_name=r[6], type=_build(types, r[3], r[4]),
                   not_null=r[5], toastable=r[7], generated=r[8])
            for r in rows)
        pk: tuple[str, ...] = ()
        ident_index, ident_cols = None, ()
        for relid, is_pk, is_ident, index_name, indkey, nkey in index_rows:
            if relid != oid:
                continue
            keycols = tuple(attname.get(k, f"<expr {k}>") for k in list(indkey)[:nkey])
            if is_pk:
                pk = keycols
            if is_ident:
                ident_index, ident_cols = index_name, keycols
        table = Table(schema=schema, name=relname, oid=oid, columns=columns, primary_key=pk,
                      replica_identity=ident, identity_index=ident_index if ident == "i" else None,
                      identity_index_columns=ident_cols if ident == "i" else (), kind=relkind)
        result[name] = _effective_key(table, keys.get(name))
    unknown = sorted(set(keys) - set(tables))
    if unknown:
        raise CatalogError(f"source.keys names table(s) that are not in source.tables: {', '.join(unknown)}; "
                           f"add them to source.tables or remove them from source.keys")
    return result


def _effective_key(table: Table, declared: list[str] | None) -> Table:
    """The table keyed by its primary key, else its replica identity index, else the columns conf declares."""
    if declared is not None:
        if table.primary_key:
            raise CatalogError(f"source.keys declares a key for {table.qualified}, which has a primary key "
                               f"({', '.join(table.primary_key)}): remove {table.qualified} from source.keys")
        if isinstance(declared, str) or not declared:
            raise CatalogError(f"source.keys.{table.qualified} must be a non-empty list of column names")
        names = {c.name for c in table.columns}
        for column in declared:
            if column not in names:
                raise CatalogError(f"source.keys.{table.qualified} names column {column!r}, which "
                                   f"{table.qualified} does not have; columns: {', '.join(sorted(names))}")
            if not table.column(column).not_null:
                raise CatalogError(f"source.keys.{table.qualified}: key column {table.qualified}.{column} "
                                   f"allows NULL; declare NOT NULL columns only (ALTER TABLE {table.qualified} "
                                   f"ALTER COLUMN {column} SET NOT NULL) or choose other columns")
        return dataclasses.replace(table, primary_key=tuple(declared), key_source="source.keys")
    if not table.primary_key and table.replica_identity == "i":
        return dataclasses.replace(table, primary_key=table.identity_index_columns,
                                   key_source=f"replica identity index {table.identity_index}")
    return table


def check_capturable(table: Table) -> None:
    """Raise CatalogError (with the remedy) unless updates and deletes can be keyed.

    Publishing UPDATE/DELETE for a table with neither a primary key nor REPLICA IDENTITY
    USING INDEX/FULL makes those statements FAIL on the source, hence the refusal.
    """
    if not table.primary_key:
        raise CatalogError(
            f"table {table.qualified} has no primary key; topics are keyed by primary key, and once it is "
            f"published UPDATE and DELETE on it would fail on the source. Remedies: add one (ALTER TABLE "
            f"{table.qualified} ADD PRIMARY KEY (...)); or ALTER TABLE {table.qualified} REPLICA IDENTITY USING "
            f"INDEX <unique index on NOT NULL columns>; or declare its key columns under source.keys and run "
            f"ALTER TABLE {table.qualified} REPLICA IDENTITY FULL (docs/events.md, \"Tables without a primary "
            f"key\"); or remove the table from source.tables")
    if table.key_source == "source.keys" and table.replica_identity != "f":
        raise CatalogError(
            f"table {table.qualified} is keyed by source.keys ({', '.join(table.primary_key)}) but its replica "
            f"identity is {_IDENTITY_NAMES.get(table.replica_identity, table.replica_identity)}: once published, "
            f"UPDATE and DELETE on it would fail on the source and deletes could not be keyed; run ALTER TABLE "
            f"{table.qualified} REPLICA IDENTITY FULL first")
    if table.replica_identity == "n":
        raise CatalogError(
            f"table {table.qualified} has REPLICA IDENTITY NOTHING: updates and deletes carry no key; "
            f"run ALTER TABLE {table.qualified} REPLICA IDENTITY DEFAULT")
    if table.replica_identity == "i" and not set(table.primary_key) <= set(table.identity_index_columns):
        raise CatalogError(
            f"table {table.qualified} has REPLICA IDENTITY USING INDEX {table.identity_index} "
            f"({', '.join(table.identity_index_columns)}), which lacks primary key column(s) "
            f"{', '.join(c for c in table.primary_key if c not in table.identity_index_columns)}: deletes "
            f"could not be keyed; run ALTER TABLE {table.qualified} REPLICA IDENTITY DEFAULT")
    generated = [c for c in table.primary_key if table.column(c).generated]
    if generated:
        raise CatalogError(
            f"table {table.qualified}: primary key column(s) {', '.join(generated)} are generated columns, "
            f"which pgoutput does not send; use a plain key column")


_IDENTITY_NAMES = {"d": "DEFAULT", "n": "NOTHING", "i": "USING INDEX", "f": "FULL"}


def _load_types(cur, oids: set[int]) -> dict[int, tuple]:
    """pg_type rows for oids and every element/base type they reference, plus enum labels."""
    rows: dict[int, tuple] = {}
    todo = set(oids)
    while todo:
        cur.execute(_TYPES_SQL, (sorted(todo),))
        fetched = cur.fetchall()
        todo = set()
        for r in fetched:
            rows[r[0]] = r
            for ref in (r[5], r[7]):  # typelem, typbasetype
                if ref and ref not in rows:
                    todo.add(ref)
        todo -= rows.keys()
    enums = [oid for oid, r in rows.items() if r[3] == "e"]
    labels: dict[int, list[str]] = {}
    if enums:
        cur.execute(_ENUM_SQL, (enums,))
        for typid, label in cur.fetchall():
            labels.setdefault(typid, []).append(label)
    return {oid: r + (tuple(labels.get(oid, ())),) for oid, r in rows.items()}


def type_of(cur, oid: int, typmod: int) -> PgType | None:
    """The PgType tree of a type oid with a typmod, read from pg_type; None when the type no longer exists."""
    types = _load_types(cur, {oid})
    return _build(types, oid, typmod) if oid in types else None


def _build(types: dict[int, tuple], oid: int, typmod: int) -> PgType:
    """A PgType tree for oid with the given typmod."""
    oid_, schema, name, typtype, category, elem, typlen, basetype, typtypmod, labels = types[oid]
    kind = _TYPTYPE.get(typtype, "base")
    element = base = None
    if kind == "base" and category == "A" and elem and typlen == -1 and name not in _VECTOR_TYPES:
        kind = "array"
        element = _build(types, elem, typmod)
    elif kind == "domain":
        base = _build(types, basetype, typtypmod)
    return PgType(oid=oid_, schema=schema, name=name, kind=kind, category=category, typmod=typmod,
                  element=element, base=base, labels=labels)
