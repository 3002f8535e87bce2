"""The embedded store: one local folder, safe for many processes and ranks at once.

On-disk layout (format 1)::

    <root>/                                   created 0700
      artifacts/<akey>/                       content-addressed compiled graph, shared by every rank
          inductor/...                        torch's unpacked artifact: generated code, kernels (.so / cubins)
          MANIFEST.json                       {"format", "akey", "files": {relpath: sha256}, "bytes", ...}
          MANIFEST.sig                        with a signing key: HMAC-SHA256 of MANIFEST.json's bytes
      entries/<topology>/<method>/<ekey>.json entry manifest: key factors, signature, input/output recipes, akey
                                              (with a signing key: a "sig" field over the canonical JSON of the rest)
      index/                                  diskcache index: bookkeeping for ls/stats/eviction, never on the call path
      locks/<akey>.lock                       one lock per artifact: the process holding it compiles
      locks/<akey>.lease.lock                 held for a moment while a lease is taken or an artifact evicted
      leases/<akey>/<pid>@<host>              "this process loaded the artifact": never evicted while the pid lives
      tmp/<akey>.<pid>.<tag>                  work folders; a published artifact is renamed out of here
      quarantine/                             artifacts (and entry manifests) that failed a check, kept for inspection

Publishing is crash-safe: an artifact is built in ``tmp/``, its ``MANIFEST.json`` (and signature) written last, then
the folder is renamed into ``artifacts/`` (atomic); an entry manifest is written to a temp name and ``os.replace``-d,
after its artifact exists. A reader treats an artifact without a valid manifest, or whose files do not match their
digests, as corrupt: quarantined, never executed. Leftovers of killed processes (work folders, temp manifest files,
leases, soft locks) are removed by :meth:`Store.cleanup`, run once by every Store that writes. See
docs/RELIABILITY.md for every fault and what happens.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import stat
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterator

import filelock

from .counters import counters
from .errors import (CacheCorruptionError, ConfigError, LockTimeoutError, UntrustedArtifactError,
                     UntrustedCacheError)
from .key import FORMAT_VERSION

log = logging.getLogger("gearcache.store")

_LOCKS_DIR = "inductor/locks/"     # lock files torch writes while loading an artifact; empty, never executed
SIGNING_KEY_ENV = "GEARCACHE_SIGNING_KEY"
MANIFEST = "MANIFEST.json"
SIGNATURE = "MANIFEST.sig"
TMP_MAX_AGE_S = 3600.0             # a temp folder or file of another host (whose pid cannot be checked) older than this
FOREIGN_LEASE_TTL_S = 24 * 3600.0  # a lease of another host (whose pid cannot be checked) counts for this long
LEASE_LOCK_TIMEOUT_S = 30.0
HOST = socket.gethostname()
HOST_TAG = hashlib.sha256(HOST.encode()).hexdigest()[:6]   # in temp names: tells this host's leftovers from others'
_TMP_FILE = re.compile(r"^\..+\.(?P<pid>\d+)\.(?P<tag>[0-9a-f]+)\.tmp$")


def default_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("GEARCACHE_HOME") or ".gearcache")


# Every rename of the store goes through these two (tests simulate a full or read-only disk by replacing them).
def _rename(src: os.PathLike, dst: os.PathLike) -> None:
    os.rename(src, dst)


def _replace(src: os.PathLike, dst: os.PathLike) -> None:
    os.replace(src, dst)


def _sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tmp_tag() -> str:
    return f"{HOST_TAG}{uuid.uuid4().hex[:8]}"


def _mkdir(path: pathlib.Path, mode: int) -> None:
    """``mkdir`` with exactly ``mode`` (not narrowed by the umask: a shared store's folders are group-writable)."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    os.chmod(path, mode)


def _makedirs(path: pathlib.Path, mode: int) -> None:
    """``mkdir -p`` where every folder created gets ``mode`` (pathlib gives missing parents the default mode)."""
    if path.is_dir():
        return
    _makedirs(path.parent, mode)
    _mkdir(path, mode)


def write_json_atomic(path: pathlib.Path, data: Any, *, dir_mode: int = 0o700) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, fsync'd, then ``os.replace``: a reader sees
    the old file or the new one, never a part. A temp file left by a killed writer is removed by ``Store.cleanup``."""
    _makedirs(path.parent, dir_mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_tmp_tag()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=repr)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------------------- signatures
def canonical_bytes(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=repr).encode()


def _hmac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def sign_json(key: bytes, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it will read back from JSON, with ``"sig"``: HMAC-SHA256 over the canonical JSON of the rest."""
    plain = json.loads(json.dumps(data, default=repr))
    plain.pop("sig", None)
    plain["sig"] = _hmac(key, canonical_bytes(plain))
    return plain


def json_signature_ok(key: bytes, data: dict[str, Any]) -> bool:
    sig = data.get("sig")
    if not isinstance(sig, str):
        return False
    rest = {k: v for k, v in data.items() if k != "sig"}
    return hmac.compare_digest(sig, _hmac(key, canonical_bytes(rest)))


# -------------------------------------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from /proc (None where there is no /proc or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode(), rest[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def _start_token(pid: int) -> str:
    info = _proc_stat(pid)
    return info[1] if info else ""


def pid_alive(pid: int, start_token: str = "") -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not; nor does a new process that reused the pid, when
    ``start_token`` is known)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                    # it exists, under another user
    except OSError:
        return True
    info = _proc_stat(pid)
    if info is None:
        return True
    state, start = info
    if state in ("Z", "X"):
        return False
    return not start_token or start == start_token


