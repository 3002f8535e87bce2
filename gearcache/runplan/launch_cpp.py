"""C++ kernels: imported from the ``.so`` libraries the artifact carries, as torch's ``CppPythonBindingsCodeCache``
imports them (entry point ``kernel``)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import sys
import threading
from typing import Any, Callable, Iterator

from .._torch import runplan as torch_runplan
from ..errors import RunPlanUnavailable

_IMPORT_LOCK = threading.Lock()     # one import at a time: the environment variable below is the process's


def import_cpp_kernel(path: pathlib.Path, digest: str) -> Callable[..., Any]:
    """The ``kernel`` function of the library at ``path`` (its source's sha256 is ``digest``). The library's init
    reads the tensor data-pointer offset from the environment, which is set for the duration of the import only (one
    import at a time: a warm-up loads its gears side by side, and the environment is the whole process's)."""
    name = f"gearcache_cpp_{digest[:24]}.kernel"
    with _IMPORT_LOCK:
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise RunPlanUnavailable(f"cannot import {path}")
            with _environ(torch_runplan.CPP_KERNEL_ENV, torch_runplan.cpp_kernel_env_value()):
                module = importlib.util.module_from_spec(spec)      # runs the library's init
                spec.loader.exec_module(module)
            sys.modules[name] = module
    kernel: Callable[..., Any] = module.kernel
    return kernel


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
