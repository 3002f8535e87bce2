"""``Entries``: entry manifests and gear plans, ``entries/<topology>/<method>/<ekey>.json`` and
``.../plans/<pkey>.json``."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Any

from ..counters import counters
from ..errors import UntrustedCacheError
from ..keys.key import FORMAT_VERSION
from . import files as fs
from .files import storage_fix, write_json_atomic
from .fleet import Fleet
from .index import Index
from .layout import Layout
from .leases import Leases
from .first_use import FirstUse
from .signing import json_signature_ok, sign_json, signature_problem
from .trust import Trust, first_untrusted_warning

log = logging.getLogger("gearcache.store")


class Entries:
    """Reading and writing the entry manifests and gear plans of one folder, signed with ``key`` (or unsigned: None).
    A read for a load leases the entry's artifact; with a remote store (``fleet``), a local miss is fetched from it
    and a written entry pushed to it."""

    def __init__(self, layout: Layout, trust: Trust, leases: Leases, index: Index, first_use: FirstUse,
                 key: bytes | None, fleet: Fleet | None):
        self.layout, self.trust, self.leases, self.index = layout, trust, leases, index
        self.first_use, self.key, self.fleet = first_use, key, fleet

    def read(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """The entry manifest (``"sig"`` dropped), or None: missing, unreadable, another format, not trusted, or
        (with a signing key) unsigned or wrongly signed. Nothing is leased, quarantined or fetched."""
        return self._read(topology_folder, method, ekey, load=False)

    def read_for_load(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """:meth:`read` for a process about to load the entry: the folder's first-use checks run first, a bad
        manifest is moved to quarantine/, and the artifact is leased (before the caller verifies it); with a remote
        store, a local miss is fetched from it (the entry, checked; then its artifact, verified and published here;
        the entry is written here at exit: ``Fleet.entry``), and a missing artifact of a local entry is fetched."""
        if not self.first_use.checked:
            try:
                self.first_use.ensure()              # first use: trust checks, leftovers of dead processes, max_size
            except OSError as exc:
                log.debug("cache folder %s not usable (%s)", self.layout.root, exc)
        return self._read(topology_folder, method, ekey, load=True)

    def _read(self, topology_folder: str, method: str, ekey: str, load: bool) -> dict[str, Any] | None:
        path = self.layout.entry(topology_folder, method, ekey)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:                   # with a remote: fetched, checked, its artifact published here
            return self.fleet.entry(topology_folder, method, ekey) if load and self.fleet is not None else None
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
        if self.trust.root_problem():
            return None
        data = self._checked(path, st, raw, ekey, load)
        if data is None:
            return None
        if load:
            self.leases.take(data["akey"])
            if self.fleet is not None:
                self.fleet.fetch_artifact(data["akey"])     # when it is not here yet
        self.first_use.seen()
        return data

    def _checked(self, path: pathlib.Path, st: os.stat_result, raw: bytes, ekey: str,
                 quarantine: bool) -> dict[str, Any] | None:
        """The manifest read from ``path`` once it is trusted, readable, of this format and key, names an artifact
        and (with a key) is signed; ``"sig"`` dropped. Else None (a bad one quarantined with ``quarantine``)."""
        why = self.trust.why(st, False) or self.trust.folder_problem(path.parent)
        if why is not None:
            return self._bad_entry(path, f"not trusted: {why}", quarantine)
        try:
            data = fs.read_json(raw)
        except ValueError as exc:
            return self._bad_entry(path, f"unreadable ({exc})", quarantine)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or data.get("ekey") != ekey:
            return None
        if not isinstance(data.get("akey"), str):
            return self._bad_entry(path, "it names no artifact", quarantine)
        if self.key is not None:
            if "sig" not in data:
                return self._bad_entry(path, "it is not signed and a signing key is set", quarantine)
            if not json_signature_ok(self.key, data):
                return self._bad_entry(path, "its signature does not match (tampered, or another key)", quarantine)
            data.pop("sig")
        return data

    def _bad_entry(self, path: pathlib.Path, why: str, quarantine: bool) -> dict[str, Any] | None:
        """None (a miss), the manifest at ``path`` moved to quarantine/ with ``quarantine``."""
        if not quarantine:
            log.debug("entry manifest %s %s; skipped", path, why)
            return None
        dest = self.layout.quarantined_entry(path.stem)
        try:
            self.layout.makedirs(dest.parent)
            fs._rename(path, dest)
            counters.add(quarantined=1)
            log.warning("entry manifest %s %s; moved to %s, treated as a miss", path, why, dest)
            return None
        except OSError:
            pass
        log.warning("entry manifest %s %s; treated as a miss", path, why)
        return None

    def write(self, topology_folder: str, method: str, ekey: str, manifest: dict[str, Any]) -> None:
        """Write an entry manifest (signed with a key). A store that cannot be written (full disk, read-only,
        vanished) is warned about, never raised: the process keeps its entry, later processes compile again."""
        path = self.layout.entry(topology_folder, method, ekey)
        data = sign_json(self.key, manifest) if self.key else manifest
        try:
            self.first_use.ensure()
            write_json_atomic(path, data, dir_mode=self.layout.dir_mode)
        except OSError as exc:
            if isinstance(exc, UntrustedCacheError) and not first_untrusted_warning(self.layout.root):
                return                          # warned once already, with the fix
            log.warning("could not write entry manifest %s (%s: %s): this process keeps using the entry, but later "
                        "processes will compile it again. Fix: %s", path, type(exc).__name__, exc,
                        storage_fix(exc, self.layout.root))
            return
        self.index.put(ekey, {"method": method, "topology": topology_folder, "akey": manifest["akey"],
                              "created": time.time(), "last_used": time.time()})
        if self.fleet is not None:
            self.fleet.push_entry(topology_folder, method, ekey, data)

    def read_gear_plan(self, topology_folder: str, method: str, pkey: str) -> dict[str, Any] | None:
        """A gear plan written by :meth:`write_gear_plan`, or None (missing, unreadable, other format, bad
        signature)."""
        try:
            data = fs.read_json(self.layout.gear_plan(topology_folder, method, pkey).read_bytes())
        except (OSError, ValueError):
            return None
        ok = isinstance(data, dict) and data.get("format") == FORMAT_VERSION and data.get("pkey") == pkey
        if ok and self.key is not None:
            ok = json_signature_ok(self.key, data)
            if ok:
                data.pop("sig")
        return data if ok else None

    def write_gear_plan(self, topology_folder: str, method: str, pkey: str, plan: dict[str, Any]) -> None:
        path = self.layout.gear_plan(topology_folder, method, pkey)
        try:
            self.first_use.ensure()
            write_json_atomic(path, sign_json(self.key, plan) if self.key else plan, dir_mode=self.layout.dir_mode)
        except OSError as exc:
            if isinstance(exc, UntrustedCacheError) and not first_untrusted_warning(self.layout.root):
                return                          # warned once already, with the fix
            log.warning("could not write gear plan %s (%s); later processes will trace it again. Fix: %s", path,
                        exc, storage_fix(exc, self.layout.root))

    def in_method(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        """Every entry manifest of a method that :meth:`read` accepts, in file name order."""
        folder = self.layout.method(topology_folder, method)
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            data = self.read(topology_folder, method, path.stem)
            if data is not None:
                out.append(data)
        return out

    def gear_plans_in_method(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        """Every gear plan of a method that :meth:`read_gear_plan` accepts, in file name order."""
        folder = self.layout.gear_plans(topology_folder, method)
        plans = [self.read_gear_plan(topology_folder, method, path.stem) for path in sorted(folder.glob("*.json"))]
        return [plan for plan in plans if plan is not None]

    # ------------------------------------------------------------------------------- for tools (gearcache ls, ...)
    def check(self, topology_folder: str, method: str,
              ekey: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
        """Read an entry manifest as a tool does (``gearcache ls``, ``verify``, ``prune``): nothing is leased,
        quarantined, fetched or written, and trust is left to ``Trust.path_problem``. ``(manifest, None)``
        (``"sig"`` dropped) when it names this format, ``ekey`` and an artifact and, with a signing key, is signed
        with it; else ``(None, (status, why))``: ``"corrupt"`` (unreadable, malformed, names another entry key or no
        artifact, unsigned or wrongly signed) or ``"incompatible"`` (another format)."""
        try:
            data = json.loads(self.layout.entry(topology_folder, method, ekey).read_bytes())
        except (OSError, ValueError) as exc:
            return None, ("corrupt", f"entry manifest unreadable ({exc})")
        if not isinstance(data, dict) or data.get("ekey") != ekey or not isinstance(data.get("akey"), str):
            return None, ("corrupt", "entry manifest is malformed or names another entry key")
        if data.get("format") != FORMAT_VERSION:
            return None, ("incompatible", f"entry format {data.get('format')!r}; this gearcache reads format "
                                          f"{FORMAT_VERSION}")
        why = signature_problem(self.key, data)
        if why:
            return None, ("corrupt", f"entry manifest: {why}")
        data.pop("sig", None)
        return data, None

    def remove(self, topology_folder: str, method: str, ekey: str) -> None:
        """Delete an entry manifest (``gearcache prune``); its artifact and index row are the caller's to remove."""
        self.layout.entry(topology_folder, method, ekey).unlink(missing_ok=True)
