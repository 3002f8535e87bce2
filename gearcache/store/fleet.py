"""Part of ``Store``: the glue between the local folder and its remote store (``remote.py``).

The miss-path methods (``remote_*``, called only when ``Store.remote`` is set, never per call) never raise a remote
fault: it is counted, warned once, and the local folder carries on alone. They hold the artifact's local lock while
they fetch, so one process per machine transfers an artifact. ``push_to_remote`` / ``pull_from_remote`` serve
``gearcache push`` / ``pull`` and raise ``RemoteError``.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from ..errors import CacheCorruptionError, LockTimeoutError
from .backend import RemoteError
from .remote import write_fetched_entry

log = logging.getLogger("gearcache.store")


class FleetMixin:
    """Part of ``Store``: fetching from and pushing to ``self.remote`` (a ``RemoteStore``, or None)."""

    def remote_fetch_entry(self, topology_folder: str, method: str, ekey: str) -> bool:
        """Fetch a remote entry manifest (signature checked) and write it here. False: none, refused, or a fault."""
        if not self.remote.available():
            return False
        try:
            data = self.remote.fetch_entry(topology_folder, method, ekey)
        except RemoteError as exc:
            self.remote.failed(exc, f"entry {ekey} is compiled here")
            return False
        if data is None:
            return False
        try:
            self._ensure_root()
            write_fetched_entry(self.entry_path(topology_folder, method, ekey), data, self._dir_mode)
        except OSError as exc:
            log.warning("could not write the fetched entry manifest %s here (%s)", ekey, exc)
            return False
        return True

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
