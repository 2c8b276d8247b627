"""Test helper, run as a script in a process of its own: the whole pipeline on a target (issue 29).

    python tests/pipeline_on_target.py <target>

The five notebooks as a job (``continuous``, ``demo`` and the sample ``workload`` off, as the bundle's job runs
them), then a write load on the sample bank (the workload's inserts, updates and deletes, and a primary key change),
the capture and the merge caught up, and every table reconciled, silver and the fresh view; then the continuous merge
service (its bronze query and silver cadence) while a second load arrives, until monitor says caught up, and
reconcile again. Prints what it found as JSON, then tears the pipeline down (slot, publication, topics, subjects).
CDC__ overrides in the environment apply, as for any target.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid

from lib import config, source
from lib import spark as spark_lib
from lib.capture import stream
from lib.lake import merge, reconcile
from lib.local import workload
from lib.operate import jobs, monitor, teardown, workers
from lib.views import masking


def write_load(conf: dict, tag: str) -> dict:
    """The workload's business transactions, then a branch inserted and its primary key changed."""
    conn = source.connect(conf, admin=True)
    try:
        done = workload.run(conn, rate=float("inf"), count=80, seed=29)
        code = f"E2E-{tag}"
        with conn.cursor() as cur:
            cur.execute("INSERT INTO bank.branches VALUES (%s, 'Key change', 'Chicago', 'Midwest', NULL, "
                        "'2026-01-01')", (code,))
            conn.commit()
            cur.execute("UPDATE bank.branches SET branch_code = %s WHERE branch_code = %s", (f"{code}-K", code))
            conn.commit()
        return {"transactions": done["transactions"], "key_changed": f"{code} -> {code}-K"}
    finally:
        conn.close()


def continuous(conf: dict, spark) -> dict:
    """The merge service in a thread while a second load is captured, until the lake has caught up; then stopped."""
    stop, outcome = threading.Event(), {}

    def serve():
        try:
            outcome["totals"] = workers.run_merge(conf, spark, stop_event=stop,
                                                  log=lambda line: print(line, file=sys.stderr))
        except Exception as exc:  # noqa: BLE001 - reported in the result
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=serve, name="merge-service")
    thread.start()
    try:
        outcome["load"] = write_load(conf, uuid.uuid4().hex[:6])
        stream.run(conf, until="caught_up", heartbeat_s=0)
        outcome["caught_up_s"] = monitor.wait_until_caught_up(conf, timeout_s=600, spark=spark)["seconds"]
    finally:
        stop.set()
        thread.join(180)
    return outcome


def run(target: str) -> dict:
    """The job, the load, the catch-up and the checks on target; what each gave."""
    ran = jobs.run(target, parameters={"continuous": False, "demo": False, "workload": 0},  # as the bundle's job
                   log=lambda line: print(line, file=sys.stderr))
    facts = {"job": {r["notebook"]: r["ok"] if r["ok"] else r["error"] for r in ran}}
    if not all(r["ok"] for r in ran):
        return facts
    conf = config.load(target)
    facts["load"] = write_load(conf, uuid.uuid4().hex[:6])
    facts["stream"] = stream.run(conf, until="caught_up", heartbeat_s=0).get("events")
    spark = spark_lib.from_conf(conf)
    facts["remote"] = spark_lib.is_remote(spark)
    facts["master"] = spark.conf.get("spark.master")
    caught = merge.run_until_caught_up(conf, spark)
    facts["merge"] = {"batches": caught["batches"], "silver_tables": caught["silver_tables"]}
    facts["silver"] = {r["table"]: [r["equal"], r["source_rows"]] for r in reconcile.reconcile(conf, spark)}
    tag = uuid.uuid4().hex[:6]  # views that keep every column, so that they compare with the source
    keep = {"database": f"e2e_v_{tag}", "privileged_database": f"e2e_p_{tag}", "default": "keep"}
    masking.create_views(conf, spark, keep)
    fresh = {table: spark.table(masking.view(conf, table, "fresh", keep)) for table in facts["silver"]}
    facts["fresh"] = {r["table"]: r["equal"] for r in reconcile.reconcile(conf, spark, against=fresh)}
    facts["service"] = continuous(conf, spark)
    facts["after_service"] = {r["table"]: r["equal"] for r in reconcile.reconcile(conf, spark)}
    facts["one_run"] = one_query_per_checkpoint(conf, spark)
    facts["drift"] = drift(conf, spark)
    return facts


def one_query_per_checkpoint(conf: dict, spark) -> dict:
    """The merge query started again from a second session while the first runs (a service restarted while its
    query still ran on the server): Spark stops the first run, and stopping the second leaves no run behind."""
    from pyspark.sql import SparkSession

    other = SparkSession.builder.remote(config.get(conf, "spark.remote")).create() if spark_lib.is_remote(spark) \
        else spark.newSession()
    first = merge.start(conf, spark, "processing_time", "2 seconds")
    second = merge.start(conf, other, "processing_time", "2 seconds")
    found = {"first_active": first.isActive, "second_active": second.isActive, "name": merge.query_name(conf),
             "active": sorted(q.name for q in other.streams.active)}
    second.stop()
    found["after_stop"] = sorted(q.name for session in (spark, other) for q in session.streams.active)
    _KEPT.append(other)  # never collected while this process runs: see _KEPT
    return found


# Sessions kept to the end of the process. pyspark 4.1.1's Connect client shuts down one thread pool shared by every
# session when a session is stopped or collected (SparkSession.__del__ -> client.close); collected in the middle of
# another session's call, it deadlocks that call (seen twice here, in reconcile's collect after this test's session
# went out of scope).
_KEPT: list = []


def drift(conf: dict, spark) -> list[dict]:
    """One value changed at the source behind the pipeline's back: what reconcile says about it."""
    conn = source.connect(conf, admin=True)
    try:
        with conn.cursor() as cur:
            cur.execute("UPDATE bank.branches SET city = city || ' (moved)' WHERE branch_code = "
                        "(SELECT min(branch_code) FROM bank.branches) RETURNING branch_code")
            code = cur.fetchone()[0]
        conn.commit()
    finally:
        conn.close()
    return [{"expected": code}] + reconcile.reconcile(conf, spark, tables=["bank.branches"])[0]["differences"]


if __name__ == "__main__":
    name = sys.argv[1]
    try:
        print("PIPELINE " + json.dumps(run(name), default=str))
    finally:
        teardown.run(config.load(name), topics=True, confirm=True, log=lambda line: print(line, file=sys.stderr))
