"""Noticing, at the cost of a comparison per call, that a value an entry's guards depend on may have changed.

An entry's value guards (gearcache/keys/guard_sets.py) are checked when it is loaded; a call must also never be
served by an entry whose guarded values changed since (``model.eps = 0.1`` after the first call). Re-checking every
guard at every call would cost microseconds, so a :class:`GuardWatch` watches the objects on the guards' paths
instead, and only a change there sends the next call to ``CachedFunction._revalidate`` (which re-checks the guards
and drops the entries that no longer hold). What counts as a change (``hops``):

* an item of a dict on a path (a module's globals, an instance ``__dict__``, ``nn.Module``'s ``_modules``,
  ``_parameters`` and ``_buffers``, plain dicts): the key set, replaced or deleted. On Python 3.12+ these dicts are
  watched (``PyDict_Watch``) with a filter of the keys on the paths, so other keys (a script's loop variable in
  ``__main__``) cost nothing; on 3.10/3.11 each call compares the dicts' version tags and re-reads only a changed
  dict's keys;
* a class on a path (a class attribute set, a base class changed): watched types (``PyType_Watch``; version tags
  before 3.12);
* every other step (a list item, a closure cell, a function's ``__defaults__``, an attribute behind a property, a
  ``__slots__`` attribute) is re-read at every call and compared by identity (a property whose value is plain data,
  a bool or a list of ints say, by value: such a property may build its value anew at every read);
* what a guard reads of the object at its path: a container's contents (a dict watched whole, a list's items, a set's
  length and members re-read; for a ``value`` guard its nested containers too), the attribute ``hasattr``/``in_dict``
  look for, the class of a ``type`` guard, the dtype, device, sizes, strides and address of a ``tensor`` guard's
  tensor (one C++ loop: a ``.data`` swap keeps the tensor object). An empty hook dict is covered by
  ``torch.utils.hooks.RemovableHandle``'s class: registering a hook through torch's API makes a handle, which advances
  a class attribute (a module's hooks written into its private dicts by hand are seen at the next load).

* the class of an object on a path (``obj.__class__ = Other``, which sets no dict and no class: a pointer compare per
  object per call), and the code of the functions a graph may have inlined from it (``Cls.f.__code__ = g.__code__``
  keeps the function object, so the class is unchanged: a pointer compare per function of the object's classes, those
  of torch and Python's own left out) and of a function a guard holds by identity (a module's global function);
* a name an ``nn.Module`` attribute path reads from ``_modules``, ``_parameters`` or ``_buffers`` is watched in the
  instance ``__dict__`` too (``object.__setattr__(layer, "mlp", other)`` shadows the registered module).

An object whose class customises ``__getattribute__`` (transformers' configs do) is assumed to answer from its
instance ``__dict__`` and its class: any change of that dict counts. Not noticed: a custom ``__getattribute__`` that
reads other state; such changes are seen at the next miss or load.

``GuardWatch`` is ``gearcache.call._callpath.GuardWatch`` (C) where the extension is built, else :class:`PyGuardWatch`,
which re-reads every hop at every call.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from .._torch import tensor_checks as torch_tensor_checks
from ..counters import counters
from . import fingerprints
from .fingerprints import cell_contents
from .guard_fingerprints import hashable
from .guard_paths import MISSING_OBJECT, GuardPath, PathStep, PathValues, Scope, evaluate
from .guard_sets import GuardSet, unloaded_torch_module
from .guards_from_dynamo import GLOBAL_HOOK_DICTS, MODULE_HOOK_DICTS
from .value_guard import ValueGuard
from .watch_reads import PyGuardWatch as PyGuardWatch, Watch as Watch, plain, plain_copy     # (re-exported)

try:
    from ..call._callpath import GuardWatch as _NativeGuardWatch
except ImportError:                 # pragma: no cover - depends on how gearcache was installed
    _NativeGuardWatch = None

ABSENT = MISSING_OBJECT      # a key or attribute that is not there (expected so)
_OBJECT_GETATTRIBUTE: Callable[..., Any] = object.__getattribute__
_MODULE_GETATTRIBUTE: Callable[..., Any] = torch.nn.Module.__getattribute__
_NESTED_DEPTH = 16          # containers nested deeper in a guarded value are not watched (seen at the next load)


class Hops:
    """What a watch covers: ``dicts`` ``[(dict, key or None for every key, expected value or ABSENT)]``, ``types``
    ``[type]``, ``checked`` ``[(op, parent, key, expected)]`` re-read per call (op ``"attr"``: ``getattr(parent, key)
    is expected``; ``"attr_eq"``: a property's plain value equals ``expected``, of the same types; ``"item"``:
    ``parent[key] is expected``; ``"len"``: ``len(parent) == expected``; ``"contains"``:
    ``(key in parent) is expected``; ``"seq"``: the list ``parent`` holds the items of the tuple ``expected``, by
    identity; ``"class"``: ``type(parent) is expected``; ``"code"``, ``"defaults"``, ``"kwdefaults"``: the function
    ``parent``'s ``__code__``, ``__defaults__`` or ``__kwdefaults__`` is ``expected``, read from the function's
    struct in C (a getattr of ``__defaults__`` raises an audit event: ~0.3 µs each where a hook is installed);
    ``"cell"``: the closure cell ``parent`` holds ``expected``, ``ABSENT`` when empty) and
    ``tensors``, whose dtype, device, sizes, strides and alignment must stay as they are (a parameter whose ``.data``
    is swapped keeps its Python object)."""

    def __init__(self) -> None:
        self.dicts: list[tuple[dict[Any, Any], Any, Any]] = []     # the user's dicts, keys and values
        self.types: list[type] = []
        self.checked: list[tuple[str, Any, Any, Any]] = []
        self.tensors: list[torch.Tensor] = []
        self._seen: set[tuple[object, ...]] = set()
        self._frozen: set[int] = set()          # objects covered by a watched type (a class's __dict__, __mro__)
        self.stores: dict[int, dict[str, Any]] = {}     # id of a module's _modules/_parameters/_buffers: its __dict__

    def dict_item(self, d: dict[Any, Any], key: Any, expected: Any) -> bool:
        """Watch ``d[key]`` (``key`` None: all of ``d``); whether it was not watched yet."""
        return self._once(("d", id(d), hashable(key)), lambda: self.dicts.append((d, key, expected)))

    def type_(self, t: type) -> None:
        self._once(("t", id(t)), lambda: self.types.append(t))

    def check(self, op: str, parent: Any, key: Any, expected: Any) -> None:
        mark = ("c", op, id(parent), hashable(key))
        self._once(mark, lambda: self.checked.append((op, parent, key, expected)))

    def instance_class(self, obj: Any) -> None:
        """``obj``'s class stays its class (``obj.__class__ = Other`` is seen), and its class's functions their code."""
        cls = type(obj)
        if not fingerprints.is_builtin_class(cls):
            self.check("class", obj, None, cls)
            self.class_code(cls)

    def class_code(self, cls: type) -> None:
        """The code and defaults of every function of ``cls`` and its bases (:func:`own_functions`: a function changed
        in place, ``f.__code__ = g.__code__`` or ``f.__defaults__ = (3.0,)``, keeps the class's dict as it was; torch
        2.11's Dynamo guards no defaults, so only the watch sees it in the process that compiled)."""
        for func in own_functions(cls):
            self.function_code(func)
            self.function_defaults(func)

    def function_defaults(self, func: types.FunctionType) -> None:
        """``func``'s defaults and keyword-only defaults stay the objects they are, and the containers in them keep
        their contents (``f.__defaults__[0][0] = 3.0``: torch 2.11's Dynamo guards no defaults)."""
        self.check("defaults", func, None, func.__defaults__)
        self.check("kwdefaults", func, None, func.__kwdefaults__)
        self.held_contents(func.__defaults__)
        self.held_contents(func.__kwdefaults__)

    def held_contents(self, value: Any) -> None:
        """The contents of the lists, dicts and sets ``value`` is or holds, where it holds any (a list default or a
        list in a closure cell changed in place keeps every identity)."""
        if fingerprints.holds_mutable(value):
            self.contents(value)
            self.nested_contents(value)

    def function_code(self, func: types.FunctionType) -> None:
        self.check("code", func, None, func.__code__)

    def function_identity(self, func: types.FunctionType) -> None:
        """A function a guard holds by identity: its code, its defaults and its closure cells' contents stay the
        objects they are (its fingerprint covers them all, so a load sees ``f.__defaults__ = (3.0,)``; Dynamo guards
        the defaults itself only from torch 2.13)."""
        self.function_code(func)
        self.function_defaults(func)
        for cell in func.__closure__ or ():
            value = cell_contents(cell, ABSENT)
            self.check("cell", cell, None, value)
            self.held_contents(value)

    def tensor(self, t: torch.Tensor) -> None:
        self._once(("x", id(t)), lambda: self.tensors.append(t))

    def contents(self, obj: Any) -> None:
        """Any change of what the container ``obj`` holds (a guard reads its length, keys or items as a whole)."""
        if isinstance(obj, dict):
            self.dict_item(obj, None, None)
        elif isinstance(obj, list):
            self.check("seq", obj, None, tuple(obj))
        elif isinstance(obj, set):                  # as long, and every member still in: the same members
            for check in [("len", None, len(obj)), *(("contains", member, True) for member in obj)]:
                self.check(check[0], obj, check[1], check[2])
        elif isinstance(obj, bytearray) or (hasattr(obj, "__len__") and not isinstance(
                obj, (tuple, str, bytes, frozenset, types.MappingProxyType, range, torch.Tensor))):
            self.check("len", obj, None, len(obj))

    def nested_contents(self, obj: Any, depth: int = 0) -> None:
        """:meth:`contents` of every container nested in ``obj`` (a ``value`` guard's fingerprint holds them item by
        item: ``m.pair[0].append(5.0)`` changes ``m.pair = ([1.0],)``). Per call: a ``seq`` re-read per list, ..."""
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, frozenset)) else ()
        for item in items:
            if isinstance(item, (dict, list, tuple, set, frozenset, bytearray)) and depth < _NESTED_DEPTH:
                self.contents(item)
                self.nested_contents(item, depth + 1)

    def _once(self, mark: tuple[object, ...], add: Callable[[], None]) -> bool:
        if mark in self._seen:
            return False
        self._seen.add(mark)
        add()
        return True


