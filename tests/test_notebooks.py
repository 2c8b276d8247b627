"""Every notebook teaches the same way: an opening, a parameters cell, no definitions, no outputs."""

from __future__ import annotations

import json

import pytest

from lib.operate import jobs

NOTEBOOKS = jobs.notebooks()


def code_cells(notebook):
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_five_notebooks_exist_in_order():
    names = [path.stem for path in NOTEBOOKS]
    assert names == ["01_bootstrap_slot", "02_snapshot", "03_stream_to_kafka", "04_merge_into_delta",
                     "05_masking_views"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_title_and_explains_job_and_parameters(path):
    notebook = json.loads(path.read_text())
    first = notebook["cells"][0]
    assert first["cell_type"] == "markdown"
    text = source(first)
    assert text.startswith("# "), "the first cell is a markdown H1 title"
    assert "job" in text.lower() and "parameters" in text.lower()
    assert "**What you will learn**" in text and "```" in text, "the opening teaches, with a diagram"
    assert "**Next:**" in source(notebook["cells"][-1]) or path == NOTEBOOKS[-1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_code_cell_is_the_papermill_parameters_cell(path):
    cells = code_cells(json.loads(path.read_text()))
    assert "parameters" in cells[0].get("metadata", {}).get("tags", [])
    assert "target = " in source(cells[0])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_function_or_class_definitions_and_short_cells(path):
    for cell in code_cells(json.loads(path.read_text())):
        lines = source(cell).splitlines()
        assert not any(line.lstrip().startswith(("def ", "class ", "async def ")) for line in lines), source(cell)
        assert "lambda" not in source(cell), f"a lambda helper: move it into lib/\n{source(cell)}"
        assert len(lines) <= 12, f"a code cell of {len(lines)} lines: move the logic into lib/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    for cell in code_cells(json.loads(path.read_text())):
        assert not cell.get("outputs") and cell.get("execution_count") is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_has_an_id_of_its_own(path):
    """nbformat 4.5 cells carry ids; papermill and nbval warn on a missing one (a future nbformat refuses it)."""
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), ids
