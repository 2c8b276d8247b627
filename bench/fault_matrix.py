"""Failure matrix: faults injected into the local stack under a running write load, each case proven exact.

    .venv/bin/python bench/fault_matrix.py [--cases kafka_kill,postgres_restart] [--cycles N] [--no-doc]

A pipeline of its own (bench/bench_env.py) over three of the bank's tables: notebook 01 and 02 through lib, then
continuous mode. Per case lib.local.workload writes, the fault comes and goes, capture and merge catch up, and the
case is exact only when lib.lake.reconcile is exact for every table, bronze holds every (topic, partition, offset)
of the table topics exactly once, and no keeper gave up (keeper.state is polled throughout; where a dependency was
down, its keeper must have waited). What each case does and proves, and the results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_env  # noqa: E402

from lib import config, source  # noqa: E402
from lib.capture import bootstrap, snapshot  # noqa: E402
from lib.lake import lake_paths, reconcile  # noqa: E402
from lib.local import stack  # noqa: E402
from lib.local.stack import kafka, kafka_brokers, postgres, process, registry  # noqa: E402
from lib.local.stack.links import Link  # noqa: E402
from lib.operate import keeper, metrics, monitor, service, tables  # noqa: E402
from lib.operate.process import tree  # noqa: E402

TABLES = ["bank.customers", "bank.account_holders", "bank.transactions"]
SERVICES = ("capture", "merge")
RATE = 8.0  # workload business transactions per second
KAFKA_DOWN_S = 45.0  # how long kafka_kill keeps the broker down (at least: until both keepers wait for it)
CHILDREN_KILLED_AFTER_S = 10.0  # how far into the broker's outage kafka_kill kills capture and merge
LAKE_FS_SIZE = "64m"  # disk_full's lake filesystem
BROKERS_DOWN_S = 60.0  # how long brokers keeps two of its three brokers down
KAFKA_STALL_S = 75.0  # stall_kafka: past the capture's delivery timeout (DELIVERY_TIMEOUT_MS), Kafka's timeouts
POSTGRES_STALL_S = 120.0  # stall_postgres: past wal_sender_timeout (60 s) and source.stall_timeout_s (60 s)
REGISTRY_STALL_S = 60.0  # stall_registry: past the registry client's timeout (30 s)
LINK_CASES = ("stall_kafka", "stall_kafka_merge", "stall_postgres", "stall_registry",
              "drop_links")  # on a pipeline behind links
DELIVERY_TIMEOUT_MS = 30_000  # brokers: the capture's delivery timeout (kafka.producer message.timeout.ms)
DOC = bench_env.REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


quiet = lambda *_args, **_kwargs: None  # noqa: E731 - a log that drops lines


# the pipeline


def make_pipeline(folder: str, lake_root: str | None = None, overrides: dict | None = None) -> dict:
    """conf of a new bench database over TABLES, lake and service folder under folder, fast service cadence.
    ``overrides``: settings on top (e.g. a broker of the pipeline's own: kafka.bootstrap_servers, stack.dir)."""
    extra = {"CDC__LAKE__ROOT": lake_root or os.path.join(folder, "lake"),
             "CDC__SERVICE__DIR": os.path.join(folder, "services"), "CDC__KAFKA__PARTITIONS": "2",
             "CDC__SERVICE__MERGE_INTERVAL": "2 seconds", "CDC__SERVICE__METRICS_INTERVAL_S": "2",
             "CDC__SERVICE__HEARTBEAT_S": "2", "CDC__SERVICE__RESTART_BACKOFF_S": "1",
             "CDC__SPARK__APP_NAME": "cdc-fault-matrix", **(overrides or {})}
    return bench_env.isolated(TABLES, extra)


def start_pipeline(conf: dict, spark, log=print) -> None:
    """Notebook 01 and 02 through lib, then continuous mode; returns once both services record metrics."""
    bootstrap.run(conf, log=quiet)
    snapshot.run(conf, spark, log=quiet)
    service.start(conf, log=quiet)
    bench_env.wait_for(lambda: metrics.latest(conf, "merge") and metrics.latest(conf, "capture"), 900,
                       "both services to record metrics after service.start")
    log(f"pipeline  database {config.get(conf, 'source.database')}, topics {conf['bench_prefix']}*, lake "
        f"{config.get(conf, 'lake.root')}: capture and merge running")


def stop_pipeline(conf: dict, folder: str, log=print) -> None:
    """Stop the services, drop the database, slot, topics and subjects, remove folder."""
    with contextlib.suppress(Exception):
        service.stop(conf, timeout=60, log=quiet)
    bench_env.finish(conf, folder, log=log)


# load and observation


def watch_keepers(conf: dict):
    """Poll keeper.state of both services every 0.5 s in a thread; returns stop() -> {service: {'states': the states
    seen in order, 'waiting': what a waiting keeper said first, or None, 'said': what the running service's metrics
    record said it waits for first (make status shows it), or None}}."""
    seen = {name: {"states": [], "waiting": None, "said": None} for name in SERVICES}
    stopping = threading.Event()

    def run() -> None:
        while not stopping.is_set():
            for name in SERVICES:
                row, w = keeper.state(conf, name), seen[name]
                if not w["states"] or w["states"][-1] != row["state"]:
                    w["states"].append(row["state"])
                if row["state"] == "waiting":
                    w["waiting"] = w["waiting"] or row["last_line"]
                said = (metrics.latest(conf, name) or {}).get("waiting_for") if row["state"] == "running" else None
                w["said"] = w["said"] or (said and said.split(", for ")[0])
            stopping.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return lambda: (stopping.set(), thread.join(10), seen)[-1]


def give_ups(conf: dict) -> dict[str, int]:
    """Times each keeper gave up so far, from its log (our own stop() can show as 'crashed' for a moment)."""
    logs = {name: keeper.files(conf, name)["log"] for name in SERVICES}
    return {name: path.read_text().count(", giving up;") if path.exists() else 0 for name, path in logs.items()}


def describe_watch(watched: dict) -> str:
    """'capture running>waiting (waiting for Kafka at ... since ...)>running; merge running'."""
    parts = []
    for name, w in watched.items():
        text = f"{name} {'>'.join(w['states'])}"
        text += f" ('{_reason(w['waiting'])}')" if w["waiting"] else ""
        parts.append(text + (f", said it waits for '{w['said']}'" if w.get("said") else ""))
    return "; ".join(parts)


def _reason(waiting: str) -> str:
    """What a keeper said it waits for, without the time: the dependency, and which partition when Kafka answers
    but cannot take the pipeline's writes."""
    text = waiting.split(" since ")[0]
    return text if "partition" in text else text.split(" (")[0]


def running_since(conf: dict, since: datetime) -> bool:
    """Both keepers run a child and both services recorded metrics after since (they work again)."""
    rows = [(keeper.state(conf, n), metrics.latest(conf, n)) for n in SERVICES]
    return all(r["state"] == "running" and r["child"] and m and datetime.fromisoformat(m["ts"]) > since
               for r, m in rows)


def wait_running(conf: dict, since: datetime | None = None, timeout_s: float = 600) -> None:
    """Until both services run and report again after since (default: now)."""
    since = since or datetime.now(timezone.utc)
    bench_env.wait_for(lambda: running_since(conf, since), timeout_s, "capture and merge to run and report again")


# faults on the stack (through lib.local.stack's modules, on the pid files of the conf's stack)


def kill_recorded(name: str, pid_file: Path) -> int:
    """kill -9 the process in a stack pid file, wait for it to go, remove the pid file; returns the pid."""
    pid = process.read_pid(pid_file)
    if not pid or not process.pid_alive(pid):
        raise RuntimeError(f"{name} is not running (pid file {pid_file})")
    process.kill_now(pid)
    pid_file.unlink(missing_ok=True)
    return pid


def start_again(conf: dict, module) -> None:
    """Start kafka or registry again through its stack module and wait until it answers."""
    folder = stack.stack_dir(conf)
    pid = module.start(conf, folder, log=quiet)
    where = module.files(folder)
    process.wait_ready(module.__name__.rsplit(".", 1)[-1], lambda: module.ready(conf),
                       float(config.get(conf, "stack.start_timeout_s")), where["log"], pid, where["pid"])
    if module is kafka:
        kafka.ensure_user(conf, folder)  # a restarted broker has lost its SCRAM credentials (docs/reliability.md)


def pg_ctl_stop(conf: dict, mode: str) -> None:
    """pg_ctl -m mode stop on the stack's cluster, as the postgres user (lib/local/stack/postgres.py)."""
    where = postgres.layout(stack.stack_dir(conf), conf)
    command = [str(postgres.bin_dir(conf) / "pg_ctl"), "-D", str(where["data"]), "-m", mode, "-w", "stop"]
    result = subprocess.run(postgres.as_server_user(command, conf), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pg_ctl -m {mode} stop failed: {result.stderr.strip()}")


def kill_child(conf: dict, name: str) -> int:
    """kill -9 a service's current child (not its keeper); returns its pid."""
    child = bench_env.wait_for(lambda: keeper.state(conf, name)["child"], 120, f"a running {name} child")
    os.kill(child, signal.SIGKILL)
    return child


def admin_sql(conf: dict, *statements: str) -> None:
    """Run statements as the admin role, autocommit."""
    conn = source.connect(conf, admin=True)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


# the cases: each injects its fault `cycles` times and returns time.monotonic() at the end of its last fault


def case_kafka_kill(ctx: dict, cycles: int, log) -> float:
    """kill -9 of the broker mid-stream, down 45 s (KAFKA_DOWN_S); 10 s in, capture and merge are killed (-9) as if the
    outage had crashed them (their keepers must wait for Kafka, not spend the restart budget); broker restarted."""
    conf = ctx["conf"]
    for cycle in range(cycles):
        pid = kill_recorded("kafka", kafka.files(stack.stack_dir(conf))["pid"])
        down_at = time.monotonic()
        time.sleep(CHILDREN_KILLED_AFTER_S)
        children = [kill_child(conf, name) for name in SERVICES]
        bench_env.wait_for(lambda: all(keeper.state(conf, n)["state"] == "waiting" for n in SERVICES), 120,
                           "both keepers to wait for Kafka", poll_s=0.2)
        time.sleep(max(0.0, KAFKA_DOWN_S - (time.monotonic() - down_at)))
        start_again(conf, kafka)
        ended = time.monotonic()
        log(f"  cycle {cycle + 1}: broker pid {pid} killed (-9), capture and merge pids {children} killed "
            f"{CHILDREN_KILLED_AFTER_S:.0f} s later, broker down {time.monotonic() - down_at:.0f} s, answers again")
        wait_running(conf)
    return ended


def case_postgres_restart(ctx: dict, cycles: int, log) -> float:
    """pg_ctl stop -m fast, then -m immediate (alternating), 10 s down, started again while the capture streams."""
    for cycle in range(cycles):
        mode = ("fast", "immediate")[cycle % 2]
        pg_ctl_stop(ctx["conf"], mode)
        time.sleep(10)
        postgres.start(ctx["conf"], stack.stack_dir(ctx["conf"]), log=quiet)
        ended = time.monotonic()
        log(f"  cycle {cycle + 1}: PostgreSQL stopped with -m {mode}, down 10 s, started again")
        wait_running(ctx["conf"])
    return ended


def case_registry_down(ctx: dict, cycles: int, log) -> float:
    """The registry stopped 60 s while ALTER TABLE ADD COLUMN and writes using it need a new schema version."""
    conf = ctx["conf"]
    for cycle in range(cycles):
        column = f"fault_note_{cycle + 1}"
        registry.stop(stack.stack_dir(conf), log=quiet)
        admin_sql(conf, f"ALTER TABLE bank.customers ADD COLUMN {column} text",
                  f"UPDATE bank.customers SET {column} = 'during the registry outage ' || customer_id "
                  f"WHERE customer_id % 3 = 0")
        time.sleep(60)
        start_again(conf, registry)
        ended = time.monotonic()
        admin_sql(conf, f"UPDATE bank.customers SET {column} = 'after the outage' WHERE customer_id % 3 = 1")
        log(f"  cycle {cycle + 1}: registry down 60 s while bank.customers gained {column} (written before and "
            f"after)")
        wait_running(conf)
    return ended


def case_kill_cycles(ctx: dict, cycles: int, log) -> float:
    """kill -9 of the capture and of the merge at random points, cycles times each."""
    conf, rng = ctx["conf"], random.Random(ctx["seed"])
    budget = int(config.get(conf, "service.max_restarts"))
    if cycles >= budget:  # deliberate kills, not a crash loop: a budget for them, the conf's again afterwards
        restart_services(conf, config.apply_overrides(conf, {"CDC__SERVICE__MAX_RESTARTS": str(2 * cycles)}))
        log(f"  service.max_restarts={2 * cycles} for {cycles} kills of each service")
    for cycle in range(cycles):
        for name in SERVICES:
            time.sleep(rng.uniform(1, 4))  # the 2 s trigger: sometimes mid-batch, sometimes between batches
            log(f"  cycle {cycle + 1}: {name} pid {kill_child(conf, name)} killed (-9)")
        ended = time.monotonic()
        wait_running(conf)
    if cycles >= budget:
        restart_services(conf, conf)
    return ended


def streaming(conf: dict, events: int, timeout_s: float = 120.0) -> None:
    """Wait until the capture has sent `events` more events than it had when asked (its metrics record)."""
    count = lambda: int((metrics.latest(conf, "capture") or {}).get("events") or 0)  # noqa: E731
    start = count()
    bench_env.wait_for(lambda: count() >= start + events, timeout_s, f"{events} more captured events", poll_s=0.5)


def restart_services(conf: dict, new: dict) -> None:
    """Stop both services, start them with the conf new, wait until they report."""
    service.stop(conf, log=quiet)
    service.start(new, log=quiet)
    wait_running(conf)


COPY_ROWS = ("INSERT INTO bank.transactions (transaction_id, account_id, card_id, kind, status, amount, currency, "
             "fx_rate, description, merchant, tags, counterparty, booked_at, local_time, value_date) SELECT "
             "gen_random_uuid(), account_id, card_id, kind, status, amount, currency, fx_rate, %s, merchant, tags, "
             "counterparty, booked_at, local_time, value_date FROM bank.transactions WHERE description NOT LIKE "
             "'long tx%%' LIMIT 1500")


def case_long_transaction(ctx: dict, cycles: int, log) -> float:
    """A transaction open across a capture kill -9 and restart (rows inserted, updated and deleted before and after),
    committed after; logical_decoding_work_mem=64kB, so the server streams it in progress (spooled by the capture)."""
    conf = ctx["conf"]
    admin_sql(conf, f"ALTER DATABASE {config.get(conf, 'source.database')} SET logical_decoding_work_mem = '64kB'")
    for cycle in range(cycles):
        conn, tag = source.connect(conf, admin=True), f"long tx {cycle + 1}"
        try:
            with conn.cursor() as cur:
                cur.execute(COPY_ROWS, (f"{tag} before",))
                cur.execute("UPDATE bank.transactions SET status = 'reversed' WHERE description = %s AND "
                            "amount < 0", (f"{tag} before",))
                time.sleep(3)
                pid = kill_child(conf, "capture")
                wait_running(conf)
                cur.execute(COPY_ROWS, (f"{tag} after",))
                cur.execute("DELETE FROM bank.transactions WHERE description LIKE %s AND amount > 100", (f"{tag}%",))
            conn.commit()
        finally:
            conn.close()
        ended = time.monotonic()
        log(f"  cycle {cycle + 1}: transaction of ~3,000 rows open across the kill of capture pid {pid} and its "
            f"restart, committed after")
    return ended


REKEYED = "bank.customers"
REMEDY = re.compile(r"primary key changed from .*kafka\.topics: \{bank\.customers: ([\w.-]+)\}")
SPARE = "00000000-0000-4000-8000-00000000f417"  # a key no generated row has (gen_random_uuid is random)


def key_change_round(conn) -> None:
    """On bank.transactions (nothing references its uuid key), three transactions: new keys for three rows; a swap
    of two rows' keys through SPARE; a key moved to SPARE, its row updated, and moved back."""
    move = "UPDATE bank.transactions SET transaction_id = %s WHERE transaction_id = %s"
    with conn.cursor() as cur:
        cur.execute("UPDATE bank.transactions SET transaction_id = gen_random_uuid() WHERE transaction_id IN "
                    "(SELECT transaction_id FROM bank.transactions ORDER BY random() LIMIT 3)")
        conn.commit()
        cur.execute("SELECT transaction_id::text FROM bank.transactions ORDER BY random() LIMIT 2")
        a, b = (r[0] for r in cur.fetchall())
        for new, old in ((SPARE, a), (a, b), (b, SPARE)):
            cur.execute(move, (new, old))
        conn.commit()
        cur.execute(move, (SPARE, a))
        cur.execute("UPDATE bank.transactions SET status = 'reversed' WHERE transaction_id = %s", (SPARE,))
        cur.execute(move, (a, SPARE))
        conn.commit()


def case_key_update(ctx: dict, cycles: int, log) -> float:
    """UPDATEs that change primary key values (new keys, swaps, changed and back) under load, 20 rounds a cycle."""
    conn = source.connect(ctx["conf"], admin=True)
    try:
        for cycle in range(cycles):
            for _ in range(20):
                key_change_round(conn)
                time.sleep(0.5)
            log(f"  cycle {cycle + 1}: 20 rounds of key changes on bank.transactions")
    finally:
        conn.close()
    return time.monotonic()


def case_rekey_ddl(ctx: dict, cycles: int, log) -> float:
    """Under load, bank.customers re-keyed by DDL (customer_id -> customer_uuid, back on the next cycle): the capture
    stops before the change with its remedy, which is applied as it says (a new topic under kafka.topics, then
    python -m lib.operate.tables rekey)."""
    conf = ctx["conf"]
    capture_log = keeper.files(conf, "capture")["log"]
    for cycle in range(cycles):
        key = ("customer_uuid", "customer_id")[cycle % 2]
        seen = capture_log.stat().st_size
        admin_sql(conf, f"ALTER TABLE bank.customers DROP CONSTRAINT customers_pkey CASCADE, ADD PRIMARY KEY ({key})")
        remedy = bench_env.wait_for(lambda s=seen: REMEDY.search(capture_log.read_bytes()[s:].decode(errors="replace")),
                                    300, "the capture to stop on the re-keyed table with its remedy")
        conf["kafka"]["topics"] = {**(conf["kafka"].get("topics") or {}), REKEYED: remedy.group(1)}
        tables.rekey_table(conf, REKEYED, log=quiet)
        log(f"  cycle {cycle + 1}: key -> ({key}); the capture stopped with the remedy, applied: "
            f"{REKEYED} now in topic {remedy.group(1)}")
    return time.monotonic()


def fill(folder: str) -> Path:
    """A file taking all free space of folder's filesystem; returns it."""
    filler = Path(folder, "filler")
    with open(filler, "wb", buffering=0) as handle:
        for chunk in (1 << 20, 4096, 512):  # until ENOSPC, then smaller pieces into what is left
            with contextlib.suppress(OSError):
                while True:
                    handle.write(bytes(chunk))
    return filler


def case_disk_full(ctx: dict, cycles: int, log) -> float:
    """The lake's own small tmpfs filled during merges for 40 s, then the space freed."""
    root = config.get(ctx["conf"], "lake.root")
    for cycle in range(cycles):
        filler = fill(root)
        time.sleep(40)
        left = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        filler.unlink()
        log(f"  cycle {cycle + 1}: lake filesystem full for 40 s ({left} bytes left at the end), then freed")
        wait_running(ctx["conf"])
    return time.monotonic()


def case_brokers(ctx: dict, cycles: int, log) -> float:
    """On three brokers (replication factor 3, min.insync.replicas 2): kill -9 the leader of the busiest table
    partition; 15 s after a new leader took over, kill -9 a second broker (the controller quorum is lost: nothing can
    be written), keep it down BROKERS_DOWN_S (past the capture's delivery timeout, 30 s here); both started again."""
    conf = ctx["conf"]
    names = [spec.topic for spec in lake_paths.table_specs(conf)]
    for cycle in range(cycles):
        busiest, leader = kafka_brokers.busiest_partition(conf, names)
        kafka_brokers.kill(conf, leader)
        elected_s = kafka_brokers.wait_new_leader(conf, busiest, leader)
        time.sleep(15)
        second = next(n for n in kafka_brokers.NODES if n != leader)
        kafka_brokers.kill(conf, second)
        down_at = time.monotonic()
        bench_env.wait_for(lambda: keeper.state(conf, "capture")["state"] == "waiting", 300,
                           "the capture's keeper to wait for Kafka", poll_s=0.5)
        waiting_s = time.monotonic() - down_at
        time.sleep(max(0.0, BROKERS_DOWN_S - (time.monotonic() - down_at)))
        kafka_brokers.up(conf, log=quiet)
        ended = time.monotonic()
        log(f"  cycle {cycle + 1}: leader {leader} of {busiest[0]}[{busiest[1]}] killed (-9), new leader after "
            f"{elected_s:.1f} s; broker {second} killed 15 s later, the capture's keeper waiting {waiting_s:.0f} s "
            f"after; both down until {ended - down_at:.0f} s, started again")
        wait_running(conf)
    return ended


def _stall(ctx: dict, name: str, seconds: float, log, during=None, clients: set[int] | None = None) -> float:
    """Stall every link of ctx's named dependency for seconds (during(): what to do meanwhile), then resume.
    ``clients``: only those processes' connections stall (Link.stall), the others flow."""
    links = ctx["links"][name]
    held = sum(link.stall(clients=clients) for link in links)
    began = time.monotonic()
    if during is not None:
        during()
    time.sleep(max(0.0, seconds - (time.monotonic() - began)))
    for link in links:
        link.resume()
    ended = time.monotonic()
    whose = "every" if clients is None else f"{len(clients)} processes' connections on each"
    log(f"  {name}: {whose} link stalled {ended - began:.0f} s ({held} open connection(s) held, new ones unanswered, "
        f"none refused), then resumed")
    return ended


def case_stall_kafka(ctx: dict, cycles: int, log) -> float:
    """Every link to the three brokers stalls for KAFKA_STALL_S: no byte moves either way and no connection is
    refused (the capture, the merge and their keepers' probes all come through the links)."""
    for _ in range(cycles):
        ended = _stall(ctx, "kafka", KAFKA_STALL_S, log)
        wait_running(ctx["conf"])
    return ended


def case_stall_kafka_merge(ctx: dict, cycles: int, log) -> float:
    """Only the merge's connections to the three brokers stall for KAFKA_STALL_S (its process tree's, its JVM's
    included); the capture's go on, and so does the load."""
    for _ in range(cycles):
        ended = _stall(ctx, "kafka", KAFKA_STALL_S, log, clients=tree(keeper.state(ctx["conf"], "merge")["pid"]))
        wait_running(ctx["conf"])
    return ended


def case_stall_postgres(ctx: dict, cycles: int, log) -> float:
    """The capture's link to PostgreSQL stalls for POSTGRES_STALL_S, past wal_sender_timeout and
    source.stall_timeout_s; the writers reach the server directly and go on."""
    for _ in range(cycles):
        ended = _stall(ctx, "postgres", POSTGRES_STALL_S, log)
        wait_running(ctx["conf"])
    return ended


def case_stall_registry(ctx: dict, cycles: int, log) -> float:
    """The link to the registry stalls for REGISTRY_STALL_S while ALTER TABLE ADD COLUMN and writes using it need a
    new schema version; more writes after it returns."""
    conf = ctx["conf"]
    for cycle in range(cycles):
        column = f"stall_note_{cycle + 1}"
        ended = _stall(ctx, "registry", REGISTRY_STALL_S, log, during=lambda c=column: admin_sql(
            ctx["writer_conf"], f"ALTER TABLE bank.customers ADD COLUMN {c} text",
            f"UPDATE bank.customers SET {c} = 'during the stall ' || customer_id WHERE customer_id % 3 = 0"))
        admin_sql(ctx["writer_conf"], f"UPDATE bank.customers SET {column} = 'after' WHERE customer_id % 3 = 1")
        wait_running(conf)
    return ended


def case_drop_links(ctx: dict, cycles: int, log) -> float:
    """Every open connection of every link (PostgreSQL, registry, three brokers) reset at once, mid-transfer, at a
    random moment of the load."""
    rng = random.Random(ctx["seed"])
    for cycle in range(cycles):
        time.sleep(rng.uniform(2, 8))
        cut = sum(link.drop() for links in ctx["links"].values() for link in links)
        ended = time.monotonic()
        log(f"  cycle {cycle + 1}: {cut} sockets reset")
        wait_running(ctx["conf"])
    return ended


# name: (inject, default cycles, services whose keeper must be seen waiting for the missing dependency)
CASES = {"kafka_kill": (case_kafka_kill, 2, SERVICES), "postgres_restart": (case_postgres_restart, 2, ("capture",)),
         "registry_down": (case_registry_down, 1, ("capture",)), "kill_cycles": (case_kill_cycles, 10, ()),
         "long_transaction": (case_long_transaction, 1, ()), "key_update": (case_key_update, 1, ()),
         "rekey_ddl": (case_rekey_ddl, 2, ()), "disk_full": (case_disk_full, 1, ()),
         "brokers": (case_brokers, 1, ("capture",)), "stall_kafka": (case_stall_kafka, 1, ("capture",)),
         "stall_kafka_merge": (case_stall_kafka_merge, 1, ("merge",)),
         "stall_postgres": (case_stall_postgres, 1, ("capture",)),
         "stall_registry": (case_stall_registry, 1, ("capture",)), "drop_links": (case_drop_links, 3, ())}
OWN_STACK = ("disk_full", "brokers")  # cases that run on a pipeline of their own (a small lake, three brokers)


# checks


def bronze_offsets(conf: dict, spark) -> list[str]:
    """Problems with bronze against Kafka: per table topic partition, every offset from the start to the end
    exactly once (no duplicate, no gap, none missing at the end); [] when complete."""
    from pyspark.sql import functions as F

    specs = lake_paths.table_specs(conf)
    ends, problems = monitor.end_offsets(conf, [s.topic for s in specs]), []
    for spec in specs:
        bronze = spark.read.format("delta").load(lake_paths.bronze_path(conf))
        have = {int(r["_kafka_partition"]): r for r in bronze.filter(F.col("_kafka_topic") == spec.topic).groupBy(
            "_kafka_partition").agg(F.count(F.lit(1)).alias("n"), F.countDistinct("_kafka_offset").alias("d"),
                                    F.min("_kafka_offset").alias("lo"), F.max("_kafka_offset").alias("hi")).collect()}
        for partition, end in sorted(ends.get(spec.topic, {}).items()):
            r = have.get(int(partition))
            n, d, lo, hi = (r["n"], r["d"], r["lo"], r["hi"]) if r else (0, 0, None, None)
            if n != d:
                problems.append(f"{spec.topic}[{partition}]: {n - d} duplicate offset(s)")
            if end and (lo != 0 or hi != end - 1 or d != end):
                problems.append(f"{spec.topic}[{partition}]: bronze has {d} distinct offsets {lo}..{hi}, "
                                f"Kafka 0..{end - 1}")
    return problems


def verify(conf: dict, spark) -> dict:
    """Reconcile every table and check bronze offsets; {'exact': bool, 'details': str}."""
    results = reconcile.reconcile(conf, spark)
    wrong = [f"{r['table']}: source {r['source_rows']} rows, silver {r['silver_rows']}, e.g. {r['differences'][:2]}"
             for r in results if not r["equal"]]
    offsets = bronze_offsets(conf, spark)
    rows = sum(r["source_rows"] for r in results)
    return {"exact": not wrong and not offsets and len(results) == len(TABLES),
            "details": "; ".join(wrong + offsets) or f"{len(results)} tables, {rows} rows equal; bronze offsets once"}


# running a case


def run_case(name: str, cycles: int, ctx: dict, log=print) -> dict:
    """Load, the case's faults, recovery, catch-up, checks; the result row (see the module doc)."""
    conf, inject, began = ctx["conf"], CASES[name][0], time.monotonic()
    stop_load = bench_env.background_workload(ctx.get("writer_conf", conf), RATE)
    stop_watch, gave_before = watch_keepers(conf), give_ups(conf)
    row = {"case": name, "cycles": cycles, "exact": False}
    try:
        streaming(conf, 20)  # the load streams before the fault
        fault_ended = inject(ctx, cycles, log)
        wait_running(conf, datetime.fromtimestamp(time.time() - (time.monotonic() - fault_ended), timezone.utc))
        row["running_s"] = time.monotonic() - fault_ended
        streaming(conf, 20)  # some load after the recovery, then quiet
        row["load"] = stop_load()
        monitor.wait_until_caught_up(conf, timeout_s=900)
        row["caught_up_s"] = time.monotonic() - fault_ended
    except Exception as exc:  # noqa: BLE001 - the case fails with its reason; the checks still run
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"  error: {row['error']}")
        row.setdefault("load", stop_load())
    finally:
        row["keeper"] = stop_watch()
    row["gave_up"] = give_up = [n for n, count in give_ups(conf).items() if count > gave_before[n]]
    no_wait = [n for n in CASES[name][2] if not (row["keeper"][n]["waiting"] or row["keeper"][n]["said"])]
    try:
        check = verify(conf, ctx["spark"])
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed case
        check = {"exact": False, "details": f"checks failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    row["exact"] = check["exact"] and not give_up and not no_wait and "error" not in row
    row["details"] = "; ".join(filter(None, [row.get("error"), give_up and f"keeper gave up: {give_up}",
                                             no_wait and f"never said it waits: {no_wait}", check["details"]]))
    return {**row, "seconds": time.monotonic() - began}


def line(row: dict) -> str:
    """The case's one-line result."""
    timing = (f"running again {row['running_s']:.0f} s, caught up {row['caught_up_s']:.0f} s after the fault's end"
              if "caught_up_s" in row else "did not recover")
    outcome = "exact" if row["exact"] else "NOT exact"
    return (f"{row['case']:17s} cycles {row['cycles']:2d}  {outcome:9s}  {timing}; keeper: "
            f"{describe_watch(row['keeper'])}; load {row['load']['transactions']} tx "
            f"({row['load']['reconnects']} reconnects); {row['details']}")


# the report in docs/reliability.md


def table_rows(text: str) -> dict[str, str]:
    """The results table's rows in the doc's block, by case."""
    if BEGIN not in text:
        return {}
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return {r.split("`")[1]: r for r in block.splitlines() if r.startswith("| `")}


def doc_row(row: dict, run: str) -> str:
    """One Markdown row of the results table."""
    timing = (f"{row['running_s']:.0f} s | {row['caught_up_s']:.0f} s" if "caught_up_s" in row else "- | -")
    outcome = "exact" if row["exact"] else f"**NOT exact**: {row['details']}"
    keeper_said = describe_watch(row["keeper"]).replace("|", "/")
    return f"| `{row['case']}` | {row['cycles']} | {outcome} | {timing} | {keeper_said} | {run} |"


def write_doc(rows: list[dict], command: str, load_before: str, load_after: str, path: Path = DOC) -> None:
    """Replace this run's cases in the results block of docs/reliability.md (other cases' rows stay)."""
    text = path.read_text() if path.exists() else "# Reliability\n\n" + BEGIN + "\n" + END + "\n"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    kept = table_rows(text)
    kept.update({row["case"]: doc_row(row, f"{date}, `{command}`") for row in rows})
    ordered = [kept[name] for name in list(CASES) + sorted(set(kept) - set(CASES)) if name in kept]
    block = "\n".join([
        BEGIN, f"Last run: `{command}` on {date}; machine: {load_before} before, {load_after} after.", "",
        "| case | cycles | outcome | services running again | caught up | keeper.state during the faults | run |",
        "|---|---|---|---|---|---|---|", *ordered, END])
    head, _, rest = text.partition(BEGIN)
    tail = rest.split(END, 1)[1] if END in rest else ""
    path.write_text(head + block + tail)


# command line


def new_context(spark, seed: int, log, lake_root: str | None = None, overrides: dict | None = None) -> dict:
    """A pipeline of its own, running: {conf, folder, spark, seed}."""
    folder = tempfile.mkdtemp(prefix="fault-matrix-")
    conf = make_pipeline(folder, lake_root, overrides)
    direct = {k: v for k, v in conf["env"].items() if k != "CDC__SOURCE__PORT"}  # writers skip the link
    ctx = {"conf": conf, "folder": folder, "spark": spark, "seed": seed,
           "writer_conf": config.apply_overrides(config.load(None), direct)}
    try:
        start_pipeline(conf, spark, log)
    except BaseException:
        stop_pipeline(conf, folder, log)
        raise
    return ctx


def run_matrix(names: list[str], cycles: int | None, seed: int, spark, log=print) -> list[dict]:
    """The named cases in order on one pipeline, then disk_full on one of its own; their result rows."""
    rows = []
    plain = [n for n in names if n not in OWN_STACK and n not in LINK_CASES]
    for group in (plain, *([n] for n in OWN_STACK if n in names), [n for n in names if n in LINK_CASES]):
        if not group:
            continue
        mount = tmpfs() if group == ["disk_full"] else None
        links = {}
        overrides = three_brokers(log) if group == ["brokers"] else None
        if group[0] in LINK_CASES:
            overrides, links = behind_links(log)
        ctx = None
        try:
            ctx = new_context(spark, seed, log, lake_root=mount, overrides=overrides)
            ctx["links"] = links
            for name in group:
                log(f"{name}: {' '.join(CASES[name][0].__doc__.split())}")
                rows.append(run_case(name, cycles or CASES[name][1], ctx, log))
                log(line(rows[-1]))
        finally:
            if ctx is not None:
                stop_pipeline(ctx["conf"], ctx["folder"], log)
            if mount:
                subprocess.run(["umount", mount], check=False)
                os.rmdir(mount)
            for link in (link for found in links.values() for link in found):
                link.close()
            if overrides:
                kafka_brokers.down(config.load("local"), log=quiet)
    return rows


def three_brokers(log) -> dict:
    """Start the three brokers (lib/local/stack/kafka_brokers.py); the settings that point a pipeline at them."""
    three = kafka_brokers.up(config.load("local"), log=quiet)
    log(f"brokers   {config.get(three, 'kafka.bootstrap_servers')}: replication factor 3, min.insync.replicas 2")
    return {"CDC__KAFKA__BOOTSTRAP_SERVERS": config.get(three, "kafka.bootstrap_servers"),
            "CDC__KAFKA__REPLICATION_FACTOR": "3", "CDC__KAFKA__MIN_INSYNC_REPLICAS": "2",
            "CDC__KAFKA__PRODUCER": f"{{message.timeout.ms: {DELIVERY_TIMEOUT_MS}}}"}


def behind_links(log) -> tuple[dict, dict]:
    """Links (lib/local/stack/links.py) to PostgreSQL, the registry and each of three brokers, in this process;
    (the settings that send a pipeline through them, {dependency: [links]})."""
    local = config.load("local")
    overrides = three_brokers(log)
    postgres_link = Link((config.get(local, "source.host"), int(config.get(local, "source.port")))).start()
    url = urlparse(config.get(local, "registry.url"))
    registry_link = Link((url.hostname, url.port)).start()
    links = {"postgres": [postgres_link], "registry": [registry_link], "kafka": kafka_brokers.start_links(local)}
    overrides.update({"CDC__SOURCE__PORT": str(postgres_link.port),
                      "CDC__REGISTRY__URL": url._replace(netloc=f"{url.hostname}:{registry_link.port}").geturl(),
                      "CDC__KAFKA__BOOTSTRAP_SERVERS": kafka_brokers.link_servers(local)})
    log(f"links     PostgreSQL, the registry and three brokers reached through links (ports {postgres_link.port}, "
        f"{registry_link.port}, {kafka_brokers.link_servers(local)})")
    return overrides, links


def tmpfs(size: str = LAKE_FS_SIZE) -> str:
    """A new folder with a tmpfs of size mounted on it (for disk_full's lake; needs root)."""
    folder = tempfile.mkdtemp(prefix="fault-lake-")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True)
    if result.returncode != 0:
        os.rmdir(folder)
        raise RuntimeError(f"disk_full: cannot mount a {size} tmpfs on {folder} for the lake (needs root): "
                           f"{result.stderr.decode().strip()}")
    return folder


def main(argv: list[str] | None = None) -> int:
    """python bench/fault_matrix.py [--cases a,b] [--cycles N] [--seed S] [--no-doc]; exit 1 unless all exact."""
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    cli.add_argument("--cycles", type=int, default=None, help="faults per case (default: each case's own)")
    cli.add_argument("--seed", type=int, default=int(time.time()), help="random points of kill_cycles")
    cli.add_argument("--no-doc", action="store_true", help="do not update docs/reliability.md")
    args = cli.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CASES]:
        cli.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    from lib import spark as spark_lib

    load_before = bench_env.machine()
    print(f"fault matrix: {', '.join(names)} (seed {args.seed}); {load_before}", flush=True)
    session = spark_lib.from_conf(config.load("local"), catalog="in-memory")
    try:
        rows = run_matrix(names, args.cycles, args.seed, session, log=lambda text: print(text, flush=True))
    finally:
        session.stop()
    load_after = bench_env.machine()
    if not args.no_doc:
        command = "python bench/fault_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_doc(rows, command.strip(), load_before, load_after)
    print(f"fault matrix: {sum(r['exact'] for r in rows)} of {len(rows)} case(s) exact; {load_after}", flush=True)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