def hops_for(guard_sets: Iterable[GuardSet], scope: Scope) -> Hops:
    """The hops of every path of every guard in ``guard_sets``, read on the live objects of ``scope``."""
    hops = Hops()
    values: PathValues = {}
    done: set[GuardPath] = set()
    for gs in guard_sets:
        _add_guards(hops, gs, scope, values, done)
    return hops


def _add_guards(hops: Hops, gs: GuardSet, scope: Scope, values: PathValues, done: set[GuardPath]) -> None:
    for g in gs.guards:
        if unloaded_torch_module(g):
            continue
        _add_path(hops, g.path, scope, values, done)
        if g.kind == "same_as":
            _add_path(hops, g.arg, scope, values, done)
        leaf = evaluate(g.path, scope, values)
        if leaf is not ABSENT:
            _add_leaf(hops, g, leaf)


def _add_leaf(hops: Hops, g: ValueGuard, leaf: Any) -> None:
    """What a guard reads of the object at its path, beyond the object itself: its class's contents (``type``, a class
    or module by ``identity``), the attribute ``hasattr`` and ``in_dict`` look for, a container's contents, a
    tensor's metadata."""
    kind = g.kind
    if kind in ("type", "identity", "live"):
        cls = leaf if isinstance(leaf, type) else type(leaf)
        if kind != "identity" or isinstance(leaf, (type, torch.nn.Module)):
            _watch_class(hops, cls)
            if isinstance(leaf, type):
                hops.class_code(leaf)
            else:
                hops.instance_class(leaf)
        elif isinstance(leaf, types.FunctionType):
            hops.function_identity(leaf)
    elif kind == "hasattr":
        _add_attr(hops, leaf, g.arg, getattr(leaf, g.arg, ABSENT))
        _watch_class(hops, type(leaf))
    elif kind == "in_dict":
        d = getattr(leaf, "__dict__", None)
        if isinstance(d, dict):
            hops.dict_item(d, g.arg, d.get(g.arg, ABSENT))
    elif kind == "length" and _empty_hook_dict(g, leaf):
        hops.type_(RemovableHandle)         # every hook registered through torch's API makes a handle: the class's
        #                                     counter, a class attribute, changes (one watch, not a dict per module)
    elif kind in ("length", "keys", "value"):
        hops.contents(leaf)
        if kind == "value":
            hops.nested_contents(leaf)
    elif kind == "contains":
        if isinstance(leaf, dict):
            hops.dict_item(leaf, g.arg, leaf.get(g.arg, ABSENT))
        else:
            hops.check("contains", leaf, g.arg, g.expected[1] if isinstance(g.expected, list) else None)
    elif kind == "tensor" and isinstance(leaf, torch.Tensor):
        hops.tensor(leaf)


