"""``Sync``: ``gearcache push`` / ``pull``, every entry of the folder to the remote store, or back. Unlike a miss
(``fleet.py``), these raise ``RemoteError``; in a folder without a remote store, ``ConfigError``."""
from __future__ import annotations

import json
import logging

from ..errors import CacheCorruptionError, ConfigError
from .artifacts import Artifacts
from .entries import Entries
from .fleet import Fleet
from .layout import Layout
from .locks import Locks
from .first_use import FirstUse
from .remote import REMOTE_ENV

log = logging.getLogger("gearcache.store")


class Sync:
    """Pushing the folder's entries to ``fleet.remote`` and pulling its entries into the folder (``fleet``: None
    when the folder has no remote store; then both raise ``ConfigError``)."""

    def __init__(self, layout: Layout, locks: Locks, first_use: FirstUse, entries: Entries, artifacts: Artifacts,
                 fleet: Fleet | None):
        self.layout, self.locks, self.first_use = layout, locks, first_use
        self.entries, self.artifacts, self._fleet = entries, artifacts, fleet

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise ConfigError(f"the store at {self.layout.root} has no remote store. Fix: pass remote=... (or set "
                              f"${REMOTE_ENV})")
        return self._fleet

    def push(self, *, force: bool = False) -> dict[str, int]:
        """Push every valid local entry and its artifact (an artifact the remote holds already is skipped unless
        ``force``). Raises ``RemoteError``; corrupt local artifacts are skipped (counted in ``"skipped"``)."""
        remote = self.fleet.remote
        done = {"entries": 0, "artifacts": 0, "skipped": 0}
        pushed: set[str] = set()
        for path in sorted(self.layout.entry_files()):
            topology, method, ekey = path.parent.parent.name, path.parent.name, path.stem
            data = self.entries.read(topology, method, ekey)
            if data is None:
                continue
            akey = data["akey"]
            try:
                self.artifacts.verify(akey)
            except (OSError, CacheCorruptionError) as exc:
                log.warning("not pushing entry %s: its artifact %s is not valid here (%s)", ekey, akey, exc)
                done["skipped"] += 1
                continue
            if akey not in pushed and (force or remote.backend.get(remote.head_key(akey)) is None):
                remote.push_artifact(self.artifacts, akey)
                done["artifacts"] += 1
            pushed.add(akey)
            raw = json.loads(path.read_bytes())         # as written here: signed with the key
            remote.push_entry(topology, method, ekey, raw)
            done["entries"] += 1
        return done

    def pull(self, *, method: str | None = None) -> dict[str, int]:
        """Fetch every remote entry (of ``method``, when given) and its artifact into this folder, checked as a
        miss would be. Raises ``RemoteError``."""
        remote = self.fleet.remote
        done = {"entries": 0, "artifacts": 0, "refused": 0}
        for topology, name, ekey in sorted(remote.entries()):
            if method is not None and name != method:
                continue
            if not self.layout.entry(topology, name, ekey).is_file():
                if not self.fleet.fetch_entry(topology, name, ekey):
                    done["refused"] += 1
                    continue
            data = self.entries.read(topology, name, ekey)
            if data is None:
                done["refused"] += 1
                continue
            done["entries"] += 1
            if not self.layout.artifact(data["akey"]).is_dir():
                self.first_use.ensure()
                with self.locks.held(self.locks.path(data["akey"]), self.locks.timeout_s):
                    if remote.fetch_artifact(self.artifacts, data["akey"]):
                        done["artifacts"] += 1
                    else:
                        done["refused"] += 1
        return done
