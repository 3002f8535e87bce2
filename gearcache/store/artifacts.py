"""``Artifacts``: publishing (build in tmp/, manifest last, rename in), installing checked bytes (a fetch from the
remote store), verifying digests and signature, quarantine."""
from __future__ import annotations

import hmac
import json
import logging
import os
import pathlib
import shutil
import stat
import sys
import time
from typing import Any, Callable, Protocol, Sequence

from ..counters import counters
from ..errors import CacheCorruptionError, LockTimeoutError, UntrustedArtifactError
from ..keys.key import FORMAT_VERSION
from . import files as fs
from .files import MANIFEST, SIGNATURE, _LOCKS_DIR, _is_lock_file, _sha256_file, write_json_atomic
from .index import Index
from .layout import TORCH_FOLDER, Layout
from .leases import Leases
from .locks import Locks
from .first_use import FirstUse
from .maintenance import Maintenance
from .signing import _hmac
from .stamps import Stamps, covered, manifest_digest, stat_record
from .trust import Trust

log = logging.getLogger("gearcache.store")



class FleetPublisher(Protocol):
    """What a publish needs of the remote store (``remote.RemoteStore``): whether it is up, and its one compile per
    fleet (fetch the artifact: None; or run ``build_here`` once for the fleet and push it: its size)."""

    def available(self) -> bool: ...

    def publish(self, artifacts: Artifacts, akey: str, build_here: Callable[[], int], wait_s: float) -> int | None: ...


# A checked file of a fetched artifact: (relative path, bytes, mode).
CheckedFile = tuple[str, memoryview, int]


