"""What the tests that set a database up as README's "Capture your own database" says share: its removal."""

from __future__ import annotations

import os

from psycopg2 import sql

from lib import config
from lib.operate import teardown


def remove(root, conf: dict, database: str, roles: list[str], passwords: dict) -> None:
    """Drop the database and the roles (root: a superuser connection), the pipeline's topics, the password variables."""
    with root.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
        for role in roles:
            cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
    root.close()
    teardown.delete_prefix(conf, config.get(conf, "kafka.topic_prefix"))
    for name in passwords:
        os.environ.pop(name, None)
