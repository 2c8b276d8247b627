"""Executed notebooks are kept where analysts may read them: no cell shows unmasked personal data (issue 16, 15)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lib import config

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RAW = re.compile(r"merge\.(silver|bronze|key_history)\(")  # silver and bronze hold every value in clear


def _code(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _masked(table: str) -> set[str]:
    """Columns the local masking policy does not keep as they are: personal data."""
    rules = (config.load("local")["masking"].get("tables") or {}).get(table) or {}
    return {column for column, rule in rules.items() if rule != "keep"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_reads_an_unmasked_view(path):
    assert not [cell for cell in _code(path) if "_full" in cell], f"{path.name} reads a _full view"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_shows_a_masked_column_of_silver_or_bronze(path):
    shown = []
    for cell in _code(path):
        if not RAW.search(cell):
            continue
        named = set(re.findall(r"[\"'](?:after\.|before\.)?(\w+)[\"']", cell))
        for table in set(re.findall(r"[\"'](\w+\.\w+)[\"']", cell)):
            shown += [(table, column) for column in sorted(_masked(table) & named)]
    assert not shown, f"{path.name} shows columns the policy masks, straight from the lake: {shown}"
