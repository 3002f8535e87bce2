"""Part of ``Store``: the glue between the local folder and its remote store (``remote.py``).

The miss-path methods (``remote_*``, called only when ``Store.remote`` is set, never per call) never raise a remote
fault: it is counted, warned once, and the local folder carries on alone. They hold the artifact's local lock while
they fetch, so one process per machine transfers an artifact. A fetched entry manifest is written after its
artifact, at exit (:func:`flush_fetched_entries`), off the first call's path. ``push_to_remote`` /
``pull_from_remote`` serve ``gearcache push`` / ``pull`` and raise ``RemoteError``.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pathlib
import threading
from typing import Any, Callable

from ..errors import CacheCorruptionError, LockTimeoutError
from .backend import RemoteError
from .remote import write_fetched_entry

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
        if (root / "artifacts" / str(data.get("akey"))).is_dir():
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
        write_fetched_entry(path, data, dir_mode)
    except OSError as exc:
        log.warning("could not write the fetched entry manifest %s here (%s)", path.stem, exc)
        return False
    return True


class FleetMixin:
    """Part of ``Store``: fetching from and pushing to ``self.remote`` (a ``RemoteStore``, or None)."""

    def remote_entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """A local miss looked up remotely (``read_entry`` with ``load``): the entry manifest (signature checked,
        ``"sig"`` dropped, as ``read_entry`` returns one), its artifact leased and fetched here when missing (under
        its lock, verified before it is renamed in). Once the artifact is here, the manifest is queued to be written
        here at exit (:func:`flush_fetched_entries`): the call goes on with the checked copy in memory and never waits
        for the disk. None: no remote entry, refused, a fault, or this folder cannot be used. Never raises."""
        data = self._checked_remote_entry(topology_folder, method, ekey)
        if data is None:
            return None
        akey = data["akey"]
        self.lease(akey)
        self.remote_fetch_artifact(akey)
        if self.artifact_dir(akey).is_dir():        # else the caller compiles it and writes the entry itself
            _write_at_exit(self.root, self.entry_path(topology_folder, method, ekey), data, self._dir_mode)
        self._seen_root = True
        return {k: v for k, v in data.items() if k != "sig"}

    def remote_fetch_entry(self, topology_folder: str, method: str, ekey: str) -> bool:
        """Fetch a remote entry manifest (signature checked) and write it here now. False: none, refused, a fault,
        or it could not be written."""
        data = self._checked_remote_entry(topology_folder, method, ekey)
        return data is not None and _write_entry(self.root, self.entry_path(topology_folder, method, ekey), data,
                                                 self._dir_mode)

    def _checked_remote_entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
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
            self._ensure_root()
        except OSError as exc:
            log.warning("could not use the fetched entry manifest %s here (%s)", ekey, exc)
            return None
        return None if self._root_problem() else data

    def remote_fetch_artifact(self, akey: str) -> bool:
        """Fetch artifact ``akey`` into the folder unless it is here already (under its lock). Never raises."""
        if self.artifact_dir(akey).is_dir() or not self.remote.available():
            return False
        try:
            with self._locked(self._lock_path(akey), self.lock_timeout_s):
                if self.artifact_dir(akey).is_dir():
                    return False
                return self.remote.fetch_artifact(self, akey)
        except RemoteError as exc:
            self.remote.failed(exc, f"artifact {akey} is compiled here")
        except (LockTimeoutError, OSError) as exc:
            log.info("could not fetch artifact %s from the remote store (%s); it is compiled here", akey, exc)
        return False

    def remote_publish(self, akey: str, build_here: Callable[[], int]) -> int | None:
        """Under the artifact's local lock: fetch it (None), or build it here once for the fleet (its size)."""
        if not self.remote.available():
            return build_here()
        return self.remote.publish(self, akey, build_here, wait_s=self.lock_timeout_s)

    def remote_push_entry(self, topology_folder: str, method: str, ekey: str, data: dict[str, Any]) -> None:
        if not self.remote.available():
            return
        try:
            self.remote.push_entry(topology_folder, method, ekey, data)
        except RemoteError as exc:
            self.remote.failed(exc, f"entry {ekey} stays local")

    # ------------------------------------------------------------------------------ gearcache push / pull
    def push_to_remote(self, *, force: bool = False) -> dict[str, int]:
        """Push every valid local entry and its artifact (an artifact the remote holds already is skipped unless
        ``force``). Raises ``RemoteError``; corrupt local artifacts are skipped (counted in ``"skipped"``)."""
        done = {"entries": 0, "artifacts": 0, "skipped": 0}
        pushed: set[str] = set()
        for path in sorted((self.root / "entries").glob("*/*/*.json")):
            topology, method, ekey = path.parent.parent.name, path.parent.name, path.stem
            data = self.read_entry(topology, method, ekey, load=False)
            if data is None:
                continue
            akey = data["akey"]
            try:
                self.verify_artifact(akey)
            except (OSError, CacheCorruptionError) as exc:
                log.warning("not pushing entry %s: its artifact %s is not valid here (%s)", ekey, akey, exc)
                done["skipped"] += 1
                continue
            if akey not in pushed and (force or self.remote.backend.get(self.remote.head_key(akey)) is None):
                self.remote.push_artifact(self, akey)
                done["artifacts"] += 1
            pushed.add(akey)
            raw = json.loads(path.read_bytes())         # as written here: signed with the key
            self.remote.push_entry(topology, method, ekey, raw)
            done["entries"] += 1
        return done

    def pull_from_remote(self, *, method: str | None = None) -> dict[str, int]:
        """Fetch every remote entry (of ``method``, when given) and its artifact into this folder, checked as a
        miss would be. Raises ``RemoteError``."""
        done = {"entries": 0, "artifacts": 0, "refused": 0}
        for topology, name, ekey in sorted(self.remote.entries()):
            if method is not None and name != method:
                continue
            if not self.entry_path(topology, name, ekey).is_file():
                if not self.remote_fetch_entry(topology, name, ekey):
                    done["refused"] += 1
                    continue
            data = self.read_entry(topology, name, ekey, load=False)
            if data is None:
                done["refused"] += 1
                continue
            done["entries"] += 1
            if not self.artifact_dir(data["akey"]).is_dir():
                self._ensure_root()
                with self._locked(self._lock_path(data["akey"]), self.lock_timeout_s):
                    if self.remote.fetch_artifact(self, data["akey"]):
                        done["artifacts"] += 1
                    else:
                        done["refused"] += 1
        return done
