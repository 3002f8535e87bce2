"""The diskcache index: bookkeeping (loads, hits, last used) for ls/stats/eviction, never on the call path."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("gearcache.store")


# Index bookkeeping (last_used, load counts) is queued and written in one transaction at exit, or when
# ``flush_index_updates`` is called: a warm process's first call neither imports diskcache nor opens SQLite.
_DEFERRED: dict[str, list[Callable[[Any], None]]] = {}
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
            from .local import Store

            index = Store(root).index
            with index.transact():
                for update in updates:
                    update(index)
        except Exception as exc:
            log.debug("cache index update of %s failed (%s); entries stay usable", root, exc)




class IndexMixin:
    """Part of ``Store``: the diskcache index and the deferred bookkeeping updates."""

    def _touch_artifact(self, akey: str) -> None:
        now = time.time()

        def touch(index: Any) -> None:
            row = index.get(f"artifact:{akey}")
            if row is not None:
                index[f"artifact:{akey}"] = dict(row, last_used=max(now, row.get("last_used") or 0))

        self.defer_index_update(touch)

    def defer_index_update(self, update: Callable[[Any], None]) -> None:
        """Queue ``update(index)`` (bookkeeping only) for :func:`flush_index_updates`, which runs at exit."""
        with _DEFERRED_LOCK:
            _DEFERRED.setdefault(str(self.root), []).append(update)
            if not _DEFERRED_ATEXIT[0]:
                atexit.register(flush_index_updates)
                _DEFERRED_ATEXIT[0] = True

    def _last_used(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            for key, row in self.index.items():
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
    def index(self):
        """diskcache index of entries and artifacts (bookkeeping only); reopened after a fork."""
        if self._index is None or self._index_pid != os.getpid():
            import diskcache

            self._ensure_root()
            self._index = diskcache.Index(str(self.root / "index"))
            self._index_pid = os.getpid()
        return self._index

    def _index_put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self.index[key] = value
        except Exception as exc:        # bookkeeping must never fail a call
            log.warning("cache index update failed (%s); entries stay usable", exc)

    def _index_pop(self, keys: list[str], akey: str | None = None) -> None:
        """Remove index rows (an entry row only while it still names ``akey``)."""
        try:
            index = self.index
            with index.transact():
                for key in keys:
                    row = index.get(key)
                    if row is not None and (akey is None or key.startswith("artifact:") or
                                            (isinstance(row, dict) and row.get("akey") == akey)):
                        del index[key]
        except Exception as exc:
            log.warning("cache index update failed (%s); entries stay usable", exc)

    def touch(self, ekey: str) -> None:
        """Record a load of an entry (not called per call: once per entry per process)."""
        try:
            row = self.index.get(ekey)
            if row is not None:
                row = dict(row, last_used=time.time(), loads=row.get("loads", 0) + 1)
                self.index[ekey] = row
        except Exception as exc:
            log.warning("cache index update failed (%s)", exc)


