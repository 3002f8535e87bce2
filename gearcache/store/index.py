"""The diskcache index: bookkeeping (loads, hits, last used) for ls/stats/eviction, never on the call path.

``<root>/index/`` is a diskcache ``Index`` (SQLite, ``cache.db``). Rows: ``<ekey>`` -> ``{"method", "topology",
"akey", "created", "last_used", "loads", "load_seconds", "hits", "padded_elements", "real_elements"}`` and
``artifact:<akey>`` -> ``{"bytes", "created", "last_used"}``. Everything in it can be lost: an index SQLite cannot
read (``database disk image is malformed``, ``file is not a database``) is moved to ``quarantine/index.<time>.<tag>``
and rebuilt from the entry manifests and artifact manifests (loads and hits then count from zero; last used is the
time of the repair), with one warning per process.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pathlib
import sqlite3
import threading
import time
from typing import Any, Callable

from ..errors import UntrustedCacheError
from . import files as fs
from .layout import Layout
from .locks import Locks
from .first_use import FirstUse

log = logging.getLogger("gearcache.store")
INDEX_LOCK_TIMEOUT_S = 30.0
_HEALTHY: set[str] = set()          # index folders found readable by this process (checked once)
_WARNED: set[str] = set()           # index folders this process warned about


# Index bookkeeping (last_used, load counts) is queued and written in one transaction at exit, or when
# ``flush_index_updates`` is called: a warm process's first call neither imports diskcache nor opens SQLite.
_DEFERRED: dict[str, list[Callable[[Any], None]]] = {}
_OPENERS: dict[str, Callable[[str], Any]] = {}        # root -> opens its index as a new Store does
_DEFERRED_LOCK = threading.Lock()
_DEFERRED_ATEXIT = [False]


def flush_index_updates() -> None:
    """Write the queued index updates of every cache folder of this process. Never raises."""
    with _DEFERRED_LOCK:
        pending = dict(_DEFERRED)
        _DEFERRED.clear()
    for root, updates in pending.items():
        if not os.path.isdir(root):
            continue                    # the cache folder was removed: never recreate it
        try:
            index = _OPENERS[root](root)
            with index.transact():
                for update in updates:
                    update(index)
        except Exception as exc:
            log.debug("cache index update of %s failed (%s); entries stay usable", root, exc)


class Index:
    """The diskcache index of one folder (bookkeeping only), opened at first use after the folder's first-use checks
    (``first_use``); an unreadable one is rebuilt under ``locks/index.lock``. ``fresh(root)``: the index of a new
    Store of ``root``, which writes the updates queued for the exit (:func:`flush_index_updates`)."""

    def __init__(self, layout: Layout, locks: Locks, first_use: FirstUse, fresh: Callable[[str], Any]):
        self.layout, self.locks, self.first_use, self.fresh = layout, locks, first_use, fresh
        self._db: Any = None
        self._db_pid: int | None = None

    def touch_artifact(self, akey: str) -> None:
        """Queue: artifact ``akey`` was used now."""
        now = time.time()

        def touch(index: Any) -> None:
            row = index.get(f"artifact:{akey}")
            if row is not None:
                index[f"artifact:{akey}"] = dict(row, last_used=max(now, row.get("last_used") or 0))

        self.defer(touch)

    def defer(self, update: Callable[[Any], None]) -> None:
        """Queue ``update(index)`` (bookkeeping only) for :func:`flush_index_updates`, which runs at exit."""
        root = str(self.layout.root)
        with _DEFERRED_LOCK:
            _DEFERRED.setdefault(root, []).append(update)
            _OPENERS.setdefault(root, self.fresh)
            if not _DEFERRED_ATEXIT[0]:
                atexit.register(flush_index_updates)
                _DEFERRED_ATEXIT[0] = True

    def last_used(self) -> dict[str, float]:
        """``{akey: last used}`` from the index (an artifact's row, or its newest entry's); {} when unreadable."""
        out: dict[str, float] = {}
        try:
            for key, row in self.db.items():
                if not isinstance(row, dict):
                    continue
                akey = key[len("artifact:"):] if key.startswith("artifact:") else row.get("akey")
                t = row.get("last_used") or row.get("created")
                if isinstance(akey, str) and isinstance(t, (int, float)):
                    out[akey] = max(out.get(akey, 0.0), float(t))
        except Exception as exc:
            log.debug("cache index unreadable (%s); eviction goes by manifest age", exc)
        return out

    @property
    def db(self) -> Any:
        """diskcache index of entries and artifacts (bookkeeping only); reopened after a fork; repaired if SQLite
        cannot read it (:meth:`read`)."""
        if self._db is None or self._db_pid != os.getpid():
            self.first_use.ensure()
            self._db = self.read()
            self._db_pid = os.getpid()
        return self._db

    def close(self) -> None:
        """Close the index's SQLite connection, if this Store opened it."""
        if self._db is not None:
            self._db.cache.close()

    def read(self) -> Any:
        """Open the index (without the first-use checks of the store: ``gearcache ls`` reads it too). One SQLite
        cannot read is moved to ``quarantine/`` and rebuilt from the manifests (:meth:`_rebuild`)."""
        import diskcache

        folder = str(self.layout.index)
        problem = None if folder in _HEALTHY else _index_problem(self.layout.index_db)
        if problem is None:
            try:
                index = diskcache.Index(folder)
                _HEALTHY.add(folder)
                return index
            except sqlite3.DatabaseError as exc:
                problem = str(exc)
        return self._rebuild(problem)

    def _rebuild(self, problem: str | None) -> Any:
        """Move the unreadable index aside and write a new one from the entry manifests (one row per entry: method,
        topology, artifact, created) and the artifacts (bytes, created); ``last_used`` is now. Under
        ``locks/index.lock``: a process that finds it rebuilt by another meanwhile opens that one. Warned once."""
        import diskcache

        folder = self.layout.index
        self.layout.makedirs(self.layout.locks)
        with self.locks.held(self.locks.path("index"), INDEX_LOCK_TIMEOUT_S):
            problem = _index_problem(self.layout.index_db) and problem
            if problem:
                dest = self.layout.quarantined_index()
                try:
                    self.layout.makedirs(dest.parent)
                    fs._rename(folder, dest)
                except OSError as exc:
                    _warn_once(str(folder), f"cache index {folder} is unreadable ({problem}) and could not be moved "
                                            f"aside ({exc}): loads, hits and last used are not recorded. Fix: "
                                            f"remove {folder} (bookkeeping only; it is rebuilt)")
                    raise
                index = diskcache.Index(str(folder))
                rows = self._rows_from_manifests()
                with index.transact():
                    for key, row in rows.items():
                        index[key] = row
                _warn_once(str(folder), f"cache index {folder} was unreadable ({problem}); moved it to {dest} and "
                                        f"rebuilt it from {sum(not k.startswith('artifact:') for k in rows)} entry "
                                        f"manifest(s): loads and hits before now are lost (warned once per process)")
            else:
                index = diskcache.Index(str(folder))
        _HEALTHY.add(str(folder))
        return index

    def _rows_from_manifests(self) -> dict[str, dict[str, Any]]:
        """The index rows the entry manifests and artifacts on disk give (loads and hits unknown: none)."""
        now = time.time()
        rows: dict[str, dict[str, Any]] = {}
        for path in sorted(self.layout.entry_files()):
            try:
                data = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("ekey") == path.stem and isinstance(data.get("akey"), str):
                created = data.get("created") if isinstance(data.get("created"), (int, float)) else now
                rows[path.stem] = {"method": path.parent.name, "topology": path.parent.parent.name,
                                   "akey": data["akey"], "created": created, "last_used": now}
        for akey, (size, mtime) in self.layout.artifact_sizes().items():
            rows[f"artifact:{akey}"] = {"bytes": size, "created": mtime, "last_used": now}
        return rows

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Set one row. Never raises (a failure is logged)."""
        try:
            self.db[key] = value
        except Exception as exc:        # bookkeeping must never fail a call
            _index_failed(exc)

    def pop(self, keys: list[str], akey: str | None = None) -> None:
        """Remove index rows (an entry row only while it still names ``akey``). Never raises."""
        try:
            index = self.db
            with index.transact():
                for key in keys:
                    row = index.get(key)
                    if row is not None and (akey is None or key.startswith("artifact:") or
                                            (isinstance(row, dict) and row.get("akey") == akey)):
                        del index[key]
        except Exception as exc:        # bookkeeping must never fail a call
            _index_failed(exc)

    def entry_usage(self) -> dict[str, dict[str, Any]]:
        """The index's rows of entries by entry key (``loads``, ``hits``, ``last_used``, ...: the module docstring);
        {} when there is no index. Opened without the store's first-use checks (:meth:`read`); raises what opening
        it raises."""
        if not self.layout.index.is_dir():
            return {}
        return {key: row for key, row in self.read().items()
                if isinstance(row, dict) and not key.startswith("artifact:")}

    def forget(self, ekeys: list[str], akeys: list[str]) -> None:
        """Remove the index rows of entries ``ekeys`` and artifacts ``akeys`` (``gearcache prune``). Never raises."""
        self.pop([*ekeys, *(f"artifact:{akey}" for akey in akeys)])

    def record_load(self, ekey: str) -> None:
        """Record a load of an entry (not called per call: once per entry per process). Never raises."""
        try:
            row = self.db.get(ekey)
            if row is not None:
                row = dict(row, last_used=time.time(), loads=row.get("loads", 0) + 1)
                self.db[ekey] = row
        except Exception as exc:        # bookkeeping must never fail a call
            _index_failed(exc)


def _index_problem(db: pathlib.Path) -> str | None:
    """Why SQLite cannot read the index's file ``db`` (``Layout.index_db``; ``PRAGMA quick_check``); None when it
    can, or there is none."""
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(db, timeout=30)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    if rows != [("ok",)]:
        return "; ".join(str(r[0]) for r in rows[:3])
    return None


def _warn_once(folder: str, message: str) -> None:
    if folder not in _WARNED:
        _WARNED.add(folder)
        log.warning("%s", message)


def _index_failed(exc: Exception) -> None:
    """Log a failed index update: a warning, unless the store is refused (``UntrustedCacheError``: warned once where
    the refusal is met, gearcache/store/trust.py)."""
    if isinstance(exc, UntrustedCacheError):
        log.debug("cache index update skipped (%s)", exc)
    else:
        log.warning("cache index update failed (%s); entries stay usable", exc)
