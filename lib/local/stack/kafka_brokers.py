"""Three Kafka brokers in KRaft mode beside the stack (issue 30, several brokers).

Each node is a broker and a controller (a quorum of three: two must run for the cluster to change
anything), in .stack/kafka-brokers/node-<id> with PLAINTEXT on port_base + 10 * id, its controller listener on
the next port, and a listener two ports up for clients that come through links (start_links, link_servers:
the network drills). The settings are the ones docs/reliability.md asks of a user's cluster: every
topic at replication factor 3 with ``min.insync.replicas`` 2 (the pipeline's topics through
kafka.replication_factor / kafka.min_insync_replicas, the brokers' internal ones through their defaults),
and no unclean leader election: a replica that missed acknowledged writes never becomes the leader.

``python -m lib.local.stack brokers up|down|status``; ``conf_for(conf)`` is a conf pointing at them.
The single broker of ``make up`` stays as it is: these three are for the fault drills (bench/fault_matrix.py
case ``brokers``, tests/test_brokers.py) and for trying the pipeline against a replicated cluster.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from pathlib import Path

from lib import config
from lib.local.stack import kafka, process
from lib.local.stack.process import StackError

NODES = (1, 2, 3)
LINK_OFFSET = 5  # node n's link (links.Link, made by start_links) listens on its PLAINTEXT port + 5
REPLICATION_FACTOR = 3
MIN_INSYNC = 2


def stack_dir(conf: dict) -> Path:
    """The stack's folder (as lib.local.stack.stack_dir)."""
    return config.project_path(config.get(conf, "stack.dir")).resolve()


def ports(conf: dict, node: int) -> tuple[int, int]:
    """(PLAINTEXT port, controller port) of a node."""
    base = int(config.get(conf, "stack.kafka_brokers.port_base"))
    return base + 10 * node, base + 10 * node + 1


def bootstrap_servers(conf: dict) -> str:
    """host:port of every node, comma-separated."""
    host = kafka.endpoint(conf)[0]
    return ",".join(f"{host}:{ports(conf, node)[0]}" for node in NODES)


def link_servers(conf: dict) -> str:
    """host:port of every node's link, comma-separated: a client bootstrapping here reaches every broker through
    the links of start_links, which a drill can stall or cut."""
    host = kafka.endpoint(conf)[0]
    return ",".join(f"{host}:{ports(conf, node)[0] + LINK_OFFSET}" for node in NODES)


def start_links(conf: dict) -> list:
    """One links.Link per node, in this process, from its link port to its LINKED listener."""
    from lib.local.stack.links import Link

    host = kafka.endpoint(conf)[0]
    return [Link((host, ports(conf, n)[0] + 2), port=ports(conf, n)[0] + LINK_OFFSET).start() for n in NODES]


def conf_for(conf: dict) -> dict:
    """conf with the pipeline's Kafka at the three brokers: PLAINTEXT, replication factor 3, min.insync.replicas 2."""
    three = copy.deepcopy(conf)
    three["kafka"] = {**{k: v for k, v in three["kafka"].items() if not k.startswith(("sasl_", "ssl_"))},
                      "bootstrap_servers": bootstrap_servers(conf), "security_protocol": "PLAINTEXT",
                      "replication_factor": REPLICATION_FACTOR, "min_insync_replicas": MIN_INSYNC}
    return three


def files(conf: dict, node: int) -> dict[str, Path]:
    """Config, data, log and pid locations of a node."""
    base = stack_dir(conf) / "kafka-brokers" / f"node-{node}"
    return {"base": base, "properties": base / "server.properties", "log4j": base / "log4j2.properties",
            "data": base / "data", "log": stack_dir(conf) / "logs" / f"kafka-broker-{node}.log",
            "pid": stack_dir(conf) / "run" / f"kafka-broker-{node}.pid"}


def properties(conf: dict, node: int) -> str:
    """The text of a node's server.properties."""
    host = kafka.endpoint(conf)[0]
    port, controller = ports(conf, node)
    voters = ",".join(f"{n}@{host}:{ports(conf, n)[1]}" for n in NODES)
    settings = {
        "process.roles": "broker,controller",
        "node.id": node,
        "controller.quorum.voters": voters,
        # LINKED: what a client that bootstraps through the links (link_servers) is told to use, the links' ports
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller},LINKED://{host}:{port + 2}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port},LINKED://{host}:{port + LINK_OFFSET}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,LINKED:PLAINTEXT",
        "log.dirs": files(conf, node)["data"],
        "num.partitions": 1,
        "auto.create.topics.enable": "false",
        "default.replication.factor": REPLICATION_FACTOR,
        "min.insync.replicas": MIN_INSYNC,
        "unclean.leader.election.enable": "false",  # Kafka's default, written down: the drill depends on it
        "offsets.topic.replication.factor": REPLICATION_FACTOR,
        "transaction.state.log.replication.factor": REPLICATION_FACTOR,
        "transaction.state.log.min.isr": MIN_INSYNC,
        "share.coordinator.state.topic.replication.factor": REPLICATION_FACTOR,
        "share.coordinator.state.topic.min.isr": MIN_INSYNC,
        "group.initial.rebalance.delay.ms": 0,
    }
    return "".join(f"{k}={kafka.property_value(v)}\n" for k, v in settings.items())


def cluster_id(conf: dict) -> str:
    """The cluster's id, made once and kept beside the nodes (all three are formatted with it)."""
    path = stack_dir(conf) / "kafka-brokers" / "cluster.id"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(kafka.new_cluster_id())
    return path.read_text().strip()


