"""``Leases``: ``leases/<akey>/<pid>@<host>`` marks an artifact in use by a live process (never evicted meanwhile)."""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
import time
import weakref

from ..counters import counters
from ..errors import LockTimeoutError
from .files import FOREIGN_LEASE_TTL_S, HOST, LEASE_LOCK_TIMEOUT_S, _older_than
from .index import Index
from .layout import Layout
from .locks import Locks
from .processes import _start_token, pid_alive

log = logging.getLogger("gearcache.store")


# Leases held by this process: (root, akey) -> number of live Leases objects (one per Store) holding it. The lease
# file is removed when the last one's owner (its Store) is garbage collected (or at exit); a killed process's file
# names a dead pid and is ignored.
_LEASES: dict[tuple[str, str], int] = {}
_LEASES_LOCK = threading.Lock()


def _release_leases(root: str, akeys: set[str], pid: int) -> None:
    if os.getpid() != pid:
        return                                  # a forked child: the leases are its parent's
    for akey in list(akeys):
        with _LEASES_LOCK:                      # unlinked under the lock: a new Leases.take of this process waits
            n = _LEASES.get((root, akey), 0) - 1
            if n > 0:
                _LEASES[(root, akey)] = n
                continue
            _LEASES.pop((root, akey), None)
            path = Layout(pathlib.Path(root)).lease(akey, pid)
            with contextlib.suppress(OSError):
                path.unlink()                   # (empty lease folders are removed by Maintenance.cleanup)


_OWN_START: dict[int, str] = {}       # this process's start time (/proc), read once per pid (a fork has its own)


def _own_start_token() -> str:
    pid = os.getpid()
    token = _OWN_START.get(pid)
    if token is None:
        token = _OWN_START[pid] = _start_token(pid)
    return token


class Leases:
    """The leases this Store holds on the artifacts this process loaded, and the liveness of anyone's lease. A lease
    is written under ``locks/<akey>.lease.lock`` (held shared; an evictor holds it exclusively); a first lease
    records the artifact as used in the index.
    ``owner``: the object the leases last as long as (the Store; held weakly); None: this part itself."""

    def __init__(self, layout: Layout, locks: Locks, index: Index, owner: object | None = None):
        self.layout, self.locks, self.index = layout, locks, index
        self._owner = None if owner is None else weakref.ref(owner)
        self._held: set[str] = set()
        self._finalizer: weakref.finalize[..., object] | None = None

    def take(self, akey: str) -> None:
        """Mark artifact ``akey`` as in use by this process (``leases/<akey>/<pid>@<host>``) for as long as this
        Store lives: eviction never removes it meanwhile. Idempotent, cheap after the first call, never raises.
        ``Entries.read_for_load`` and ``Artifacts.publish`` take it before they verify the artifact, so an
        artifact cannot be evicted between its check and its load: the lease file is written under
        ``locks/<akey>.lease.lock`` held shared (loaders of one artifact, the ranks of a job, never wait for each
        other), which an evictor holds exclusively while it checks the leases and moves the artifact away."""
        if akey in self._held:
            return
        pid, root = os.getpid(), str(self.layout.root)
        with _LEASES_LOCK:              # counted first: from now on no Store of this process removes the file
            if akey in self._held:
                return                  # taken meanwhile by another thread (a warm-up's gears load side by side)
            held = _LEASES.get((root, akey), 0)
            _LEASES[(root, akey)] = held + 1
            self._held.add(akey)
            if self._finalizer is None:
                owner = self if self._owner is None else self._owner() or self
                self._finalizer = weakref.finalize(owner, _release_leases, root, self._held, pid)
        path = self.layout.lease(akey, pid)
        if held and path.exists():
            return                      # (the first lease of this process always writes: a file left by an
                                        # earlier process with the same pid names another start time)
        try:
            try:
                with self.locks.held(self.locks.path(akey, "lease"), min(self.locks.timeout_s, LEASE_LOCK_TIMEOUT_S),
                                     on_wait=lambda: counters.add(lease_waits=1), shared=True):
                    self._write(path)
            except LockTimeoutError:
                self._write(path)                               # better a lease without the lock than none
        except OSError as exc:
            log.debug("could not write lease %s (%s); the artifact may be evicted while in use", path, exc)
            return
        self.index.touch_artifact(akey)

    def _write(self, path: pathlib.Path) -> None:
        for attempt in range(3):
            try:
                if not path.parent.parent.is_dir():
                    self.layout.mkdir(path.parent.parent)       # never recreates a vanished root
                self.layout.mkdir(path.parent)
                path.write_text(_own_start_token() + "\n")
                return
            except FileNotFoundError:
                if attempt == 2 or not self.layout.root.is_dir():
                    raise                       # (an empty lease folder removed by a cleanup meanwhile: again)

    def end(self, akey: str) -> None:
        """Give up this Store's lease of ``akey`` (the file goes when no other Store of this process holds it)."""
        if akey in self._held:
            self._held.discard(akey)
            _release_leases(str(self.layout.root), {akey}, os.getpid())

    def is_live(self, path: pathlib.Path, now: float | None = None) -> bool:
        """Whether the lease file ``path`` names a live process (of another host: a recent file)."""
        pid_s, _, host = path.name.partition("@")
        if not pid_s.isdigit():
            return False
        if host != HOST:
            return not _older_than(path, FOREIGN_LEASE_TTL_S, now or time.time())
        pid = int(pid_s)
        if pid == os.getpid():
            with _LEASES_LOCK:
                return _LEASES.get((str(self.layout.root), path.parent.name), 0) > 0
        try:
            token = path.read_text().strip()
        except OSError:
            token = ""
        return pid_alive(pid, token)

    def live_holders(self, akey: str) -> list[str]:
        """Names (``pid@host``) of the live processes holding a lease of ``akey``."""
        try:
            return sorted(p.name for p in self.layout.lease_folder(akey).iterdir() if self.is_live(p))
        except OSError:
            return []
