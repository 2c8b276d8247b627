"""Change the set of tables a running pipeline captures: add one, snapshot one again, re-key one, remove one.

``add_table`` publishes the table and requests its chunked snapshot (lib/capture/incremental.py), then
points the local continuous mode at the new conf: when a service runs, its conf.json is rewritten (a
restarted capture must know the table), and a running merge service is restarted, since a Kafka query
subscribes only to the topics of the conf it started with; from its checkpoint it reads the new topic
from the start. A merge running elsewhere (a notebook's query, the Databricks job ``cdc_merge``) must
be restarted by hand.
"""

from __future__ import annotations

import argparse
import sys

from lib import config
from lib.capture import avro_schemas, incremental
from lib.operate import service


def add_table(conf: dict, name: str, log=print) -> dict:
    """Publish a table listed in source.tables, create its topic and schemas, request its snapshot, and have the
    local services use the new conf."""
    record = incremental.add_table(conf, name, log)
    update_services(conf, record["table"], avro_schemas.topic_for(conf, record["table"]), log)
    return record


def rekey_table(conf: dict, name: str, log=print) -> dict:
    """Move a table whose key changed by DDL to its new topic (conf kafka.topics) and read it anew, the local services
    stopped meanwhile and started again with conf.

    A capture or merge running elsewhere (a notebook, the Databricks jobs) must be stopped first and
    started again with the new conf: the capture refuses the re-key's snapshot under its old conf.
    """
    was = [row["service"] for row in service.status(conf) if row["state"] in ("running", "crashed")]
    service.stop(conf, tuple(was), log=lambda line: log(f"rekey {name}: {line.strip()}"))
    record = incremental.rekey_table(conf, name, log)
    if was:
        service.start(conf, tuple(was), log=lambda line: log(f"rekey {name}: {line.strip()}"))
    else:
        log(f"rekey {name}: no local service runs here; start the capture and the merge with this conf (notebooks "
            f"03 and 04, or the Databricks jobs cdc_capture and cdc_merge)")
    return record


def update_services(conf: dict, table: str, topic: str, log=print) -> bool:
    """Give the local services conf (with the added table); restart a running merge service. True if restarted.

    The running capture learns the table from its request; the merge subscribes only to the topics
    of the conf it started with, so it must start again (from its checkpoint) to merge the table.
    """
    states = {row["service"]: row["state"] for row in service.status(conf)}
    if "running" in states.values():
        service.write_conf(conf)  # what a capture restarted by its keeper reads
    if states.get("merge") != "running":
        log(f"incremental {table}: no merge service runs here; a merge running elsewhere (a notebook's query, the "
            f"Databricks job cdc_merge) reads only the topics of the conf it started with: restart it with this conf "
            f"to merge {topic} (it resumes from its checkpoint and reads the new topic from its start)")
        return False
    try:
        pid = service.restart(conf, "merge", log=lambda line: log(f"incremental {table}: {line.strip()}"))
    except service.ServiceError as exc:
        raise incremental.IncrementalError(f"{table} was added and its snapshot requested, but restarting the merge "
                                           f"service so it reads {topic} failed: {exc}") from exc
    log(f"incremental {table}: merge service restarted with this conf (keeper pid {pid}); it now merges {topic}")
    return True


def main(argv: list[str] | None = None) -> int:
    """python -m lib.operate.tables add|resnapshot|rekey|remove <schema.table> | status  [--target local]."""
    parser = argparse.ArgumentParser(prog="python -m lib.operate.tables", description=main.__doc__)
    parser.add_argument("action", choices=("add", "resnapshot", "rekey", "remove", "status"))
    parser.add_argument("table", nargs="?", help="schema.table as listed in source.tables")
    parser.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    args = parser.parse_args(argv)
    conf = config.load(args.target)
    if args.action == "status":
        for record in incremental.progress(conf):
            print(f"{record['table']:<32} {record['state']:<9} {record.get('chunks', 0):>6} chunks "
                  f"{record.get('rows', 0):>10} rows  last key {record.get('last_key')}")
        return 0
    if not args.table:
        parser.error(f"{args.action} needs a table (schema.table)")
    action = {"add": add_table, "resnapshot": incremental.resnapshot_table, "rekey": rekey_table,
              "remove": incremental.remove_table}[args.action]
    try:
        action(conf, args.table)
    except (incremental.IncrementalError, service.ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
