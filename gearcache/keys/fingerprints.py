"""Fingerprints of code: what a class or a function does, as a digest that means the same in every process.

A value guard on a function or a class (gearcache/keys/value_guard.py) must change whenever what it guards would run
differently. Dynamo guards a class by its identity and trusts that its attributes do not change, and it guards the
functions it inlines by identity alone; neither holds across processes, nor after ``MyBlock.helper = patched`` (the
Liger/Unsloth pattern) or a factory building the same class over other closure values. So:

* :func:`function_digest`: a function's code (:func:`code_digest`: bytecode, names, constants, nested code; not its
  file or line numbers), its defaults, keyword defaults and the contents of its closure cells;
* :func:`class_digest`: every attribute of every class of its MRO that Python did not build in (functions by
  :func:`function_digest`, ``staticmethod``/``classmethod``/``property`` and other descriptors by their functions,
  constants by value, classes and modules by name, any other object by its type's name: what a graph reads from such
  an object is guarded by Dynamo on its own path).

What is nested in a function or a class: functions by their own digest, to a bounded depth (``_DEPTH``; below it by
name and code), so a digest is a pure function of the objects (the same in every process whatever was digested
first, and finite for a function whose closure holds itself); classes by name (what a graph reads from a class it
reaches that way, Dynamo guards on a path of its own). Digests are cached per process: a function's while its code,
defaults, keyword defaults and closure cells' contents are the same objects; each class's own attributes while every
value in its ``__dict__`` is the same object and its functions' code too (a snapshot of identities: a fraction of the
digest's cost). So a function's defaults changed in place inside a class count once the class itself changes, or in
a fresh process.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import json
import types
import weakref
from typing import Any

import torch

from .._torch import nn_modules as torch_nn_modules
from .naming import importable_module

try:
    from ..call._callpath import type_version
except ImportError:                 # pragma: no cover - depends on how gearcache was installed
    type_version = None

_DEPTH = 3          # how deep functions and classes nested in a fingerprinted function or class are fingerprinted

# Class attributes that say nothing about what the class does, or that Python or the standard library set on a class
# at run time (pickle's ``__slotnames__``, ABC's caches): leaving them out keeps a digest the same in a process that
# pickled or type-checked an instance and one that did not.
_NOISE = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__slotnames__",
                    "__annotations__", "__orig_bases__", "__parameters__", "__abstractmethods__", "_abc_impl",
                    "__static_attributes__", "__firstlineno__", "__type_params__", "__annotate_func__",
                    "__annotations_cache__"})


def type_name(t: Any) -> str:
    """``module.QualName`` of a class or a function, the module named as it is imported (a class of the script run as
    ``__main__`` has the same name as when it is imported: ``naming.importable_module``)."""
    qualname = getattr(t, "__qualname__", getattr(t, "__name__", repr(t)))
    return f"{importable_module(getattr(t, '__module__', '?'))}.{qualname}"


_CODE_DIGESTS: dict[int, tuple[Any, str]] = {}


def code_digest(code: types.CodeType) -> str:
    """sha256 of what a code object does: bytecode, names, constants (nested code too); not its file or lines."""
    cached = _CODE_DIGESTS.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
                   code.co_kwonlyargcount, code.co_posonlyargcount, code.co_flags)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            h.update(code_digest(const).encode())
        elif isinstance(const, frozenset):
            h.update(repr(sorted(repr(x) for x in const)).encode())     # set order follows string hashing
        else:
            h.update(repr(const).encode())
    digest = h.hexdigest()[:24]
    _CODE_DIGESTS[id(code)] = (code, digest)
    return digest


def is_builtin_class(cls: type) -> bool:
    """A class whose attributes no program can set (built in, or an extension type): its name says what it does."""
    return not (cls.__flags__ & (1 << 9))          # Py_TPFLAGS_HEAPTYPE


# ------------------------------------------------------------------------------------------------- functions
_FUNCTION_DIGESTS: dict[tuple[int, int], tuple[types.FunctionType, tuple[object, ...], str]] = {}
"""(id, depth) -> (function, snapshot, digest); only for functions whose state holds no mutable container"""


def function_digest(fn: types.FunctionType, depth: int = _DEPTH) -> str:
    """sha256 of what ``fn`` runs: its code, defaults, keyword defaults and closure contents; functions among those
    by their own digest at ``depth - 1`` (at depth 0 by name and code). A pure function of ``fn`` and ``depth``:
    the same in every process, whatever was digested before."""
    snapshot = _function_snapshot(fn)
    cached = _FUNCTION_DIGESTS.get((id(fn), depth))
    if cached is not None and cached[0] is fn and _same_objects(cached[1], snapshot):
        return cached[2]
    digest = _digest(["fn", code_digest(fn.__code__), nested_fp(fn.__defaults__, depth),
                      nested_fp(fn.__kwdefaults__, depth),
                      [nested_fp(cell_contents(c), depth) for c in fn.__closure__ or ()]])
    if not holds_mutable(snapshot[1:]):     # a list default changed in place keeps every identity: not cached
        _FUNCTION_DIGESTS[(id(fn), depth)] = (fn, snapshot, digest)
    return digest


def _function_snapshot(fn: types.FunctionType) -> tuple[object, ...]:
    """What a function's digest reads, held and compared by identity: its code, defaults, keyword-only defaults and
    cells' contents."""
    return (fn.__code__, fn.__defaults__, fn.__kwdefaults__, *(cell_contents(c) for c in fn.__closure__ or ()))