def _empty_hook_dict(g: ValueGuard, leaf: Any) -> bool:
    """Whether ``leaf`` is an empty hook dict of a module or of torch's global module hooks (``g`` reads its length)."""
    last = g.path[-1]
    return (isinstance(leaf, dict) and not leaf and last[0] == "attr"
            and last[1] in MODULE_HOOK_DICTS + GLOBAL_HOOK_DICTS)


def _watch_class(hops: Hops, cls: type) -> None:
    """A class's contents and its bases' (a change to a base advances the class's version too)."""
    if not fingerprints.is_builtin_class(cls):
        hops.type_(cls)


def _add_path(hops: Hops, path: GuardPath, scope: Scope, values: PathValues, done: set[GuardPath]) -> None:
    if path in done:                    # its prefixes were added with it (entries of one model share most paths)
        return
    for n in range(1, len(path) + 1):
        prefix = path[:n]
        if prefix in done:
            continue
        done.add(prefix)
        child = evaluate(prefix, scope, values)
        if n == 1:
            _add_root(hops, prefix[0], scope, child)
            continue
        parent = evaluate(prefix[:-1], scope, values)
        if parent is ABSENT:
            return
        _add_step(hops, parent, prefix[-1], child)


def _add_root(hops: Hops, root: Any, scope: Scope, child: Any) -> None:
    """A root that can change: a global of the method's module, a closure cell or a default of the cached function."""
    if not isinstance(root, tuple):
        return
    kind, name = root
    if kind == "global":
        hops.dict_item(scope.globals, name, child)
    elif kind == "closure":
        hops.check("cell", scope.cell(name), None, child)
    elif kind == "default":
        holder, _ = scope.default_holder(name)
        func = scope.func
        if isinstance(holder, dict):                        # __kwdefaults__: replaced, or its item
            hops.check("kwdefaults", func, None, holder)
            hops.dict_item(holder, name, child)
        else:
            hops.check("defaults", func, None, holder)


