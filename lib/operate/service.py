"""Continuous mode: the capture (slot -> Kafka) and the merge (Kafka -> Delta) as long-running processes.

How it works and what it guarantees: docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lib import config, control, runtime
from lib.operate import keeper, metrics, process, workers

STOP_TIMEOUT_S = 90.0
START_CHECK_S = 3.0


class ServiceError(RuntimeError):
    """A service could not be started, stopped or run; the message names the cause and the remedy."""


# ---------------------------------------------------------------------------------------------
# files and state


def status(conf: dict) -> list[dict]:
    """state() of every service."""
    return [keeper.state(conf, name) for name in metrics.SERVICES]


# ---------------------------------------------------------------------------------------------
# start and stop


def require_snapshot(conf: dict) -> dict:
    """The slot's snapshot record when it is complete; otherwise ServiceError saying to run notebooks 01 and 02."""
    slot = config.get(conf, "source.slot")
    remedy = (f"run notebook 01 (bootstrap) and 02 (snapshot) for slot {slot} first: `make demo`, or "
              f"`python -m lib.operate.jobs --only 01 02`")
    for attempt in range(3):  # a control topic created a moment ago may not have its metadata yet
        try:
            record = control.snapshot_state(conf, slot)
            break
        except control.ControlError as exc:
            if attempt == 2:
                raise ServiceError(f"continuous mode for slot {slot}: cannot read the snapshot state ({exc}); "
                                   f"{remedy}") from exc
            time.sleep(1)
    if not record or record.get("state") != "complete":
        found = "no snapshot was taken" if not record else f"its snapshot is {record.get('state')!r}, not complete"
        raise ServiceError(f"continuous mode for slot {slot}: {found}, so the stream would miss the rows that existed "
                           f"before the slot; {remedy}")
    return record


def write_conf(conf: dict) -> Path:
    """Write the conf the services run with to <service dir>/conf.json (references only, no secret values)."""
    path = metrics.service_dir(conf) / "conf.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conf, default=str, indent=1, sort_keys=True))
    return path


def start(conf: dict, services: tuple[str, ...] = metrics.SERVICES, log=print) -> dict[str, int]:
    """Start the keepers of the services that do not run (a crashed one again); returns {name: keeper pid}.

    Refuses before the snapshot. A service whose child fails within START_CHECK_S raises ServiceError
    naming its error; its keeper goes on retrying per service.max_restarts until stopped.
    """
    if runtime.on_databricks():
        raise ServiceError("on Databricks the continuous mode runs as the bundle's jobs cdc_capture and cdc_merge "
                           "(bundle.yml): `databricks bundle run -t <target> cdc_capture` and `... cdc_merge`")
    for name in services:
        keeper.check_service_name(name)
    require_snapshot(conf)
    conf_file = write_conf(conf)
    started, launched = {}, []
    for name in services:
        paths = keeper.files(conf, name)
        row = keeper.state(conf, name)
        if row["state"] == "running":
            log(f"{name:9s} already running (pid {row['pid']})")
            started[name] = row["pid"]
            continue
        launched.append(name)
        if row["state"] == "crashed":
            log(f"{name:9s} was not stopped cleanly (pid {row['pid']} is gone; last log line: {row['last_line']}); "
                f"starting it again: it resumes where it left off")
            _stop_leftover_child(conf, name, row["pid"], log)
            paths["pid"].unlink(missing_ok=True)
        paths["keeper"].unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "lib.operate.service", "keep", name, "--conf", str(conf_file)]
        with open(paths["log"], "a") as handle:
            handle.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {name}\n")
        started[name] = process.start(command, paths["log"], paths["pid"], env=env, cwd=config.PROJECT_ROOT)
    deadline = time.monotonic() + START_CHECK_S
    while time.monotonic() < deadline:  # a wrong setting usually fails at once: say so here, not only in the log
        time.sleep(0.25)
        for name in launched:
            row, record = keeper.state(conf, name), keeper.keeper_record(conf, name, started[name])
            if row["state"] == "crashed":
                raise ServiceError(f"the {name} service exited right after starting: {row['last_line']}; "
                                   f"see {row['log']}")
            if record.get("last_exit"):
                policy = keeper.restart_policy(conf)
                raise ServiceError(
                    f"the {name} service failed right after starting ({record['last_exit']}): "
                    f"{record.get('last_error') or 'no error line'}; its keeper (pid {started[name]}) starts it again "
                    f"up to service.max_restarts={policy['max_restarts']} times within service.restart_window_s="
                    f"{policy['window_s']:.0f} s, then leaves it crashed: fix the cause, then "
                    f"{config.make(conf, 'stop')} and {config.make(conf, 'run')}; see {row['log']}")
    for name, pid in started.items():
        log(f"{name:9s} running (keeper pid {pid}), log {keeper.files(conf, name)['log']}")
    return started


