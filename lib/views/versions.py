"""Views that order a key's events by source position: every version of a row (SCD type 2) and the fresh
view (silver plus the events the merge has not applied yet). Masked like the clean view (lib/views/policy.py).
"""

from __future__ import annotations

from lib.lake.lake_paths import quote
from lib.views.policy import (
    MaskingError,
    bronze_columns,
    data_fields,
    field_at,
    key_join,
    mask_expr,
    require_deleted,
    rule_for,
    sql_string,
    type_kind,
)


def carried(column: str, datatype, ref: str, unchanged: str, window: str) -> str:
    """A row's value of column in a key's events in position order: a TOASTable value PostgreSQL did not resend
    (column listed in the unchanged array) is taken from the newest event before that had it."""
    if type_kind(datatype) not in ("string", "binary", "complex"):
        return ref
    return (f"last(CASE WHEN array_contains({unchanged}, {sql_string(column)}) THEN NULL ELSE named_struct('v', {ref}) "
            f"END, true) OVER ({window} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW).`v`")


def scd2_select(table: str, schema, policy: dict, source: str, key_table: str) -> tuple[str, list[str]]:
    """SELECT of the SCD type 2 view over bronze: one row per version of a key (c, u, r events; a duplicate
    delivery counted once), valid from its commit until the key's next event, masked like the clean view.
    The version's own columns (op, tx_id, commit_lsn, event_serial, valid_from, valid_to, is_current) get a
    leading _ where the table has a column of that name."""
    columns = bronze_columns(schema)
    if columns is None or field_at(schema, ("key",)) is None or field_at(schema, ("source", "commit_lsn")) is None:
        raise MaskingError(f"bronze table of {table} lacks key, after or source.commit_lsn; it does not follow "
                           f"the bronze layout")
    order = "PARTITION BY `e`.`__key` ORDER BY `e`.`__lsn`, `e`.`__serial`"
    values, items, names = [], [], []
    for column, datatype in columns.items():
        value = carried(column, datatype, f"`e`.`__after`.{quote(column)}", "`e`.`__unchanged`", order)
        values.append(f"{value} AS {quote(column)}")
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
              f"FROM {source} AS `b` WHERE `b`.`op` IS NOT NULL AND `b`.`op` <> 't'")
    versions = (f"SELECT `e`.`__op`, `e`.`__tx`, `e`.`__lsn`, `e`.`__serial`, `e`.`__ts`, "
                f"lead(`e`.`__ts`) OVER ({order}) AS `__to`, {', '.join(values)} "
                f"FROM ({events}) AS `e` WHERE `e`.`__copy` = 1")
    join = key_join(items, key_table)
    return f"SELECT {', '.join(items)} FROM ({versions}) AS `v`{join} WHERE `v`.`__op` <> 'd'", names


def fresh_select(table: str, silver, bronze, policy: dict, silver_source: str, bronze_source: str,
                 key_table: str) -> tuple[str, list[str]]:
    """SELECT of the fresh view: silver's rows plus the bronze log's events silver has not applied yet, the newest
    per key by source position (kept as _commit_lsn, _event_serial), deleted keys hidden, masked like the clean
    view.

    Silver records with every row the bronze log commit it was brought up to (_bronze_seq), and a silver
    step applies every event of the log up to that commit: so the events it may lack are those of later log
    commits (with a few it applied, which rank below silver's own rows). A truncate among them hides every
    older row.
    """
    key = field_at(bronze, ("key",))
    if key is None or field_at(bronze, ("_seq",)) is None or field_at(bronze, ("source", "commit_lsn")) is None:
        raise MaskingError(f"bronze log rows of {table} lack key, _seq or source.commit_lsn; they do not follow "
                           f"the bronze layout (lib/lake/bronze_log.py)")
    require_deleted(silver, table)
    keys = key.dataType.fieldNames()
    data = data_fields(silver)
    after = bronze_columns(bronze) or {}
    from_silver, from_bronze = [], []
    for field in data:
        from_silver.append(f"`s`.{quote(field.name)} AS {quote(field.name)}")
        if field.name in keys:
            ref = f"`b`.`key`.{quote(field.name)}"
        elif field.name in after:
            ref = f"`b`.`after`.{quote(field.name)}"
        else:
            ref = f"CAST(NULL AS {field.dataType.simpleString()})"
        from_bronze.append(f"{ref} AS {quote(field.name)}")
    applied = (f"(SELECT coalesce(max(`_bronze_seq`), -1) FROM {silver_source})"
               if "_bronze_seq" in silver.fieldNames() else "-1")  # a silver table older than the bronze log: all
    truncated = (f"(SELECT max(named_struct('l', `t`.`source`.`commit_lsn`, 's', `t`.`source`.`event_serial`)) "
                 f"FROM {bronze_source} AS `t` WHERE `t`.`op` = 't' AND `t`.`_seq` > {applied})")
    rows = (f"SELECT {', '.join(from_silver)}, `s`.`_commit_lsn` AS `__lsn`, `s`.`_event_serial` AS `__serial`, "
            f"coalesce(`s`.`_deleted`, false) AS `__deleted`, CAST(array() AS array<string>) AS `__unchanged`, "
            f"0 AS `__from` FROM {silver_source} AS `s` "
            f"UNION ALL SELECT {', '.join(from_bronze)}, `b`.`source`.`commit_lsn`, `b`.`source`.`event_serial`, "
            f"`b`.`op` = 'd', coalesce(`b`.`unchanged_cols`, array()), 1 FROM {bronze_source} AS `b` "
            f"WHERE `b`.`op` IS NOT NULL AND `b`.`op` <> 't' AND `b`.`_seq` > {applied}")
    by_key = ", ".join(f"`u`.{quote(k)}" for k in keys)
    ascending = f"PARTITION BY {by_key} ORDER BY `u`.`__lsn`, `u`.`__serial`, `u`.`__from`"
    values = []
    for field in data:
        ref = f"`u`.{quote(field.name)}"
        value = ref if field.name in keys else carried(field.name, field.dataType, ref, "`u`.`__unchanged`", ascending)
        values.append(f"{value} AS {quote(field.name)}")
    ranked = (f"SELECT {', '.join(values)}, `u`.`__lsn`, `u`.`__serial`, `u`.`__deleted`, "
              f"row_number() OVER (PARTITION BY {by_key} ORDER BY `u`.`__lsn` DESC, `u`.`__serial` DESC, "
              f"`u`.`__from` DESC) AS `__rank` FROM ({rows}) AS `u`")
    items, names = [], []
    for field in data:
        expr = mask_expr(rule_for(policy, table, field.name), f"`f`.{quote(field.name)}", field.dataType,
                         f"masking.tables.{table}.{field.name}")
        if expr is not None:
            items.append(f"{expr} AS {quote(field.name)}")
            names.append(field.name)
    items += ["`f`.`__lsn` AS `_commit_lsn`", "`f`.`__serial` AS `_event_serial`"]  # the row's newest position
    names += ["_commit_lsn", "_event_serial"]
    join = key_join(items, key_table)
    newer = f"coalesce(named_struct('l', `f`.`__lsn`, 's', `f`.`__serial`) > {truncated}, true)"
    return (f"SELECT {', '.join(items)} FROM ({ranked}) AS `f`{join} WHERE `f`.`__rank` = 1 AND NOT `f`.`__deleted` "
            f"AND {newer}", names)
