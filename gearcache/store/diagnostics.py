"""Bookkeeping for ``gearcache explain``, ``ls`` and ``stats``: recorded misses, loads, hits and padding.

Nothing here runs on the call path. ``record_miss`` runs once per compile, ``record_load`` once per load, and hits are
counted by the call path as one integer increment on the entry (``Entry.hits``; a geared call also adds its inputs'
real and padded elements: ``Entry.real_elements``, ``Entry.padded_elements``) and written to the index by one
``atexit`` flush per process (:func:`flush_hits`; call it yourself in a long-running server to write them earlier).
Every write is wrapped: a failure logs a warning and never raises into the caller.

On disk::

    <root>/misses/<topology>/<method>/<ekey>.json   the key factors of a miss that compiled (newest 50 per method)
    <root>/index/                                   index rows: loads, last_used, load_seconds, hits,
                                                    real_elements, padded_elements (padding waste: stats)
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pathlib
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, Protocol

from ..errors import UntrustedCacheError
from ..keys.key import FORMAT_VERSION
from . import Store, flush_index_updates, write_json_atomic
from .layout import Layout

log = logging.getLogger("gearcache.store.diagnostics")

MAX_MISSES_PER_METHOD = 50


# ------------------------------------------------------------------------------------------------------- factors
def differing_factors(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names of the factors whose hashes differ between two ``{factor: hash}`` maps (in ``a``'s order, then ``b``'s)."""
    names = list(dict.fromkeys([*a, *b]))
    return [n for n in names if a.get(n) != b.get(n)]


