"""The capture's optional compiled hot path (lib/capture/_native.pyx); everything else is in pyproject.toml.

Built by `make install` (pip install -e .) with Cython and the system's C compiler. CDC_PURE_PYTHON=1 builds
without it: bundle.yml does so, since Databricks needs one wheel for every Python version and platform. Without
Cython, a compiler or Python's headers the build goes on without it and says so; lib/capture/native.py then
selects the Python path (make install prints which one runs).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SKIPPED = ("warning: the compiled capture (lib/capture/_native.pyx) is not built ({}); the capture runs its "
           "pure-Python path")


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: any error (no compiler at all included) leaves the Python path."""

    skipped = False

    def run(self):
        try:
            super().run()
        except Exception as exc:  # e.g. the editable install copying the module that failed to build
            if not self.skipped:
                print(SKIPPED.format(f"{type(exc).__name__}: {exc}"), file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # also the OSError of a missing compiler, which Extension(optional=True) lets through
            self.skipped = True
            print(SKIPPED.format(f"{type(exc).__name__}: {exc}"), file=sys.stderr)


def extensions() -> list:
    """The Cython extension, or none (CDC_PURE_PYTHON=1, or Cython missing)."""
    if os.environ.get("CDC_PURE_PYTHON") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as exc:
        print(SKIPPED.format(f"Cython is missing: {exc}"), file=sys.stderr)
        return []
    native = Extension("lib.capture._native", ["lib/capture/_native.pyx"], extra_compile_args=["-O2"])
    try:
        return cythonize([native], compiler_directives={"language_level": "3"}, quiet=True)
    except Exception as exc:  # a Cython error: the message above names the line
        print(SKIPPED.format(f"Cython failed: {exc}"), file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
