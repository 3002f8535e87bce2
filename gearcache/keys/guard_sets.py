"""Value guards: the Python values a captured graph bakes in, recorded at capture and checked before it is served.

Dynamo specialises a capture on every Python value the method reads — module attributes (``self.heads``,
``self.ln.eps``, ``self.training``), globals and constants of any module (``SCALE``, ``helper.ALPHA``), closure
cells, config objects, the identity of the functions and classes it calls, empty hook dicts — and records each as a
*guard*. ``torch.compile`` checks its guards at every call; a gearcache entry keeps them as value guards:

* at capture, ``guards_from_dynamo.from_dynamo`` turns Dynamo's guards (``_torch.guards.DynamoGuard``) into
  ``ValueGuard`` records (gearcache/keys/value_guard.py): a path from a root (the module, a Python module's globals,
  builtins) to the guarded object (gearcache/keys/guard_paths.py), what is checked about it (``kind``) and the
  expected *fingerprint*, a JSON value that means the same in every process (gearcache/keys/guard_fingerprints.py);
* an entry or a gear plan is served only where every fingerprint computed on the live objects equals the recorded
  one (:meth:`GuardSet.mismatch`, at load and whenever :mod:`gearcache.keys.guard_watch` sees a guarded object change);
* stored entries of one call signature whose guards differ live side by side: the first is stored under the
  signature's entry key, each other one under :func:`variant_key` (that key plus the live fingerprints of the first
  one's guards), so a lookup reads at most two manifests (:func:`choose`).

This module is the set of one capture's guards: :class:`GuardSet` (its JSON form, the manifest's ``"guards"``:
``[[kind, path, arg, expected], ...]``), its check on live objects (:class:`Reading`, :class:`Mismatch`) and the
choice of a stored record at load (:func:`choose`, :func:`variant_key`). A set with a *local* guard (an object known
only by its identity) is served in this process only, never stored (:func:`warn_local`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, TypeVar

from ..counters import counters
from ..errors import Unpersistable
from .guard_fingerprints import hashable, live_fingerprint
from .guard_paths import GuardPath, PathValues, Scope
from .value_guard import LiveObject, ValueGuard

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The first guard whose live fingerprint differs from the recorded one."""
    guard: ValueGuard
    live: Any

    def __str__(self) -> str:
        return (f"{self.guard.text()} ({self.guard.kind}): compiled with {_show(self.guard.expected)}, "
                f"now {_show(self.live)}")


class GuardSet:
    """The value guards of one capture. ``local`` (a message) when one of them cannot be checked in another process:
    the entry is then served in this process only. Never changed once made (sets parsed from equal JSON are one
    object: :meth:`from_json`)."""

    def __init__(self, guards: list[ValueGuard], local: str | None = None):
        self.guards = guards
        self.local = local
        self._source: list[Any] | None = None     # the JSON it was parsed from (from_json): compared, never changed

    def __len__(self) -> int:
        return len(self.guards)

    def to_json(self) -> list[Any]:
        if self.local is not None:
            raise Unpersistable(self.local)
        return [g.to_json() for g in self.guards]

    @classmethod
    def from_json(cls, data: list[Any] | None) -> "GuardSet":
        """The set of a manifest's ``"guards"``. JSON equal to that of a set parsed before in this process, and still
        held, gives that set itself (the gears of one method store the same guards: each distinct set is parsed once,
        and checked and watched once per pass, :meth:`mismatch`, ``guard_watch.Watcher``). The JSON is kept by the
        set to compare with (a manifest's lists are never changed after it is read). Counts
        ``counters.guard_parses``."""
        data = data or []
        with _INTERNED_LOCK:
            same = _INTERNED.get(len(data), [])
            for ref in same:
                held = ref()
                if held is not None and (held._source is data or held._source == data):
                    return held
        parsed = cls([ValueGuard.from_json(g) for g in data])
        parsed._source = data
        counters.add(guard_parses=1)
        with _INTERNED_LOCK:
            same = _INTERNED.setdefault(len(data), [])
            same[:] = [ref for ref in same if ref() is not None]
            same.append(weakref.ref(parsed))
        return parsed

    def mismatch(self, scope: Scope, reading: "Reading | None" = None) -> Mismatch | None:
        """The first guard that does not hold on the live objects, or None. ``reading``: objects and fingerprints
        already read in this pass (several guard sets checked at once share the paths they have in common; a set
        checked already in the pass is answered from it: :meth:`Reading.checked`). Counts ``counters.guard_checks``
        (the sets checked guard by guard)."""
        if reading is not None:
            known = reading.checked(self, scope)
            if known is not None:
                return known[0]
        reading = reading if reading is not None else Reading()
        counters.add(guard_checks=1)
        skipped: list[ValueGuard] = []
        found: Mismatch | None = None
        for g in self.guards:
            if unloaded_torch_module(g):
                skipped.append(g)
                continue
            live = reading.fingerprint(g, scope)
            if live != g.expected:
                found = Mismatch(g, live)
                break
        reading.remember(self, scope, found, skipped)
        return found

    def live_fingerprints(self, scope: Scope) -> list[Any]:
        reading = Reading()
        return [g.expected if unloaded_torch_module(g) else reading.fingerprint(g, scope) for g in self.guards]


