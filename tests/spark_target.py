"""Test helper, run as a script in a process of its own: the session a target's conf gives, described as JSON.

    python tests/spark_target.py <target> <folder for a Delta table>

CDC__ overrides in the environment apply, as for any target.
"""

from __future__ import annotations

import json
import sys

from lib import config
from lib import spark as spark_lib


def describe(target: str, folder: str) -> dict:
    """What from_conf gave: remote or not, the master, executors, where the workers import lib from, a Delta round."""
    conf = config.load(target)
    spark = spark_lib.from_conf(conf)
    remote = spark_lib.is_remote(spark)
    facts = {"remote": remote, "master": spark.conf.get("spark.master"),
             "workers_lib": spark_lib.ship_project(spark),
             "delta_rows": delta_round(spark, f"{folder}/t"), "unreachable": unreachable(spark)}
    if not remote:
        facts["executors"] = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
    spark.stop()
    return facts


def unreachable(spark) -> str:
    """What the workers' reach check says about an address nothing listens at (from_conf checked conf's already)."""
    try:
        spark_lib.check_reach(spark, {"kafka.bootstrap_servers": ["127.0.0.1:9"]}, timeout_s=2)
    except spark_lib.TargetError as exc:
        return str(exc)
    return "no error"


def delta_round(spark, path: str) -> int:
    """Create, fill and count a Delta table through SQL (what runs on a Connect server too)."""
    spark.sql(f"CREATE TABLE delta.`{path}` (id bigint) USING delta")
    spark.sql(f"INSERT INTO delta.`{path}` SELECT id FROM range(1000)")
    return spark.sql(f"SELECT count(*) FROM delta.`{path}`").collect()[0][0]


if __name__ == "__main__":
    print("TARGET " + json.dumps(describe(sys.argv[1], sys.argv[2])))
