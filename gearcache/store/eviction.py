"""``Eviction``: eviction under ``max_size`` (least recently used first, leased artifacts spared) and removal
(``prune``)."""
from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import shutil
import time

from ..counters import counters
from ..errors import LockTimeoutError
from . import files as fs
from .index import Index
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .first_use import FirstUse

log = logging.getLogger("gearcache.store")


class Eviction:
    """Eviction under ``max_size`` (bytes of artifacts; None: no limit) and ``remove_artifact``, both under the
    artifact's lease lock, sparing what a live process leases."""

    def __init__(self, layout: Layout, locks: Locks, leases: Leases, index: Index, first_use: FirstUse,
                 max_size: int | None):
        self.layout, self.locks, self.leases, self.index = layout, locks, leases, index
        self.first_use, self.max_size = first_use, max_size

    def remove_artifact(self, akey: str) -> str:
        """Remove artifact ``akey`` (and its lease folder) unless a live process holds a lease on it. Checked and
        moved aside under ``locks/<akey>.lease.lock``, as eviction does, so a process cannot lease it in between.
        Returns ``"removed"``, ``"gone"``, ``"in use by pid@host, ..."`` or ``"lease lock busy"``."""
        self.layout.mkdir(self.layout.tmp)
        try:
            with self.locks.held(self.locks.path(akey, "lease"), 0.5):
                live = self.leases.live_holders(akey)
                if live:
                    return "in use by " + ", ".join(live)
                aside = self.layout.work(akey)
                try:
                    fs._rename(self.layout.artifact(akey), aside)
                except FileNotFoundError:
                    return "gone"
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.layout.lease_folder(akey))
        except LockTimeoutError:
            return "lease lock busy"
        shutil.rmtree(aside, ignore_errors=True)
        return "removed"

    def _entries_naming(self, akey: str) -> list[pathlib.Path]:
        """The entry manifests that name artifact ``akey`` (unreadable ones are skipped)."""
        out = []
        for path in self.layout.entry_files():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if json.loads(path.read_bytes()).get("akey") == akey:
                    out.append(path)
        return out

    def evict(self, *, keep: set[str] | frozenset[str] = frozenset(), when: str | None = None) -> list[str]:
        """Evict least recently used artifacts (index ``last_used``, then manifest mtime) with their entry manifests
        until the artifacts fit in ``max_size``; an artifact a live process holds a lease on, or in ``keep``, stays.
        Returns the evicted keys. Never raises."""
        if self.max_size is None:
            return []
        try:
            self.first_use.ensure()              # first: its cleanup may evict already (and must not run in the middle)
            sizes = self.layout.artifact_sizes()
            total = sum(s for s, _ in sizes.values())
            if total <= self.max_size:
                return []
            used = self.index.last_used()
            order = sorted((a for a in sizes if a not in keep), key=lambda a: (used.get(a, sizes[a][1]), sizes[a][1]))
            evicted, before = [], total
            for akey in order:
                if total <= self.max_size:
                    break
                reason = f"the folder held {before} bytes of artifacts, over max_size={self.max_size}" + (
                    f" {when}" if when else "")
                if self._evict_one(akey, sizes[akey][0], used.get(akey), reason):
                    total -= sizes[akey][0]
                    evicted.append(akey)
            if total > self.max_size:
                log.info("%s holds %d bytes of artifacts, over max_size=%d: the rest is in use by live processes "
                         "(or was just published)", self.layout.root, total, self.max_size)
            return evicted
        except Exception as exc:                # eviction is housekeeping: it must never fail a call
            log.warning("eviction in %s failed (%s: %s)", self.layout.root, type(exc).__name__, exc)
            return []

    def _evict_one(self, akey: str, size: int, last_used: float | None, reason: str) -> bool:
        """Evict ``akey`` with every entry manifest (and index row) naming it, unless a live process leases it.

        The entries are listed under the artifact's lease lock, not before: a process writes an entry for ``akey``
        while it holds a lease on it (``publish_artifact`` and ``entry_for_load`` take one first), so with no live lease
        under the lock every such entry is on disk already (a list made earlier missed the entries written in
        between: they outlived their artifact). The one write without a lease, a fetched entry written at exit
        (``fleet.flush_fetched_entries``), checks that its artifact is still there; an entry that names a missing
        artifact anyway is a miss to its reader, never a wrong answer."""
        lock = self.locks.path(akey, "lease")
        try:
            with self.locks.held(lock, 0.5):
                live = self.leases.live_holders(akey)
                if live:
                    log.debug("artifact %s is in use by %s: not evicted", akey, ", ".join(live))
                    return False
                gone = []
                for path in self._entries_naming(akey):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        gone.append(path)
                ekeys = [path.stem for path in gone]
                aside = self.layout.work(akey)
                try:
                    fs._rename(self.layout.artifact(akey), aside)
                except FileNotFoundError:
                    return False                # evicted by another process meanwhile
                self.index.pop([f"artifact:{akey}", *ekeys], akey=akey)
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.layout.lease_folder(akey))
        except LockTimeoutError:
            return False
        shutil.rmtree(aside, ignore_errors=True)
        counters.evictions += 1
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last_used)) if last_used else "never"
        log.info("evicted artifact %s (%d bytes, last used %s) and %d entry manifest(s): %s", akey, size, when,
                 len(gone), reason)
        return True