class Reading:
    """One pass over live objects: the object at each path and each guard's live fingerprint, read once (nothing may
    change them during the pass: use one per check, or per pass of checks under the method's lock: ``_revalidate``,
    a warm-up's look-ups in ``warmup.driver.find_all``, whose threads share it; two threads reading one value at once
    both read it, one result is kept)."""

    def __init__(self) -> None:
        self.values: PathValues = {}
        self._fps: dict[tuple[str, GuardPath, object], Any] = {}   # (kind, path, arg) -> fingerprint (JSON)
        # id of a guard set checked in this pass -> (the set, its scope, its first mismatch, the guards it skipped)
        self._sets: dict[int, tuple[GuardSet, Scope, Mismatch | None, list[ValueGuard]]] = {}
        self._once: dict[tuple[str, int], Any] = {}

    def fingerprint(self, guard: ValueGuard, scope: Scope) -> Any:
        mark = (guard.kind, guard.path, hashable(guard.arg))
        try:
            return self._fps[mark]
        except KeyError:
            fp = self._fps[mark] = live_fingerprint(guard, scope, self.values)
            return fp

    def once(self, mark: tuple[str, int], read: Callable[[], _T]) -> _T:
        """``read()`` the first time ``mark`` (a name and an object's id, alive through the pass) is asked for in this
        pass, its value after: something else a pass of look-ups reads of live objects once for all (the module's
        tensors: ``entry_life.ModuleTensors``)."""
        try:
            held: _T = self._once[mark]
            return held
        except KeyError:
            value = self._once[mark] = read()
            return value

    def remember(self, guards: GuardSet, scope: Scope, found: Mismatch | None, skipped: list[ValueGuard]) -> None:
        """``guards.mismatch(scope)`` of this pass was ``found``, with the ``skipped`` guards left unchecked (they read
        a module of torch's own this process had not imported: ``unloaded_torch_module``)."""
        self._sets[id(guards)] = (guards, scope, found, skipped)

    def checked(self, guards: GuardSet, scope: Scope) -> tuple[Mismatch | None] | None:
        """``(mismatch,)`` when ``guards`` was checked on ``scope`` in this pass already (None otherwise): what that
        check found, as checking again would (every fingerprint it read is this pass's), except that a guard it
        skipped whose torch module has been imported since is checked now."""
        known = self._sets.get(id(guards))
        if known is None or known[0] is not guards or known[1] is not scope:
            return None
        found = known[2]
        if found is None:
            for g in known[3]:
                if not unloaded_torch_module(g):
                    live = self.fingerprint(g, scope)
                    if live != g.expected:
                        return (Mismatch(g, live),)
        return (found,)


_INTERNED: dict[int, list["weakref.ref[GuardSet]"]] = {}   # GuardSet.from_json's sets still held, by guard count
_INTERNED_LOCK = threading.Lock()


