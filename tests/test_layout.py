"""lib/ shows the architecture: stage packages, no import circle, no module far over 500 lines, local tools apart."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from lib import config

LIB = config.PROJECT_ROOT / "lib"
STAGES = ("capture", "lake", "views", "operate", "local")
MAX_LINES = 560  # "about 500": a module past this holds more than one concept


def modules() -> dict[str, Path]:
    """Every module of lib/ by its dotted name."""
    found = {}
    for path in sorted(LIB.rglob("*.py")):
        parts = path.relative_to(LIB.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """lib modules a module imports, at the top or inside functions."""
    out = set()
    package = ".".join(path.relative_to(LIB.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {name for name in out if name in known and name != "lib"}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_no_import_circle():
    edges = graph()
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == [], " ; ".join(" -> ".join(c) for c in circles)


def test_every_module_lives_in_a_stage_or_is_shared():
    shared = {"lib", "lib.config", "lib.secrets", "lib.runtime", "lib.control", "lib.spark", "lib.carried_call",
              "lib.source", "lib.schema_registry", "lib.topics", "lib.kafka_client", "lib.waiting"}
    stray = [name for name in modules() if name not in shared and name.split(".")[1] not in STAGES]
    assert stray == []


def test_no_module_holds_several_concepts_by_size():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_pipeline_does_not_import_the_local_tools():
    edges = graph()
    leaks = {name: sorted(d for d in deps if d.startswith("lib.local")) for name, deps in edges.items()
             if not name.startswith("lib.local")}
    assert {name: deps for name, deps in leaks.items() if deps} == {}


def test_shared_modules_do_not_reach_into_the_stages():
    edges = graph()
    upward = {name: sorted(d for d in deps if d.split(".")[1] in STAGES) for name, deps in edges.items()
              if name.count(".") == 1}
    assert {name: deps for name, deps in upward.items() if deps} == {}


def test_the_wheel_ships_the_pipeline_without_the_local_tools(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir",
                    str(tmp_path), str(config.PROJECT_ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"lib/capture/stream.py", "lib/lake/merge.py", "lib/views/masking.py", "lib/operate/service.py",
            "lib/config.py"} <= names
    assert [n for n in names if n.startswith("lib/local/")] == []


def top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (a package: also its modules)."""
    names = set()
    for statement in ast.parse(path.read_text()).body:  # what each top-level statement binds, not what it calls
        for node in [statement] if isinstance(statement, (ast.FunctionDef, ast.ClassDef)) else ast.walk(statement):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.glob("*.py"))
        names.update(p.name for p in path.parent.iterdir() if p.is_dir())
    return names


def test_every_module_attribute_used_exists():
    """`merge.table_specs` after table_specs moved elsewhere fails only at run time: catch it here."""
    known = modules()
    sources = [(p, p.read_text()) for p in [*LIB.rglob("*.py"), *(config.PROJECT_ROOT / "tests").glob("*.py")]]
    for notebook in sorted((config.PROJECT_ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources.append((notebook, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    missing = []
    for path, text in sources:
        tree = ast.parse(text)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lib") and not node.level:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in known})
        defined = {alias: top_level_names(known[name]) for alias, name in aliases.items()}
        shadowed = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for node in ast.walk(f) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in {a.arg for a in f.args.args + f.args.kwonlyargs}}  # a parameter, not a module
        missing += [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and id(node) not in shadowed
                    and node.value.id in defined and node.attr not in defined[node.value.id]]
    assert missing == []
