"""``Fleet``: the glue between the local folder and its remote store (``remote.py``), on a miss.

Its methods (called only when ``Store.remote`` is set, never per call) never raise a remote fault: it is counted,
warned once, and the local folder carries on alone. They hold the artifact's local lock while they fetch, so one
process per machine transfers an artifact. A fetched entry manifest is written after its artifact, at exit
(:func:`flush_fetched_entries`), off the first call's path. ``gearcache push`` / ``pull`` are ``sync.py``'s.
"""
from __future__ import annotations

import atexit
import logging
import os
import pathlib
import threading
from typing import Any

from ..errors import LockTimeoutError, RemoteError
from .artifacts import Artifacts
from .files import write_json_atomic
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .remote import RemoteStore
from .first_use import FirstUse
from .trust import Trust

log = logging.getLogger("gearcache.store")

# Entry manifests fetched on a local miss, written at exit, after their artifacts (published at once): the first call
# goes on with the checked copy in memory and never waits for an fsync (~2 ms alone, ~20 ms among 8 processes on 2
# cores). A process killed before exit leaves the entry unwritten, never partly written: the next process fetches it
# again (one GET; its artifact is here).
_AT_EXIT: list[tuple[int, pathlib.Path, pathlib.Path, dict[str, Any], int]] = []
_AT_EXIT_LOCK = threading.Lock()
_AT_EXIT_REGISTERED = [False]


def flush_fetched_entries() -> None:
    """Write the fetched entry manifests this process queued (atomic, fsync'd; not into a folder that vanished, nor
    one whose artifact was evicted since: at exit this process may no longer lease it). Runs at exit; never raises."""
    with _AT_EXIT_LOCK:
        pending = list(_AT_EXIT)
        _AT_EXIT.clear()
    for pid, root, path, data, dir_mode in pending:
        if pid != os.getpid():                  # a forked child leaves its parent's to the parent
            continue
        if Layout(root).artifact(str(data.get("akey"))).is_dir():
            _write_entry(root, path, data, dir_mode)
        else:
            log.info("fetched entry manifest %s not written here: its artifact was evicted since", path.stem)


def _write_at_exit(root: pathlib.Path, path: pathlib.Path, data: dict[str, Any], dir_mode: int) -> None:
    with _AT_EXIT_LOCK:
        _AT_EXIT.append((os.getpid(), root, path, data, dir_mode))
        if not _AT_EXIT_REGISTERED[0]:
            atexit.register(flush_fetched_entries)
            _AT_EXIT_REGISTERED[0] = True


def _write_entry(root: pathlib.Path, path: pathlib.Path, data: dict[str, Any], dir_mode: int) -> bool:
    """Write a fetched (checked) entry manifest; False (warned) when it cannot be."""
    if not root.is_dir():
        return False                            # the folder vanished: never recreate it
    try:
        write_json_atomic(path, data, dir_mode=dir_mode)      # the usual atomic steps
    except OSError as exc:
        log.warning("could not write the fetched entry manifest %s here (%s)", path.stem, exc)
        return False
    return True


class Fleet:
    """Fetching from and pushing to ``remote`` on a miss of the local folder."""

    def __init__(self, layout: Layout, locks: Locks, leases: Leases, trust: Trust, first_use: FirstUse,
                 artifacts: Artifacts, remote: RemoteStore):
        self.layout, self.locks, self.leases, self.trust = layout, locks, leases, trust
        self.first_use, self.artifacts, self.remote = first_use, artifacts, remote

    def entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """A local miss looked up remotely (``Entries.read_for_load``): the entry manifest (signature checked,
        ``"sig"`` dropped, as ``Entries.read`` returns one), its artifact leased and fetched here when missing (under
        its lock, verified before it is renamed in). Once the artifact is here, the manifest is queued to be written
        here at exit (:func:`flush_fetched_entries`): the call goes on with the checked copy in memory and never waits
        for the disk. None: no remote entry, refused, a fault, or this folder cannot be used. Never raises."""
        data = self._checked_entry(topology_folder, method, ekey)
        if data is None:
            return None
        akey = data["akey"]
        self.leases.take(akey)
        self.fetch_artifact(akey)
        if self.layout.artifact(akey).is_dir():     # else the caller compiles it and writes the entry itself
            _write_at_exit(self.layout.root, self.layout.entry(topology_folder, method, ekey), data,
                           self.layout.dir_mode)
        self.first_use.seen()
        return {k: v for k, v in data.items() if k != "sig"}

    def fetch_entry(self, topology_folder: str, method: str, ekey: str) -> bool:
        """Fetch a remote entry manifest (signature checked) and write it here now. False: none, refused, a fault,
        or it could not be written."""
        data = self._checked_entry(topology_folder, method, ekey)
        return data is not None and _write_entry(self.layout.root, self.layout.entry(topology_folder, method, ekey),
                                                 data, self.layout.dir_mode)

    def _checked_entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """The remote entry manifest (signature checked, ``"sig"`` kept), once this folder is usable; else None."""
        if not self.remote.available():
            return None
        try:
            data = self.remote.fetch_entry(topology_folder, method, ekey)
        except RemoteError as exc:
            self.remote.failed(exc, f"entry {ekey} is compiled here")
            return None
        if data is None:
            return None
        try:
            self.first_use.ensure()
        except OSError as exc:
            log.warning("could not use the fetched entry manifest %s here (%s)", ekey, exc)
            return None
        return None if self.trust.root_problem() else data

    def fetch_artifact(self, akey: str) -> bool:
        """Fetch artifact ``akey`` into the folder unless it is here already (under its lock). Never raises."""
        if self.layout.artifact(akey).is_dir() or not self.remote.available():
            return False
        try:
            with self.locks.held(self.locks.path(akey), self.locks.timeout_s):
                if self.layout.artifact(akey).is_dir():
                    return False
                return self.remote.fetch_artifact(self.artifacts, akey)
        except RemoteError as exc:
            self.remote.failed(exc, f"artifact {akey} is compiled here")
        except (LockTimeoutError, OSError) as exc:
            log.info("could not fetch artifact %s from the remote store (%s); it is compiled here", akey, exc)
        return False

    def push_entry(self, topology_folder: str, method: str, ekey: str, data: dict[str, Any]) -> None:
        if not self.remote.available():
            return
        try:
            self.remote.push_entry(topology_folder, method, ekey, data)
        except RemoteError as exc:
            self.remote.failed(exc, f"entry {ekey} stays local")
