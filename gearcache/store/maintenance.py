"""``Maintenance``: keeping one cache folder in shape. Eviction under ``max_size`` (least recently used first, leased
artifacts spared), removal of one artifact (``gearcache prune``), and the cleanup of what killed processes left: work
folders, temp files, leases of dead pids, stale soft locks."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import time
import uuid

from ..counters import counters
from ..errors import LockTimeoutError
from . import files as fs
from .files import HOST_TAG, TMP_MAX_AGE_S, _TMP_FILE, _older_than
from .first_use import FirstUse
from .index import Index
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .processes import pid_alive
from .stamps import Stamps

log = logging.getLogger("gearcache.store")


class Maintenance:
    """Eviction under ``max_size`` (bytes of artifacts; None: no limit), ``remove_artifact`` (both under the
    artifact's lease lock, sparing what a live process leases) and ``cleanup`` (run once by every Store that writes:
    its first use)."""

    def __init__(self, layout: Layout, locks: Locks, leases: Leases, index: Index, first_use: FirstUse,
                 stamps: Stamps, max_size: int | None):
        self.layout, self.locks, self.leases, self.index = layout, locks, leases, index
        self.first_use, self.stamps, self.max_size = first_use, stamps, max_size

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
                self.stamps.remove(akey)
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
        while it holds a lease on it (``Artifacts.publish`` and ``Entries.read_for_load`` take one first), so with no
        live lease under the lock every such entry is on disk already (a list made earlier missed the entries written in
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
                self.stamps.remove(akey)
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

    def _dead_leases(self, now: float) -> int:
        """Remove the leases of dead processes; returns how many. Each artifact's are removed under its lease lock,
        held exclusively (as an evictor holds it), and read again there: a process that took the dead one's pid
        writes its lease at the same path under that lock (shared), so it is never removed in between. An artifact
        whose lease lock is held (a loader writing its lease) is left for the next cleanup."""
        removed = 0
        try:
            folders = list(self.layout.leases.iterdir())
        except OSError:
            return 0
        for folder in folders:
            try:
                dead = [lease for lease in folder.iterdir() if not self.leases.is_live(lease, now)]
            except OSError:
                continue
            if dead:
                try:
                    with self.locks.held(self.locks.path(folder.name, "lease"), 0.5):
                        for lease in dead:
                            if not self.leases.is_live(lease, time.time()):
                                with contextlib.suppress(OSError):
                                    lease.unlink()
                                    removed += 1
                except LockTimeoutError:
                    continue
            with contextlib.suppress(OSError):
                folder.rmdir()
        return removed

    def cleanup(self) -> dict[str, int]:
        """Remove what killed processes left behind: work folders in ``tmp/`` whose pid is dead (another host's:
        older than an hour), temp manifest files likewise, leases of dead processes, and (``lock_mode="soft"``)
        stale soft locks; with ``max_size``, evict down to it (artifacts that were in use when the folder went over
        the cap may not be any more). Never raises; returns counts per kind."""
        done = {"tmp": 0, "partial_files": 0, "leases": 0, "soft_locks": 0, "stamps": 0, "evicted": 0}
        now = time.time()
        try:
            for path in list(self.layout.tmp.iterdir()):
                if self._tmp_leftover(path.name, path, now):
                    aside = path.with_name(f".{path.name}.removing.{uuid.uuid4().hex[:6]}")
                    with contextlib.suppress(OSError):
                        fs._rename(path, aside)
                        shutil.rmtree(aside, ignore_errors=True)
                        done["tmp"] += 1
        except OSError:
            pass
        for folder in (self.layout.entries, self.layout.misses, self.layout.stamps):
            for dirpath, _, names in os.walk(folder):
                for name in names:
                    m = _TMP_FILE.match(name)
                    if m and self._pid_leftover(int(m["pid"]), m["tag"], pathlib.Path(dirpath) / name, now):
                        with contextlib.suppress(OSError):
                            os.unlink(pathlib.Path(dirpath) / name)
                            done["partial_files"] += 1
        done["leases"] = self._dead_leases(now)
        done["stamps"] = self._orphan_stamps()
        if self.locks.mode == "soft":
            try:
                for lock in list(self.layout.locks.glob("*.softlock")):
                    done["soft_locks"] += self.locks.break_if_stale(lock)
            except OSError:
                pass
        if self.max_size is not None:  # a folder left over the cap (its artifacts were in use) is trimmed
            done["evicted"] = len(self.evict(when="when a process opened it"))
        if any(done.values()):
            log.info("cleaned %s: %s", self.layout.root, ", ".join(f"{v} {k}" for k, v in done.items() if v))
        return done

    def _orphan_stamps(self) -> int:
        """Remove the stamps whose artifact is gone (its removal was cut short); returns how many."""
        n = 0
        try:
            for path in list(self.layout.stamps.glob("*.json")):
                if not self.layout.artifact(path.stem).is_dir():
                    with contextlib.suppress(OSError):
                        path.unlink()
                        n += 1
        except OSError:
            pass
        return n

    def _tmp_leftover(self, name: str, path: pathlib.Path, now: float) -> bool:
        parts = name.split(".")
        if name.startswith(".") and ".removing." in name:
            return True                         # a removal that was itself interrupted
        if len(parts) >= 3 and parts[1].isdigit():
            return self._pid_leftover(int(parts[1]), parts[2], path, now)
        return _older_than(path, TMP_MAX_AGE_S, now)

    def _pid_leftover(self, pid: int, tag: str, path: pathlib.Path, now: float) -> bool:
        if tag.startswith(HOST_TAG) and len(tag) == len(HOST_TAG) + 8:
            return pid != os.getpid() and not pid_alive(pid)
        return _older_than(path, TMP_MAX_AGE_S, now)     # another host's (or an older gearcache's)
