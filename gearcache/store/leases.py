"""Leases: ``leases/<akey>/<pid>@<host>`` marks an artifact in use by a live process (never evicted meanwhile)."""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
import time
import weakref

from ..errors import LockTimeoutError
from .files import FOREIGN_LEASE_TTL_S, HOST, LEASE_LOCK_TIMEOUT_S, _mkdir
from .processes import _start_token, pid_alive

log = logging.getLogger("gearcache.store")


# Leases held by this process: (root, akey) -> number of live Store objects holding it. The lease file is removed
# when the last one is garbage collected (or at exit); a killed process's file names a dead pid and is ignored.
_LEASES: dict[tuple[str, str], int] = {}
_LEASES_LOCK = threading.Lock()



def _release_leases(root: str, akeys: set[str], pid: int) -> None:
    if os.getpid() != pid:
        return                                  # a forked child: the leases are its parent's
    for akey in list(akeys):
        with _LEASES_LOCK:                      # unlinked under the lock: a new lease() of this process waits
            n = _LEASES.get((root, akey), 0) - 1
            if n > 0:
                _LEASES[(root, akey)] = n
                continue
            _LEASES.pop((root, akey), None)
            path = pathlib.Path(root) / "leases" / akey / f"{pid}@{HOST}"
            with contextlib.suppress(OSError):
                path.unlink()                   # (empty lease folders are removed by Store.cleanup)




class LeaseMixin:
    """Part of ``Store``: leases of the artifacts this process loaded."""

    def lease(self, akey: str) -> None:
        """Mark artifact ``akey`` as in use by this process (``leases/<akey>/<pid>@<host>``) for as long as this
        Store lives: eviction never removes it meanwhile. Idempotent, cheap after the first call, never raises.
        ``read_entry`` and ``publish_artifact`` take it before they verify the artifact, so an artifact cannot be
        evicted between its check and its load (the lease file is written under ``locks/<akey>.lease.lock``, which
        an evictor holds while it checks the leases and moves the artifact away)."""
        if akey in self._leased:
            return
        pid = os.getpid()
        with _LEASES_LOCK:              # counted first: from now on no Store of this process removes the file
            held = _LEASES.get((str(self.root), akey), 0)
            _LEASES[(str(self.root), akey)] = held + 1
            self._leased.add(akey)
            if self._lease_finalizer is None:
                self._lease_finalizer = weakref.finalize(self, _release_leases, str(self.root), self._leased, pid)
        path = self.root / "leases" / akey / f"{pid}@{HOST}"
        if held and path.exists():
            return                      # (the first lease of this process always writes: a file left by an
                                        # earlier process with the same pid names another start time)
        try:
            try:
                with self._locked(self._lock_path(akey, "lease"), min(self.lock_timeout_s, LEASE_LOCK_TIMEOUT_S)):
                    self._write_lease(path)
            except LockTimeoutError:
                self._write_lease(path)                         # better a lease without the lock than none
        except OSError as exc:
            log.debug("could not write lease %s (%s); the artifact may be evicted while in use", path, exc)
            return
        self._touch_artifact(akey)

    def _write_lease(self, path: pathlib.Path) -> None:
        for attempt in range(3):
            try:
                if not path.parent.parent.is_dir():
                    _mkdir(path.parent.parent, self._dir_mode)       # never recreates a vanished root
                _mkdir(path.parent, self._dir_mode)
                path.write_text(_start_token(os.getpid()) + "\n")
                return
            except FileNotFoundError:
                if attempt == 2 or not self.root.is_dir():
                    raise                       # (an empty lease folder removed by a cleanup meanwhile: again)

    def release(self, akey: str) -> None:
        """Give up this Store's lease of ``akey`` (the file goes when no other Store of this process holds it)."""
        if akey in self._leased:
            self._leased.discard(akey)
            _release_leases(str(self.root), {akey}, os.getpid())

    def _lease_live(self, path: pathlib.Path, now: float | None = None) -> bool:
        pid_s, _, host = path.name.partition("@")
        if not pid_s.isdigit():
            return False
        if host != HOST:
            return not self._older_than(path, FOREIGN_LEASE_TTL_S, now or time.time())
        pid = int(pid_s)
        if pid == os.getpid():
            with _LEASES_LOCK:
                return _LEASES.get((str(self.root), path.parent.name), 0) > 0
        try:
            token = path.read_text().strip()
        except OSError:
            token = ""
        return pid_alive(pid, token)

    def live_leases(self, akey: str) -> list[str]:
        """Names (``pid@host``) of the live processes holding a lease of ``akey``."""
        folder = self.root / "leases" / akey
        try:
            return sorted(p.name for p in folder.iterdir() if self._lease_live(p))
        except OSError:
            return []