def unloaded_torch_module(guard: ValueGuard) -> bool:
    """Whether ``guard`` reads a module of torch's own that this process has not imported (Dynamo's helpers such as
    ``torch._dynamo.polyfills``, which its traces import). Such a guard holds without a check: the module's values are
    those of this torch version (a key factor) as imported, since nothing in this process could have set them; and
    importing it to check would import torch's compiler into a warm process that never needs it."""
    return (_unloaded_torch_root(guard.path[0])
            or (guard.kind == "same_as" and _unloaded_torch_root(guard.arg[0])))


def _unloaded_torch_root(root: Any) -> bool:
    return (type(root) is tuple and root[0] == "module" and (root[1] == "torch" or root[1].startswith("torch."))
            and root[1] not in sys.modules)


def variant_key(ekey: str, first: GuardSet, scope: Scope) -> str:
    """Where an entry of signature key ``ekey`` whose guards differ from ``first``'s (the entry stored under ``ekey``)
    is stored: ``ekey`` + the live fingerprints of ``first``'s guards. Two processes whose guarded values agree on
    those guards compute the same key."""
    text = json.dumps([ekey, first.live_fingerprints(scope)], sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclasses.dataclass
class Choice:
    """What :func:`choose` found: ``record`` (None: a miss) with its ``guards``, the ``key`` it is (or, on a miss, is
    to be) stored under, and on a miss caused by guards the ``mismatch`` with the signature's first record."""
    record: dict[str, Any] | None
    guards: GuardSet | None
    key: str
    mismatch: Mismatch | None = None


def choose(read: Callable[[str], dict[str, Any] | None], key: str, scope: Scope,
           reading: Reading | None = None) -> Choice:
    """The stored record (an entry manifest or a gear plan) of ``key`` whose guards hold on ``scope``: the one stored
    under ``key`` or its variant (:func:`variant_key`). ``read(key) -> record or None``. ``reading``: the live
    values read in this pass already (a warm-up's look-ups of all its gears, under the method's lock, share one)."""
    first = read(key)
    if first is None:
        return Choice(None, None, key)
    first_guards = _guards_of(first)
    mismatch = first_guards.mismatch(scope, reading)
    if mismatch is None:
        return Choice(first, first_guards, key)
    vkey = variant_key(key, first_guards, scope)
    variant = read(vkey)
    if variant is not None:
        variant_guards = _guards_of(variant)
        if variant_guards.mismatch(scope, reading) is None:
            return Choice(variant, variant_guards, vkey)
    return Choice(None, None, vkey, mismatch)


def _guards_of(record: dict[str, Any]) -> GuardSet:
    """The guard set of a record just read (``GuardSet.from_json``); where that set was parsed from another record's
    equal JSON, the record's ``"guards"`` becomes that JSON (the same values), so that the gears of a method keep one
    copy of their guards between them, not one each (a 8-layer decoder's: ~800 guards, ~10^4 objects a copy)."""
    raw = record.get("guards")
    guards = GuardSet.from_json(raw)
    if isinstance(raw, list) and guards._source is not raw:
        record["guards"] = guards._source
    return guards


def _show(fp: Any) -> str:
    if isinstance(fp, list) and len(fp) == 2 and fp[0] in ("bool", "int", "str", "float", "NoneType"):
        return repr(fp[1]) if fp[0] != "float" else fp[1]
    if isinstance(fp, LiveObject):
        return f"<object at {id(fp.obj):#x}>"
    text = json.dumps(fp, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."


def warn_local(method_name: str, guards: GuardSet,
               _warned: set[str] = set()) -> None:   # noqa: B006 - once per method
    """Warn, once per method, that its entries are served in this process only (``guards.local`` says why)."""
    if guards.local is None or method_name in _warned:
        return
    _warned.add(method_name)
    warnings.warn(f"gearcache: {method_name}: {guards.local}; its entries are compiled and served in this process "
                  f"only, not stored. Fix: make the value a constant (int, float, str, enum, tuple) or a module "
                  f"attribute gearcache can read", stacklevel=4)
