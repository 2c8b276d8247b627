"""Run the notebooks in order as a job (papermill), keeping each executed copy under runs/."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from lib import config

NOTEBOOKS = config.PROJECT_ROOT / "notebooks"


def notebooks(only: list[str] | None = None, folder: Path = NOTEBOOKS) -> list[Path]:
    """The numbered notebooks in order, optionally only those whose name starts with a prefix."""
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [path for path in found if any(path.name.startswith(prefix) for prefix in only)]
    return found


def run_dir(runs_dir: Path) -> Path:
    """A new timestamped folder for one job run."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    runs_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 100):
        folder = runs_dir / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"too many job runs started at {stamp} in {runs_dir}")


def kernel_config(folder: str):
    """Kernel manager settings: talk to the kernel over Unix sockets in folder (a kernel on TCP, even on
    localhost, warns that its traffic is unencrypted)."""
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": str(Path(folder) / "kernel")}})


def run(target: str = "local", only: list[str] | None = None, parameters: dict | None = None,
        log=print, folder: Path = NOTEBOOKS) -> list[dict]:
    """Execute the notebooks in order with papermill; stop at the first failure."""
    import papermill

    conf = config.load(target)
    out_dir = run_dir(config.project_path(config.get(conf, "jobs.runs_dir")))
    results = []
    with tempfile.TemporaryDirectory(prefix="cdc-kernel-") as sockets:  # the kernels' Unix sockets
        for path in notebooks(only, folder):
            output = out_dir / path.name
            began = time.monotonic()
            log(f"job       {path.stem}: running (executed copy: {output})")
            try:
                papermill.execute_notebook(str(path), str(output), parameters={"target": target, **(parameters or {})},
                                           cwd=str(folder), progress_bar=False, kernel_name="python3",
                                           config=kernel_config(sockets))
            except papermill.PapermillExecutionError as exc:
                results.append({"notebook": path.stem, "ok": False, "seconds": time.monotonic() - began,
                                "output": output, "error": f"{exc.ename}: {exc.evalue}"})
                log(f"job       {path.stem}: FAILED in cell {exc.exec_count}: {exc.ename}: {exc.evalue}")
                break
            results.append({"notebook": path.stem, "ok": True, "seconds": time.monotonic() - began, "output": output})
            log(f"job       {path.stem}: done in {results[-1]['seconds']:.1f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    """CLI: python -m lib.operate.jobs [--target local] [--only 01 02] [-p name value ...]."""
    parser = argparse.ArgumentParser(prog="python -m lib.operate.jobs", description=__doc__)
    parser.add_argument("--target", default="local")
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 02")
    parser.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="a notebook parameter (YAML-typed), repeatable")
    args = parser.parse_args(argv)
    import yaml

    parameters = {name: yaml.safe_load(value) for name, value in args.param}
    if not notebooks(args.only):
        print(f"job       no notebooks match in {NOTEBOOKS}", file=sys.stderr)
        return 1
    results = run(args.target, args.only, parameters)
    failed = [row for row in results if not row["ok"]]
    if failed:
        print(f"error: notebook {failed[0]['notebook']} failed ({failed[0]['error']}); the executed copy "
              f"with the failing cell is {failed[0]['output']}", file=sys.stderr)
        return 1
    print(f"job       {len(results)} notebook(s) ran; executed copies in {results[0]['output'].parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
