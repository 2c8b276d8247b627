"""Where a notebook runs: Databricks (dbutils, widgets, display) or locally (Jupyter, papermill)."""

from __future__ import annotations

import json
import os

INJECTED = "CDC_INJECTED_PARAMETERS"  # set by lib.operate.notebook_task: the parameters are in the namespace already


def on_databricks() -> bool:
    """True inside a Databricks runtime."""
    return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION"))


def dbutils():
    """Databricks' dbutils, or None locally."""
    if not on_databricks():
        return None
    try:
        import IPython

        shell = IPython.get_ipython()
        found = shell.user_ns.get("dbutils") if shell else None
        if found is not None:
            return found
    except ImportError:
        pass
    from pyspark.dbutils import DBUtils  # only on Databricks
    from pyspark.sql import SparkSession

    return DBUtils(SparkSession.builder.getOrCreate())


def convert(text: str, default):
    """A widget's text as the type of its default (bool, int, float, dict/list as JSON, str)."""
    if isinstance(default, bool):
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true or false, got {text!r}")
        return lowered in ("true", "1", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, (dict, list)):
        return json.loads(text)
    return text


def params(**defaults) -> dict:
    """Notebook parameters: papermill (or lib.operate.notebook_task) injects them; in a Databricks notebook they come
    as widgets."""
    utils = None if os.environ.get(INJECTED) else dbutils()
    if utils is None:
        return dict(defaults)
    values = {}
    for name, default in defaults.items():
        shown = json.dumps(default) if isinstance(default, (dict, list)) else str(default).lower() \
            if isinstance(default, bool) else str(default)
        utils.widgets.text(name, shown)
        text = utils.widgets.get(name)
        try:
            values[name] = convert(text, default)
        except ValueError as exc:
            raise ValueError(f"notebook parameter {name}={text!r}: {exc}") from exc
    return values


def display(obj, rows: int = 20):
    """Databricks' display when there, else a pandas preview of a Spark DataFrame or the object."""
    if on_databricks():
        import IPython

        shell = IPython.get_ipython()
        show = shell.user_ns.get("display") if shell else None
        if show is not None:
            return show(obj)
    if hasattr(obj, "limit") and hasattr(obj, "toPandas"):
        obj = obj.limit(rows).toPandas()
    try:
        from IPython.display import display as ipython_display

        return ipython_display(obj)
    except ImportError:
        print(obj)
        return None
