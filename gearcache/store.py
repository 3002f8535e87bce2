"""The embedded store: one local folder, safe for many processes and ranks at once.

On-disk layout (format 1)::

    <root>/                                   created 0700
      artifacts/<akey>/                       content-addressed compiled graph, shared by every rank
          inductor/...                        torch's unpacked artifact: generated code, kernels (.so / cubins)
          MANIFEST.json                       {"format", "akey", "files": {relpath: sha256}, "bytes", ...}
      entries/<topology>/<method>/<ekey>.json entry manifest: key factors, signature, input/output recipes, akey
      index/                                  diskcache index: bookkeeping for ls/stats/eviction, never on the call path
      locks/<akey>.lock                       one filelock per artifact: the process holding it compiles
      tmp/                                    work folders; a published artifact is renamed out of here
      quarantine/                             artifacts that failed their digest check, kept for inspection

Publishing is crash-safe: an artifact is built in ``tmp/``, its ``MANIFEST.json`` written last, then the folder is
renamed into ``artifacts/`` (atomic); an entry manifest is written to a temp name and ``os.replace``-d, after its
artifact exists. A reader treats an artifact without a valid manifest, or whose files do not match their digests, as
a miss. The index is written after the blobs; a missing blob is a miss (after diskcache).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import stat
import time
import uuid
from typing import Any, Callable

import filelock

from .counters import counters
from .errors import CacheCorruptionError, ConfigError, LockTimeoutError, UntrustedCacheError
from .key import FORMAT_VERSION

log = logging.getLogger("gearcache.store")

_LOCKS_DIR = "inductor/locks/"     # lock files torch writes while loading an artifact; empty, never executed


def default_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("GEARCACHE_HOME") or ".gearcache")


def _sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=repr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Store:
    def __init__(self, root: str | os.PathLike | None, *, lock_timeout_s: float = 900.0):
        self.root = pathlib.Path(root) if root is not None else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"cache_dir={str(self.root)!r} is a file, not a folder. Fix: pass a folder path "
                              f"(it is created if missing)")
        self.root = self.root.resolve()
        self.lock_timeout_s = lock_timeout_s
        self._index = None
        self._index_pid = None
        self._checked = False

    # ------------------------------------------------------------------------------------------------ layout
    def entry_path(self, topology_folder: str, method: str, ekey: str) -> pathlib.Path:
        return self.root / "entries" / topology_folder / method / f"{ekey}.json"

    def artifact_dir(self, akey: str) -> pathlib.Path:
        return self.root / "artifacts" / akey

    def _ensure_root(self) -> None:
        if self._checked:
            return
        for sub in ("", "artifacts", "entries", "locks", "tmp"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in ("", "artifacts", "entries"):
            self._check_trusted(self.root / sub)
        self._checked = True

    @staticmethod
    def _check_trusted(path: pathlib.Path) -> None:
        """Loading executes code: refuse a folder another user owns or can write (a sticky shared root is fine)."""
        st = path.stat()
        if st.st_uid != os.getuid():
            raise UntrustedCacheError(str(path), st.st_mode, f"it is owned by uid {st.st_uid}, not by you")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UntrustedCacheError(str(path), st.st_mode)

    # ------------------------------------------------------------------------------------------------ entries
    def read_entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        path = self.entry_path(topology_folder, method, ekey)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("unreadable entry manifest %s (%s): treated as a miss", path, exc)
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or data.get("ekey") != ekey:
            return None
        return data

    def write_entry(self, topology_folder: str, method: str, ekey: str, manifest: dict[str, Any]) -> None:
        self._ensure_root()
        write_json_atomic(self.entry_path(topology_folder, method, ekey), manifest)
        self._index_put(ekey, {"method": method, "topology": topology_folder, "akey": manifest["akey"],
                               "created": time.time(), "last_used": time.time()})

    def plan_path(self, topology_folder: str, method: str, pkey: str) -> pathlib.Path:
        return self.root / "entries" / topology_folder / method / "plans" / f"{pkey}.json"

    def read_plan(self, topology_folder: str, method: str, pkey: str) -> dict[str, Any] | None:
        """A gear plan written by :meth:`write_plan`, or None (missing, unreadable, other format)."""
        try:
            with open(self.plan_path(topology_folder, method, pkey), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        ok = isinstance(data, dict) and data.get("format") == FORMAT_VERSION and data.get("pkey") == pkey
        return data if ok else None

    def write_plan(self, topology_folder: str, method: str, pkey: str, plan: dict[str, Any]) -> None:
        self._ensure_root()
        write_json_atomic(self.plan_path(topology_folder, method, pkey), plan)

    def list_entries(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        folder = self.root / "entries" / topology_folder / method
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            data = self.read_entry(topology_folder, method, path.stem)
            if data is not None:
                out.append(data)
        return out

    # ---------------------------------------------------------------------------------------------- artifacts
    def verify_artifact(self, akey: str) -> None:
        """Raise ``CacheCorruptionError`` unless every file of the artifact matches its manifest digest and no
        unlisted file could be executed. A missing artifact raises ``FileNotFoundError``."""
        folder = self.artifact_dir(akey)
        manifest_path = folder / "MANIFEST.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(str(manifest_path))
        self._check_trusted(folder)
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            files: dict[str, str] = manifest["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheCorruptionError(str(folder), f"MANIFEST.json unreadable ({exc})") from None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise CacheCorruptionError(str(folder), "MANIFEST.json is malformed")
        if manifest.get("format") != FORMAT_VERSION or manifest.get("akey") != akey:
            raise CacheCorruptionError(str(folder), "MANIFEST.json names another format or key")
        for rel, digest in files.items():
            path = folder / rel
            if not path.is_file():
                raise CacheCorruptionError(str(folder), f"{rel} is missing")
            if _sha256_file(path) != digest:
                raise CacheCorruptionError(str(folder), f"{rel} does not match its sha256 digest")
        present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        extra = {p for p in present - set(files) - {"MANIFEST.json"} if not _is_lock_file(p)}
        if extra:
            raise CacheCorruptionError(str(folder), f"unlisted file(s) {sorted(extra)[:3]}")

    def quarantine(self, akey: str, reason: str) -> None:
        folder = self.artifact_dir(akey)
        dest = self.root / "quarantine" / f"{akey}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.rename(folder, dest)
            counters.quarantined += 1
            log.warning("quarantined artifact %s -> %s: %s", folder, dest, reason)
        except FileNotFoundError:
            pass

    def publish_artifact(self, akey: str, build: Callable[[pathlib.Path], None]) -> tuple[pathlib.Path, bool]:
        """Return ``(artifact folder, built_here)``. Exactly one process per ``akey`` runs ``build(folder)``; the
        others wait on the artifact's lock and then find it published. ``build`` writes into an empty work folder
        that is renamed into place after its digests are written."""
        self._ensure_root()
        final = self.artifact_dir(akey)
        if self._valid(akey):
            return final, False
        lock_path = self.root / "locks" / f"{akey}.lock"
        try:
            with filelock.FileLock(str(lock_path), timeout=self.lock_timeout_s):
                if self._valid(akey):
                    return final, False
                work = self.root / "tmp" / f"{akey}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                work.mkdir(mode=0o700)
                try:
                    build(work / "inductor")
                    self._write_artifact_manifest(work, akey)
                    if final.exists():
                        shutil.rmtree(final)
                    os.rename(work, final)
                finally:
                    if work.exists():
                        shutil.rmtree(work, ignore_errors=True)
        except filelock.Timeout:
            raise LockTimeoutError(str(lock_path), self.lock_timeout_s) from None
        self._index_put(f"artifact:{akey}", {"bytes": _folder_bytes(final), "created": time.time()})
        return final, True

    def _valid(self, akey: str) -> bool:
        try:
            self.verify_artifact(akey)
            return True
        except FileNotFoundError:
            return False
        except CacheCorruptionError as exc:
            self.quarantine(akey, exc.reason)
            return False

    @staticmethod
    def _write_artifact_manifest(work: pathlib.Path, akey: str) -> None:
        files = {p.relative_to(work).as_posix(): _sha256_file(p) for p in sorted(work.rglob("*"))
                 if p.is_file() and not _is_lock_file(p.relative_to(work).as_posix())}
        write_json_atomic(work / "MANIFEST.json", {
            "format": FORMAT_VERSION, "akey": akey, "files": files, "created": time.time(),
            "bytes": sum((work / rel).stat().st_size for rel in files)})

    # -------------------------------------------------------------------------------------------------- index
    @property
    def index(self):
        """diskcache index of entries and artifacts (bookkeeping only); reopened after a fork."""
        if self._index is None or self._index_pid != os.getpid():
            import diskcache

            self._ensure_root()
            self._index = diskcache.Index(str(self.root / "index"))
            self._index_pid = os.getpid()
        return self._index

    def _index_put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self.index[key] = value
        except Exception as exc:        # bookkeeping must never fail a call
            log.warning("cache index update failed (%s); entries stay usable", exc)

    def touch(self, ekey: str) -> None:
        """Record a load of an entry (not called per call: once per entry per process)."""
        try:
            row = self.index.get(ekey)
            if row is not None:
                row = dict(row, last_used=time.time(), loads=row.get("loads", 0) + 1)
                self.index[ekey] = row
        except Exception as exc:
            log.warning("cache index update failed (%s)", exc)


def _is_lock_file(rel: str) -> bool:
    return rel.startswith(_LOCKS_DIR) and rel.endswith(".lock") and "/" not in rel[len(_LOCKS_DIR):]


def _folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
