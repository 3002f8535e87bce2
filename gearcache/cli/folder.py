"""The cache folder as ``gearcache`` sees it: a read-mostly client of one ``Store`` (gearcache/store/).

Every manifest, index row, artifact folder and lock is reached through the store's public methods: the CLI has no
file format, path or lock of its own. Entry manifests are read with ``Store.entries.check`` (signature checked with
``$GEARCACHE_SIGNING_KEY``, as the call path checks it); nothing here writes, except what ``prune --yes`` asks the
store to delete.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from typing import Any

from ..errors import CliError
from ..store import Store, StoreConfig, default_root
from .output import warn

ENTRY_PREFIX_MIN = 6


@dataclasses.dataclass
class EntryRef:
    """One entry manifest file. ``manifest`` is None when the store does not accept it; ``problem`` then says why."""
    topology: str
    method: str
    ekey: str
    path: pathlib.Path
    manifest: dict[str, Any] | None
    problem: tuple[str, str] | None = None        # (status, detail): ("corrupt" | "incompatible", why)

    @property
    def akey(self) -> str | None:
        return self.manifest.get("akey") if self.manifest else None


class StoreView:
    """What the commands read of one cache folder, through its ``Store`` (lazily, memoised). Opening one writes
    nothing; the store is local only (``$GEARCACHE_REMOTE`` is for ``--remote`` commands)."""

    def __init__(self, root: pathlib.Path):
        self.store = Store(root, StoreConfig(remote=""))
        self.root = self.store.root
        self._entries: list[EntryRef] | None = None
        self._usage: dict[str, dict[str, Any]] | None = None
        self._sizes: dict[str, tuple[int, float]] | None = None

    # ------------------------------------------------------------------------------------------------ entries
    def entries(self, refresh: bool = False) -> list[EntryRef]:
        """Every entry manifest on disk, accepted or not (``EntryRef.problem``)."""
        if self._entries is None or refresh:
            self._entries = []
            for topology, method, ekey in self.store.layout.entry_keys():
                manifest, problem = self.store.entries.check(topology, method, ekey)
                path = self.store.layout.entry(topology, method, ekey)
                self._entries.append(EntryRef(topology, method, ekey, path, manifest, problem))
        return self._entries

    def good_entries(self) -> list[EntryRef]:
        return [e for e in self.entries() if e.manifest is not None]

    def resolve(self, name: str) -> list[EntryRef]:
        """Entries (one per topology holding it) whose key is ``name`` or starts with it."""
        name = name.strip().lower()
        if len(name) < ENTRY_PREFIX_MIN:
            raise CliError(f"entry {name!r}: give an entry key or at least {ENTRY_PREFIX_MIN} of its first "
                           f"characters (see `gearcache ls`)")
        matches = [e for e in self.good_entries() if e.ekey.startswith(name)]
        if not matches:
            raise CliError(f"no entry {name!r} in {self.root} (see `gearcache ls`)")
        keys = sorted({e.ekey for e in matches})
        if len(keys) > 1:
            raise CliError(f"entry {name!r} is ambiguous: it starts {len(keys)} entry keys "
                           f"({', '.join(k[:16] for k in keys[:5])}{', ...' if len(keys) > 5 else ''}); give more "
                           f"characters")
        return matches

    def gears(self, topology: str, method: str) -> list[list[dict[str, Any]]]:
        """The method's gear plans: per plan, its marked dims ``{name, leaf, dim, sizes}``."""
        plans = []
        for data in self.store.entries.gear_plans_in_method(topology, method):
            try:
                plans.append([{"name": d.get("name"), "leaf": d.get("leaf"), "dim": d.get("dim"),
                               "sizes": list(d.get("sizes", []))} for d in data["plan"]["dims"]])
            except (KeyError, TypeError, AttributeError):
                continue
        return plans

    # ---------------------------------------------------------------------------------------------- artifacts
    def artifact_keys(self) -> list[str]:
        """Every artifact folder, valid or not."""
        return self.store.layout.artifact_keys()

    def published(self) -> dict[str, tuple[int, float]]:
        """``{akey: (bytes, manifest mtime)}`` of the artifacts with a readable manifest."""
        if self._sizes is None:
            self._sizes = self.store.layout.artifact_sizes()
        return self._sizes

    def artifact_bytes(self, akey: str | None) -> int | None:
        found = self.published().get(akey) if akey else None
        return found[0] if found else None

    # ------------------------------------------------------------------------------------------------- index
    def usage(self, ekey: str) -> dict[str, Any]:
        """The entry's index row (loads, hits, last used, ...); {} without one. An index that cannot be read is
        repaired by the store (warned once); one that cannot be opened at all is warned about here."""
        if self._usage is None:
            self._usage = {}
            try:
                self._usage = self.store.index.entry_usage()
            except Exception as exc:
                warn(f"cannot read the index of {self.root} ({exc}); loads, hits and last used are not shown")
        return self._usage.get(ekey) or {}

    def last_used(self, ref: EntryRef) -> float | None:
        row = self.usage(ref.ekey)
        value = row.get("last_used") or row.get("created") or (ref.manifest or {}).get("created")
        return float(value) if isinstance(value, (int, float)) else None


def open_view(args: argparse.Namespace, must_exist: bool = True) -> StoreView:
    """The cache folder of ``--cache-dir`` (else ``$GEARCACHE_HOME``, else ``./.gearcache``); ``CliError`` when it is
    not there."""
    root = pathlib.Path(args.cache_dir) if args.cache_dir else default_root()
    if must_exist and not root.is_dir():
        where = "--cache-dir" if args.cache_dir else ("$GEARCACHE_HOME" if os.environ.get("GEARCACHE_HOME")
                                                      else "the default ./.gearcache")
        raise CliError(f"no cache folder at {root} ({where}). Pass --cache-dir PATH or set GEARCACHE_HOME")
    return StoreView(root)