def nearest_entry(manifests: Iterable[dict[str, Any]], hashes: dict[str, str],
                  exclude: str | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The manifest with the fewest factor hashes differing from ``hashes`` (the newest on a tie; ``exclude`` is an
    entry key to skip), and those factor names. ``(None, [])`` when there is none."""
    best, best_diff = None, []
    for m in manifests:
        if exclude is not None and m.get("ekey") == exclude:
            continue
        other = (m.get("factors") or {}).get("hashes") or {}
        diff = differing_factors(hashes, other)
        if (best is None or len(diff) < len(best_diff) or
                (len(diff) == len(best_diff) and m.get("created", 0) > best.get("created", 0))):
            best, best_diff = m, diff
    return best, best_diff


# -------------------------------------------------------------------------------------------------------- misses
def record_miss(store: Store, topology_folder: str, method: str, ekey: str, factors: dict[str, Any]) -> None:
    """Write a miss's key factors to ``misses/<topology>/<method>/<ekey>.json`` (newest 50 kept per method) and log
    at INFO which factors differ from the nearest existing entry of the method (whether this process then compiles
    the artifact, or waits for another one compiling it, is logged by the store). Never raises."""
    try:
        known = store.entries.in_method(topology_folder, method)
        nearest, diff = nearest_entry(known, factors["hashes"], exclude=ekey)
        if factors.get("guard_miss"):
            reason = f"a value the graph bakes in differs from the stored entry's: {factors['guard_miss']}"
        elif any(m.get("ekey") == ekey for m in known):
            reason = "its entry is on disk but could not be used (stale or missing artifact, logged above)"
        elif nearest is None:
            reason = "no entry of this method on disk yet"
        else:
            reason = f"key factor(s) {', '.join(diff)} differ from the nearest entry {nearest['ekey']}"
        log.info("%s: miss for entry %s: %s; capturing it", method, ekey, reason)
        store.first_use.ensure()
        folder = store.layout.method_misses(topology_folder, method)
        for d in (folder.parent.parent, folder.parent, folder):
            d.mkdir(mode=0o700, exist_ok=True)
        write_json_atomic(folder / f"{ekey}.json", {
            "format": FORMAT_VERSION, "ekey": ekey, "method": method, "topology": topology_folder,
            "time": time.time(), "pid": os.getpid(), "factors": factors,
            "nearest": nearest["ekey"] if nearest is not None else None, "differs": diff,
            "guard": factors.get("guard_miss")})
        _trim(folder, MAX_MISSES_PER_METHOD)
    except UntrustedCacheError as exc:      # the store is refused: warned once where the refusal is met
        log.debug("%s: miss of entry %s not recorded (%s)", method, ekey, exc)
    except Exception as exc:                # diagnostics must never fail a call
        log.warning("%s: could not record the miss of entry %s (%s)", method, ekey, exc)


def _trim(folder: pathlib.Path, keep: int) -> None:
    records = [p for p in folder.glob("*.json")]
    if len(records) <= keep:
        return
    by_age = sorted(records, key=lambda p: p.stat().st_mtime)
    for path in by_age[:len(records) - keep]:
        path.unlink(missing_ok=True)


def recorded_misses(layout: Layout, method: str) -> list[tuple[float, pathlib.Path, dict[str, Any]]]:
    """The misses of ``method`` :func:`record_miss` recorded in the folder of ``layout`` (every topology), as
    ``(time, path, record)``; unreadable records are skipped (``gearcache explain --method``)."""
    records = []
    for path in layout.miss_files(method):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("factors"), dict):
                records.append((float(data.get("time", path.stat().st_mtime)), path, data))
        except (OSError, ValueError, TypeError):
            continue
    return records


def missed_methods(layout: Layout) -> set[str]:
    """The methods with recorded misses in the folder of ``layout``."""
    return layout.missed_methods()


# --------------------------------------------------------------------------------------------------------- loads
def record_load(store: Store, ekey: str, seconds: float) -> None:
    """Index row of ``ekey``: ``loads`` + 1, ``last_used`` = now, ``load_seconds`` += ``seconds``; queued, written at
    exit (``index.flush_index_updates``). Never raises."""
    now = time.time()

    def update(index: Any) -> None:
        row = dict(index.get(ekey) or {})
        row["loads"] = row.get("loads", 0) + 1
        row["last_used"] = max(now, row.get("last_used") or 0)
        row["load_seconds"] = row.get("load_seconds", 0.0) + float(seconds)
        index[ekey] = row

    store.index.defer(update)


# ---------------------------------------------------------------------------------------------------------- hits
# The call path counts hits on the entry (``entry.hits += 1``). Each CachedFunction that missed once is tracked here
# with a weakref finalizer holding its cache folder's path and its entry table (never the CachedFunction, so it can
# still be collected); a collected one moves its counts to ``_pending`` (dict work only: safe inside the garbage
# collector), and ``flush_hits`` (atexit) writes live and pending counts to the index rows' ``hits``.
class CountedEntry(Protocol):
    """An entry as the hit bookkeeping reads it: its manifest (beside the counts named in ``COUNTED``)."""

    @property
    def manifest(self) -> dict[str, Any]: ...


class HitCounted(Protocol):
    """What the hit bookkeeping reads of a method's entries (an ``EntryLife``): its store, and its entry table
    (signature -> an entry with ``manifest`` and the counts named in ``COUNTED``)."""

    store: Store

    @property
    def table(self) -> Mapping[Any, CountedEntry]: ...     # signature key -> entry


_lock = threading.Lock()
_tracked: "weakref.WeakKeyDictionary[HitCounted, weakref.finalize[..., HitCounted]]" = weakref.WeakKeyDictionary()
COUNTED = ("hits", "real_elements", "padded_elements")     # what entries count per call, flushed to their rows
# (root, topology, method, ekey) -> {name in COUNTED: count not yet written}
_pending: dict[tuple[str, str, str, str], dict[str, int]] = {}
_atexit_registered = False


def track_hits(entries: HitCounted) -> None:
    """Have this process's hits on ``entries``' entries written to the index at exit (idempotent)."""
    global _atexit_registered
    if entries in _tracked:
        return
    with _lock:
        if entries in _tracked:
            return
        fin = weakref.finalize(entries, _stash, str(entries.store.root), entries.table)
        fin.atexit = False              # flush_hits reads the live ones itself
        _tracked[entries] = fin
        if not _atexit_registered:
            atexit.register(flush_hits)
            _atexit_registered = True


def _stash(root: str, table: Mapping[Any, CountedEntry]) -> None:
    seen: set[int] = set()
    for entry in list(table.values()):
        if id(entry) in seen:
            continue
        seen.add(id(entry))
        counts = {name: getattr(entry, name, 0) for name in COUNTED}
        if any(counts.values()):
            for name in COUNTED:
                setattr(entry, name, 0)
            m = entry.manifest
            k = (root, m.get("topology", ""), m.get("method", ""), m["ekey"])
            row = _pending.setdefault(k, dict.fromkeys(COUNTED, 0))
            for name, n in counts.items():
                row[name] += n


def flush_hits() -> None:
    """Add the hits (and geared calls' elements) counted in this process since the last flush to the index rows'
    ``hits`` (``real_elements``, ``padded_elements``), and write the other queued index updates
    (``index.flush_index_updates``). Never raises."""
    global _pending
    flush_index_updates()
    try:
        for cf in list(_tracked.keys()):
            _stash(str(cf.store.root), cf.table)
        pending, _pending = _pending, {}
    except Exception as exc:
        log.warning("could not collect entry hits (%s)", exc)
        return
    by_root: dict[str, list[tuple[str, str, str, dict[str, int]]]] = {}
    for (root, topology, method, ekey), counts in pending.items():
        by_root.setdefault(root, []).append((topology, method, ekey, counts))
    now = time.time()
    for root, rows in by_root.items():
        if not os.path.isdir(root):
            continue                    # the cache folder was removed: never recreate it
        store = Store(root)
        try:
            index = store.index.db
            with index.transact():
                for topology, method, ekey, counts in rows:
                    row = index.get(ekey)
                    if row is None and not store.layout.entry(topology, method, ekey).is_file():
                        continue        # the entry was pruned meanwhile
                    row = dict(row or {"method": method, "topology": topology})
                    for name, n in counts.items():
                        if n or name == "hits":
                            row[name] = row.get(name, 0) + n
                    row["last_used"] = now
                    index[ekey] = row
        except UntrustedCacheError as exc:      # the store is refused: warned once where the refusal is met
            log.debug("cache index update of entry hits skipped (%s)", exc)
        except Exception as exc:
            log.warning("cache index update of entry hits failed (%s)", exc)
        finally:
            store.index.close()
