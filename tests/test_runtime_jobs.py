"""Notebook parameters (papermill locally, widgets on Databricks) and the job runner."""

from __future__ import annotations

import nbformat
import pytest

from lib import config, runtime
from lib.operate import jobs, notebook_task


class Widgets:
    """The shape of dbutils.widgets: text(name, default) creates, get(name) reads (job values win)."""

    def __init__(self, job_values):
        self.job_values, self.defaults = job_values, {}

    def text(self, name, default):
        self.defaults[name] = default

    def get(self, name):
        return self.job_values.get(name, self.defaults[name])


class DbUtils:
    def __init__(self, job_values):
        self.widgets = Widgets(job_values)


def test_locally_parameters_are_the_papermill_values(monkeypatch):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert runtime.params(target="local", reset=False) == {"target": "local", "reset": False}


def test_on_databricks_parameters_come_from_widgets_typed_like_their_defaults(monkeypatch):
    utils = DbUtils({"reset": "true", "rows": "5", "tables": '["bank.cards"]'})
    monkeypatch.setattr(runtime, "dbutils", lambda: utils)
    values = runtime.params(target="databricks", reset=False, rows=1, tables=["bank.customers"])
    assert values == {"target": "databricks", "reset": True, "rows": 5, "tables": ["bank.cards"]}
    assert utils.widgets.defaults == {"target": "databricks", "reset": "false", "rows": "1",
                                      "tables": '["bank.customers"]'}


def test_a_bad_widget_value_names_the_parameter(monkeypatch):
    monkeypatch.setattr(runtime, "dbutils", lambda: DbUtils({"reset": "maybe"}))
    with pytest.raises(ValueError, match=r"notebook parameter reset='maybe': expected true or false"):
        runtime.params(reset=False)


def write_notebook(path, *sources):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(sources[0], metadata={"tags": ["parameters"]})]
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in sources[1:]]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def test_job_runs_notebooks_in_order_keeps_executed_copies_and_stops_at_a_failure(tmp_path, monkeypatch):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "01_first.ipynb", 'target = "x"', "print(f'first ran with {target}')")
    write_notebook(folder / "02_fails.ipynb", 'target = "x"', "raise RuntimeError('bad input in table t')")
    write_notebook(folder / "03_never.ipynb", 'target = "x"', "print('never')")
    monkeypatch.setenv("CDC__JOBS__RUNS_DIR", str(tmp_path / "runs"))
    results = jobs.run("local", folder=folder, log=lambda line: None)

    assert [(r["notebook"], r["ok"]) for r in results] == [("01_first", True), ("02_fails", False)]
    assert results[1]["error"] == "RuntimeError: bad input in table t"
    first = nbformat.read(results[0]["output"], as_version=4)
    assert "first ran with local" in first.cells[-1].outputs[0]["text"]
    assert results[0]["output"].parent.parent == tmp_path / "runs"
    assert not (results[0]["output"].parent / "03_never.ipynb").exists()
    assert config.load("local", environ={})["jobs"]["runs_dir"] == "runs"


def _notebook(path, *cells) -> str:
    """A notebook of code cells; the first one tagged 'parameters'."""
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    book.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(book, str(path))
    return str(path)


def test_a_notebook_runs_as_a_task_with_its_parameters_typed_like_their_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "16.4")  # as on serverless: no widgets to ask, though
    monkeypatch.setattr(runtime, "dbutils", lambda: pytest.fail("a wheel task has no widgets"))
    monkeypatch.setenv(runtime.INJECTED, "")  # run() sets it; monkeypatch takes it away again afterwards
    path = _notebook(tmp_path / "t.ipynb", "n = 1\nflag = False\nname = 'x'",
                     "from lib import runtime\np = runtime.params(n=n, flag=flag, name=name)",
                     "result = p['n'] * 2 if p['flag'] else -1")
    done = notebook_task.run(path, {"n": "21", "flag": "true"}, log=lambda line: None)
    assert (done["result"], done["p"]) == (42, {"n": 21, "flag": True, "name": "x"})


def test_a_notebook_task_names_an_unknown_parameter_a_bad_value_and_the_failing_cell(tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.INJECTED, "")
    path = _notebook(tmp_path / "t.ipynb", "n = 1", "x = 1", "y = 1 / (n - 1)")
    with pytest.raises(notebook_task.NotebookTaskError, match=r"t.ipynb declares no parameter rows \(its parameters "
                                                              r"cell has n\)"):
        notebook_task.run(path, {"rows": "5"}, log=lambda line: None)
    with pytest.raises(notebook_task.NotebookTaskError, match=r"t.ipynb: parameter n='many'"):
        notebook_task.run(path, {"n": "many"}, log=lambda line: None)
    with pytest.raises(notebook_task.NotebookTaskError, match=r"t.ipynb: code cell 3 failed: ZeroDivisionError"):
        notebook_task.run(path, {}, log=lambda line: None)
