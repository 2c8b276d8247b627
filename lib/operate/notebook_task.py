"""A notebook's code cells run in this Python process, as a job task that is not a notebook task.

On Databricks serverless compute a job's environment (the wheel and the pinned PyPI libraries) reaches Python wheel
tasks only; a notebook task takes the notebook's own environment, which a bundle cannot set per deployment. So the
bundle's serverless job runs each notebook as a wheel task: ``cdc-notebook <path> --param name=value ...`` executes
the notebook file's code cells in order in one namespace, the parameters given set right after the cell tagged
``parameters`` (as papermill injects them), so the task runs the very notebook a user opens.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
from pathlib import Path

from lib import runtime


class NotebookTaskError(RuntimeError):
    """A notebook cell failed, or a parameter the notebook does not declare was given."""


def code_cells(path: str) -> list[tuple[str, bool]]:
    """The notebook's code cells in order: (source, whether it is the parameters cell)."""
    cells = json.loads(Path(path).read_text())["cells"]
    return [("".join(c["source"]), "parameters" in c.get("metadata", {}).get("tags", []))
            for c in cells if c["cell_type"] == "code"]


def declared(source: str) -> dict:
    """Names and literal defaults of a parameters cell (`name = literal` lines)."""
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}


def run(path: str, texts: dict[str, str] | None = None, log=print) -> dict:
    """Execute the notebook's code cells with the given parameters (text, converted to each default's type)."""
    name = Path(path).name
    cells = code_cells(path)
    defaults = next((declared(source) for source, tagged in cells if tagged), {})
    unknown = sorted(set(texts or {}) - set(defaults))
    if unknown:
        raise NotebookTaskError(f"{name} declares no parameter {', '.join(unknown)} (its parameters cell has "
                                f"{', '.join(defaults) or 'none'})")
    values = {}
    for key, text in (texts or {}).items():
        try:
            values[key] = runtime.convert(text, defaults[key])
        except ValueError as exc:
            raise NotebookTaskError(f"{name}: parameter {key}={text!r}: {exc}") from exc
    os.environ[runtime.INJECTED] = "1"  # runtime.params: no widgets to ask
    namespace: dict = {"__name__": "__main__"}
    for n, (source, tagged) in enumerate(cells, 1):
        log(f"{name}: code cell {n} of {len(cells)}")
        try:
            exec(compile(source, f"{name}, code cell {n}", "exec"), namespace)  # noqa: S102 - the notebook itself
        except Exception as exc:
            raise NotebookTaskError(f"{name}: code cell {n} failed: {type(exc).__name__}: {exc}") from exc
        if tagged:
            namespace.update(values)
    return namespace


def parser() -> argparse.ArgumentParser:
    """cdc-notebook's command line."""
    parser = argparse.ArgumentParser(prog="cdc-notebook", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", help="the .ipynb file (on Databricks: /Workspace/<bundle files>/notebooks/...)")
    parser.add_argument("--conf-dir", help="the conf/ folder (sets CDC_CONF_DIR: the wheel holds no conf)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a parameter of the notebook's parameters cell (repeatable)")
    return parser


def main(argv=None) -> None:
    command = parser()
    args = command.parse_args(argv)
    texts = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            command.error(f"--param {item!r}: expected NAME=VALUE")
        texts[key] = value
    if args.conf_dir:
        os.environ["CDC_CONF_DIR"] = args.conf_dir
    run(args.notebook, texts)


if __name__ == "__main__":
    main()
