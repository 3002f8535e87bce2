"""gearcache's native checks: the dispatch shortcut's tensor and torch-state checks compiled against the headers of
the torch that runs them (``guards.cpp``: what they check and why). Optional: without them gearcache uses Dynamo's
checks (``torch._C._dynamo.guards``), which answer the same questions more slowly (~5,400 instructions per call of
a decode step against ~1,000; docs/DESIGN.md, "Call path").

The module is built once per machine and torch build, outside any call: the first process that wants it and finds
none starts ``python -m gearcache.native.build --if-idle`` in the background (``build.py``) and goes on with Dynamo's
checks; later processes load it. ``gearcache native build`` builds it now; ``GEARCACHE_NATIVE=0`` turns loading and
building off.

On disk (``native_dir()``: ``$GEARCACHE_NATIVE_DIR``, else ``$XDG_CACHE_HOME/gearcache/native``, else
``~/.cache/gearcache/native``)::

    <key>/                          key: sha256 of extension_key_parts() (sources, torch build, Python ABI), 24 hex
        gearcache_native_guards.so  the module; published last (os.replace); its BUILD_KEY must equal <key>
        build.log                   the compiler's command and output of the last try
        failed                      the last try failed: no automatic retry
        .lock                       held while building

Trust: loading the module runs its code. It is loaded only from a folder and file owned by this user and writable by
no one else (as the compiler left it), and only if the module's own ``BUILD_KEY`` is this process's key: a module
built for another torch is never loaded (its C++ layouts may differ).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import stat
import subprocess
import sys
import threading
from typing import Any
from types import ModuleType

MODULE_NAME = "gearcache_native_guards"
MODULE_FILE = MODULE_NAME + ".so"
LOG_FILE, FAILED_FILE, LOCK_FILE = "build.log", "failed", ".lock"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guards.cpp")
SOURCES = (SOURCE, os.path.join(os.path.dirname(SOURCE), "guards_state.h"))   # what it is compiled from (the key)
ENV_SWITCH = "GEARCACHE_NATIVE"
ENV_DIR = "GEARCACHE_NATIVE_DIR"

log = logging.getLogger("gearcache.native")


def enabled() -> bool:
    """False when ``$GEARCACHE_NATIVE`` is ``0`` (or ``off``/``false``/``no``), or off Linux."""
    return sys.platform == "linux" and os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false",
                                                                                                "no")


def native_dir() -> str:
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "gearcache", "native")


def extension_key_parts() -> list[tuple[str, str]]:
    """What the compiled module depends on, in order: its sources (SOURCES), the torch build whose headers and
    libraries it is compiled against, and the Python ABI it is loaded into."""
    import torch

    digest = hashlib.sha256()
    for path in SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    source = digest.hexdigest()
    return [("source", source),
            ("torch", f"{torch.__version__} {getattr(torch.version, 'git_version', '')} "
                      f"cxx11abi={torch.compiled_with_cxx11_abi()}"),
            ("python", f"{sys.implementation.cache_tag} {importlib.machinery.EXTENSION_SUFFIXES[0]}"),
            ("platform", f"{sys.platform} {platform.machine()}")]


def extension_key(parts: list[tuple[str, str]] | None = None) -> str:
    """The key of ``parts`` (default: :func:`extension_key_parts`)."""
    digest = hashlib.sha256()
    for name, value in parts if parts is not None else extension_key_parts():
        digest.update(f"{name}={value}\n".encode())
        log.debug("native build key part %s: %s", name, hashlib.sha256(value.encode()).hexdigest()[:12])
    return digest.hexdigest()[:24]


def key_dir(key: str) -> str:
    return os.path.join(native_dir(), key)


class _Loaded:
    """This process's view: the module once loaded (or refused: not tried again), and whether a background build
    was started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: ModuleType | None = None
        self.refused = False
        self.key: str | None = None
        self.build_started = False


_loaded = _Loaded()


def guards(*, build_if_missing: bool = True) -> ModuleType | None:
    """The loaded native module, or None (disabled, not built yet, or refused: see the module docstring). On the
    first call that finds none, starts the background build unless ``build_if_missing`` is False or an earlier try
    failed. ``$GEARCACHE_NATIVE`` is read at every call (``0``: None). Cheap after the first call: a process loads
    (or refuses) the module at most once; while it is missing each call costs one ``stat``."""
    if not enabled():
        return None
    if _loaded.module is not None or _loaded.refused:
        return _loaded.module
    with _loaded.lock:
        if _loaded.module is not None or _loaded.refused:
            return _loaded.module
        if _loaded.key is None:
            _loaded.key = extension_key()
        folder = key_dir(_loaded.key)
        path = os.path.join(folder, MODULE_FILE)
        if os.path.exists(path):
            _loaded.module = _load(path, _loaded.key)
            _loaded.refused = _loaded.module is None
            return _loaded.module
        if build_if_missing and not _loaded.build_started and not os.path.exists(os.path.join(folder, FAILED_FILE)):
            _loaded.build_started = True
            _start_background_build()
    return None


def _load(path: str, key: str) -> ModuleType | None:
    problem = _unsafe(path)
    if problem:
        log.warning("not loading gearcache's native checks from %s: %s", path, problem)
        return None
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a loadable extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        log.warning("gearcache's native checks at %s do not load (%s); using Dynamo's checks", path, e)
        return None
    if getattr(module, "BUILD_KEY", None) != key:
        log.warning("not using gearcache's native checks at %s: built for key %s, this process's is %s", path,
                    getattr(module, "BUILD_KEY", None), key)
        return None
    log.debug("loaded gearcache's native checks from %s", path)
    return module


def _unsafe(path: str) -> str | None:
    """Why ``path`` (and its folder) must not be loaded, or None: each must belong to this user and be writable by
    no one else."""
    for p in (os.path.dirname(path), path):
        st = os.stat(p)
        if st.st_uid != os.getuid():
            return f"{p} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{p} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _start_background_build() -> None:
    """``python -m gearcache.native.build --if-idle`` in a session of its own (it lowers its own priority), output
    discarded (the build writes its own log); this process does not wait for it."""
    try:
        subprocess.Popen([sys.executable, "-m", "gearcache.native.build", "--if-idle"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
        log.info("building gearcache's native checks in the background into %s", native_dir())
    except OSError as e:
        log.info("could not start the background build of gearcache's native checks: %s", e)


def status() -> dict[str, Any]:
    """For ``gearcache native status`` and diagnostics: the switch, the key, its folder and what is in it."""
    parts = extension_key_parts()
    key = extension_key(parts)
    folder = key_dir(key)
    return {"enabled": enabled(), "dir": native_dir(), "key": key, "key_parts": dict(parts),
            "built": os.path.exists(os.path.join(folder, MODULE_FILE)),
            "failed": os.path.exists(os.path.join(folder, FAILED_FILE)),
            "loaded_in_this_process": _loaded.module is not None}
