"""The folder layout's primitives: names, atomic writes, renames, digests, modes.

Every rename of the store goes through :func:`_rename` and :func:`_replace` (tests simulate a full or read-only disk by
replacing them in this module).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import os
import pathlib
import re
import socket
import threading
import uuid
from typing import Any, Iterator

from ..errors import LockTimeoutError, UntrustedCacheError

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
def _rename(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
    os.rename(src, dst)


def _replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
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


def write_json_atomic(path: pathlib.Path, data: Any, *, dir_mode: int = 0o700, sync: bool = True,
                      indent: int | None = 1) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, fsync'd (``sync``), then ``os.replace``: a
    reader sees the old file or the new one, never a part. A temp file left by a killed writer is removed by
    ``Maintenance.cleanup``. ``indent``: ``json.dump``'s (None: one line)."""
    _makedirs(path.parent, dir_mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_tmp_tag()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, sort_keys=True, default=repr,
                      separators=None if indent is not None else (",", ":"))
            if sync:
                f.flush()
                os.fsync(f.fileno())
        _replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(raw: bytes | str) -> Any:
    """``json.loads(raw)`` with the cyclic garbage collector paused while it parses (:func:`_collector_paused`). An
    entry manifest or gear plan is ~10^4 lists and dicts (its value guards: ~800 on an 8-layer decoder) made at once;
    the collector, running during the parse, promotes them towards its oldest generation, and a warm start that reads
    a dozen such records then pays for a full collection of the process (0.08-0.39 s measured on a TP=2 CPU warm
    start, issue #38), also for the copies it drops right away (the guards a gear shares with its method's other
    gears: ``guard_sets.choose``). Paused, the dropped ones are freed young, never counted. JSON makes no cycles:
    nothing the collector could free is kept from it."""
    with _collector_paused():
        return json.loads(raw)


_PAUSE_LOCK = threading.Lock()
_pause = {"depth": 0, "was_enabled": False}      # parses under way in this process, and the collector's state then


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """``gc.disable()`` for the block, the collector's state restored when the last block of this process's threads
    ends (a collector disabled by the program stays disabled)."""
    with _PAUSE_LOCK:
        if _pause["depth"] == 0:
            _pause["was_enabled"] = gc.isenabled()
            gc.disable()
        _pause["depth"] += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _pause["depth"] -= 1
            if _pause["depth"] == 0 and _pause["was_enabled"]:
                gc.enable()


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


def _older_than(path: pathlib.Path, age: float, now: float) -> bool:
    """Whether ``path``'s mtime is more than ``age`` seconds before ``now`` (False when it is gone)."""
    try:
        return now - path.lstat().st_mtime > age
    except OSError:
        return False