def _stop_leftover_child(conf: dict, name: str, keeper_pid: int | None, log) -> None:
    """Stop a child whose keeper died, so two captures never share a slot (nor two merges a checkpoint)."""
    child = keeper.keeper_record(conf, name, keeper_pid).get("child")
    if child and process.pid_alive(child) and keeper.service_marker(name) in process.cmdline(child):
        log(f"{name:9s} the previous process (pid {child}) still runs without its keeper: stopping it first")
        process.stop(child, timeout=STOP_TIMEOUT_S)


def stop(conf: dict, services: tuple[str, ...] = metrics.SERVICES, timeout: float = STOP_TIMEOUT_S, log=print) -> None:
    """Stop the services (capture first, so the merge sees everything it sent); a dead one's pid file is removed."""
    for name in services:
        paths = keeper.files(conf, name)
        row = keeper.state(conf, name)
        if row["state"] == "running":
            process.stop(row["pid"], timeout, group=True)  # the keeper forwards SIGTERM to its child
            log(f"{name:9s} stopped")
        elif row["state"] == "crashed":
            _stop_leftover_child(conf, name, row["pid"], log)
            log(f"{name:9s} was not running (pid {row['pid']} had died); pid file removed")
        paths["pid"].unlink(missing_ok=True)


def restart(conf: dict, name: str, log=print) -> int | None:
    """Stop and start one service when it runs (e.g. so the merge subscribes to a table added to conf); else None."""
    if keeper.state(conf, name)["state"] != "running":
        return None
    stop(conf, (name,), log=log)
    return start(conf, (name,), log=log)[name]


# ---------------------------------------------------------------------------------------------
# the keeper: runs one service as its child and starts it again when it crashes


# ---------------------------------------------------------------------------------------------
# the processes themselves


# ---------------------------------------------------------------------------------------------
# command line


def parser() -> argparse.ArgumentParser:
    """The command line (also parsed by the bundle test for the Databricks jobs' parameters)."""
    cli = argparse.ArgumentParser(prog="python -m lib.operate.service", description=__doc__.splitlines()[0])
    cli.add_argument("--target", default=None, help="conf/<target>.yml (default: CDC_TARGET or local)")
    commands = cli.add_subparsers(dest="command", required=True)
    for name, text in (("start", "start the services in the background (make run)"),
                       ("stop", "stop them (make stop)"), ("status", "state of each service")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("services", nargs="*", metavar="SERVICE",
                         help=f"{' and/or '.join(metrics.SERVICES)} (default: both)")
        sub.add_argument("--target", dest="sub_target", default=None, help="conf/<target>.yml (here or before)")
    keep = commands.add_parser("keep", help="run one service as a child, restarting it when it crashes (what "
                                            "start launches)")
    keep.add_argument("service", choices=metrics.SERVICES)
    keep.add_argument("--conf", required=True, help="a conf.json written by start")
    run = commands.add_parser("run", help="run one service in the foreground (what the keeper runs; Databricks jobs)")
    run.add_argument("service", choices=metrics.SERVICES)
    run.add_argument("--target", dest="run_target", default=None, help="conf/<target>.yml")
    run.add_argument("--conf", default=None, help="a conf.json written by start (instead of --target)")
    run.add_argument("--max-seconds", type=float, default=None, help="stop after this long (default: never)")
    return cli


def main(argv: list[str] | None = None) -> int:
    """python -m lib.operate.service {start,stop,status,keep,run} ...; an error is one line: cause and remedy."""
    cli = parser()
    args = cli.parse_args(argv)
    unknown = [name for name in getattr(args, "services", []) if name not in metrics.SERVICES]
    if unknown:
        cli.error(f"unknown service {unknown[0]!r}: choose from {', '.join(metrics.SERVICES)}")
    try:
        if args.command == "keep":
            return keeper.keep(args.service, args.conf, log=lambda line: print(line, flush=True))
        if args.command == "run":
            conf = keeper.load_conf(args.run_target or args.target, args.conf)
            log = lambda line: print(line, flush=True)  # noqa: E731
            if args.service == "capture":
                from lib.capture import stream

                result = workers.run_capture(conf, max_seconds=args.max_seconds, log=log)
                log("final " + stream.summary(result))
            else:
                result = workers.run_merge(conf, max_seconds=args.max_seconds, log=log)
                log(f"merge     stopped: {result}")
            return 0
        conf = config.load(args.sub_target or args.target)
        chosen = tuple(args.services) or metrics.SERVICES
        if args.command == "start":
            start(conf, chosen)
            print(f"next      {config.make(conf, 'status')} shows lag and throughput; {config.make(conf, 'stop')} "
                  f"stops both")
        elif args.command == "stop":
            stop(conf, chosen)
        else:
            for row in status(conf):
                if row["service"] in chosen:
                    print(f"{row['service']:9s} {row['state']:9s} keeper pid {str(row['pid'] or '-'):>7s}  "
                          f"worker pid {str(row['child'] or '-'):>7s}  restarts {row['restarts']}  log {row['log']}"
                          + (f"\n          last line: {row['last_line']}" if row["last_line"] else ""))
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"{cli.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