def _same_objects(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def holds_mutable(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is or holds (in tuples, lists, dicts, sets, nested up to 8 deep) a list, dict, set or
    bytearray: contents that can change while every identity stays the same."""
    if isinstance(value, (list, dict, set, bytearray)):
        return True
    if isinstance(value, (tuple, frozenset)) and depth < 8:
        return any(holds_mutable(v, depth + 1) for v in value)
    return False


class _EmptyCell:
    def __repr__(self) -> str:
        return "<empty cell>"


_EMPTY_CELL = _EmptyCell()


def cell_contents(cell: Any, empty: Any = _EMPTY_CELL) -> Any:
    """A closure cell's contents; ``empty`` for an empty cell (a name the outer function assigns later)."""
    try:
        return cell.cell_contents
    except ValueError:
        return empty


# --------------------------------------------------------------------------------------------------- classes
_OWN_DIGESTS: "weakref.WeakKeyDictionary[type, tuple[Any, tuple[tuple[Any, Any], ...], str, tuple[Any, ...]]]" = (
    weakref.WeakKeyDictionary())   # class -> (version tag or ids snapshot, (closure cell, contents) pairs, digest,
#                                    (function, code) pairs)
_CLASS_DIGESTS: dict[tuple[tuple[str, str], ...], str] = {}    # the own digests of an MRO -> its class digest


def class_digest(cls: type) -> str:
    """sha256 of what ``cls`` does: every attribute of every class of its MRO that is not built in (see the module
    docstring); "" for a built-in class."""
    if is_builtin_class(cls):
        return ""
    parts = tuple((type_name(k), own_digest(k)) for k in cls.__mro__)
    digest = _CLASS_DIGESTS.get(parts)
    if digest is None:
        digest = _CLASS_DIGESTS[parts] = _digest([list(p) for p in parts])
    return digest


def own_digest(cls: type) -> str:
    """sha256 of the attributes ``cls`` itself defines ("" for a built-in class). Cached while the class's version tag
    (``_callpath.type_version``: it changes whenever an attribute of the class is set or deleted) is the same and its
    functions' closure cells hold the same objects (a factory's class whose ``scale`` is rebound by ``nonlocal``) and
    the same code and defaults (``f.__code__ = ...``, ``f.__defaults__ = ...``); without a version tag, while every
    value of its ``__dict__`` is the same object too."""
    if is_builtin_class(cls):
        return ""
    tag = type_version(cls) if type_version is not None else 0
    snapshot: Any = tag or tuple(map(id, cls.__dict__.values()))
    cached = _OWN_DIGESTS.get(cls)
    if (cached is not None and cached[0] == snapshot and all(cell_contents(c) is v for c, v in cached[1])
            and all(_same_objects(_fields(f), fields) for f, fields in cached[3])):
        return cached[2]
    members = []
    for name, value in cls.__dict__.items():
        value = torch_nn_modules.unpatched_class_attribute(cls, name, value)
        if name not in _NOISE and value is not torch_nn_modules.NOT_TORCHS:
            members.append((name, member_fp(value, _DEPTH)))
    members.sort()
    digest = _digest([list(m) for m in members])
    codes = _codes(cls)
    if not any(holds_mutable(fields[1:]) for _, fields in codes):     # a list default changed in place: not cached
        _OWN_DIGESTS[cls] = (snapshot, _closure_cells(cls), digest, codes)
    return digest


def _codes(cls: type) -> tuple[tuple[types.FunctionType, tuple[object, object, object]], ...]:
    """``(function, _fields(function))`` of every function ``cls`` defines (``f.__code__ = ...`` and
    ``f.__defaults__ = ...`` set no class attribute)."""
    functions = (getattr(value, "__func__", value) for value in cls.__dict__.values())
    return tuple((fn, _fields(fn)) for fn in functions if isinstance(fn, types.FunctionType))


def _fields(fn: types.FunctionType) -> tuple[object, object, object]:
    """A function's code, defaults and keyword-only defaults (compared by identity: held, so never a reused id)."""
    return fn.__code__, fn.__defaults__, fn.__kwdefaults__


def _closure_cells(cls: type) -> tuple[tuple[Any, Any], ...]:
    """``(cell, contents)`` of every closure cell of the functions ``cls`` defines (a class's ``__class__`` cell,
    which ``super()`` reads, excepted: it holds the class)."""
    cells = []
    for value in cls.__dict__.values():
        fn = getattr(value, "__func__", value)
        for cell in getattr(fn, "__closure__", None) or ():
            contents = cell_contents(cell)
            if contents is not cls:
                cells.append((cell, contents))
    return tuple(cells)


def class_fp(cls: type) -> list[str]:
    """A class's fingerprint: its importable name and, unless built in, the digest of its contents."""
    digest = class_digest(cls)
    return ["class", type_name(cls), digest] if digest else ["class", type_name(cls)]


# ------------------------------------------------------------------------------------------- nested objects
def member_fp(value: Any, depth: int) -> Any:
    """A class attribute's fingerprint: descriptors by the functions they hold, other objects by :func:`nested_fp`."""
    if isinstance(value, (staticmethod, classmethod)):
        return [type(value).__name__, nested_fp(value.__func__, depth)]
    if isinstance(value, property):
        return ["property", [nested_fp(f, depth) for f in (value.fget, value.fset, value.fdel)]]
    if isinstance(value, functools.cached_property):
        return ["cached_property", nested_fp(value.func, depth)]
    return nested_fp(value, depth)


def nested_fp(value: Any, depth: int) -> Any:
    """The fingerprint of an object met inside a function or a class (see the module docstring); never raises.
    Functions nest by their digest while ``depth`` lasts; classes by their name (what the graph reads of a class it
    reaches this way, Dynamo guards on a path of its own)."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return [t.__name__, value]
    if t is float or t is complex:
        return [t.__name__, repr(value)]
    if t is types.FunctionType:
        if depth <= 0:
            return ["fn", type_name(value), code_digest(value.__code__)]
        return ["fn", type_name(value), function_digest(value, depth - 1)]
    if isinstance(value, type):
        return ["class", type_name(value)]
    if t in (tuple, list, frozenset, set):
        items = [nested_fp(x, depth) for x in value]
        return [t.__name__, items if t in (tuple, list) else sorted(items, key=_sort_key)]
    if t is dict:
        return ["dict", sorted(([nested_fp(k, 0), nested_fp(v, depth)] for k, v in value.items()), key=_sort_key)]
    return _object_fp(value, depth)


def _object_fp(value: Any, depth: int) -> Any:
    if isinstance(value, enum.Enum):
        return ["enum", type_name(type(value)), value.name]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type_name(type(value)), str(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.MethodType):
        return ["method", nested_fp(value.__func__, depth), ["object", type_name(type(value.__self__))]]
    if isinstance(value, functools.partial):
        return ["partial", nested_fp(value.func, depth), nested_fp(value.args, depth),
                nested_fp(value.keywords, depth)]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.ClassMethodDescriptorType)):
        return ["builtin", _builtin_name(value)]
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape)]
    wrapped = getattr(value, "__wrapped__", None) if not isinstance(value, torch.nn.Module) else None
    if type(wrapped) is types.FunctionType:                 # a decorator object around a function
        return ["wrapped", type_name(type(value)), nested_fp(wrapped, depth)]
    return ["object", type_name(type(value))]


def _builtin_name(v: Any) -> str:
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or str(v)
    module = getattr(v, "__module__", None) or getattr(getattr(v, "__objclass__", None), "__module__", "")
    return f"{module}.{name}"


def _sort_key(fp: Any) -> str:
    return json.dumps(fp, sort_keys=True, default=repr)


def _digest(parts: Any) -> str:
    """sha256 of a fingerprint (nested lists of str, int, bool and None: its repr is canonical)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
