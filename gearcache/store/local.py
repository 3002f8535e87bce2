"""``Store``: one local cache folder, a façade over its parts (each in its own module of this package).

The parts, and what each is built from (the constructors show every dependency)::

    Layout(root, dir_mode)                                  every path (layout.py)
    Locks(layout, mode, timeout_s)                          publish and lease locks (locks.py)
    Trust(layout, shared)                                   who may have written what is loaded (trust.py)
    FirstUse(layout, trust, on_first_use=Store.cleanup)     the folder's first-use checks (first_use.py)
    Index(layout, locks, first_use, fresh)                  the diskcache bookkeeping (index.py)
    Leases(layout, locks, index)                            "this process loaded it" (leases.py)
    Eviction(layout, locks, leases, index, first_use, max_size)                         (eviction.py)
    Cleanup(layout, locks, leases, eviction)                leftovers of dead processes (cleanup.py)
    Artifacts(layout, locks, leases, trust, index, first_use, eviction, key)            (artifacts.py)
    Fleet(layout, locks, leases, trust, first_use, artifacts, RemoteStore)  a remote store, on a miss (fleet.py)
    Entries(layout, trust, leases, index, first_use, key, fleet)    entry manifests, gear plans (entries.py)
    Sync(layout, locks, first_use, entries, artifacts, fleet)       gearcache push / pull (sync.py)

The remote tier (``remote.py``) sees only ``Artifacts`` (checked bytes in, ``Artifacts.install`` out). The layout is
in this package's docstring (``gearcache/store/__init__.py``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import weakref
from typing import Any, Callable, Iterator, Sequence

from ..errors import ConfigError
from .artifacts import Artifacts
from .cleanup import Cleanup
from .entries import Entries
from .eviction import Eviction
from .files import SIGNING_KEY_ENV, default_root
from .first_use import FirstUse
from .fleet import Fleet
from .index import Index
from .layout import Layout
from .leases import Leases
from .locks import Locks
from .remote import REMOTE_ENV, TRUST, RemoteStore
from .sync import Sync
from .trust import Trust

log = logging.getLogger("gearcache.store")
_warned_unsigned: set[str] = set()


def _warn_unsigned(url: str) -> None:
    if url not in _warned_unsigned:
        _warned_unsigned.add(url)
        log.warning("remote store %s is used without a signing key (remote_trust='unsigned-ok'): any client of that "
                    "server can make this process execute its code. Set config.signing_key (or $%s) to close this",
                    url, SIGNING_KEY_ENV)


def _fresh_index(root: str) -> Any:
    """The index of a new Store of ``root`` (first-use checks included): what the updates queued for the exit are
    written to (``index.flush_index_updates``)."""
    return Store(root).index


def _cleanup_of(store: weakref.ref[Store]) -> Callable[[], object]:
    """``store.cleanup()`` while the Store lives (a weak reference: the parts never keep their Store alive)."""
    def cleanup() -> object:
        live = store()
        return live.cleanup() if live is not None else None
    return cleanup


def _checked_options(root: pathlib.Path, lock_mode: str, max_size: int | None) -> None:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"cache_dir={str(root)!r} is a file, not a folder. Fix: pass a folder path "
                          f"(it is created if missing)")
    if lock_mode not in ("flock", "soft"):
        raise ConfigError(f"lock_mode={lock_mode!r}: expected 'flock' or 'soft'")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0):
        raise ConfigError(f"max_size={max_size!r}: expected a positive number of bytes, or None for no limit")


class Store:
    """One cache folder. Cheap to create; nothing is touched on disk until the first read or write."""

    def __init__(self, root: str | os.PathLike | None, *, lock_timeout_s: float = 900.0, lock_mode: str = "flock",
                 max_size: int | None = None, signing_key: str | bytes | None = None,
                 trust_shared_folder: bool = False, remote: str | None = None, remote_trust: str = "signed",
                 remote_timeout_s: float = 5.0, remote_chunk_bytes: int = 4 << 20,
                 remote_claim_ttl_s: float = 20.0):
        path = pathlib.Path(root) if root is not None else default_root()
        _checked_options(path, lock_mode, max_size)
        self.root = path.resolve()
        self.lock_timeout_s, self.lock_mode, self.max_size = lock_timeout_s, lock_mode, max_size
        key = signing_key if signing_key is not None else os.environ.get(SIGNING_KEY_ENV) or None
        self._key: bytes | None = (key.encode() if isinstance(key, str) else key) or None
        self.trust_shared_folder = bool(trust_shared_folder)
        shared = self.trust_shared_folder and self._key is not None
        self.layout = layout = Layout(self.root, 0o770 if shared else 0o700)
        self.locks = locks = Locks(layout, lock_mode, lock_timeout_s)
        self.trust = trust = Trust(layout, shared)
        self.first_use = first_use = FirstUse(layout, trust, on_first_use=_cleanup_of(weakref.ref(self)))
        self.bookkeeping = index = Index(layout, locks, first_use, fresh=_fresh_index)
        self.leases = leases = Leases(layout, locks, index)
        self.eviction = eviction = Eviction(layout, locks, leases, index, first_use, max_size)
        self.cleaner = Cleanup(layout, locks, leases, eviction)
        self.artifacts = artifacts = Artifacts(layout, locks, leases, trust, index, first_use, eviction, self._key)
        self.remote = self._open_remote(remote, remote_trust, timeout_s=remote_timeout_s,
                                        chunk_bytes=remote_chunk_bytes, claim_ttl_s=remote_claim_ttl_s)
        self.fleet = None if self.remote is None else Fleet(layout, locks, leases, trust, first_use, artifacts,
                                                            self.remote)
        self.entries = entries = Entries(layout, trust, leases, index, first_use, self._key, self.fleet)
        self.sync = None if self.fleet is None else Sync(layout, locks, first_use, entries, artifacts, self.fleet)

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

    def ensure_ready(self) -> None:
        """Run the folder's first-use checks now (once per Store): create it, refuse it when untrusted
        (``UntrustedCacheError``), clean up after dead processes. Raises ``OSError``."""
        self.first_use.ensure()

    def cleanup(self) -> dict[str, int]:
        """Remove what killed processes left behind (``Cleanup.run``; run once by every Store that writes, at its
        first use). Never raises; returns counts per kind."""
        return self.cleaner.run()

    # ------------------------------------------------------------------------------------------------ layout
    def entry_path(self, topology_folder: str, method: str, ekey: str) -> pathlib.Path:
        return self.layout.entry(topology_folder, method, ekey)

    def plan_path(self, topology_folder: str, method: str, pkey: str) -> pathlib.Path:
        return self.layout.plan(topology_folder, method, pkey)

    def artifact_dir(self, akey: str) -> pathlib.Path:
        return self.layout.artifact(akey)

    def torch_artifact_dir(self, akey: str) -> pathlib.Path:
        """torch's unpacked artifact inside artifact ``akey``: the generated code and kernels."""
        return self.layout.torch_artifact(akey)

    def entry_keys(self) -> list[tuple[str, str, str]]:
        return self.layout.entry_keys()

    def artifact_keys(self) -> list[str]:
        return self.layout.artifact_keys()

    def artifact_sizes(self) -> dict[str, tuple[int, float]]:
        return self.layout.artifact_sizes()

    # --------------------------------------------------------------------------------------------- artifacts
    def publish_artifact(self, akey: str, build: Callable[[pathlib.Path], None]) -> tuple[pathlib.Path, bool]:
        """``Artifacts.publish``, through the remote store when there is one (``Fleet.publish``)."""
        return self.artifacts.publish(akey, build, None if self.fleet is None else self.fleet.publish)

    def verify_artifact(self, akey: str, folder: pathlib.Path | None = None,
                        only: Sequence[str] | None = None) -> None:
        """``Artifacts.verify``: ``CacheCorruptionError`` unless the artifact (or its copy ``folder``; or its parts
        ``only``) matches its manifest."""
        self.artifacts.verify(akey, folder, only)

    def verify_for_load(self, akey: str, only: Sequence[str] | None) -> None:
        self.artifacts.verify_for_load(akey, only)

    def quarantine(self, akey: str, reason: str) -> None:
        self.artifacts.quarantine(akey, reason)

    def lease(self, akey: str) -> None:
        """``Leases.take``: artifact ``akey`` is in use by this process while this Store lives (never evicted)."""
        self.leases.take(akey)

    def end_lease(self, akey: str) -> None:
        self.leases.end(akey)

    def live_leases(self, akey: str) -> list[str]:
        return self.leases.live_holders(akey)

    def evict(self, *, keep: set[str] | frozenset[str] = frozenset(), when: str | None = None) -> list[str]:
        return self.eviction.evict(keep=keep, when=when)

    def remove_artifact(self, akey: str) -> str:
        return self.eviction.remove_artifact(akey)

    @contextlib.contextmanager
    def locked_in_every_mode(self, akey: str, timeout: float) -> Iterator[None]:
        with self.locks.held_in_every_mode(akey, timeout):
            yield

    # ----------------------------------------------------------------------------------------------- entries
    def read_entry(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """``Entries.read``: the entry manifest, or None; nothing is leased, quarantined or fetched."""
        return self.entries.read(topology_folder, method, ekey)

    def entry_for_load(self, topology_folder: str, method: str, ekey: str) -> dict[str, Any] | None:
        """``Entries.read_for_load``: the entry manifest of an entry about to be loaded, its artifact leased (and
        fetched from the remote store when missing), a bad manifest quarantined, a local miss fetched remotely."""
        return self.entries.read_for_load(topology_folder, method, ekey)

    def write_entry(self, topology_folder: str, method: str, ekey: str, manifest: dict[str, Any]) -> None:
        self.entries.write(topology_folder, method, ekey, manifest)

    def list_entries(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        return self.entries.in_method(topology_folder, method)

    def check_entry(self, topology_folder: str, method: str,
                    ekey: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
        return self.entries.check(topology_folder, method, ekey)

    def remove_entry(self, topology_folder: str, method: str, ekey: str) -> None:
        self.entries.remove(topology_folder, method, ekey)

    def read_plan(self, topology_folder: str, method: str, pkey: str) -> dict[str, Any] | None:
        return self.entries.read_plan(topology_folder, method, pkey)

    def write_plan(self, topology_folder: str, method: str, pkey: str, plan: dict[str, Any]) -> None:
        self.entries.write_plan(topology_folder, method, pkey, plan)

    def list_plans(self, topology_folder: str, method: str) -> list[dict[str, Any]]:
        return self.entries.list_plans(topology_folder, method)

    # ------------------------------------------------------------------------------------------------- index
    @property
    def index(self) -> Any:
        """The diskcache index (``Index.db``): bookkeeping only, opened after the first-use checks."""
        return self.bookkeeping.db

    def close_index(self) -> None:
        self.bookkeeping.close()

    def read_index(self) -> Any:
        return self.bookkeeping.read()

    def entry_usage(self) -> dict[str, dict[str, Any]]:
        return self.bookkeeping.entry_usage()

    def defer_index_update(self, update: Callable[[Any], None]) -> None:
        self.bookkeeping.defer(update)

    def forget(self, ekeys: list[str], akeys: list[str]) -> None:
        self.bookkeeping.forget(ekeys, akeys)

    def touch(self, ekey: str) -> None:
        """Record a load of an entry (``Index.record_load``)."""
        self.bookkeeping.record_load(ekey)

    # ------------------------------------------------------------------------------------------------- trust
    def untrusted_why(self, path: pathlib.Path) -> str | None:
        return self.trust.path_problem(path)

    def refused_folders(self) -> list[tuple[pathlib.Path, str]]:
        return self.trust.refused_folders()

    # ------------------------------------------------------------------------------------- gearcache push / pull
    def push_to_remote(self, *, force: bool = False) -> dict[str, int]:
        return self._sync().push(force=force)

    def pull_from_remote(self, *, method: str | None = None) -> dict[str, int]:
        return self._sync().pull(method=method)

    def _sync(self) -> Sync:
        if self.sync is None:
            raise ConfigError(f"the store at {self.root} has no remote store. Fix: pass remote=... (or set "
                              f"${REMOTE_ENV})")
        return self.sync