def _add_step(hops: Hops, parent: Any, step: PathStep, child: Any) -> None:
    op = step[0]
    if id(parent) in hops._frozen or op == "type":
        if op in ("attr", "generic_attr") and isinstance(child, (dict, types.MappingProxyType, tuple)):
            hops._frozen.add(id(child))
        return
    if op in ("attr", "generic_attr"):
        _add_attr(hops, parent, step[1], child)
        if step[1] in _MODULE_STORES and isinstance(parent, torch.nn.Module) and isinstance(child, dict):
            hops.stores[id(child)] = _OBJECT_GETATTRIBUTE(parent, "__dict__")
    elif op == "item":
        if isinstance(parent, dict):
            hops.dict_item(parent, step[1], child)
            owner = hops.stores.get(id(parent))
            if owner is not None:           # a name read from _modules/_parameters/_buffers: not shadowed
                hops.dict_item(owner, step[1], owner.get(step[1], ABSENT))
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
    descriptor = _is_data_descriptor(cls, name)
    if not isinstance(d, dict) or descriptor:
        row = _struct_read(parent, name, child)             # slots, properties, functions' __defaults__, cells
        if row[0] == "attr" and descriptor and plain(child):
            # a property may build its value anew at every read (transformers 5.17's ``StaticCache.is_sliding``, a
            # fresh list of bools): compared by value (a copy), not identity, else every call revalidates. A
            # function's fields and a cell's contents are the stored objects: by identity (0.0 == -0.0)
            row = ("attr_eq", parent, name, plain_copy(child))
        hops.check(*row)
        return
    hops.type_(cls)
    hops.instance_class(parent)
    if cls.__getattribute__ not in (_OBJECT_GETATTRIBUTE, _MODULE_GETATTRIBUTE):
        hops.dict_item(d, None, None)                       # answers from its __dict__ (see the module docstring)
        return
    hops.dict_item(d, name, d.get(name, ABSENT))
    if name not in d and isinstance(parent, torch.nn.Module):
        for store in _MODULE_STORES:                        # nn.Module.__getattr__ reads these
            held = d.get(store)
            if isinstance(held, dict):
                hops.dict_item(held, name, held.get(name, ABSENT))
    elif name not in d and getattr(cls, "__getattr__", None) is not None:
        hops.check("attr", parent, name, child)


_MODULE_STORES = ("_modules", "_parameters", "_buffers")     # what nn.Module.__getattr__ reads
_FUNCTION_FIELDS = {"__code__": "code", "__defaults__": "defaults", "__kwdefaults__": "kwdefaults"}


def _struct_read(parent: Any, name: str, child: Any) -> tuple[str, Any, Any, Any]:
    """The checked row for ``getattr(parent, name) is child``: a function's code and defaults and a cell's contents
    read from their structs (``"code"``, ``"defaults"``, ``"kwdefaults"``, ``"cell"``; no audit event), else
    ``"attr"``."""
    if isinstance(parent, types.FunctionType) and name in _FUNCTION_FIELDS:
        return _FUNCTION_FIELDS[name], parent, None, child
    if isinstance(parent, types.CellType) and name == "cell_contents":
        return "cell", parent, None, child
    return "attr", parent, name, child


