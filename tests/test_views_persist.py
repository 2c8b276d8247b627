"""Masking views persist in the local Hive metastore: built by one Spark driver, queried by the next.

Each step runs in its own Python process (one Spark driver each, the way notebook 05 runs in its
own kernel), against a metastore and lake of its own under tmp: the shared one stays free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from lib import config, spark
from lib.views import masking

SALT_ENV = "CDC_TEST_PERSIST_SALT"
TABLE = "bank.customers"
SILVER_DDL = ("customer_id long, email string, city string, _commit_lsn long, _event_serial long, _op string, "
              "_deleted boolean, _deleted_at timestamp, _updated_at timestamp")
ROW = "struct<customer_id:long,email:string,city:string>"
BRONZE_DDL = (f"key struct<customer_id:long>, op string, before {ROW}, after {ROW}, "
              "source struct<ts_ms:long,txId:long,commit_lsn:long,event_serial:long,snapshot:string>, "
              "unchanged_cols array<string>, _tombstone boolean, _kafka_offset long, _batch_id long")

# First driver: silver and the bronze log as the merge leaves them, then the views.
BUILD = """
import json, sys
sys.path.insert(0, "tests")
import bronze_rows
from lib import spark as spark_lib
from lib.lake import lake_paths
from lib.views import masking
job = json.load(sys.stdin)
conf, table = job["conf"], job["table"]
session = spark_lib.from_conf(conf)
silver = masking.lake_path(conf, "silver", table)
session.createDataFrame([tuple(row) for row in job["silver"]], job["silver_ddl"]).write.format("delta").save(silver)
session.sql(f"ALTER TABLE delta.`{silver}` SET TBLPROPERTIES ('cdc.key' = 'customer_id')")
bronze_rows.append(session.createDataFrame([tuple(row) for row in job["bronze"]], job["bronze_ddl"]), table,
                   lake_paths.bronze_path(conf), 0)
results = masking.create_views(conf, session, job["policy"], tables=[table])
print(json.dumps({"results": results}, default=str))
"""

# Second driver: what the metastore kept, then rebuilds (same policy, changed policy, changed schema).
REOPEN = """
import json, sys
from lib import spark as spark_lib
from lib.views import masking
job = json.load(sys.stdin)
conf, table, policy = job["conf"], job["table"], job["policy"]
session = spark_lib.from_conf(conf)
db = policy["database"]
private = policy.get("privileged_database") or masking.DEFAULT_PRIVILEGED_DATABASE


def rows(view):
    frame = session.table((private if view.endswith("_full") else db) + "." + view)
    return [r.asDict() for r in frame.orderBy(frame.columns[0]).collect()]


def text(view):
    described = session.sql(f"DESCRIBE TABLE EXTENDED {db}.{view}").collect()
    return [r["data_type"] for r in described if r["col_name"] == "View Text"][0]


out = {"catalog": session.conf.get("spark.sql.catalogImplementation"),
       "listed": sorted(t.name for t in session.catalog.listTables(db)),
       "listed_private": sorted(t.name for t in session.catalog.listTables(private)),
       "kept": {view: rows(view) for view in ("customers_clean", "customers_full", "customers_history")},
       "text": text("customers_clean")}
out["again"] = masking.create_views(conf, session, policy, tables=[table])
out["again_rows"], out["again_text"] = rows("customers_clean"), text("customers_clean")
masking.create_views(conf, session, job["policy_redact"], tables=[table])
out["redacted"] = rows("customers_clean")
extra = session.createDataFrame([tuple(row) for row in job["silver_phone"]], job["silver_phone_ddl"])
extra.write.format("delta").mode("append").option("mergeSchema", "true").save(masking.lake_path(conf, "silver", table))
masking.create_views(conf, session, job["policy_redact"], tables=[table])
out["new_column_default"] = {"clean": rows("customers_clean"), "full": rows("customers_full")}
masking.create_views(conf, session, job["policy_phone"], tables=[table])
out["new_column_listed"] = rows("customers_clean")
print(json.dumps(out, default=str))
"""


def source(lsn: int, snapshot: str) -> list:
    """A bronze event's source struct: ts_ms, txId, commit_lsn, event_serial, snapshot."""
    return [0, 7, lsn, 0, snapshot]


def masking_hash(salt: str, text: str) -> str:
    """The hash rule's value for text under salt."""
    return hashlib.sha256((masking.derive_key(salt) + text).encode()).hexdigest()


