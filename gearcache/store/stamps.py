"""``Stamps``: what a full check of an artifact saw, so that a later load of the unchanged artifact skips its digests.

``stamps/<akey>.json`` (outside the artifact folder, where an unlisted file is refused) records, for each file and
folder a check covered, ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, mode, uid)`` as ``lstat`` gave them
before the file was read, the sha256 of the ``MANIFEST.json`` it checked against, and the parts it covered (None: the
whole artifact; else ``runplan.files_read``'s list); with a signing key, a ``"sig"`` field (HMAC-SHA256 of the rest,
as an entry manifest's). ``Artifacts.check`` skips the digests of an artifact whose every stamped ``lstat`` still
matches and whose manifest bytes are the stamped ones; anything else is checked in full, as without a stamp.

Why this keeps the trust boundary: a file's ``st_ctime`` is set by the kernel on every change of its data or metadata
(a write, a chmod, a rename, ``os.utime``) and no unprivileged writer can set it back, so a file changed after the
stamp no longer matches it, even with its size and mtime restored; a file renamed in has another inode; a file added
to or removed from a folder changes the folder's mtime and ctime. A ctime is set at the kernel's clock tick, though:
a change within the tick of the one before keeps the ctime. So a stamp written after a check (:meth:`Stamps.write`
with ``fresh=False``) is written only where every ctime is older than ``RACY_S`` (as git treats a racily clean
index entry); a publisher stamps what it has just written (``fresh=True``: its own work folder, where a writer that
could race it could as well have changed the files before their digests were taken; and only where the folder's
files are the listed ones, each with the ``lstat`` it had before its digest: ``Artifacts._rename_in``). A stamp
that cannot be read, is not trusted (another user's, or in a folder others can write), names another artifact or
format, or (with a signing key) is unsigned or wrongly signed, is ignored: the artifact is checked in full.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import Any, Sequence

from .files import write_json_atomic
from .layout import Layout
from .signing import json_signature_ok, sign_json
from .trust import Trust

log = logging.getLogger("gearcache.store")

STAMP_FORMAT = 1
RACY_S = 2.0
"""A check's stamp is written only where every ctime it records is older than this (see the module docstring)."""

Stamp = dict[str, Any]


def stat_record(st: os.stat_result) -> list[int]:
    """What a stamp records of one file or folder (JSON)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid]


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class Stamps:
    """The stamps of one folder's artifacts, signed with ``key`` (or unsigned: None)."""

    def __init__(self, layout: Layout, trust: Trust, key: bytes | None):
        self.layout, self.trust, self.key = layout, trust, key

    def read(self, akey: str) -> Stamp | None:
        """Artifact ``akey``'s stamp, or None (none, or one to ignore: see the module docstring)."""
        path = self.layout.stamp(akey)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                raw = f.read()
            if self.trust.why(st, False) is not None or self.trust.folder_problem(path.parent) is not None:
                return None
            data = json.loads(raw)
        except (OSError, ValueError):
            return None
        ok = (isinstance(data, dict) and data.get("format") == STAMP_FORMAT and data.get("akey") == akey
              and isinstance(data.get("paths"), dict) and isinstance(data.get("manifest"), str)
              and (data.get("parts") is None or isinstance(data.get("parts"), list)))
        if ok and self.key is not None and not json_signature_ok(self.key, data):
            log.debug("stamp %s is not signed with this store's key: ignored", path)
            ok = False
        return data if ok else None

    def write(self, akey: str, manifest: bytes, parts: Sequence[str] | None, seen: dict[str, os.stat_result], *,
              fresh: bool) -> None:
        """Stamp artifact ``akey``: ``seen`` (relative path -> ``lstat``, ``""`` the folder itself) checked against
        the manifest bytes ``manifest``, covering ``parts`` (None: the whole artifact). ``fresh``: the caller wrote
        the files itself (a publish); else nothing is written while a ctime is younger than ``RACY_S``. Never
        raises: without a stamp, the next load checks in full."""
        if not fresh and max(st.st_ctime_ns for st in seen.values()) > time.time_ns() - int(RACY_S * 1e9):
            return
        data: Stamp = {"format": STAMP_FORMAT, "akey": akey, "manifest": manifest_digest(manifest),
                       "parts": None if parts is None or "" in parts else sorted(set(parts)),
                       "paths": {rel: stat_record(st) for rel, st in seen.items()}}
        if self.key is not None:
            data = sign_json(self.key, data)
        try:
            write_json_atomic(self.layout.stamp(akey), data, dir_mode=self.layout.dir_mode, sync=False, indent=None)
        except OSError as exc:
            log.debug("could not write the stamp of artifact %s (%s): its next load checks its digests", akey, exc)

    def remove(self, akey: str) -> None:
        """Remove artifact ``akey``'s stamp (with the artifact)."""
        with contextlib.suppress(OSError):
            self.layout.stamp(akey).unlink()


def covered(stamp: Stamp, only: Sequence[str] | None) -> list[str] | None:
    """The stamped paths a check of ``only`` (``Artifacts.verify``'s parts; None: the whole artifact) must find
    unchanged, or None when the stamp does not cover ``only``: a whole check needs a whole stamp, a check of parts a
    stamp of the whole or of at least those parts."""
    paths, parts = stamp["paths"], stamp["parts"]
    if only is None or "" in only:
        return list(paths) if parts is None else None
    if parts is not None and not set(only) <= set(parts):
        return None
    rels = [""]
    for part in only:
        if part.endswith("/"):
            rels.append(part.rstrip("/"))
            rels.extend(rel for rel in paths if rel.startswith(part))
        else:
            steps = part.split("/")
            rels.extend("/".join(steps[:i]) for i in range(1, len(steps) + 1))
    return rels if all(rel in paths for rel in rels) else None
