"""A function that brings lib/ along, for a Python process that has no way to import the project otherwise.

Spark Connect runs a streaming query's foreachBatch function in a Python worker of the server's driver, and that
worker does not see the session's artifacts (pyspark 4.1.1: only UDF workers get the zip that lib.spark.ship_project
sends). This module imports the standard library only and is pickled by value (lib.spark.carrying), so the wrapper
unpickles in any Python; its first call puts the project's zip, carried as bytes, on sys.path and then unpickles the
wrapped function.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile


def carrying(archive: bytes, name: str, payload: bytes):
    """A callable that, where it runs, installs the zip ``archive`` as ``name`` in the temp folder, puts it on
    sys.path and calls the function pickled in ``payload`` with its arguments."""
    loaded = []

    def call(*args):
        if not loaded:
            path = os.path.join(tempfile.gettempdir(), name)
            if not os.path.exists(path):
                partial = f"{path}.{os.getpid()}"
                with open(partial, "wb") as out:
                    out.write(archive)
                os.replace(partial, path)
            if path not in sys.path:
                sys.path.insert(0, path)
            try:
                loaded.append(pickle.loads(payload))
            except ImportError as exc:
                raise ImportError(
                    f"the project's code reached this Python ({sys.executable}, {path}) but does not import here: "
                    f"{exc}. Give this interpreter (a Spark Connect server's PYSPARK_PYTHON) the packages of "
                    f"requirements.txt") from exc
        return loaded[0](*args)

    return call
