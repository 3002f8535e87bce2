"""Entry manifests and gear plans: ``entries/<topology>/<method>/<ekey>.json`` and ``.../plans/<pkey>.json``."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time
import uuid
from typing import Any

from ..counters import counters
from ..errors import UntrustedCacheError
from ..key import FORMAT_VERSION
from . import files as fs
from .files import _makedirs, storage_fix, write_json_atomic
from .signing import json_signature_ok, sign_json, signature_problem
from .trust import first_untrusted_warning

log = logging.getLogger("gearcache.store")


class EntryMixin:
    """Part of ``Store``: reading and writing entry manifests and gear plans."""

    def read_entry(self, topology_folder: str, method: str, ekey: str, *, load: bool = True) -> dict[str, Any] | None:
        """The entry manifest, or None: missing, unreadable, another format, not trusted, or (with a signing key)
        unsigned or wrongly signed. ``load`` (a process about to load it): a bad manifest is moved to quarantine/
        and the artifact is leased before it is verified; with a remote store, a local miss is fetched from it (the
        entry, checked; then its artifact, verified and published here; the entry is written here at exit:
        ``FleetMixin.remote_entry``)."""
        if load and not self._checked:
            try:
                self._ensure_root()             # first use: trust checks, leftovers of dead processes, max_size
            except OSError as exc:
                log.debug("cache folder %s not usable (%s)", self.root, exc)
        path = self.entry_path(topology_folder, method, ekey)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:                   # with a remote: fetched, checked, its artifact published here
            return self.remote_entry(topology_folder, method, ekey) if load and self.remote is not None else None
        except OSError as exc:
            log.warning("unreadable entry manifest %s (%s): treated as a miss", path, exc)
            return None
        try:
            st = os.fstat(fd)
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
        except OSError as exc:
            log.warning("unreadable entry manifest %s (%s): treated as a miss", path, exc)
            return None
        if self._root_problem():
            return None
        why = self._untrusted_why(st, False) or self._untrusted_dir(path.parent)
        if why is not None:
            return self._bad_entry(path, f"not trusted: {why}", load)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return self._bad_entry(path, f"unreadable ({exc})", load)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or data.get("ekey") != ekey:
            return None
        if not isinstance(data.get("akey"), str):
            return self._bad_entry(path, "it names no artifact", load)
        if self._key is not None:
            if "sig" not in data:
                return self._bad_entry(path, "it is not signed and a signing key is set", load)
            if not json_signature_ok(self._key, data):
                return self._bad_entry(path, "its signature does not match (tampered, or another key)", load)
            data.pop("sig")
        if load:
            self.lease(data["akey"])
            if self.remote is not None:
                self.remote_fetch_artifact(data["akey"])    # when it is not here yet
        self._seen_root = True
        return data

    def _bad_entry(self, path: pathlib.Path, why: str, quarantine: bool) -> None:
        if not quarantine:
            log.debug("entry manifest %s %s; skipped", path, why)
            return None
        dest = self.root / "quarantine" / "entries" / f"{path.stem}.{int(time.time())}.{uuid.uuid4().hex[:6]}.json"
        try:
            _makedirs(dest.parent, self._dir_mode)
            fs._rename(path, dest)
            counters.quarantined += 1
            log.warning("entry manifest %s %s; moved to %s, treated as a miss", path, why, dest)
            return None
        except OSError:
            pass
        log.warning("entry manifest %s %s; treated as a miss", path, why)
        return None

    def write_entry(self, topology_folder: str, method: str, ekey: str, manifest: dict[str, Any]) -> None:
        """Write an entry manifest (signed with a key). A store that cannot be written (full disk, read-only,
        vanished) is warned about, never raised: the process keeps its entry, later processes compile again."""
        path = self.entry_path(topology_folder, method, ekey)
        data = sign_json(self._key, manifest) if self._key else manifest
        try:
            self._ensure_root()
            write_json_atomic(path, data, dir_mode=self._dir_mode)
        except OSError as exc:
            if isinstance(exc, UntrustedCacheError) and not first_untrusted_warning(self.root):
                return                          # warned once already, with the fix
            log.warning("could not write entry manifest %s (%s: %s): this process keeps using the entry, but later "
                        "processes will compile it again. Fix: %s", path, type(exc).__name__, exc,
                        storage_fix(exc, self.root))
            return
        self._index_put(ekey, {"method": method, "topology": topology_folder, "akey": manifest["akey"],
                               "created": time.time(), "last_used": time.time()})
        if self.remote is not None:
            self.remote_push_entry(topology_folder, method, ekey, data)

    def plan_path(self, topology_folder: str, method: str, pkey: str) -> pathlib.Path:
        return self.root / "entries" / topology_folder / method / "plans" / f"{pkey}.json"

    def read_plan(self, topology_folder: str, method: str, pkey: str) -> dict[str, Any] | None:
        """A gear plan written by :meth:`write_plan`, or None (missing, unreadable, other format, bad signature)."""
        try:
            with open(self.plan_path(topology_folder, method, pkey), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        ok = isinstance(data, dict) and data.get("format") == FORMAT_VERSION and data.get("pkey") == pkey
        if ok and self._key is not None:
            ok = json_signature_ok(self._key, data)
            if ok:
                data.pop("sig")
        return data if ok else None

    def write_plan(self, topology_folder: str, method: str, pkey: str, plan: dict[str, Any]) -> None:
        path = self.plan_path(topology_folder, method, pkey)
        try:
            self._ensure_root()
            write_json_atomic(path, sign_json(self._key, plan) if self._key else plan, dir_mode=self._dir_mode)
        except OSError as exc:
            if isinstance(exc, UntrustedCacheError) and not first_untrusted_warning(self.root):
                return                          # warned once already, with the fix
            log.warning("could not write gear plan %s (%s); later processes will trace it again. Fix: %s", path,
                        exc, storage_fix(exc, self.root))

    def list_entries(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        folder = self.root / "entries" / topology_folder / method
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            data = self.read_entry(topology_folder, method, path.stem, load=False)
            if data is not None:
                out.append(data)
        return out


    # ------------------------------------------------------------------------------- for tools (gearcache ls, ...)
    def entry_keys(self) -> list[tuple[str, str, str]]:
        """``(topology folder, method, ekey)`` of every entry manifest file in ``entries/``, readable or not, sorted."""
        return sorted((p.parent.parent.name, p.parent.name, p.stem) for p in (self.root / "entries").glob("*/*/*.json"))

    def check_entry(self, topology_folder: str, method: str,
                    ekey: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
        """Read an entry manifest as a tool does (``gearcache ls``, ``verify``, ``prune``): nothing is leased,
        quarantined, fetched or written, and trust is left to :meth:`untrusted_why`. ``(manifest, None)`` (``"sig"``
        dropped) when it names this format, ``ekey`` and an artifact and, with a signing key, is signed with it; else
        ``(None, (status, why))``: ``"corrupt"`` (unreadable, malformed, names another entry key or no artifact,
        unsigned or wrongly signed) or ``"incompatible"`` (another format)."""
        try:
            data = json.loads(self.entry_path(topology_folder, method, ekey).read_bytes())
        except (OSError, ValueError) as exc:
            return None, ("corrupt", f"entry manifest unreadable ({exc})")
        if not isinstance(data, dict) or data.get("ekey") != ekey or not isinstance(data.get("akey"), str):
            return None, ("corrupt", "entry manifest is malformed or names another entry key")
        if data.get("format") != FORMAT_VERSION:
            return None, ("incompatible", f"entry format {data.get('format')!r}; this gearcache reads format "
                                          f"{FORMAT_VERSION}")
        why = signature_problem(self._key, data)
        if why:
            return None, ("corrupt", f"entry manifest: {why}")
        data.pop("sig", None)
        return data, None

    def remove_entry(self, topology_folder: str, method: str, ekey: str) -> None:
        """Delete an entry manifest (``gearcache prune``); its artifact and index row are the caller's to remove."""
        self.entry_path(topology_folder, method, ekey).unlink(missing_ok=True)

    def list_plans(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        """Every gear plan of a method that :meth:`read_plan` accepts, in file name order."""
        folder = self.plan_path(topology_folder, method, "-").parent
        plans = [self.read_plan(topology_folder, method, path.stem) for path in sorted(folder.glob("*.json"))]
        return [plan for plan in plans if plan is not None]