# Leases held by this process: (root, akey) -> number of live Store objects holding it. The lease file is removed
# when the last one is garbage collected (or at exit); a killed process's file names a dead pid and is ignored.
_LEASES: dict[tuple[str, str], int] = {}
_LEASES_LOCK = threading.Lock()


# Index bookkeeping (last_used, load counts) is queued and written in one transaction at exit, or when
# ``flush_index_updates`` is called: a warm process's first call neither imports diskcache nor opens SQLite.
_DEFERRED: dict[str, list[Callable[[Any], None]]] = {}
_DEFERRED_LOCK = threading.Lock()
_DEFERRED_ATEXIT = [False]


def flush_index_updates() -> None:
    """Write the queued index updates of every cache folder of this process. Never raises."""
    with _DEFERRED_LOCK:
        pending = dict(_DEFERRED)
        _DEFERRED.clear()
    for root, updates in pending.items():
        if not os.path.isdir(root):
            continue                    # the cache folder was removed: never recreate it
        try:
            index = Store(root).index
            with index.transact():
                for update in updates:
                    update(index)
        except Exception as exc:
            log.debug("cache index update of %s failed (%s); entries stay usable", root, exc)


def _release_leases(root: str, akeys: set[str], pid: int) -> None:
    if os.getpid() != pid:
        return                                  # a forked child: the leases are its parent's
    for akey in list(akeys):
        with _LEASES_LOCK:                      # unlinked under the lock: a new lease() of this process waits
            n = _LEASES.get((root, akey), 0) - 1
            if n > 0:
                _LEASES[(root, akey)] = n
                continue
            _LEASES.pop((root, akey), None)
            path = pathlib.Path(root) / "leases" / akey / f"{pid}@{HOST}"
            with contextlib.suppress(OSError):
                path.unlink()                   # (empty lease folders are removed by Store.cleanup)