def start(conf: dict, node: int, log=print) -> int | None:
    """Start one node if it is not running; returns the pid of a new process."""
    where = files(conf, node)
    host = kafka.endpoint(conf)[0]
    port, controller = ports(conf, node)
    wanted = [(host, p, "stack.kafka_brokers.port_base") for p in (port, controller, port + 2)]
    if not process.claim(f"kafka-{node}", where["pid"], kafka.MARKER, wanted, log):
        return None
    java_bin = kafka.java()
    where["base"].mkdir(parents=True, exist_ok=True)
    where["properties"].write_text(properties(conf, node))
    where["log4j"].write_text(process.console_log4j2("INFO", {"kafka": "WARN", "org.apache.kafka": "WARN"}))
    if not (where["data"] / "meta.properties").is_file():
        command = [java_bin, "-cp", kafka.classpath(stack_dir(conf)), f"-Dlog4j2.configurationFile={where['log4j']}",
                   "kafka.tools.StorageTool", "format", "-t", cluster_id(conf), "-c", str(where["properties"])]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"kafka-{node}: formatting {where['data']} failed; run `python -m lib.local.stack "
                             f"brokers down` and up again", details=result.stdout + result.stderr)
    heap = config.get(conf, "stack.kafka_brokers.heap")
    command = [java_bin, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={where['log4j']}", "-cp", kafka.classpath(stack_dir(conf)),
               kafka.MARKER, str(where["properties"])]
    log(f"kafka-{node}   starting on port {port}")
    return process.start(command, where["log"], where["pid"])


def up(conf: dict, log=print) -> dict:
    """Start the nodes that do not run and wait until all three serve as brokers; returns conf_for(conf)."""
    started = {node: start(conf, node, log=log) for node in NODES}
    timeout = float(config.get(conf, "stack.start_timeout_s"))
    for node in NODES:
        where = files(conf, node)
        process.wait_ready(f"kafka-{node}", lambda n=node: live_brokers(conf, n) == list(NODES), timeout,
                           where["log"], started[node], where["pid"])
    return conf_for(conf)


def live_brokers(conf: dict, node: int) -> list[int]:
    """Ids of the brokers a node's own metadata lists (a broker the controllers fenced is not listed)."""
    from confluent_kafka.admin import AdminClient

    host = kafka.endpoint(conf)[0]
    admin = AdminClient({"bootstrap.servers": f"{host}:{ports(conf, node)[0]}", "log_level": 0})
    return sorted(admin.list_topics(timeout=5).brokers)


def kill(conf: dict, node: int) -> int:
    """kill -9 a node (a crash: nothing flushed, no controlled shutdown); returns its pid."""
    where = files(conf, node)
    pid = process.running_pid(f"kafka-{node}", where["pid"], kafka.MARKER)
    if pid is None:
        raise StackError(f"kafka-{node} does not run (pid file {where['pid']})")
    process.kill_now(pid)
    where["pid"].unlink(missing_ok=True)
    return pid


def stop(conf: dict, node: int, log=print) -> None:
    """Stop one node, clearing a stale pid file."""
    process.stop_recorded(f"kafka-{node}", files(conf, node)["pid"], kafka.MARKER, timeout=60, log=log)


def down(conf: dict, log=print, remove: bool = True) -> None:
    """Stop every node (killed: the last one alone would wait for the quorum it left) and, with remove, delete their
    folders so the next up makes a new cluster."""
    for node in NODES:
        pid = process.read_pid(files(conf, node)["pid"])
        if pid and process.pid_alive(pid) and kafka.MARKER in process.cmdline(pid):
            process.kill_now(pid)
            log(f"kafka-{node}   stopped")
        files(conf, node)["pid"].unlink(missing_ok=True)
    if remove:
        shutil.rmtree(stack_dir(conf) / "kafka-brokers", ignore_errors=True)


def leaders(conf: dict, topics: list[str]) -> dict[tuple[str, int], int]:
    """{(topic, partition): id of its leader} from the cluster's metadata (-1: none)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap_servers(conf), "log_level": 0})
    metadata = admin.list_topics(timeout=10).topics
    return {(t, p): part.leader for t in topics if t in metadata for p, part in metadata[t].partitions.items()}


def busiest_partition(conf: dict, topics: list[str]) -> tuple[tuple[str, int], int]:
    """((topic, partition) with the most messages among topics, id of its leader)."""
    from confluent_kafka.admin import AdminClient

    from lib import topics as kafka_topics

    admin = AdminClient({"bootstrap.servers": bootstrap_servers(conf), "log_level": 0})
    ends = kafka_topics.end_offsets(admin, topics)
    busiest = max(((t, p) for t, parts in ends.items() for p in parts), key=lambda tp: ends[tp[0]][tp[1]])
    return busiest, leaders(conf, [busiest[0]])[busiest]


def wait_new_leader(conf: dict, partition: tuple[str, int], old: int, timeout_s: float = 120.0) -> float:
    """Seconds until a broker other than old leads the partition; StackError after timeout_s."""
    started = time.monotonic()
    while leaders(conf, [partition[0]]).get(partition) in (old, -1):
        if time.monotonic() - started > timeout_s:
            raise StackError(f"{partition[0]} partition {partition[1]} has no new leader {timeout_s:.0f} s after "
                             f"broker {old} went; see the brokers' logs in {stack_dir(conf) / 'logs'}")
        time.sleep(0.2)
    return time.monotonic() - started


def status(conf: dict) -> list[dict]:
    """One row per node, for `stack brokers status`."""
    rows = []
    for node in NODES:
        where = files(conf, node)
        pid, state = process.recorded_state(f"kafka-{node}", where["pid"], kafka.MARKER)
        rows.append({"service": f"kafka-{node}", "state": state, "pid": pid, "port": ports(conf, node)[0],
                     "version": kafka.version(stack_dir(conf)), "log": where["log"]})
    return rows
