"""Noticing, at the cost of a comparison per call, that a value an entry's guards depend on may have changed.

An entry's value guards (gearcache/guards.py) are checked when it is loaded; a call must also never be served by an
entry whose guarded values changed since (``model.eps = 0.1`` after the first call). Re-checking every guard at every
call would cost microseconds, so a :class:`GuardWatch` watches the objects on the guards' paths instead, and only a
change there sends the next call to ``CachedFunction._revalidate`` (which re-checks the guards and drops the entries
that no longer hold). What counts as a change (``hops``):

* an item of a dict on a path (a module's globals, an instance ``__dict__``, ``nn.Module``'s ``_modules``,
  ``_parameters`` and ``_buffers``, plain dicts): the key set, replaced or deleted. On Python 3.12+ these dicts are
  watched (``PyDict_Watch``) with a filter of the keys on the paths, so other keys (a script's loop variable in
  ``__main__``) cost nothing; on 3.10/3.11 each call compares the dicts' version tags and re-reads only a changed
  dict's keys;
* a class on a path (a class attribute set, a base class changed): watched types (``PyType_Watch``; version tags
  before 3.12);
* every other step (a list item, a closure cell, a function's ``__defaults__``, an attribute behind a property, a
  ``__slots__`` attribute) is re-read at every call and compared by identity.

An object whose class customises ``__getattribute__`` (transformers' configs do) is assumed to answer from its
instance ``__dict__`` and its class: any change of that dict counts. Not noticed: ``obj.__class__ = Other`` and a
custom ``__getattribute__`` that reads other state; such changes are seen at the next miss or load.

``GuardWatch`` is ``gearcache._callpath.GuardWatch`` (C) where the extension is built, else :class:`PyGuardWatch`,
which re-reads every hop at every call.
"""
from __future__ import annotations

import types
from typing import Any, Iterable

import torch

from . import guards as guards_mod

try:
    from ._callpath import GuardWatch as _NativeGuardWatch
except ImportError:                 # pragma: no cover - depends on how gearcache was installed
    _NativeGuardWatch = None

ABSENT = guards_mod.MISSING_OBJECT      # a key or attribute that is not there (expected so)
_OBJECT_GETATTRIBUTE = object.__getattribute__
_MODULE_GETATTRIBUTE = torch.nn.Module.__getattribute__


class Hops:
    """What a watch covers: ``dicts`` ``[(dict, key or None for every key, expected value or ABSENT)]``, ``types``
    ``[type]``, ``checked`` ``[(op, parent, key, expected)]`` (op ``"attr"`` or ``"item"``, re-read per call)."""

    def __init__(self) -> None:
        self.dicts: list[tuple[dict, Any, Any]] = []
        self.types: list[type] = []
        self.checked: list[tuple[str, Any, Any, Any]] = []
        self._seen: set = set()
        self._frozen: set[int] = set()          # objects covered by a watched type (a class's __dict__, __mro__)

    def dict_item(self, d: dict, key: Any, expected: Any) -> None:
        self._once(("d", id(d), guards_mod.hashable(key)), lambda: self.dicts.append((d, key, expected)))

    def type_(self, t: type) -> None:
        self._once(("t", id(t)), lambda: self.types.append(t))

    def check(self, op: str, parent: Any, key: Any, expected: Any) -> None:
        mark = ("c", op, id(parent), guards_mod.hashable(key))
        self._once(mark, lambda: self.checked.append((op, parent, key, expected)))

    def _once(self, mark: tuple, add: Any) -> None:
        if mark not in self._seen:
            self._seen.add(mark)
            add()


def hops_for(guard_sets: Iterable[guards_mod.GuardSet], scope: guards_mod.Scope) -> Hops:
    """The hops of every path of every guard in ``guard_sets``, read on the live objects of ``scope``."""
    hops = Hops()
    values: dict[tuple, Any] = {}
    done: set[tuple] = set()
    for gs in guard_sets:
        _add_guards(hops, gs, scope, values, done)
    return hops


def _add_guards(hops: Hops, gs: guards_mod.GuardSet, scope: guards_mod.Scope, values: dict, done: set) -> None:
    for g in gs.guards:
        if guards_mod.unloaded_torch_module(g):
            continue
        _add_path(hops, g.path, scope, values, done)
        if g.kind == "same_as":
            _add_path(hops, g.arg, scope, values, done)


def _add_path(hops: Hops, path: tuple, scope: guards_mod.Scope, values: dict, done: set) -> None:
    if path in done:                    # its prefixes were added with it (entries of one model share most paths)
        return
    for n in range(1, len(path) + 1):
        prefix = path[:n]
        if prefix in done:
            continue
        done.add(prefix)
        child = guards_mod.evaluate(prefix, scope, values)
        if n == 1:
            if isinstance(prefix[0], tuple) and prefix[0][0] == "global":
                hops.dict_item(scope.globals, prefix[0][1], child)
            continue
        parent = guards_mod.evaluate(prefix[:-1], scope, values)
        if parent is ABSENT:
            return
        _add_step(hops, parent, prefix[-1], child)


def _add_step(hops: Hops, parent: Any, step: tuple, child: Any) -> None:
    op = step[0]
    if id(parent) in hops._frozen or op == "type":
        if op in ("attr", "generic_attr") and isinstance(child, (dict, types.MappingProxyType, tuple)):
            hops._frozen.add(id(child))
        return
    if op in ("attr", "generic_attr"):
        _add_attr(hops, parent, step[1], child)
    elif op == "item":
        if isinstance(parent, dict):
            hops.dict_item(parent, step[1], child)
        elif not isinstance(parent, (tuple, str, bytes, frozenset, types.MappingProxyType)):
            hops.check("item", parent, step[1], child)
    elif isinstance(parent, dict):                          # item_at / key_at: any change of the dict
        hops.dict_item(parent, None, None)
    else:
        hops.check("item", parent, step, child)             # pragma: no cover - a mapping that is not a dict


