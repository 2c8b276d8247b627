"""Executed notebooks are kept where analysts may read them: no cell shows unmasked personal data (issue 16, 15).

Cells that name sample columns are checked here against the local policy; cells that show the example table
pick their columns from the policy at run time (masking.kept_columns), which tests/test_own_database.py
checks on executed notebooks with planted values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lib import config

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RAW = re.compile(r"browse\.(silver|bronze|key_history|silver_key)\(")  # silver and bronze hold every value in clear
NAMED = {"examples.DEMO_TABLE": "bank.branches", "examples.SAMPLE_TABLE": "bank.customers"}


def _code(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _masked(table: str) -> set[str]:
    """Columns the local masking policy does not keep as they are: personal data."""
    rules = (config.load("local")["masking"].get("tables") or {}).get(table) or {}
    return {column for column, rule in rules.items() if rule != "keep"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_reads_an_unmasked_view(path):
    assert not [cell for cell in _code(path) if "_full" in cell], f"{path.name} reads a _full view"


def _shows_masked(cell: str) -> list[tuple[str, str]]:
    """(table, column) pairs a cell reads from silver or bronze although the local policy masks them."""
    if not RAW.search(cell):
        return []
    named = set(re.findall(r"[\"'](?:after\.|before\.)?(\w+)[\"']", cell))
    tables = set(re.findall(r"[\"'](\w+\.\w+)[\"']", cell)) | {t for ref, t in NAMED.items() if ref in cell}
    return [(table, column) for table in sorted(tables) for column in sorted(_masked(table) & named)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_shows_a_masked_column_of_silver_or_bronze(path):
    shown = [pair for cell in _code(path) for pair in _shows_masked(cell)]
    assert not shown, f"{path.name} shows columns the policy masks, straight from the lake: {shown}"


def test_the_check_above_sees_a_cell_that_shows_a_masked_column():
    cell = 'runtime.display(browse.silver_key(conf, session, examples.SAMPLE_TABLE, key).select("email", "kyc_status"))'
    assert _shows_masked(cell) == [("bank.customers", "email")]
