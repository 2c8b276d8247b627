"""Command line for the local stack: python -m lib.local.stack {fetch,up,down,status,logs,versions,cluster,brokers}."""

from __future__ import annotations

import argparse
import sys

from lib import config
from lib.local import stack
from lib.local.stack import kafka_brokers, pg_versions, spark_cluster
from lib.local.stack.process import StackError
from lib.secrets import SecretError
from lib.source import SourceError


def main(argv: list[str] | None = None) -> int:
    """Run one stack command; errors are one line with the cause and the fix, exit 1."""
    parser = argparse.ArgumentParser(prog="python -m lib.local.stack", description=__doc__)
    parser.add_argument("--target", default="local", help="conf/<target>.yml (default: local)")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download Kafka, Apicurio Registry and Spark jars into the cache")
    fetch.add_argument("--downloads", action="store_true",
                       help="only the downloads, not the driver's class-data archive (which needs pyspark)")
    commands.add_parser("up", help="start PostgreSQL, Kafka and the registry; wait until ready")
    commands.add_parser("down", help="stop every service (data and logs stay)")
    commands.add_parser("status", help="what runs: pid, port, version, log file")
    commands.add_parser("clean", help="stop the stack and delete its data and logs (downloads stay)")
    sample = commands.add_parser("sample", help="load the sample bank database (once; --reset reloads)")
    sample.add_argument("--customers", type=int, default=200)
    sample.add_argument("--seed", type=int, default=7)
    sample.add_argument("--reset", action="store_true", help="drop schema bank and load it again")
    cluster = commands.add_parser("cluster", help="a Spark standalone master, its workers and a Connect server")
    cluster.add_argument("action", choices=("up", "down", "status"))
    brokers = commands.add_parser("brokers", help="three Kafka brokers (replication factor 3) for the drills")
    brokers.add_argument("action", choices=("up", "down", "status"))
    versions = commands.add_parser("versions", help="servers of other PostgreSQL majors (the version matrix)")
    versions.add_argument("action", choices=("up", "down", "status"))
    versions.add_argument("majors", nargs="?", help="e.g. 13,18 (default: every major in conf)")
    logs = commands.add_parser("logs", help="last lines of the services' logs")
    logs.add_argument("service", nargs="?", choices=stack.SERVICES)
    logs.add_argument("-n", "--lines", type=int, default=40)
    args = parser.parse_args(argv)

    try:
        conf = config.load(args.target)
        if args.command == "fetch":
            stack.fetch_all(conf, archive=not args.downloads)
        elif args.command == "up":
            stack.up(conf)
        elif args.command == "sample":
            stack.sample(conf, args.customers, args.seed, args.reset)
        elif args.command == "down":
            stack.down(conf)
        elif args.command == "clean":
            stack.clean(conf)
        elif args.command == "cluster":
            folder = stack.stack_dir(conf)
            if args.action == "up":
                spark_cluster.start(conf, folder)
            elif args.action == "down":
                spark_cluster.stop(conf, folder)
            else:
                for row in spark_cluster.status(conf, folder):
                    print(f"{row['service']:15s} {row['state']:9s} {row['port']:>6}  {row['version']:11s} {row['log']}")
        elif args.command == "brokers":
            if args.action == "up":
                print(f"kafka.bootstrap_servers {config.get(kafka_brokers.up(conf), 'kafka.bootstrap_servers')}")
            elif args.action == "down":
                kafka_brokers.down(conf)
            else:
                for row in kafka_brokers.status(conf):
                    print(f"{row['service']:9s} {row['state']:9s} {row['port']:>6}  {row['version']:8s} {row['log']}")
        elif args.command == "versions":
            if args.action == "up":
                for major, server in pg_versions.up(conf, args.majors).items():
                    print(f"postgres-{major} {pg_versions.versions(conf)[major]} at "
                          f"{server['source']['host']}:{server['source']['port']}")
            elif args.action == "down":
                pg_versions.down(conf)
            else:
                for row in pg_versions.status(conf):
                    print(f"{row['service']:11s} {row['state']:9s} {row['port']:>6}  {row['version']:8s} {row['log']}")
        elif args.command == "status":
            print(f"{'service':11s} {'state':15s} {'pid':>7s} {'port':>6s}  {'version':16s} log")
            for row in stack.status(conf):
                print(f"{row['service']:11s} {row['state']:15s} {str(row['pid'] or '-'):>7s} "
                      f"{row['port']:>6}  {row['version']:16s} {row['log']}")
            print()
            for name, where in stack.endpoints(conf).items():
                print(f"{name:14s} {where}")
        elif args.command == "logs":
            print(stack.logs(conf, args.service, args.lines))
    except (StackError, SecretError, SourceError, config.ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        details = getattr(exc, "details", "")
        if details:
            print("  " + details.replace("\n", "\n  "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
