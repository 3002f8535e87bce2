"""Trust checks: loading executes code, so a folder or file another user owns or can write is refused."""
from __future__ import annotations

import logging
import os
import pathlib
import stat

from ..errors import UntrustedArtifactError, UntrustedCacheError

log = logging.getLogger("gearcache.store")


class TrustMixin:
    """Part of ``Store``: the trust checks of the root, its folders, artifacts and entry manifests."""

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

    def _untrusted_dir(self, folder: pathlib.Path) -> str | None:
        try:
            return self._untrusted_why(folder.stat(), True)
        except OSError:
            return None