def _add_attr(hops: Hops, parent: Any, name: str, child: Any) -> None:
    if isinstance(parent, type):
        hops.type_(parent)                                  # class attributes, __mro__, __dict__
        if name in ("__dict__", "__mro__"):
            hops._frozen.add(id(child))
        return
    if isinstance(parent, types.ModuleType):
        hops.dict_item(parent.__dict__, name, child)
        return
    cls = type(parent)
    try:
        d = _OBJECT_GETATTRIBUTE(parent, "__dict__")
    except AttributeError:
        d = None
    if not isinstance(d, dict) or _is_data_descriptor(cls, name):
        hops.check("attr", parent, name, child)             # slots, properties, functions' __defaults__, cells
        return
    hops.type_(cls)
    if cls.__getattribute__ not in (_OBJECT_GETATTRIBUTE, _MODULE_GETATTRIBUTE):
        hops.dict_item(d, None, None)                       # answers from its __dict__ (see the module docstring)
        return
    hops.dict_item(d, name, d.get(name, ABSENT))
    if name not in d and isinstance(parent, torch.nn.Module):
        for store in ("_parameters", "_buffers", "_modules"):   # nn.Module.__getattr__ reads these
            held = d.get(store)
            if isinstance(held, dict):
                hops.dict_item(held, name, held.get(name, ABSENT))
    elif name not in d and getattr(cls, "__getattr__", None) is not None:
        hops.check("attr", parent, name, child)


def _is_data_descriptor(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        attr = klass.__dict__.get(name, ABSENT)
        if attr is not ABSENT:
            return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")
    return False


class PyGuardWatch:
    """The watch in Python (no C extension): every hop re-read at every call. ``valid()`` True while none changed."""

    def __init__(self, dicts: list, types_: list, checked: list, absent: Any):
        self._reads = ([("item", d, k, e) for d, k, e in dicts if k is not None]
                       + [("attr", p, k, e) if op == "attr" else ("item", p, k, e) for op, p, k, e in checked])
        self._whole = [(d, dict(d)) for d, k, _ in dicts if k is None]
        self._types = [(t, dict(t.__dict__)) for t in types_]
        self._absent = absent

    def valid(self) -> bool:
        absent = self._absent
        for op, parent, key, expected in self._reads:
            try:
                got = getattr(parent, key) if op == "attr" else parent[key]
            except (AttributeError, KeyError, IndexError, TypeError):
                got = absent
            if got is not expected:
                return False
        for d, copy in self._whole:
            if d.keys() != copy.keys() or any(d[k] is not v for k, v in copy.items()):
                return False
        for t, copy in self._types:
            if t.__dict__.keys() != copy.keys() or any(t.__dict__[k] is not v for k, v in copy.items()):
                return False
        return True


GuardWatch = _NativeGuardWatch or PyGuardWatch


class Watcher:
    """The watch of one cached method, grown as entries are added: :meth:`watch` returns a watch over the paths of
    the guard sets it is given, reusing the hops of the previous call's sets when it only adds sets to them and the
    previous watch is still valid (what those hops read is then what they read when built: every object on their
    paths is the one seen then). Otherwise (sets dropped, or a watched object changed) every hop is read again.

    A warm process loading entries one by one thus reads each shared path once: the entries of one model guard mostly
    the same attributes (measured on an H100, a 1024-hidden 8-layer Llama: 2,990 guards in two entries; rebuilding
    the watch from scratch per entry was 0.2 s of the first ``generate()`` under cProfile)."""

    def __init__(self, scope: guards_mod.Scope):
        self._scope = scope
        self._sets: list[guards_mod.GuardSet] = []
        self._hops = Hops()
        self._values: dict[tuple, Any] = {}
        self._done: set[tuple] = set()
        self._watch: Any = None

    def watch(self, guard_sets: Iterable[guards_mod.GuardSet | None]) -> Any:
        """A watch over the paths of ``guard_sets`` as they are now (call it right after the guards were checked);
        None when there is nothing to watch."""
        sets = [gs for gs in guard_sets if gs is not None and len(gs)]
        if not self._extends(sets):
            self._sets, self._hops, self._values, self._done = [], Hops(), {}, set()
        known = {id(gs) for gs in self._sets}
        for gs in sets:
            if id(gs) not in known:
                _add_guards(self._hops, gs, self._scope, self._values, self._done)
        self._sets = sets
        hops = self._hops
        self._watch = (GuardWatch(list(hops.dicts), list(hops.types), list(hops.checked), ABSENT)
                       if hops.dicts or hops.types or hops.checked else None)
        return self._watch

    def _extends(self, sets: list[guards_mod.GuardSet]) -> bool:
        """Whether ``sets`` holds every set of the previous call and the previous watch still holds."""
        now = {id(gs) for gs in sets}
        return (all(id(gs) in now for gs in self._sets)
                and (self._watch is None or self._watch.valid()))


def watch(guard_sets: Iterable[guards_mod.GuardSet], scope: guards_mod.Scope) -> Any:
    """A watch over the paths of ``guard_sets`` as they are now (call it right after the guards were checked); None
    when there is nothing to watch. A one-off :class:`Watcher`."""
    return Watcher(scope).watch(guard_sets)
