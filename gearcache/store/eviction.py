"""Eviction under ``max_size`` (least recently used first, leased artifacts spared) and removal (``prune``)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import time

from ..counters import counters
from ..errors import LockTimeoutError
from . import files as fs
from .files import MANIFEST, _folder_bytes, _mkdir, _tmp_tag

log = logging.getLogger("gearcache.store")


class EvictionMixin:
    """Part of ``Store``: eviction under ``max_size`` and ``remove_artifact``."""

    def remove_artifact(self, akey: str) -> str:
        """Remove artifact ``akey`` (and its lease folder) unless a live process holds a lease on it. Checked and
        moved aside under ``locks/<akey>.lease.lock``, as eviction does, so a process cannot lease it in between.
        Returns ``"removed"``, ``"gone"``, ``"in use by pid@host, ..."`` or ``"lease lock busy"``."""
        _mkdir(self.root / "tmp", self._dir_mode)
        try:
            with self._locked(self._lock_path(akey, "lease"), 0.5):
                live = self.live_leases(akey)
                if live:
                    return "in use by " + ", ".join(live)
                aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
                try:
                    fs._rename(self.artifact_dir(akey), aside)
                except FileNotFoundError:
                    return "gone"
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.root / "leases" / akey)
        except LockTimeoutError:
            return "lease lock busy"
        shutil.rmtree(aside, ignore_errors=True)
        return "removed"

    def artifact_keys(self) -> list[str]:
        """The key of every folder in ``artifacts/``, valid or not, sorted."""
        folder = self.root / "artifacts"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def artifact_sizes(self) -> dict[str, tuple[int, float]]:
        """``{akey: (bytes, manifest mtime)}`` of the published artifacts."""
        out = {}
        try:
            folders = list((self.root / "artifacts").iterdir())
        except OSError:
            return out
        for folder in folders:
            try:
                st = (folder / MANIFEST).stat()
                size = json.loads((folder / MANIFEST).read_bytes()).get("bytes")
                if not isinstance(size, int):
                    size = _folder_bytes(folder)
            except (OSError, ValueError, AttributeError):
                continue                        # vanished meanwhile, or corrupt: not counted
            out[folder.name] = (size, st.st_mtime)
        return out

    def _entries_naming(self, akey: str) -> list[pathlib.Path]:
        """The entry manifests that name artifact ``akey`` (unreadable ones are skipped)."""
        out = []
        for path in (self.root / "entries").glob("*/*/*.json"):
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
            self._ensure_root()             # first: its cleanup may evict already (and must not run in the middle)
            sizes = self.artifact_sizes()
            total = sum(s for s, _ in sizes.values())
            if total <= self.max_size:
                return []
            used = self._last_used()
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
                         "(or was just published)", self.root, total, self.max_size)
            return evicted
        except Exception as exc:                # eviction is housekeeping: it must never fail a call
            log.warning("eviction in %s failed (%s: %s)", self.root, type(exc).__name__, exc)
            return []

    def _evict_one(self, akey: str, size: int, last_used: float | None, reason: str) -> bool:
        """Evict ``akey`` with every entry manifest (and index row) naming it, unless a live process leases it.

        The entries are listed under the artifact's lease lock, not before: a process writes an entry for ``akey``
        while it holds a lease on it (``publish_artifact`` and ``read_entry`` take one first), so with no live lease
        under the lock every such entry is on disk already (a list made earlier missed the entries written in
        between: they outlived their artifact). The one write without a lease, a fetched entry written at exit
        (``fleet.flush_fetched_entries``), checks that its artifact is still there; an entry that names a missing
        artifact anyway is a miss to its reader, never a wrong answer."""
        lock = self._lock_path(akey, "lease")
        try:
            with self._locked(lock, 0.5):
                live = self.live_leases(akey)
                if live:
                    log.debug("artifact %s is in use by %s: not evicted", akey, ", ".join(live))
                    return False
                gone = []
                for path in self._entries_naming(akey):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        gone.append(path)
                ekeys = [path.stem for path in gone]
                aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
                try:
                    fs._rename(self.artifact_dir(akey), aside)
                except FileNotFoundError:
                    return False                # evicted by another process meanwhile
                self._index_pop([f"artifact:{akey}", *ekeys], akey=akey)
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.root / "leases" / akey)
        except LockTimeoutError:
            return False
        shutil.rmtree(aside, ignore_errors=True)
        counters.evictions += 1
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last_used)) if last_used else "never"
        log.info("evicted artifact %s (%d bytes, last used %s) and %d entry manifest(s): %s", akey, size, when,
                 len(gone), reason)
        return True