def _is_data_descriptor(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        attr = klass.__dict__.get(name, ABSENT)
        if attr is not ABSENT:
            return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")
    return False


def own_functions(cls: type) -> Iterator[types.FunctionType]:
    """The functions of ``cls`` and its bases (static and class methods' too), torch's and Python's own classes left
    out: the code a program's class brings."""
    for klass in cls.__mro__:
        if fingerprints.is_builtin_class(klass) or klass.__module__.split(".")[0] == "torch":
            continue
        for value in vars(klass).values():
            func = getattr(value, "__func__", value)            # staticmethod, classmethod
            if isinstance(func, types.FunctionType):
                yield func


GuardWatch = _NativeGuardWatch or PyGuardWatch


class Watcher:
    """The watch of one cached method, grown as entries are added: :meth:`watch` returns a watch over the paths of
    the guard sets it is given, reusing the hops of the previous call's sets when it only adds sets to them and the
    previous watch is still valid (what those hops read is then what they read when built: every object on their
    paths is the one seen then). Otherwise (sets dropped, or a watched object changed) every hop is read again.

    A warm process loading entries one by one thus reads each shared path once: the entries of one model guard mostly
    the same attributes (measured on an H100, a 1024-hidden 8-layer Llama: 2,990 guards in two entries; rebuilding
    the watch from scratch per entry was 0.2 s of the first ``generate()`` under cProfile)."""

    def __init__(self, scope: Scope):
        self._scope = scope
        self._sets: list[GuardSet] = []
        self._hops = Hops()
        self._values: PathValues = {}
        self._done: set[GuardPath] = set()
        self._watch: Watch | None = None

    def watch(self, guard_sets: Iterable[GuardSet | None],
              items: Iterable[tuple[dict[Any, Any], Any]] = ()) -> Watch | None:
        """A watch over the paths of ``guard_sets`` as they are now (call it right after the guards were checked);
        None when there is nothing to watch. The previous watch itself when it still holds and ``guard_sets`` adds
        no set to its sets (the gears of one method share one parsed set: ``GuardSet.from_json``). ``items``: dict
        items watched besides, by identity, as they are now (the default process group's slot)."""
        sets = [gs for gs in guard_sets if gs is not None and len(gs)]
        if not self._extends(sets):
            self._sets, self._hops, self._values, self._done = [], Hops(), {}, set()
            self._watch = None
        for d, key in items:
            if self._hops.dict_item(d, key, d.get(key, ABSENT)):
                self._watch = None
        known = {id(gs) for gs in self._sets}
        added = False
        for gs in sets:
            if id(gs) not in known:
                known.add(id(gs))
                added = True
                _add_guards(self._hops, gs, self._scope, self._values, self._done)
        self._sets = sets
        if added or self._watch is None:
            self._watch = make_watch(self._hops)
        return self._watch

    def _extends(self, sets: list[GuardSet]) -> bool:
        """Whether ``sets`` holds every set of the previous call and the previous watch still holds."""
        now = {id(gs) for gs in sets}
        return (all(id(gs) in now for gs in self._sets)
                and (self._watch is None or self._watch.valid()))


def make_watch(hops: Hops) -> Watch | None:
    """A ``GuardWatch`` over ``hops`` as they are now; None when they are empty."""
    if not (hops.dicts or hops.types or hops.checked or hops.tensors):
        return None
    counters.add(guard_watches=1)
    meta, meta_holds = torch_tensor_checks.tensor_meta_match(tuple(hops.tensors)) if hops.tensors else (None, None)
    order = {id(d): n for n, (d, _, _) in reversed(list(enumerate(hops.dicts)))}    # a dict's first row
    dicts = sorted(hops.dicts, key=lambda row: order[id(row[0])])                  # its rows together (stable)
    leading = {"class": 0, "code": 1, "defaults": 2, "kwdefaults": 3}     # read first, in tight loops (C)
    checked = sorted(hops.checked, key=lambda row: leading.get(row[0], 4))
    return GuardWatch(dicts, list(hops.types), checked, ABSENT, meta, meta_holds)


def watch(guard_sets: Iterable[GuardSet], scope: Scope) -> Watch | None:
    """A watch over the paths of ``guard_sets`` as they are now (call it right after the guards were checked); None
    when there is nothing to watch. A one-off :class:`Watcher`."""
    return Watcher(scope).watch(guard_sets)
