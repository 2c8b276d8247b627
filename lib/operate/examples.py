"""What the notebooks' teaching cells show: an example table from the conf, and demo writes only on the sample.

The notebooks run on a user's own database as well as on the local sample bank. Their teaching cells
take the table they show from `example_table` (a notebook parameter), and their demo rows and sample
workload go only into the local stack's own sample database, which `make sample` marks with a comment
on schema bank. A user's database never carries that mark, so no parameter can make the notebooks
write into it.
"""

from __future__ import annotations

from lib import config, source
from lib.capture import catalog

SAMPLE_TABLE = "bank.customers"  # the example when the sample bank is configured
DEMO_TABLE = "bank.branches"  # where notebooks 03 and 04 write their demo rows
SAMPLE_SCHEMA = "bank"
SAMPLE_MARK = "cdc-pipeline local sample bank: notebooks may write demo rows here"  # COMMENT ON SCHEMA bank


def configured(conf: dict) -> list[str]:
    """source.tables as schema.table, in conf order."""
    return [catalog.qualified(entry) for entry in config.get(conf, "source.tables")]


def example_table(conf: dict, requested: str | None = None) -> str:
    """The table teaching cells show: requested when given, else bank.customers when configured, else the first."""
    tables = configured(conf)
    if not tables:
        raise config.ConfigError(f"source.tables is empty in {conf.get('conf_file', 'the configuration')}: "
                                 f"list the tables to capture")
    if requested:
        name = catalog.qualified(requested)
        if name not in tables:
            raise config.ConfigError(f"example_table {requested!r} is not in source.tables of "
                                     f"{conf.get('conf_file', 'the configuration')} ({', '.join(tables)}); "
                                     f"pass one of them, or leave it empty for the default")
        return name
    return SAMPLE_TABLE if SAMPLE_TABLE in tables else tables[0]


def sample_configured(conf: dict) -> bool:
    """True when the conf captures the sample bank (its exercises then apply)."""
    return SAMPLE_TABLE in configured(conf)


def sample_marked(conf: dict) -> bool:
    """True when the source database holds schema bank with the mark `make sample` leaves on it."""
    conn = source.connect(conf)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s",
                        (SAMPLE_SCHEMA,))
            row = cur.fetchone()
    finally:
        conn.close()
    return row is not None and row[0] == SAMPLE_MARK


def demo_writes(conf: dict, wanted: bool) -> tuple[bool, str]:
    """(allowed, why): demo rows and the sample workload are written only into the local sample database."""
    if not wanted:
        return False, "demo=False: nothing is written at the source"
    if DEMO_TABLE not in configured(conf):
        return False, (f"demo writes skipped: {DEMO_TABLE} is not in source.tables, so this is not the sample "
                       f"bank; the notebooks only read your database, they never write into it")
    if not sample_marked(conf):
        return False, (f"demo writes skipped: schema {SAMPLE_SCHEMA} of database {config.get(conf, 'source.database')} "
                       f"does not carry the mark of the local stack's sample (`make sample`); the notebooks only "
                       f"read a database they did not create")
    return True, f"demo writes on: the local stack's sample database ({config.get(conf, 'source.database')})"
