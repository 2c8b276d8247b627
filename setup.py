"""The capture's optional compiled hot path (lib/capture/_native.pyx); everything else is in pyproject.toml.

Built by `make install` (pip install -e .) with Cython and the system's C compiler. CDC_PURE_PYTHON=1 builds
without it: bundle.yml does so, since Databricks needs one wheel for every Python version and platform. Without
Cython or a compiler the build goes on without it too; lib/capture/native.py then selects the Python path.
"""

import os

from setuptools import Extension, setup


def extensions() -> list:
    """The Cython extension, or none (CDC_PURE_PYTHON=1, or Cython missing)."""
    if os.environ.get("CDC_PURE_PYTHON") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    native = Extension("lib.capture._native", ["lib/capture/_native.pyx"], optional=True,
                       extra_compile_args=["-O2"])
    return cythonize([native], compiler_directives={"language_level": "3"}, quiet=True)


setup(ext_modules=extensions())
