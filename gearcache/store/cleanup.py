"""``Cleanup``: removing what killed processes left: work folders, temp files, leases of dead pids, stale soft locks."""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import time
import uuid

from . import files as fs
from .eviction import Eviction
from .files import HOST_TAG, TMP_MAX_AGE_S, _TMP_FILE, _older_than
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .processes import pid_alive

log = logging.getLogger("gearcache.store")


class Cleanup:
    """What killed processes left in one folder (run once by every Store that writes: its first use)."""

    def __init__(self, layout: Layout, locks: Locks, leases: Leases, eviction: Eviction):
        self.layout, self.locks, self.leases, self.eviction = layout, locks, leases, eviction

    def run(self) -> dict[str, int]:
        """Remove what killed processes left behind: work folders in ``tmp/`` whose pid is dead (another host's:
        older than an hour), temp manifest files likewise, leases of dead processes, and (``lock_mode="soft"``)
        stale soft locks; with ``max_size``, evict down to it (artifacts that were in use when the folder went over
        the cap may not be any more). Never raises; returns counts per kind."""
        done = {"tmp": 0, "partial_files": 0, "leases": 0, "soft_locks": 0, "evicted": 0}
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
        for folder in (self.layout.entries, self.layout.misses):
            for dirpath, _, names in os.walk(folder):
                for name in names:
                    m = _TMP_FILE.match(name)
                    if m and self._pid_leftover(int(m["pid"]), m["tag"], pathlib.Path(dirpath) / name, now):
                        with contextlib.suppress(OSError):
                            os.unlink(pathlib.Path(dirpath) / name)
                            done["partial_files"] += 1
        try:
            for folder in list(self.layout.leases.iterdir()):
                for lease in list(folder.iterdir()):
                    if not self.leases.is_live(lease, now):
                        with contextlib.suppress(OSError):
                            lease.unlink()
                            done["leases"] += 1
                with contextlib.suppress(OSError):
                    folder.rmdir()
        except OSError:
            pass
        if self.locks.mode == "soft":
            try:
                for lock in list(self.layout.locks.glob("*.softlock")):
                    done["soft_locks"] += self.locks.break_if_stale(lock)
            except OSError:
                pass
        if self.eviction.max_size is not None:  # a folder left over the cap (its artifacts were in use) is trimmed
            done["evicted"] = len(self.eviction.evict(when="when a process opened it"))
        if any(done.values()):
            log.info("cleaned %s: %s", self.layout.root, ", ".join(f"{v} {k}" for k, v in done.items() if v))
        return done

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
