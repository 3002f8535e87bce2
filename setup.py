"""Builds gearcache's one optional C extension, ``gearcache.call._callpath`` (a loaded entry's per-call work; see
gearcache/call/entry.py). Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install
still succeeds and gearcache runs the same per-call work in Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("gearcache.call._callpath", ["gearcache/call/_callpath.c"], optional=True,
                             extra_compile_args=["-O2"])])