def run_driver(script: str, job: dict, salt: str) -> dict:
    """Run one Spark driver in a fresh Python process; its last stdout line is JSON."""
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(job), capture_output=True, text=True,
                          cwd=config.PROJECT_ROOT, env={**os.environ, SALT_ENV: salt}, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def drivers(conf, tmp_path_factory):
    """Build the views in one driver, reopen and rebuild them in a second one."""
    folder = tmp_path_factory.mktemp("views_persist")
    test_conf = spark.with_metastore(conf, str(folder / "metastore"))
    test_conf["lake"] = {"root": str(folder / "lake")}
    test_conf["spark"]["settings"]["spark.sql.shuffle.partitions"] = "1"
    # these drivers stand for a user's: Spark's own code generation (the tests' interpreted projections fail
    # catalog.listTables in Spark 4.1 with EXPRESSION_DECODING_FAILED for its Table rows; tests/conftest.py)
    options = test_conf["spark"].get("driver_java_options") or ""
    test_conf["spark"]["driver_java_options"] = re.sub(r"\s*-Dspark\.sql\.codegen\.factoryMode=\S+", "", options)
    policy = {"database": "persist_views", "key_table": "persist_private.masking_key", "default": "drop",
              "salt": {"env": SALT_ENV}, "tables": {TABLE: {"customer_id": "keep", "email": "partial", "city": "hash"}}}
    redact = json.loads(json.dumps(policy))
    redact["tables"][TABLE]["email"] = "redact"
    phone = json.loads(json.dumps(redact))
    phone["tables"][TABLE]["phone"] = "partial"
    live, gone = [1, "ann@example.com", "Springfield"], [2, "bob@example.org", "Shelbyville"]
    job = {
        "conf": test_conf, "table": TABLE, "policy": policy, "policy_redact": redact, "policy_phone": phone,
        "silver_ddl": SILVER_DDL, "silver": [live + [100, -1, "r", False, None, None],
                                             gone + [120, 0, "d", True, None, None]],
        "bronze_ddl": BRONZE_DDL, "bronze": [[[1], "r", None, live, source(100, "true"), [], False, 0, 0],
                                             [[2], "c", None, gone, source(110, "false"), [], False, 1, 0],
                                             [[2], "d", gone, None, source(120, "false"), [], False, 2, 0],
                                             [[2], None, None, None, None, None, True, 3, 0]],
        "silver_phone_ddl": SILVER_DDL + ", phone string",
        "silver_phone": [[3, "cy@example.net", "Ogdenville", 130, 0, "c", False, None, None, "+1-555-0100-1234"]],
    }
    salt = "persist-" + os.urandom(8).hex()
    built = run_driver(BUILD, job, salt)
    reopened = run_driver(REOPEN, job, salt)
    return {"built": built, "reopened": reopened, "salt": salt, "metastore": folder / "metastore"}


def test_views_outlive_the_driver_that_built_them(drivers):
    built, reopened = drivers["built"]["results"], drivers["reopened"]
    assert all(r["persistent"] for r in built if r["kind"] != "key")
    assert [r["status"] for r in built] == ["written"] + ["created"] * 5
    assert reopened["catalog"] == "hive"
    # the analysts' schema: masked views only
    assert reopened["listed"] == ["customers_clean", "customers_fresh", "customers_history", "customers_scd2"]
    assert "customers_full" in reopened["listed_private"]
    kept = reopened["kept"]
    assert kept["customers_clean"] == [{"customer_id": 1, "email": "***@example.com",
                                        "city": masking_hash(drivers["salt"], "Springfield"), "_updated_at": None}]
    assert [r["customer_id"] for r in kept["customers_full"]] == [1]
    assert sorted(r["op"] for r in kept["customers_history"]) == ["c", "d", "r"]
    assert (drivers["metastore"] / "metastore_db").is_dir() and (drivers["metastore"] / "derby.log").is_file()


def test_rebuilding_with_the_same_policy_changes_nothing(drivers):
    reopened = drivers["reopened"]
    assert [r["status"] for r in reopened["again"]] == ["unchanged"] + ["created"] * 5
    assert reopened["again_text"] == reopened["text"]
    assert reopened["again_rows"] == reopened["kept"]["customers_clean"]


def test_a_policy_change_and_a_schema_change_rebuild_the_views(drivers):
    reopened = drivers["reopened"]
    assert [r["email"] for r in reopened["redacted"]] == [masking.REDACTED]
    default = reopened["new_column_default"]
    assert "phone" not in default["clean"][0] and default["full"][-1]["phone"] == "+1-555-0100-1234"
    assert [r["customer_id"] for r in default["clean"]] == [1, 3]
    assert [r.get("phone") for r in reopened["new_column_listed"]] == [None, "***1234"]