class Artifacts:
    """Publishing, installing, verifying and quarantining the artifacts of one folder, signed with ``key`` (or
    unsigned: None). A publish leases the artifact, records it in the index and (``maintenance.max_size``) evicts.
    ``remote``: the remote store a publish goes through (None: a local folder only)."""

    def __init__(self, layout: Layout, locks: Locks, leases: Leases, trust: Trust, index: Index, first_use: FirstUse,
                 maintenance: Maintenance, stamps: Stamps, key: bytes | None, remote: FleetPublisher | None):
        self.layout, self.locks, self.leases, self.trust, self.index = layout, locks, leases, trust, index
        self.first_use, self.maintenance, self.stamps = first_use, maintenance, stamps
        self.key, self.remote = key, remote
        self._checked_in_memory: set[str] = set()   # artifacts installed here from bytes checked in memory

    def folder(self, akey: str) -> pathlib.Path:
        return self.layout.artifact(akey)

    def verify(self, akey: str, folder: pathlib.Path | None = None,
               only: Sequence[str] | None = None) -> None:
        """Raise ``CacheCorruptionError`` unless every file of the artifact matches its manifest digest, no unlisted
        file could be executed, every file and folder in it is trusted (else ``UntrustedArtifactError``, a
        ``CacheCorruptionError`` too) and, with a signing key, ``MANIFEST.sig`` is the manifest's HMAC. A missing
        artifact raises ``FileNotFoundError``. ``folder``: check a copy of the artifact instead. Every digest is
        computed (what ``gearcache verify`` runs); :meth:`check` skips them for an unchanged, stamped artifact.

        ``only``: check just the parts a loader will read, as paths relative to the artifact folder: a folder ends in
        ``/`` (``"runplan/"``: everything under it, unlisted files included), anything else is one file, which the
        manifest must list. The manifest, its signature and the artifact folder itself are always checked. A load
        that goes on to read other parts (torch's loader reads the whole folder) must check the whole artifact
        first."""
        self._verify(akey, self.layout.artifact(akey) if folder is None else pathlib.Path(folder), only, {})

    def _verify(self, akey: str, folder: pathlib.Path, only: Sequence[str] | None,
                seen: dict[str, os.stat_result]) -> bytes:
        """:meth:`verify`; ``seen`` gets the ``lstat`` of every file and folder checked (``""``: the folder itself),
        each taken before the file was read. Returns the manifest's bytes."""
        files, raw = self._verified_manifest(akey, folder, seen)
        top = str(folder)
        parts = [""] if only is None else list(only)
        present: set[str] = set()
        for part in parts:
            if part and not part.endswith("/"):
                self._check_one(top, part, files, present, seen)
            else:
                self._walk_part(top, part, present, seen)
        wanted = [rel for rel in files if any(rel == p or rel.startswith(p) for p in parts if p.endswith("/") or not p)]
        wanted += [p for p in parts if p and not p.endswith("/")]
        for rel in wanted:
            if rel not in present:
                raise CacheCorruptionError(top, f"{rel} is missing")
            counters.add(digests=1)
            if _sha256_file(folder / rel) != files[rel]:
                raise CacheCorruptionError(top, f"{rel} does not match its sha256 digest")
        extra = present - set(files) - {MANIFEST, SIGNATURE}
        if extra:
            raise CacheCorruptionError(str(folder), f"unlisted file(s) {sorted(extra)[:3]}")
        return raw

    def _verified_manifest(self, akey: str, folder: pathlib.Path,
                           seen: dict[str, os.stat_result]) -> tuple[dict[str, str], bytes]:
        """The artifact's ``files`` (relative path -> sha256) and the manifest's bytes, once the folder is trusted,
        the signature matches and the manifest names this format and key; the folder's ``lstat`` in ``seen``."""
        try:
            st = folder.lstat()
        except FileNotFoundError:
            raise FileNotFoundError(str(folder / MANIFEST)) from None
        if not stat.S_ISDIR(st.st_mode):
            raise CacheCorruptionError(str(folder), "it is not a folder")
        seen[""] = st
        self.trust.check(folder, artifact=True)
        try:
            raw = (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            if not folder.exists():
                raise FileNotFoundError(str(folder / MANIFEST)) from None      # removed meanwhile
            raise CacheCorruptionError(str(folder), "MANIFEST.json is missing") from None
        sig = None
        if self.key is not None:
            try:
                sig = (folder / SIGNATURE).read_text(encoding="ascii", errors="replace")
            except FileNotFoundError:
                pass
        return self.check_manifest(akey, raw, sig, str(folder)), raw

    def check_manifest(self, akey: str, raw: bytes, sig: str | None, where: str) -> dict[str, str]:
        """The ``files`` (relative path -> sha256) of the manifest bytes ``raw``, once (with a signing key) ``sig``
        (``MANIFEST.sig``'s text; None: there is none) is its HMAC and it names this format and key. Else
        ``CacheCorruptionError`` naming ``where``."""
        if self.key is not None:
            if sig is None:
                raise CacheCorruptionError(where, "it is not signed (no MANIFEST.sig) and a signing key is set")
            if not hmac.compare_digest(sig.strip(), _hmac(self.key, raw)):
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
        """:meth:`check` before a load, skipped once right after this Store wrote ``akey`` from bytes it had checked
        in memory (a fetch from the remote store: ``remote.py``), which would only read back what was just checked."""
        if akey in self._checked_in_memory:
            self._checked_in_memory.discard(akey)
            return
        self.check(akey, only)

    def check(self, akey: str, only: Sequence[str] | None = None) -> None:
        """``verify(akey, only=only)``, whose digests are skipped where the artifact is unchanged since a full check
        stamped it (stamps.py): every file and folder ``only`` covers has the ``lstat`` the stamp recorded (a change
        of any file changes its ctime), and the manifest is the stamped one, its signature and every trust check
        passing as in a full check. Anything else is a full check, which stamps the artifact when it passes."""
        if self._stamped(akey, only):
            return
        seen: dict[str, os.stat_result] = {}
        raw = self._verify(akey, self.layout.artifact(akey), only, seen)
        self.stamps.write(akey, raw, only, seen, fresh=False)

    def _stamped(self, akey: str, only: Sequence[str] | None) -> bool:
        """Whether artifact ``akey`` passes :meth:`check` by its stamp (False: check it in full)."""
        stamp = self.stamps.read(akey)
        rels = None if stamp is None else covered(stamp, only)
        if stamp is None or rels is None:
            return False
        folder = self.layout.artifact(akey)
        top, paths = str(folder), stamp["paths"]
        try:
            _, raw = self._verified_manifest(akey, folder, {})
            if manifest_digest(raw) != stamp["manifest"]:
                return False
            for rel in rels:
                pst = os.lstat(os.path.join(top, rel) if rel else top)
                if stat_record(pst) != paths[rel]:
                    return False
                if rel and rel + "/" != _LOCKS_DIR:
                    self._check_path(top, rel, pst)
        except (OSError, CacheCorruptionError):
            return False                        # the full check raises what is wrong
        counters.add(stamped_checks=1)
        return True

    def _walk_part(self, top: str, part: str, present: set[str], seen: dict[str, os.stat_result]) -> None:
        """Check every file and folder under ``top/part`` (``""``: the whole artifact; the part's own folder too):
        no links, nothing untrusted; add its regular files to ``present``, the ``lstat`` of each (torch's lock files
        aside) to ``seen``. A part that does not exist adds nothing (its listed files are then reported missing)."""
        start = os.path.join(top, part.rstrip("/")) if part else top
        if part:
            try:
                pst = os.lstat(start)
            except FileNotFoundError:
                return
            self._check_path(top, part.rstrip("/"), pst)
            seen[part.rstrip("/")] = pst
        cut = len(top) + 1
        for dirpath, dirnames, filenames in os.walk(start):         # never follows links: they are refused below
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                rel = full[cut:].replace(os.sep, "/")
                pst = os.lstat(full)
                if stat.S_ISLNK(pst.st_mode):
                    raise CacheCorruptionError(top, f"{rel} is a symbolic link")
                if _is_lock_file(rel):
                    continue                    # torch's empty lock files: never executed
                seen[rel] = pst                 # (their folder too: a file added there changes it)
                if rel + "/" == _LOCKS_DIR:
                    continue
                self._check_path(top, rel, pst)
                if stat.S_ISREG(pst.st_mode):
                    present.add(rel)

    def _check_one(self, top: str, rel: str, files: dict[str, str], present: set[str],
                   seen: dict[str, os.stat_result]) -> None:
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
            seen[sub] = pst
        if stat.S_ISREG(pst.st_mode):
            present.add(rel)

    def _check_path(self, top: str, rel: str, pst: os.stat_result) -> None:
        if stat.S_ISLNK(pst.st_mode):
            raise CacheCorruptionError(top, f"{rel} is a symbolic link")
        why = self.trust.why(pst, stat.S_ISDIR(pst.st_mode))
        if why is not None:
            raise UntrustedArtifactError(os.path.join(top, rel), pst.st_mode, f"{rel} in the artifact: {why}")

    def quarantine(self, akey: str, reason: str) -> None:
        """Move a corrupt artifact to ``quarantine/`` (under its lock, after checking it again: a process that
        checked an older copy never moves a good one away). Skipped while another process holds the lock: that
        process is rebuilding it."""
        try:
            with self.locks.held(self.locks.path(akey), 0):
                try:
                    self.verify(akey)
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
        folder = self.layout.artifact(akey)
        dest = self.layout.quarantined_artifact(akey)
        self.layout.makedirs(dest.parent)
        try:
            fs._rename(folder, dest)
        except FileNotFoundError:
            return
        self.stamps.remove(akey)
        counters.add(quarantined=1)
        log.warning("quarantined artifact %s -> %s: %s", folder, dest, reason)
        self.index.pop([f"artifact:{akey}"])

    def publish(self, akey: str, build: Callable[[pathlib.Path], None]) -> tuple[pathlib.Path, bool]:
        """Return ``(artifact folder, built_here)``. Exactly one process per ``akey`` runs ``build(folder)``; the
        others wait on the artifact's lock and then find it published. ``build`` writes into an empty work folder
        that is renamed into place after its digests (and signature) are written. With ``max_size``, publishing
        evicts least recently used artifacts until the folder fits. With a remote store (``self.remote``):
        the artifact is fetched from it when it has one, else one process of the whole fleet builds it and pushes
        it (``remote.py``)."""
        self.first_use.ensure()
        if not self.layout.tmp.is_dir():
            raise self.first_use.vanished()
        self.leases.take(akey)
        final = self.layout.artifact(akey)
        if self._valid(akey, quarantine=False):
            return final, False
        with self.locks.held(self.locks.path(akey), self.locks.timeout_s, on_wait=lambda: self._waiting(akey)):
            if self._valid(akey, quarantine=True):
                return final, False
            if self.remote is None:
                log.info("compiling artifact %s", akey)
                size = self._build(akey, build)
            else:                           # one compile per fleet: fetched, or built here and pushed
                fetched_or_size = self._through_remote(self.remote, akey, lambda: self._build(akey, build))
                if fetched_or_size is None:
                    return final, False
                size = fetched_or_size
        now = time.time()
        self.index.put(f"artifact:{akey}", {"bytes": size, "created": now, "last_used": now})
        if self.maintenance.max_size is not None:
            self.maintenance.evict(keep={akey}, when=f"after publishing {akey}")
        return final, True

    def _through_remote(self, remote: FleetPublisher, akey: str, build_here: Callable[[], int]) -> int | None:
        """Under the artifact's local lock: fetch it from the remote store (None), or build it here once for the
        fleet (its size); a remote store that is down (``available``) is skipped: built here."""
        if not remote.available():
            return build_here()
        return remote.publish(self, akey, build_here, wait_s=self.locks.timeout_s)

    def _waiting(self, akey: str) -> None:
        """Another process holds artifact ``akey``'s lock (compiling it): say so, naming it, in the log and, in a
        job of ranks, in this rank's report to the others (gearcache/ranks/phases.py)."""
        holder = self.locks.holder(self.locks.path(akey))
        log.info("artifact %s: another process holds its lock (compiling it: %s); waiting for it (up to "
                 "lock_timeout_s=%g s)", akey, holder, self.locks.timeout_s)
        if "torch.distributed" in sys.modules:      # a job of ranks: only then is there anyone to tell
            from ..ranks import phases as ranks

            ranks.note(f"waiting for the lock of artifact {akey[:16]}, held by {holder} (compiling it)")

    def _build(self, akey: str, build: Callable[[pathlib.Path], None]) -> int:
        """Run ``build`` into a work folder in ``tmp/``, write its manifest (and signature), rename it into
        ``artifacts/``; the caller holds the artifact's lock. Returns the artifact's bytes."""
        work = self.layout.work(akey)
        work.mkdir(mode=self.layout.dir_mode)
        try:
            build(work / TORCH_FOLDER)
            hashed: dict[str, os.stat_result] = {}
            size = self._write_manifest(work, akey, hashed)
            self._rename_in(work, akey, hashed)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        return size

    def install(self, akey: str, files: list[CheckedFile], manifest: str, sig: str | None, *, origin: str,
                size: int) -> None:
        """Install artifact ``akey`` from bytes checked in memory (a fetch from the remote store at ``origin``:
        ``remote.checked_files``): ``files`` written into a work folder, then ``MANIFEST.json`` and ``MANIFEST.sig``
        last, renamed into ``artifacts/``; the next load's check is skipped once (:meth:`verify_for_load`: it would
        read back what was just checked), and the index row is written at exit (a first call never opens the SQLite
        index). The caller holds the artifact's lock."""
        work = self.layout.work(akey)
        try:
            _unpack(self.layout, work, files, manifest, sig)
            self._rename_in(work, akey)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        self._checked_in_memory.add(akey)
        now = time.time()
        row = {"bytes": size, "created": now, "last_used": now, "from": origin}

        def record(index: Any) -> None:
            index[f"artifact:{akey}"] = dict(index.get(f"artifact:{akey}") or {}, **row)

        self.index.defer(record)

    def _rename_in(self, work: pathlib.Path, akey: str, hashed: dict[str, os.stat_result] | None = None) -> None:
        """Rename the finished work folder into ``artifacts/``, replacing a (corrupt) folder there, and stamp it
        (stamps.py: the folder as this process wrote it, checked against the manifest it wrote, which a later
        load then need not hash again). ``hashed``: each listed file's ``lstat`` taken before its digest (a
        build's); the folder is stamped only where its files are the listed ones, each unchanged since its digest
        (a file written after the digests, which a full check refuses, is not stamped)."""
        seen: dict[str, os.stat_result] = {}
        present: set[str] = set()
        try:
            self._walk_part(str(work), "", present, seen)
            text = (work / MANIFEST).read_bytes()
            raw: bytes | None = text
            listed = set(json.loads(text)["files"])
        except (OSError, CacheCorruptionError, ValueError, KeyError, TypeError):
            raw, listed = None, set()           # not stamped: its first load checks it in full
        if present - {MANIFEST, SIGNATURE} != listed or (hashed is not None and any(
                rel not in hashed or stat_record(hashed[rel]) != stat_record(seen[rel]) for rel in listed)):
            raw = None
        final = self.layout.artifact(akey)
        if final.exists() or final.is_symlink():
            aside = self.layout.work(akey)      # renamed into tmp/ (atomic: never seen half deleted), then deleted
            fs._rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        fs._rename(work, final)
        if raw is not None:
            try:
                seen[""] = final.lstat()        # (the rename changed its ctime)
            except OSError:
                return
            self.stamps.write(akey, raw, None, seen, fresh=True)

    def _valid(self, akey: str, *, quarantine: bool) -> bool:
        try:
            self.check(akey)
            return True
        except FileNotFoundError:
            return False
        except CacheCorruptionError as exc:
            if quarantine:
                self._quarantine_locked(akey, exc.reason)
            return False

    def _write_manifest(self, work: pathlib.Path, akey: str, hashed: dict[str, os.stat_result]) -> int:
        for path in [work, *work.rglob("*")]:           # artifacts are never written again: nobody else may
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
        files: dict[str, str] = {}
        for p in sorted(work.rglob("*")):               # ``hashed``: each file's lstat before its digest
            rel = p.relative_to(work).as_posix()
            if p.is_file() and not _is_lock_file(rel):
                hashed[rel] = p.lstat()
                files[rel] = _sha256_file(p)
        size = sum((work / rel).stat().st_size for rel in files)
        write_json_atomic(work / MANIFEST, {"format": FORMAT_VERSION, "akey": akey, "files": files,
                                            "created": time.time(), "bytes": size})
        if self.key is not None:
            sig = _hmac(self.key, (work / MANIFEST).read_bytes())
            tmp = work / f".{SIGNATURE}.tmp"
            tmp.write_text(sig + "\n")
            fs._replace(tmp, work / SIGNATURE)
        return size



def _unpack(layout: Layout, work: pathlib.Path, files: list[CheckedFile], manifest: str, sig: str | None) -> None:
    """Write the checked ``files`` into the new folder ``work``, then ``MANIFEST.json`` and ``MANIFEST.sig`` last."""
    work.mkdir(mode=layout.dir_mode)
    made = {work}
    for rel, data, mode in files:
        path = work.joinpath(*rel.split("/"))
        if path.parent not in made:
            layout.makedirs(path.parent)
            made.update(path.parents)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    (work / MANIFEST).write_text(manifest)
    if sig is not None:
        (work / SIGNATURE).write_text(str(sig))
