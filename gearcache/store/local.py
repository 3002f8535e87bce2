"""``Store``: one local cache folder, a composition of typed parts (each in its own module of this package). There
are no forwarding methods: a caller names the part, ``store.artifacts.publish(...)``, ``store.entries.read(...)``,
``store.layout.artifact(akey)``.

The parts, and what each is built from (the constructors show every dependency)::

    Layout(root, dir_mode)                                  every path (layout.py)
    Locks(layout, mode, timeout_s)                          publish and lease locks (locks.py)
    Trust(layout, shared)                                   who may have written what is loaded (trust.py)
    FirstUse(layout, trust)                                 the folder's first-use checks (first_use.py), whose
                                                            on_first_use is maintenance.cleanup
    Index(layout, locks, first_use, fresh)                  the diskcache bookkeeping (index.py)
    Leases(layout, locks, index, owner=store)               "this process loaded it", while the Store lives
    Stamps(layout, trust, key)                              what a full check of an artifact saw (stamps.py)
    Maintenance(layout, locks, leases, index, first_use, stamps, max_size)  eviction, removal, cleanup
    Artifacts(layout, locks, leases, trust, index, first_use, maintenance, stamps, key, RemoteStore)  (artifacts.py)
    Fleet(layout, locks, leases, trust, first_use, artifacts, RemoteStore)  a remote store, on a miss (fleet.py)
    Entries(layout, trust, leases, index, first_use, key, fleet)    entry manifests, gear plans (entries.py)
    Sync(layout, locks, first_use, entries, artifacts, fleet)       gearcache push / pull (sync.py)

With a remote store, a publish fetches from, or builds once for and pushes to, the fleet (``Artifacts.publish``).
The remote tier (``remote.py``) sees only ``Artifacts`` (checked bytes in, ``Artifacts.install`` out). The layout is
in this package's docstring (``gearcache/store/__init__.py``); the options are a ``StoreConfig`` (config.py).
"""
from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

from ..config import CompilerConfig
from ..errors import ConfigError, shown_url
from .artifacts import Artifacts
from .config import StoreConfig
from .entries import Entries
from .files import SIGNING_KEY_ENV, default_root
from .first_use import FirstUse
from .fleet import Fleet
from .index import Index
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .maintenance import Maintenance
from .remote import REMOTE_ENV, TRUST, RemoteStore
from .stamps import Stamps
from .sync import Sync
from .trust import Trust

log = logging.getLogger("gearcache.store")
DEFAULTS = StoreConfig()                # a private local folder, unsigned, without a size cap
_warned_unsigned: set[str] = set()


def _warn_unsigned(url: str) -> None:
    if url not in _warned_unsigned:
        _warned_unsigned.add(url)
        log.warning("remote store %s is used without a signing key (remote_trust='unsigned-ok'): any client of that "
                    "server can make this process execute its code. Set config.signing_key (or $%s) to close this",
                    shown_url(url), SIGNING_KEY_ENV)


def _fresh_index(root: str) -> Any:
    """The diskcache index of a new Store of ``root`` (first-use checks included): what the updates queued for the
    exit are written to (``index.flush_index_updates``)."""
    return Store(root).index.db


def _checked_options(root: pathlib.Path, config: StoreConfig) -> None:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"cache_dir={str(root)!r} is a file, not a folder. Fix: pass a folder path "
                          f"(it is created if missing)")
    if config.lock_mode not in ("flock", "soft"):
        raise ConfigError(f"lock_mode={config.lock_mode!r}: expected 'flock' or 'soft'")
    max_size = config.max_size
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0):
        raise ConfigError(f"max_size={max_size!r}: expected a positive number of bytes, or None for no limit")


def _signing_key(config: StoreConfig) -> bytes | None:
    """The key of ``config.signing_key``, else ``$GEARCACHE_SIGNING_KEY``, as bytes; None: unsigned."""
    key = config.signing_key if config.signing_key is not None else os.environ.get(SIGNING_KEY_ENV) or None
    return (key.encode() if isinstance(key, str) else key) or None


class Store:
    """One cache folder (``root``; None: the default folder) with the options of ``config``. Cheap to create; nothing
    is touched on disk until the first read or write. Raises ``ConfigError`` for a bad option."""

    def __init__(self, root: str | os.PathLike[str] | None, config: StoreConfig = DEFAULTS):
        path = pathlib.Path(root) if root is not None else default_root()
        _checked_options(path, config)
        self.root, self.config = path.resolve(), config
        self._key = _signing_key(config)
        shared = bool(config.trust_shared_folder) and self._key is not None
        self.layout = layout = Layout(self.root, 0o770 if shared else 0o700)
        self.locks = locks = Locks(layout, config.lock_mode, config.lock_timeout_s)
        self.trust = trust = Trust(layout, shared)
        self.first_use = first_use = FirstUse(layout, trust)
        self.index = index = Index(layout, locks, first_use, fresh=_fresh_index)
        self.leases = leases = Leases(layout, locks, index, owner=self)
        self.stamps = stamps = Stamps(layout, trust, self._key)
        self.maintenance = Maintenance(layout, locks, leases, index, first_use, stamps, config.max_size)
        first_use.on_first_use = self.maintenance.cleanup       # dropped once run (first_use.py)
        self.remote = self._open_remote()
        self.artifacts = artifacts = Artifacts(layout, locks, leases, trust, index, first_use, self.maintenance,
                                               stamps, self._key, self.remote)
        self.fleet = None if self.remote is None else Fleet(layout, locks, leases, trust, first_use, artifacts,
                                                            self.remote)
        self.entries = entries = Entries(layout, trust, leases, index, first_use, self._key, self.fleet)
        self.sync = Sync(layout, locks, first_use, entries, artifacts, self.fleet)

    def _open_remote(self) -> RemoteStore | None:
        """The remote store (``config.remote``, else ``$GEARCACHE_REMOTE``; None: local folder only). Loading from it
        executes what another machine wrote: a signing key is required unless ``remote_trust="unsigned-ok"``."""
        config = self.config
        url = config.remote if config.remote is not None else os.environ.get(REMOTE_ENV) or None
        if not url:
            return None
        if config.remote_trust not in TRUST:
            raise ConfigError(f"remote_trust={config.remote_trust!r}: expected one of {TRUST}")
        if self._key is None and config.remote_trust != "unsigned-ok":
            raise ConfigError(
                f"remote={shown_url(url)!r} without a signing key: loading from a remote store executes code any "
                f"client of that server could have written. Fix: set config.signing_key (or ${SIGNING_KEY_ENV}) to the "
                f"fleet's key, or accept the risk with config.remote_trust='unsigned-ok'")
        if self._key is None:
            _warn_unsigned(url)
        return RemoteStore(url, trust=config.remote_trust, signing_key=self._key, timeout_s=config.remote_timeout_s,
                           chunk_bytes=config.remote_chunk_bytes, claim_ttl_s=config.remote_claim_ttl_s)

    @classmethod
    def from_config(cls, root: str | os.PathLike[str] | None, config: CompilerConfig) -> Store:
        """The store a ``CompilerConfig`` asks for (``StoreConfig.of``)."""
        return cls(root, StoreConfig.of(config))

    @property
    def signed(self) -> bool:
        """Whether a signing key is set: everything written is signed, nothing unsigned is loaded."""
        return self._key is not None
