"""Builds gearcache's one optional C extension, ``gearcache._callpath`` (a loaded entry's per-call work; see
gearcache/entry.py). Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install
still succeeds and gearcache runs the same per-call work in Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("gearcache._callpath", ["gearcache/_callpath.c"], optional=True,
                             extra_compile_args=["-O2"])])
