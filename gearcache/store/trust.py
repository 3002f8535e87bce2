"""Trust checks: loading executes code, so a folder or file another user owns or can write is refused."""
from __future__ import annotations

import logging
import os
import pathlib
import stat

from ..errors import UntrustedArtifactError, UntrustedCacheError
from .layout import Layout

log = logging.getLogger("gearcache.store")
_warned_untrusted: set[str] = set()     # store roots this process has warned about as untrusted


def first_untrusted_warning(root: str | os.PathLike[str]) -> bool:
    """True the first time this process is about to warn that the store at ``root`` is not trusted, False after:
    whichever part of gearcache meets the refusal first warns (with the fix), the others stay quiet."""
    key = str(root)
    if key in _warned_untrusted:
        return False
    _warned_untrusted.add(key)
    return True


class Trust:
    """The trust checks of the root, its folders, artifacts and entry manifests. ``shared``: a signing key and
    ``trust_shared_folder``, so members of the folder's group are trusted."""

    def __init__(self, layout: Layout, shared: bool):
        self.layout, self.shared = layout, shared
        self._root_trusted: str | None = None          # None: not checked yet; "": trusted; else why not

    def why(self, st: os.stat_result, is_dir: bool) -> str | None:
        """Why a file or folder with this ``stat`` must not be trusted, or None."""
        sticky = is_dir and st.st_mode & stat.S_ISVTX
        if st.st_uid != os.getuid() and not self.shared:
            return f"it is owned by uid {st.st_uid}, not by you"
        if st.st_mode & stat.S_IWOTH and not sticky:
            return f"mode {oct(st.st_mode & 0o777)} lets every user write it"
        if st.st_mode & stat.S_IWGRP and not sticky and not self.shared:
            return f"mode {oct(st.st_mode & 0o777)} lets other users write it"
        return None

    def check(self, path: pathlib.Path, *, artifact: bool = False) -> None:
        """Loading executes code: refuse a folder another user owns or can write (a sticky shared root is fine; with
        a signing key and ``trust_shared_folder``, group members are trusted). ``artifact``: raise
        ``UntrustedArtifactError``, which is also a ``CacheCorruptionError`` (quarantined and rebuilt)."""
        st = path.stat()
        why = self.why(st, stat.S_ISDIR(st.st_mode))
        if why is not None:
            cls = UntrustedArtifactError if artifact else UntrustedCacheError
            raise cls(str(path), st.st_mode, why)

    def root_trusted(self) -> None:
        """The first-use checks found the root, ``entries/`` and ``artifacts/`` trusted (:meth:`root_problem`)."""
        self._root_trusted = ""

    def root_problem(self) -> str:
        """'' when the root, entries/ and artifacts/ may be loaded from (checked once), else why not."""
        if self._root_trusted is None:
            try:
                for folder in (self.layout.root, self.layout.entries, self.layout.artifacts):
                    if folder.exists():
                        self.check(folder)
                self._root_trusted = ""
            except UntrustedCacheError as exc:
                self._root_trusted = str(exc)
                if first_untrusted_warning(self.layout.root):
                    log.warning("%s; its entries are not loaded and nothing is written to it: calls compile as "
                                "config.on_cache_error says (default 'memory': in memory only) (warned once per "
                                "process)", exc)
        return self._root_trusted

    def path_problem(self, path: pathlib.Path) -> str | None:
        """Why the runtime refuses ``path`` (another user owns it, or others can write it), or None (also when it
        does not exist): what ``gearcache verify`` reports."""
        try:
            st = path.stat()
        except OSError:
            return None
        return self.why(st, stat.S_ISDIR(st.st_mode))

    def refused_folders(self) -> list[tuple[pathlib.Path, str]]:
        """``(folder, why)`` for each of the root, ``entries/`` and ``artifacts/`` the runtime refuses
        (:meth:`path_problem`): any one of them refuses the whole store (what ``gearcache verify`` reports)."""
        folders = (self.layout.root, self.layout.entries, self.layout.artifacts)
        return [(folder, why) for folder in folders if (why := self.path_problem(folder)) is not None]

    def folder_problem(self, folder: pathlib.Path) -> str | None:
        """Why the folder ``folder`` is not trusted; None when it is, or cannot be read."""
        try:
            return self.why(folder.stat(), True)
        except OSError:
            return None
