"""``Store``: one local cache folder, composed of one mixin per job (each in its own module of this package).

``Store`` itself holds the configuration, the folder layout (``entry_path``, ``artifact_dir``) and the first-use
checks (``_ensure_root``); trust checks, cleanup, locks, leases, the index, entry manifests, artifacts and eviction
live in ``trust.py``, ``cleanup.py``, ``locks.py``, ``leases.py``, ``index.py``, ``entries.py``, ``artifacts.py`` and
``eviction.py``; ``fleet.py`` connects it to a remote store (``remote.py``). The layout is in this package's
docstring (``gearcache/store/__init__.py``).
"""
from __future__ import annotations

import errno
import logging
import os
import pathlib
from typing import Any

from ..errors import ConfigError
from .artifacts import ArtifactMixin
from .cleanup import CleanupMixin
from .entries import EntryMixin
from .eviction import EvictionMixin
from .files import SIGNING_KEY_ENV, _mkdir, default_root
from .fleet import FleetMixin
from .index import IndexMixin
from .leases import LeaseMixin
from .locks import LockMixin
from .remote import REMOTE_ENV, TRUST, RemoteStore
from .trust import TrustMixin

log = logging.getLogger("gearcache.store")
_warned_unsigned: set[str] = set()


def _warn_unsigned(url: str) -> None:
    if url not in _warned_unsigned:
        _warned_unsigned.add(url)
        log.warning("remote store %s is used without a signing key (remote_trust='unsigned-ok'): any client of that "
                    "server can make this process execute its code. Set config.signing_key (or $%s) to close this",
                    url, SIGNING_KEY_ENV)


class Store(TrustMixin, CleanupMixin, LockMixin, LeaseMixin, IndexMixin, EntryMixin, ArtifactMixin, EvictionMixin,
            FleetMixin):
    """One cache folder. Cheap to create; nothing is touched on disk until the first read or write."""

    def __init__(self, root: str | os.PathLike | None, *, lock_timeout_s: float = 900.0, lock_mode: str = "flock",
                 max_size: int | None = None, signing_key: str | bytes | None = None,
                 trust_shared_folder: bool = False, remote: str | None = None, remote_trust: str = "signed",
                 remote_timeout_s: float = 5.0, remote_chunk_bytes: int = 4 << 20,
                 remote_claim_ttl_s: float = 20.0):
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
        self._checked_in_memory: set[str] = set()   # artifacts written here from bytes checked in memory (a fetch)
        self.remote = self._open_remote(remote, remote_trust, timeout_s=remote_timeout_s,
                                        chunk_bytes=remote_chunk_bytes, claim_ttl_s=remote_claim_ttl_s)

    def _open_remote(self, url: str | None, trust: str, **options: Any) -> RemoteStore | None:
        """The remote store (``remote``, else ``$GEARCACHE_REMOTE``; None: local folder only). Loading from it
        executes what another machine wrote: a signing key is required unless ``remote_trust="unsigned-ok"``."""
        url = url if url is not None else os.environ.get(REMOTE_ENV) or None
        if not url:
            return None
        if trust not in TRUST:
            raise ConfigError(f"remote_trust={trust!r}: expected one of {TRUST}")
        if self._key is None and trust != "unsigned-ok":
            raise ConfigError(
                f"remote={url!r} without a signing key: loading from a remote store executes code any client of "
                f"that server could have written. Fix: set config.signing_key (or ${SIGNING_KEY_ENV}) to the "
                f"fleet's key, or accept the risk with config.remote_trust='unsigned-ok'")
        if self._key is None:
            _warn_unsigned(url)
        return RemoteStore(url, trust=trust, signing_key=self._key, **options)

    @classmethod
    def from_config(cls, root: str | os.PathLike | None, config: Any) -> "Store":
        """The store a ``CompilerConfig`` asks for (lock timeout and mode, size cap, signing key, shared folder,
        remote store)."""
        return cls(root, lock_timeout_s=config.lock_timeout_s, lock_mode=config.lock_mode, max_size=config.max_size,
                   signing_key=config.signing_key, trust_shared_folder=config.trust_shared_folder,
                   remote=config.remote, remote_trust=config.remote_trust, remote_timeout_s=config.remote_timeout_s,
                   remote_chunk_bytes=config.remote_chunk_bytes, remote_claim_ttl_s=config.remote_claim_ttl_s)

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

    def torch_artifact_dir(self, akey: str) -> pathlib.Path:
        """torch's unpacked artifact inside artifact ``akey``: the generated code and kernels."""
        return self.artifact_dir(akey) / "inductor"

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