class Store:
    """One cache folder. Cheap to create; nothing is touched on disk until the first read or write."""

    def __init__(self, root: str | os.PathLike | None, *, lock_timeout_s: float = 900.0, lock_mode: str = "flock",
                 max_size: int | None = None, signing_key: str | bytes | None = None,
                 trust_shared_folder: bool = False):
        self.root = pathlib.Path(root) if root is not None else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"cache_dir={str(self.root)!r} is a file, not a folder. Fix: pass a folder path "
                              f"(it is created if missing)")
        if lock_mode not in ("flock", "soft"):
            raise ConfigError(f"lock_mode={lock_mode!r}: expected 'flock' or 'soft'")
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0):
            raise ConfigError(f"max_size={max_size!r}: expected a positive number of bytes, or None for no limit")
        self.root = self.root.resolve()
        self.lock_timeout_s = lock_timeout_s
        self.lock_mode = lock_mode
        self.max_size = max_size
        key = signing_key if signing_key is not None else os.environ.get(SIGNING_KEY_ENV) or None
        self._key: bytes | None = (key.encode() if isinstance(key, str) else key) or None
        self.trust_shared_folder = bool(trust_shared_folder)
        self._dir_mode = 0o770 if self._shared else 0o700
        self._index = None
        self._index_pid = None
        self._checked = False
        self._seen_root = False     # an entry was read from it: if it is gone later, it vanished (never recreate it)
        self._root_trusted: str | None = None          # None: not checked yet; "": trusted; else why not
        self._leased: set[str] = set()
        self._lease_finalizer = None

    @classmethod
    def from_config(cls, root: str | os.PathLike | None, config: Any) -> "Store":
        """The store a ``CompilerConfig`` asks for (lock timeout and mode, size cap, signing key, shared folder)."""
        return cls(root, lock_timeout_s=config.lock_timeout_s, lock_mode=config.lock_mode, max_size=config.max_size,
                   signing_key=config.signing_key, trust_shared_folder=config.trust_shared_folder)

    @property
    def signed(self) -> bool:
        """Whether a signing key is set: everything written is signed, nothing unsigned is loaded."""
        return self._key is not None

    @property
    def _shared(self) -> bool:
        return self.trust_shared_folder and self._key is not None

    # ------------------------------------------------------------------------------------------------ layout
    def entry_path(self, topology_folder: str, method: str, ekey: str) -> pathlib.Path:
        return self.root / "entries" / topology_folder / method / f"{ekey}.json"

    def artifact_dir(self, akey: str) -> pathlib.Path:
        return self.root / "artifacts" / akey

    def _ensure_root(self) -> None:
        if self._checked:
            return
        if self._seen_root and not self.root.is_dir():
            raise FileNotFoundError(errno.ENOENT, "the cache folder vanished while this process ran", str(self.root))
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _mkdir(self.root, self._dir_mode)
        self._check_trusted(self.root)
        for sub in ("artifacts", "entries", "locks", "tmp"):
            _mkdir(self.root / sub, self._dir_mode)
        for sub in ("artifacts", "entries"):
            self._check_trusted(self.root / sub)
        self._checked = True
        self._root_trusted = ""
        self.cleanup()

    def _untrusted_why(self, st: os.stat_result, is_dir: bool) -> str | None:
        """Why a file or folder with this ``stat`` must not be trusted, or None."""
        sticky = is_dir and st.st_mode & stat.S_ISVTX
        if st.st_uid != os.getuid() and not self._shared:
            return f"it is owned by uid {st.st_uid}, not by you"
        if st.st_mode & stat.S_IWOTH and not sticky:
            return f"mode {oct(st.st_mode & 0o777)} lets every user write it"
        if st.st_mode & stat.S_IWGRP and not sticky and not self._shared:
            return f"mode {oct(st.st_mode & 0o777)} lets other users write it"
        return None

    def _check_trusted(self, path: pathlib.Path, *, artifact: bool = False) -> None:
        """Loading executes code: refuse a folder another user owns or can write (a sticky shared root is fine; with
        a signing key and ``trust_shared_folder``, group members are trusted). ``artifact``: raise
        ``UntrustedArtifactError``, which is also a ``CacheCorruptionError`` (quarantined and rebuilt)."""
        st = path.stat()
        why = self._untrusted_why(st, stat.S_ISDIR(st.st_mode))
        if why is not None:
            cls = UntrustedArtifactError if artifact else UntrustedCacheError
            raise cls(str(path), st.st_mode, why)

    def _root_problem(self) -> str:
        """'' when the root, entries/ and artifacts/ may be loaded from (checked once), else why not."""
        if self._root_trusted is None:
            try:
                for sub in ("", "entries", "artifacts"):
                    if (self.root / sub).exists():
                        self._check_trusted(self.root / sub)
                self._root_trusted = ""
            except UntrustedCacheError as exc:
                self._root_trusted = str(exc)
                log.warning("%s; entries in it are not loaded (treated as misses)", exc)
        return self._root_trusted

    # ------------------------------------------------------------------------------------------------ cleanup
    def cleanup(self) -> dict[str, int]:
        """Remove what killed processes left behind: work folders in ``tmp/`` whose pid is dead (another host's:
        older than an hour), temp manifest files likewise, leases of dead processes, and (``lock_mode="soft"``)
        stale soft locks; with ``max_size``, evict down to it (artifacts that were in use when the folder went over
        the cap may not be any more). Never raises; returns counts per kind."""
        done = {"tmp": 0, "partial_files": 0, "leases": 0, "soft_locks": 0, "evicted": 0}
        now = time.time()
        try:
            for path in list((self.root / "tmp").iterdir()):
                if self._tmp_leftover(path.name, path, now):
                    aside = path.with_name(f".{path.name}.removing.{uuid.uuid4().hex[:6]}")
                    with contextlib.suppress(OSError):
                        _rename(path, aside)
                        shutil.rmtree(aside, ignore_errors=True)
                        done["tmp"] += 1
        except OSError:
            pass
        for sub in ("entries", "misses"):
            for dirpath, _, names in os.walk(self.root / sub):
                for name in names:
                    m = _TMP_FILE.match(name)
                    if m and self._pid_leftover(int(m["pid"]), m["tag"], pathlib.Path(dirpath) / name, now):
                        with contextlib.suppress(OSError):
                            os.unlink(pathlib.Path(dirpath) / name)
                            done["partial_files"] += 1
        try:
            for folder in list((self.root / "leases").iterdir()):
                for lease in list(folder.iterdir()):
                    if not self._lease_live(lease, now):
                        with contextlib.suppress(OSError):
                            lease.unlink()
                            done["leases"] += 1
                with contextlib.suppress(OSError):
                    folder.rmdir()
        except OSError:
            pass
        if self.lock_mode == "soft":
            try:
                for lock in list((self.root / "locks").glob("*.softlock")):
                    done["soft_locks"] += self._break_stale_soft_lock(lock)
            except OSError:
                pass
        if self.max_size is not None:       # a folder left over the cap (its artifacts were in use) is trimmed
            done["evicted"] = len(self.evict(when="when a process opened it"))
        if any(done.values()):
            log.info("cleaned %s: %s", self.root, ", ".join(f"{v} {k}" for k, v in done.items() if v))
        return done

    def _tmp_leftover(self, name: str, path: pathlib.Path, now: float) -> bool:
        parts = name.split(".")
        if name.startswith(".") and ".removing." in name:
            return True                         # a removal that was itself interrupted
        if len(parts) >= 3 and parts[1].isdigit():
            return self._pid_leftover(int(parts[1]), parts[2], path, now)
        return self._older_than(path, TMP_MAX_AGE_S, now)

    def _pid_leftover(self, pid: int, tag: str, path: pathlib.Path, now: float) -> bool:
        if tag.startswith(HOST_TAG) and len(tag) == len(HOST_TAG) + 8:
            return pid != os.getpid() and not pid_alive(pid)
        return self._older_than(path, TMP_MAX_AGE_S, now)     # another host's (or an older gearcache's)

    @staticmethod
    def _older_than(path: pathlib.Path, age: float, now: float) -> bool:
        try:
            return now - path.lstat().st_mtime > age
        except OSError:
            return False

    # ------------------------------------------------------------------------------------------------ locks
    def _lock_path(self, akey: str, kind: str = "") -> pathlib.Path:
        """``locks/<akey>[.lease].lock`` (flock) or ``.softlock`` (soft lock files, which are held while they exist,
        so they never share a name with a flock file that stays behind after use)."""
        suffix = "lock" if self.lock_mode == "flock" else "softlock"
        return self.root / "locks" / (f"{akey}.{kind}.{suffix}" if kind else f"{akey}.{suffix}")

    @contextlib.contextmanager
    def _locked(self, path: pathlib.Path, timeout: float) -> Iterator[None]:
        """Hold the lock at ``path`` (flock, or a soft lock file with stale-lock recovery); ``LockTimeoutError``."""
        if self.lock_mode == "flock":
            lock = filelock.FileLock(str(path), timeout=timeout)
            try:
                lock.acquire()
            except filelock.Timeout:
                raise LockTimeoutError(str(path), timeout) from None
        else:
            lock = filelock.SoftFileLock(str(path), timeout=timeout)
            deadline = time.monotonic() + timeout
            while True:
                self._break_stale_soft_lock(path)
                try:
                    lock.acquire(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                    break
                except filelock.Timeout:
                    if time.monotonic() >= deadline:
                        raise LockTimeoutError(str(path), timeout) from None
        try:
            yield
        finally:
            lock.release()

    def _break_stale_soft_lock(self, path: pathlib.Path) -> int:
        """Remove a soft lock file whose holder (``pid\\nhost`` in the file) died on this host, or that is older than
        ``lock_timeout_s``. Returns 1 when it removed one."""
        try:
            st = path.lstat()
            with open(path, "rb") as f:
                lines = f.read(1024).decode("utf-8", "replace").splitlines()
        except OSError:
            return 0
        why = None
        if len(lines) >= 2 and lines[0].strip().isdigit() and lines[1].strip() == HOST:
            if not pid_alive(int(lines[0])):
                why = f"its holder pid {lines[0].strip()} on this host is dead"
        if why is None and time.time() - st.st_mtime > self.lock_timeout_s:
            why = f"it is older than lock_timeout_s={self.lock_timeout_s:g} s"
        if why is None:
            return 0
        try:
            now = path.lstat()
            if (now.st_ino, now.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
                return 0                        # taken over meanwhile
            path.unlink()
        except OSError:
            return 0
        log.warning("removed stale soft lock %s: %s", path, why)
        return 1

    # ------------------------------------------------------------------------------------------------ leases
    def lease(self, akey: str) -> None:
        """Mark artifact ``akey`` as in use by this process (``leases/<akey>/<pid>@<host>``) for as long as this
        Store lives: eviction never removes it meanwhile. Idempotent, cheap after the first call, never raises.
        ``read_entry`` and ``publish_artifact`` take it before they verify the artifact, so an artifact cannot be
        evicted between its check and its load (the lease file is written under ``locks/<akey>.lease.lock``, which
        an evictor holds while it checks the leases and moves the artifact away)."""
        if akey in self._leased:
            return
        pid = os.getpid()
        with _LEASES_LOCK:              # counted first: from now on no Store of this process removes the file
            held = _LEASES.get((str(self.root), akey), 0)
            _LEASES[(str(self.root), akey)] = held + 1
            self._leased.add(akey)
            if self._lease_finalizer is None:
                self._lease_finalizer = weakref.finalize(self, _release_leases, str(self.root), self._leased, pid)
        path = self.root / "leases" / akey / f"{pid}@{HOST}"
        if held and path.exists():
            return                      # (the first lease of this process always writes: a file left by an
                                        # earlier process with the same pid names another start time)
        try:
            try:
                with self._locked(self._lock_path(akey, "lease"), min(self.lock_timeout_s, LEASE_LOCK_TIMEOUT_S)):
                    self._write_lease(path)
            except LockTimeoutError:
                self._write_lease(path)                         # better a lease without the lock than none
        except OSError as exc:
            log.debug("could not write lease %s (%s); the artifact may be evicted while in use", path, exc)
            return
        self._touch_artifact(akey)

    def _write_lease(self, path: pathlib.Path) -> None:
        for attempt in range(3):
            try:
                if not path.parent.parent.is_dir():
                    _mkdir(path.parent.parent, self._dir_mode)       # never recreates a vanished root
                _mkdir(path.parent, self._dir_mode)
                path.write_text(_start_token(os.getpid()) + "\n")
                return
            except FileNotFoundError:
                if attempt == 2 or not self.root.is_dir():
                    raise                       # (an empty lease folder removed by a cleanup meanwhile: again)

    def release(self, akey: str) -> None:
        """Give up this Store's lease of ``akey`` (the file goes when no other Store of this process holds it)."""
        if akey in self._leased:
            self._leased.discard(akey)
            _release_leases(str(self.root), {akey}, os.getpid())

    def _lease_live(self, path: pathlib.Path, now: float | None = None) -> bool:
        pid_s, _, host = path.name.partition("@")
        if not pid_s.isdigit():
            return False
        if host != HOST:
            return not self._older_than(path, FOREIGN_LEASE_TTL_S, now or time.time())
        pid = int(pid_s)
        if pid == os.getpid():
            with _LEASES_LOCK:
                return _LEASES.get((str(self.root), path.parent.name), 0) > 0
        try:
            token = path.read_text().strip()
        except OSError:
            token = ""
        return pid_alive(pid, token)

    def live_leases(self, akey: str) -> list[str]:
        """Names (``pid@host``) of the live processes holding a lease of ``akey``."""
        folder = self.root / "leases" / akey
        try:
            return sorted(p.name for p in folder.iterdir() if self._lease_live(p))
        except OSError:
            return []

    def remove_artifact(self, akey: str) -> str:
        """Remove artifact ``akey`` (and its lease folder) unless a live process holds a lease on it. Checked and
        moved aside under ``locks/<akey>.lease.lock``, as eviction does, so a process cannot lease it in between.
        Returns ``"removed"``, ``"gone"``, ``"in use by pid@host, ..."`` or ``"lease lock busy"``."""
        try:
            with self._locked(self._lock_path(akey, "lease"), 0.5):
                live = self.live_leases(akey)
                if live:
                    return "in use by " + ", ".join(live)
                aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
                try:
                    _rename(self.artifact_dir(akey), aside)
                except FileNotFoundError:
                    return "gone"
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.root / "leases" / akey)
        except LockTimeoutError:
            return "lease lock busy"
        shutil.rmtree(aside, ignore_errors=True)
        return "removed"

    def _touch_artifact(self, akey: str) -> None:
        now = time.time()

        def touch(index: Any) -> None:
            row = index.get(f"artifact:{akey}")
            if row is not None:
                index[f"artifact:{akey}"] = dict(row, last_used=max(now, row.get("last_used") or 0))

        self.defer_index_update(touch)

    def defer_index_update(self, update: Callable[[Any], None]) -> None:
        """Queue ``update(index)`` (bookkeeping only) for :func:`flush_index_updates`, which runs at exit."""
        with _DEFERRED_LOCK:
            _DEFERRED.setdefault(str(self.root), []).append(update)
            if not _DEFERRED_ATEXIT[0]:
                atexit.register(flush_index_updates)
                _DEFERRED_ATEXIT[0] = True

    # ------------------------------------------------------------------------------------------------ entries
    def read_entry(self, topology_folder: str, method: str, ekey: str, *, load: bool = True) -> dict[str, Any] | None:
        """The entry manifest, or None: missing, unreadable, another format, not trusted, or (with a signing key)
        unsigned or wrongly signed. ``load`` (a process about to load it): a bad manifest is moved to quarantine/
        and the artifact is leased before it is verified."""
        if load and not self._checked:
            try:
                self._ensure_root()             # first use: trust checks, leftovers of dead processes, max_size
            except OSError as exc:
                log.debug("cache folder %s not usable (%s)", self.root, exc)
        path = self.entry_path(topology_folder, method, ekey)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
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
        self._seen_root = True
        return data

    def _untrusted_dir(self, folder: pathlib.Path) -> str | None:
        try:
            return self._untrusted_why(folder.stat(), True)
        except OSError:
            return None

    def _bad_entry(self, path: pathlib.Path, why: str, quarantine: bool) -> None:
        if not quarantine:
            log.debug("entry manifest %s %s; skipped", path, why)
            return None
        dest = self.root / "quarantine" / "entries" / f"{path.stem}.{int(time.time())}.{uuid.uuid4().hex[:6]}.json"
        try:
            _makedirs(dest.parent, self._dir_mode)
            _rename(path, dest)
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
        try:
            self._ensure_root()
            write_json_atomic(path, sign_json(self._key, manifest) if self._key else manifest,
                              dir_mode=self._dir_mode)
        except OSError as exc:
            log.warning("could not write entry manifest %s (%s: %s): this process keeps using the entry, but later "
                        "processes will compile it again. Fix: %s", path, type(exc).__name__, exc,
                        storage_fix(exc, self.root))
            return
        self._index_put(ekey, {"method": method, "topology": topology_folder, "akey": manifest["akey"],
                               "created": time.time(), "last_used": time.time()})

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

    # ---------------------------------------------------------------------------------------------- artifacts
    def verify_artifact(self, akey: str, folder: pathlib.Path | None = None) -> None:
        """Raise ``CacheCorruptionError`` unless every file of the artifact matches its manifest digest, no unlisted
        file could be executed, every file and folder in it is trusted (else ``UntrustedArtifactError``, a
        ``CacheCorruptionError`` too) and, with a signing key, ``MANIFEST.sig`` is the manifest's HMAC. A missing
        artifact raises ``FileNotFoundError``. ``folder``: check a copy of the artifact instead."""
        folder = self.artifact_dir(akey) if folder is None else pathlib.Path(folder)
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
        if self._key is not None:
            try:
                sig = (folder / SIGNATURE).read_text(encoding="ascii", errors="replace").strip()
            except FileNotFoundError:
                raise CacheCorruptionError(str(folder), "it is not signed (no MANIFEST.sig) and a signing key is "
                                                        "set") from None
            if not hmac.compare_digest(sig, _hmac(self._key, raw)):
                raise CacheCorruptionError(str(folder), "MANIFEST.sig does not match the manifest (tampered, or "
                                                        "signed with another key)")
        try:
            manifest = json.loads(raw)
            files: dict[str, str] = manifest["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheCorruptionError(str(folder), f"MANIFEST.json unreadable ({exc})") from None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise CacheCorruptionError(str(folder), "MANIFEST.json is malformed")
        if manifest.get("format") != FORMAT_VERSION or manifest.get("akey") != akey:
            raise CacheCorruptionError(str(folder), "MANIFEST.json names another format or key")
        present = set()
        top = str(folder)
        for dirpath, dirnames, filenames in os.walk(top):          # never follows links: they are refused below
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, top).replace(os.sep, "/")
                pst = os.lstat(full)
                if stat.S_ISLNK(pst.st_mode):
                    raise CacheCorruptionError(top, f"{rel} is a symbolic link")
                if rel + "/" == _LOCKS_DIR or _is_lock_file(rel):
                    continue                    # torch's empty lock files (and their folder): never executed
                why = self._untrusted_why(pst, stat.S_ISDIR(pst.st_mode))
                if why is not None:
                    raise UntrustedArtifactError(full, pst.st_mode, f"{rel} in the artifact: {why}")
                if stat.S_ISREG(pst.st_mode):
                    present.add(rel)
        for rel, digest in files.items():
            if rel not in present:
                raise CacheCorruptionError(top, f"{rel} is missing")
            if _sha256_file(folder / rel) != digest:
                raise CacheCorruptionError(top, f"{rel} does not match its sha256 digest")
        extra = present - set(files) - {MANIFEST, SIGNATURE}
        if extra:
            raise CacheCorruptionError(str(folder), f"unlisted file(s) {sorted(extra)[:3]}")

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
            _rename(folder, dest)
        except FileNotFoundError:
            return
        counters.quarantined += 1
        log.warning("quarantined artifact %s -> %s: %s", folder, dest, reason)
        self._index_pop([f"artifact:{akey}"])

    def publish_artifact(self, akey: str, build: Callable[[pathlib.Path], None]) -> tuple[pathlib.Path, bool]:
        """Return ``(artifact folder, built_here)``. Exactly one process per ``akey`` runs ``build(folder)``; the
        others wait on the artifact's lock and then find it published. ``build`` writes into an empty work folder
        that is renamed into place after its digests (and signature) are written. With ``max_size``, publishing
        evicts least recently used artifacts until the folder fits."""
        self._ensure_root()
        if not (self.root / "tmp").is_dir():
            raise FileNotFoundError(errno.ENOENT, "the cache folder vanished while this process ran", str(self.root))
        self.lease(akey)
        final = self.artifact_dir(akey)
        if self._valid(akey, quarantine=False):
            return final, False
        with self._locked(self._lock_path(akey), self.lock_timeout_s):
            if self._valid(akey, quarantine=True):
                return final, False
            work = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
            work.mkdir(mode=self._dir_mode)
            try:
                build(work / "inductor")
                size = self._write_artifact_manifest(work, akey)
                if final.exists() or final.is_symlink():
                    self._remove(final, akey)
                _rename(work, final)
            finally:
                if work.exists():
                    shutil.rmtree(work, ignore_errors=True)
        now = time.time()
        self._index_put(f"artifact:{akey}", {"bytes": size, "created": now, "last_used": now})
        if self.max_size is not None:
            self.evict(keep={akey}, when=f"after publishing {akey}")
        return final, True

    def _remove(self, folder: pathlib.Path, akey: str) -> None:
        """Rename ``folder`` into tmp/ (atomic: never seen half deleted), then delete it."""
        aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
        _rename(folder, aside)
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
            _replace(tmp, work / SIGNATURE)
        return size

    # ----------------------------------------------------------------------------------------------- eviction
    def artifact_sizes(self) -> dict[str, tuple[int, float]]:
        """``{akey: (bytes, manifest mtime)}`` of the published artifacts."""
        out = {}
        try:
            folders = list((self.root / "artifacts").iterdir())
        except OSError:
            return out
        for folder in folders:
            try:
                st = (folder / MANIFEST).stat()
                size = json.loads((folder / MANIFEST).read_bytes()).get("bytes")
                if not isinstance(size, int):
                    size = _folder_bytes(folder)
            except (OSError, ValueError, AttributeError):
                continue                        # vanished meanwhile, or corrupt: not counted
            out[folder.name] = (size, st.st_mtime)
        return out

    def _entries_by_artifact(self) -> dict[str, list[pathlib.Path]]:
        out: dict[str, list[pathlib.Path]] = {}
        for path in (self.root / "entries").glob("*/*/*.json"):
            try:
                akey = json.loads(path.read_bytes()).get("akey")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(akey, str):
                out.setdefault(akey, []).append(path)
        return out

    def _last_used(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            for key, row in self.index.items():
                if not isinstance(row, dict):
                    continue
                akey = key[len("artifact:"):] if key.startswith("artifact:") else row.get("akey")
                t = row.get("last_used") or row.get("created")
                if isinstance(akey, str) and isinstance(t, (int, float)):
                    out[akey] = max(out.get(akey, 0.0), float(t))
        except Exception as exc:
            log.debug("cache index unreadable (%s); eviction goes by manifest age", exc)
        return out

    def evict(self, *, keep: set[str] | frozenset[str] = frozenset(), when: str | None = None) -> list[str]:
        """Evict least recently used artifacts (index ``last_used``, then manifest mtime) with their entry manifests
        until the artifacts fit in ``max_size``; an artifact a live process holds a lease on, or in ``keep``, stays.
        Returns the evicted keys. Never raises."""
        if self.max_size is None:
            return []
        try:
            self._ensure_root()             # first: its cleanup may evict already (and must not run in the middle)
            sizes = self.artifact_sizes()
            total = sum(s for s, _ in sizes.values())
            if total <= self.max_size:
                return []
            used = self._last_used()
            order = sorted((a for a in sizes if a not in keep), key=lambda a: (used.get(a, sizes[a][1]), sizes[a][1]))
            refs = self._entries_by_artifact()
            evicted, before = [], total
            for akey in order:
                if total <= self.max_size:
                    break
                reason = f"the folder held {before} bytes of artifacts, over max_size={self.max_size}" + (
                    f" {when}" if when else "")
                if self._evict_one(akey, refs.get(akey, []), sizes[akey][0], used.get(akey), reason):
                    total -= sizes[akey][0]
                    evicted.append(akey)
            if total > self.max_size:
                log.info("%s holds %d bytes of artifacts, over max_size=%d: the rest is in use by live processes "
                         "(or was just published)", self.root, total, self.max_size)
            return evicted
        except Exception as exc:                # eviction is housekeeping: it must never fail a call
            log.warning("eviction in %s failed (%s: %s)", self.root, type(exc).__name__, exc)
            return []

    def _evict_one(self, akey: str, entry_paths: list[pathlib.Path], size: int, last_used: float | None,
                   reason: str) -> bool:
        lock = self._lock_path(akey, "lease")
        try:
            with self._locked(lock, 0.5):
                live = self.live_leases(akey)
                if live:
                    log.debug("artifact %s is in use by %s: not evicted", akey, ", ".join(live))
                    return False
                gone, ekeys = [], []
                for path in entry_paths:
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        data = json.loads(path.read_bytes())
                        if data.get("akey") == akey:
                            path.unlink()
                            gone.append(path)
                            ekeys.append(path.stem)
                aside = self.root / "tmp" / f"{akey}.{os.getpid()}.{_tmp_tag()}"
                try:
                    _rename(self.artifact_dir(akey), aside)
                except FileNotFoundError:
                    return False                # evicted by another process meanwhile
                self._index_pop([f"artifact:{akey}", *ekeys], akey=akey)
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.root / "leases" / akey)
        except LockTimeoutError:
            return False
        shutil.rmtree(aside, ignore_errors=True)
        counters.evictions += 1
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last_used)) if last_used else "never"
        log.info("evicted artifact %s (%d bytes, last used %s) and %d entry manifest(s): %s", akey, size, when,
                 len(gone), reason)
        return True

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

    def _index_pop(self, keys: list[str], akey: str | None = None) -> None:
        """Remove index rows (an entry row only while it still names ``akey``)."""
        try:
            index = self.index
            with index.transact():
                for key in keys:
                    row = index.get(key)
                    if row is not None and (akey is None or key.startswith("artifact:") or
                                            (isinstance(row, dict) and row.get("akey") == akey)):
                        del index[key]
        except Exception as exc:
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


def storage_fix(exc: BaseException, root: pathlib.Path) -> str:
    """What to do about an error writing the store at ``root`` (for warnings)."""
    if isinstance(exc, (UntrustedCacheError, LockTimeoutError)):
        return str(exc).split("Fix: ", 1)[-1]
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free disk space (or quota) under {root}, or set config.max_size to bound the cache"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"make {root} writable by this user, or point cache_dir at a writable folder (a read-only store "
                f"still serves the entries it holds)")
    if code == errno.ENOENT:
        return f"the cache folder {root} (or part of it) vanished while running; it is recreated by the next process"
    return f"check that {root} is a healthy, writable local folder"


def _is_lock_file(rel: str) -> bool:
    return rel.startswith(_LOCKS_DIR) and rel.endswith(".lock") and "/" not in rel[len(_LOCKS_DIR):]


def _folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
