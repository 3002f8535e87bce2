"""Part of ``Store``: the glue between the local folder and its remote store (``remote.py``), on the miss path only.

Every method here is a no-op without a remote, never raises a remote fault (it is counted, warned once and the
local folder carries on alone), and holds the artifact's local lock while it fetches, so one process per machine
transfers an artifact.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import LockTimeoutError
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
