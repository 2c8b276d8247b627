"""The analyst question "what changed in this table today, and who changed it", from the masked views only.

The WAL carries no user name. "Who" is the table's own actor column (views.actors names it per table,
else the first of views.actor_columns the table has), as the policy masks it; without one visible in
the history view it is the transaction id.
"""

from __future__ import annotations

from lib import config
from lib.capture import catalog
from lib.lake import lake_paths, silver_table
from lib.views import masking


def actor(conf: dict, table: str, history_columns: list[str]) -> tuple[str | None, str]:
    """(the history view's column that says who changed a row, or None; one sentence on where "who" comes from)."""
    name = catalog.qualified(table)
    explicit = (config.get(conf, "views.actors") or {}).get(name)
    candidates = [explicit] if explicit else list(config.get(conf, "views.actor_columns"))
    policy = masking.load_policy(conf)
    for column in candidates:
        if f"after_{column}" in history_columns:
            rule = masking.rule_for(policy, name, column)
            return f"after_{column}", f"who: column {column} of {name}, as the masking policy shows it ({rule})"
    if explicit:
        return None, (f"who: the transaction id, because views.actors names {explicit} for {name} and the "
                      f"history view does not show it (missing, or dropped by the masking policy)")
    return None, (f"who: the transaction id, because {name} has no actor column the history view shows "
                  f"({', '.join(candidates)}; name one with views.actors)")


def today(conf: dict, spark, table: str, limit: int = 20):
    """The newest changes of today in a table's history view (no snapshot reads): when, what, which
    transaction, who, and the key where the policy shows it."""
    view = masking.view(conf, table, "history")
    columns = spark.table(view).columns
    who, _ = actor(conf, table, columns)
    spec = lake_paths.table_spec(conf, catalog.qualified(table))
    keys = [k for k in silver_table.key_columns(conf, spark, spec) if f"after_{k}" in columns]
    shown = ", ".join(f"coalesce({masking.quote('after_' + k)}, {masking.quote('before_' + k)}) AS {masking.quote(k)}"
                      for k in keys)
    return spark.sql(
        f"SELECT commit_ts, op, tx_id, {f'`{who}`' if who else 'CAST(tx_id AS STRING)'} AS who"
        f"{', ' + shown if shown else ''} FROM {masking.quote_name(view)} "
        f"WHERE commit_ts >= current_date() AND op <> 'r' ORDER BY commit_lsn DESC, event_serial DESC LIMIT {limit}")
