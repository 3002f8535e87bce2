"""Artifacts: publishing (build in tmp/, manifest last, rename in), verifying digests and signature, quarantine."""
from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import pathlib
import shutil
import stat
import time
import uuid
from typing import Callable, Sequence

from ..counters import counters
from ..errors import CacheCorruptionError, LockTimeoutError, UntrustedArtifactError
from ..key import FORMAT_VERSION
from . import files as fs
from .files import MANIFEST, SIGNATURE, _LOCKS_DIR, _is_lock_file, _makedirs, _sha256_file, _tmp_tag, write_json_atomic
from .signing import _hmac

log = logging.getLogger("gearcache.store")


class ArtifactMixin:
    """Part of ``Store``: publishing, verifying and quarantining artifacts."""

    def verify_artifact(self, akey: str, folder: pathlib.Path | None = None,
                        only: Sequence[str] | None = None) -> None:
        """Raise ``CacheCorruptionError`` unless every file of the artifact matches its manifest digest, no unlisted
        file could be executed, every file and folder in it is trusted (else ``UntrustedArtifactError``, a
        ``CacheCorruptionError`` too) and, with a signing key, ``MANIFEST.sig`` is the manifest's HMAC. A missing
        artifact raises ``FileNotFoundError``. ``folder``: check a copy of the artifact instead.

        ``only``: check just the parts a loader will read, as paths relative to the artifact folder: a folder ends in
        ``/`` (``"runplan/"``: everything under it, unlisted files included), anything else is one file, which the
        manifest must list. The manifest, its signature and the artifact folder itself are always checked. A load
        that goes on to read other parts (torch's loader reads the whole folder) must check the whole artifact
        first."""
        folder = self.artifact_dir(akey) if folder is None else pathlib.Path(folder)
        files = self._verified_manifest(akey, folder)
        top = str(folder)
        parts = [""] if only is None else list(only)
        present: set[str] = set()
        for part in parts:
            if part and not part.endswith("/"):
                self._check_one(top, part, files, present)
            else:
                self._walk_part(top, part, present)
        wanted = [rel for rel in files if any(rel == p or rel.startswith(p) for p in parts if p.endswith("/") or not p)]
        wanted += [p for p in parts if p and not p.endswith("/")]
        for rel in wanted:
            if rel not in present:
                raise CacheCorruptionError(top, f"{rel} is missing")
            if _sha256_file(folder / rel) != files[rel]:
                raise CacheCorruptionError(top, f"{rel} does not match its sha256 digest")
        extra = present - set(files) - {MANIFEST, SIGNATURE}
        if extra:
            raise CacheCorruptionError(str(folder), f"unlisted file(s) {sorted(extra)[:3]}")

    def _verified_manifest(self, akey: str, folder: pathlib.Path) -> dict[str, str]:
        """The artifact's ``files`` (relative path -> sha256), once the folder is trusted, the signature matches and
        the manifest names this format and key."""
        try:
            st = folder.lstat()
        except FileNotFoundError:
            raise FileNotFoundError(str(folder / MANIFEST)) from None
        if not stat.S_ISDIR(st.st_mode):
            raise CacheCorruptionError(str(folder), "it is not a folder")
        self._check_trusted(folder, artifact=True)
        try:
            raw = (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            if not folder.exists():
                raise FileNotFoundError(str(folder / MANIFEST)) from None      # removed meanwhile
            raise CacheCorruptionError(str(folder), "MANIFEST.json is missing") from None
        sig = None
        if self._key is not None:
            try:
                sig = (folder / SIGNATURE).read_text(encoding="ascii", errors="replace")
            except FileNotFoundError:
                pass
        return self.check_manifest(akey, raw, sig, str(folder))

    def check_manifest(self, akey: str, raw: bytes, sig: str | None, where: str) -> dict[str, str]:
        """The ``files`` (relative path -> sha256) of the manifest bytes ``raw``, once (with a signing key) ``sig``
        (``MANIFEST.sig``'s text; None: there is none) is its HMAC and it names this format and key. Else
        ``CacheCorruptionError`` naming ``where``."""
        if self._key is not None:
            if sig is None:
                raise CacheCorruptionError(where, "it is not signed (no MANIFEST.sig) and a signing key is set")
            if not hmac.compare_digest(sig.strip(), _hmac(self._key, raw)):
                raise CacheCorruptionError(where, "MANIFEST.sig does not match the manifest (tampered, or signed "
                                                  "with another key)")
        try:
            manifest = json.loads(raw)
            files: dict[str, str] = manifest["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheCorruptionError(where, f"MANIFEST.json unreadable ({exc})") from None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise CacheCorruptionError(where, "MANIFEST.json is malformed")
        if manifest.get("format") != FORMAT_VERSION or manifest.get("akey") != akey:
            raise CacheCorruptionError(where, "MANIFEST.json names another format or key")
        return files

    def verify_for_load(self, akey: str, only: Sequence[str] | None) -> None:
        """``verify_artifact(akey, only=only)`` before a load, skipped once right after this Store wrote ``akey``
        from bytes it had checked in memory (a fetch from the remote store: ``remote.py``), which would only read
        back what was just checked."""
        if akey in self._checked_in_memory:
            self._checked_in_memory.discard(akey)
            return
        self.verify_artifact(akey, only=only)

    def _walk_part(self, top: str, part: str, present: set[str]) -> None:
        """Check every file and folder under ``top/part`` (``""``: the whole artifact; the part's own folder too):
        no links, nothing untrusted; add its regular files to ``present``. A part that does not exist adds
        nothing (its listed files are then reported missing)."""
        start = os.path.join(top, part.rstrip("/")) if part else top
        if part:
            try:
                self._check_path(top, part.rstrip("/"), os.lstat(start))
            except FileNotFoundError:
                return
        cut = len(top) + 1
        for dirpath, dirnames, filenames in os.walk(start):         # never follows links: they are refused below
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                rel = full[cut:].replace(os.sep, "/")
                pst = os.lstat(full)
                if stat.S_ISLNK(pst.st_mode):
                    raise CacheCorruptionError(top, f"{rel} is a symbolic link")
                if rel + "/" == _LOCKS_DIR or _is_lock_file(rel):
                    continue                    # torch's empty lock files (and their folder): never executed
                self._check_path(top, rel, pst)
                if stat.S_ISREG(pst.st_mode):
                    present.add(rel)

    def _check_one(self, top: str, rel: str, files: dict[str, str], present: set[str]) -> None:
        """Check one file the manifest must list, and the folders between it and the artifact folder."""
        if rel not in files:
            raise CacheCorruptionError(top, f"{rel} is not listed in MANIFEST.json")
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            try:
                pst = os.lstat(os.path.join(top, *parts[:i]))
            except FileNotFoundError:
                return                          # reported missing by the caller
            self._check_path(top, sub, pst)
        if stat.S_ISREG(pst.st_mode):
            present.add(rel)

    def _check_path(self, top: str, rel: str, pst: os.stat_result) -> None:
        if stat.S_ISLNK(pst.st_mode):
            raise CacheCorruptionError(top, f"{rel} is a symbolic link")
        why = self._untrusted_why(pst, stat.S_ISDIR(pst.st_mode))
        if why is not None:
            raise UntrustedArtifactError(os.path.join(top, rel), pst.st_mode, f"{rel} in the artifact: {why}")

    def quarantine(self, akey: str, reason: str) -> None:
        """Move a corrupt artifact to ``quarantine/`` (under its lock, after checking it again: a process that
        checked an older copy never moves a good one away). Skipped while another process holds the lock: that
        process is rebuilding it."""
        try:
            with self._locked(self._lock_path(akey), 0):
                try:
                    self.verify_artifact(akey)
                    return                      # rebuilt meanwhile
                except FileNotFoundError:
                    return
                except CacheCorruptionError as exc:
                    self._quarantine_locked(akey, exc.reason or reason)
        except LockTimeoutError:
            log.info("artifact %s is locked by another process (rebuilding it); not quarantined here", akey)
        except OSError as exc:
            log.warning("could not quarantine artifact %s (%s); it is not loaded", akey, exc)

    def _quarantine_locked(self, akey: str, reason: str) -> None:
        folder = self.artifact_dir(akey)
        dest = self.root / "quarantine" / f"{akey}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
        _makedirs(dest.parent, self._dir_mode)
        try:
            fs._rename(folder, dest)
        except FileNotFoundError:
            return
        counters.quarantined += 1
        log.warning("quarantined artifact %s -> %s: %s", folder, dest, reason)
        self._index_pop([f"artifact:{akey}"])

    def publish_artifact(self, akey: str, build: Callable[[pathlib.Path], None]) -> tuple[pathlib.Path, bool]:
        """Return ``(artifact folder, built_here)``. Exactly one process per ``akey`` runs ``build(folder)``; the
        others wait on the artifact's lock and then find it published. ``build`` writes into an empty work folder
        that is renamed into place after its digests (and signature) are written. With ``max_size``, publishing
        evicts least recently used artifacts until the folder fits. With a remote store, the artifact is fetched
        from it when it has one, else one process of the whole fleet builds it and pushes it (``remote.py``)."""
        self._ensure_root()
        if not (self.root / "tmp").is_dir():
            raise FileNotFoundError(errno.ENOENT, "the cache folder vanished while this process ran", str(self.root))
        self.lease(akey)
        final = self.artifact_dir(akey)
        if self._valid(akey, quarantine=False):
            return final, False
        with self._locked(self._lock_path(akey), self.lock_timeout_s, on_wait=lambda: log.info(
                "artifact %s: another process holds its lock (compiling it); waiting for it (up to "
                "lock_timeout_s=%g s)", akey, self.lock_timeout_s)):
            if self._valid(akey, quarantine=True):
                return final, False
            if self.remote is None:
                log.info("compiling artifact %s", akey)
                size = self._build_artifact(akey, build)
            else:                           # one compile per fleet: fetched, or built here and pushed
                size = self.remote_publish(akey, lambda: self._build_artifact(akey, build))
                if size is None:
                    return final, False
        now = time.time()
        self._index_put(f"artifact:{akey}", {"bytes": size, "created": now, "last_used": now})
        if self.max_size is not None:
            self.evict(keep={akey}, when=f"after publishing {akey}")
        return final, True

    def _build_artifact(self, akey: str, build: Callable[[pathlib.Path], None]) -> int:
        """Run ``build`` into a work folder in ``tmp/``, write its manifest (and signature), rename it into
        ``artifacts/``; the caller holds the artifact's lock. Returns the artifact's bytes."""
        final = self.artifact_dir(akey)
        work = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
        work.mkdir(mode=self._dir_mode)
        try:
            build(work / "inductor")
            size = self._write_artifact_manifest(work, akey)
            if final.exists() or final.is_symlink():
                self._remove(final, akey)
            fs._rename(work, final)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        return size

    def _remove(self, folder: pathlib.Path, akey: str) -> None:
        """Rename ``folder`` into tmp/ (atomic: never seen half deleted), then delete it."""
        aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
        fs._rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _valid(self, akey: str, *, quarantine: bool) -> bool:
        try:
            self.verify_artifact(akey)
            return True
        except FileNotFoundError:
            return False
        except CacheCorruptionError as exc:
            if quarantine:
                self._quarantine_locked(akey, exc.reason)
            return False

    def _write_artifact_manifest(self, work: pathlib.Path, akey: str) -> int:
        for path in [work, *work.rglob("*")]:           # artifacts are never written again: nobody else may
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
        files = {p.relative_to(work).as_posix(): _sha256_file(p) for p in sorted(work.rglob("*"))
                 if p.is_file() and not _is_lock_file(p.relative_to(work).as_posix())}
        size = sum((work / rel).stat().st_size for rel in files)
        write_json_atomic(work / MANIFEST, {"format": FORMAT_VERSION, "akey": akey, "files": files,
                                            "created": time.time(), "bytes": size})
        if self._key is not None:
            sig = _hmac(self._key, (work / MANIFEST).read_bytes())
            tmp = work / f".{SIGNATURE}.tmp"
            tmp.write_text(sig + "\n")
            fs._replace(tmp, work / SIGNATURE)
        return size

