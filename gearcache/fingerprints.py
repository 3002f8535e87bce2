"""Fingerprints of code: what a class or a function does, as a digest that means the same in every process.

A value guard on a function or a class (gearcache/guards.py) must change whenever what it guards would run
differently. Dynamo guards a class by its identity and trusts that its attributes do not change, and it guards the
functions it inlines by identity alone; neither holds across processes, nor after ``MyBlock.helper = patched`` (the
Liger/Unsloth pattern) or a factory building the same class over other closure values. So:

* :func:`function_digest`: a function's code (:func:`code_digest`: bytecode, names, constants, nested code; not its
  file or line numbers), its defaults, keyword defaults and the contents of its closure cells;
* :func:`class_digest`: every attribute of every class of its MRO that Python did not build in (functions by
  :func:`function_digest`, ``staticmethod``/``classmethod``/``property`` and other descriptors by their functions,
  constants by value, classes and modules by name, any other object by its type's name: what a graph reads from such
  an object is guarded by Dynamo on its own path).

What is nested in a function or a class (a closure cell holding another function, a default that is a class) is
fingerprinted to a bounded depth (``_DEPTH``); a class met again inside its own digest (``super()``'s ``__class__``
cell) counts by its name. Digests are cached per process: a function by its code, defaults, keyword defaults and
closure cells' contents (by identity); a class by the identity of every value in its MRO's dicts (a snapshot that
costs a fraction of the digest); an entry is recomputed when its snapshot differs.
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

from .naming import importable_module

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
    h = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_kwonlyargcount, code.co_posonlyargcount, code.co_flags):
        h.update(repr(part).encode())
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
_FUNCTION_DIGESTS: "weakref.WeakKeyDictionary[Any, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def function_digest(fn: types.FunctionType) -> str:
    """sha256 of what ``fn`` runs: its code, defaults, keyword defaults and closure contents."""
    snapshot = _function_snapshot(fn)
    cached = _FUNCTION_DIGESTS.get(fn)
    if cached is not None and cached[0] == snapshot:
        return cached[1]
    digest = _digest(_function_parts(fn, _DEPTH, set()))
    _FUNCTION_DIGESTS[fn] = (snapshot, digest)
    return digest


def _function_snapshot(fn: types.FunctionType) -> tuple:
    cells = fn.__closure__ or ()
    return (id(fn.__code__), id(fn.__defaults__), id(fn.__kwdefaults__),
            *(id(_cell_contents(c)) for c in cells))


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:                              # an empty cell (a name assigned later in the outer function)
        return _EMPTY_CELL


class _EmptyCell:
    def __repr__(self) -> str:
        return "<empty cell>"


_EMPTY_CELL = _EmptyCell()


def _function_parts(fn: types.FunctionType, depth: int, seen: set[int]) -> list:
    """What :func:`function_digest` hashes, as JSON."""
    seen = seen | {id(fn)}
    return ["fn", code_digest(fn.__code__), nested_fp(fn.__defaults__, depth, seen),
            nested_fp(fn.__kwdefaults__, depth, seen),
            [nested_fp(_cell_contents(c), depth, seen) for c in fn.__closure__ or ()]]


# --------------------------------------------------------------------------------------------------- classes
_CLASS_DIGESTS: "weakref.WeakKeyDictionary[type, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def class_digest(cls: type) -> str:
    """sha256 of what ``cls`` does: every attribute of every class of its MRO that is not built in (see the module
    docstring); "" for a built-in class."""
    if is_builtin_class(cls):
        return ""
    snapshot = _class_snapshot(cls)
    cached = _CLASS_DIGESTS.get(cls)
    if cached is not None and cached[0] == snapshot:
        return cached[1]
    digest = _digest(_class_parts(cls, _DEPTH, set()))
    _CLASS_DIGESTS[cls] = (snapshot, digest)
    return digest


def _class_snapshot(cls: type) -> tuple:
    """The identity of every value the digest reads (functions' insides too): equal snapshots, equal digests."""
    parts: list = []
    for klass in cls.__mro__:
        if is_builtin_class(klass):
            continue
        parts.append(klass)
        for name, value in klass.__dict__.items():
            parts.append(id(value))
            if type(value) is types.FunctionType:
                parts.append(_function_snapshot(value))
    return tuple(parts)


def _class_parts(cls: type, depth: int, seen: set[int]) -> list:
    seen = seen | {id(cls)}
    parts: list = []
    for klass in cls.__mro__:
        if is_builtin_class(klass):
            parts.append(type_name(klass))
            continue
        members = sorted((name, member_fp(value, depth, seen)) for name, value in klass.__dict__.items()
                         if name not in _NOISE)
        parts.append([type_name(klass), [list(m) for m in members]])
    return ["class", parts]


def class_fp(cls: type) -> list:
    """A class's fingerprint: its importable name and, unless built in, the digest of its contents."""
    digest = class_digest(cls)
    return ["class", type_name(cls), digest] if digest else ["class", type_name(cls)]


# ------------------------------------------------------------------------------------------- nested objects
def member_fp(value: Any, depth: int, seen: set[int]) -> Any:
    """A class attribute's fingerprint: descriptors by the functions they hold, other objects by :func:`nested_fp`."""
    if isinstance(value, (staticmethod, classmethod)):
        return [type(value).__name__, nested_fp(value.__func__, depth, seen)]
    if isinstance(value, property):
        return ["property", [nested_fp(f, depth, seen) for f in (value.fget, value.fset, value.fdel)]]
    if isinstance(value, functools.cached_property):
        return ["cached_property", nested_fp(value.func, depth, seen)]
    return nested_fp(value, depth, seen)


def nested_fp(value: Any, depth: int, seen: set[int]) -> Any:
    """The fingerprint of an object met inside a function or a class (see the module docstring); never raises."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return [t.__name__, value]
    if t is float or t is complex:
        return [t.__name__, repr(value)]
    if t is types.FunctionType:
        if depth <= 0 or id(value) in seen:
            return ["fn", type_name(value), code_digest(value.__code__)]
        return _function_parts(value, depth - 1, seen)
    if isinstance(value, type):
        if depth <= 0 or id(value) in seen or is_builtin_class(value):
            return ["class", type_name(value)]
        return ["class", type_name(value), _class_parts(value, depth - 1, seen)]
    if t in (tuple, list, frozenset, set):
        items = [nested_fp(x, depth, seen) for x in value]
        return [t.__name__, items if t in (tuple, list) else sorted(items, key=_sort_key)]
    if t is dict:
        return ["dict", sorted(([nested_fp(k, 0, seen), nested_fp(v, depth, seen)] for k, v in value.items()),
                               key=_sort_key)]
    return _object_fp(value, depth, seen)


def _object_fp(value: Any, depth: int, seen: set[int]) -> Any:
    if isinstance(value, enum.Enum):
        return ["enum", type_name(type(value)), value.name]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type_name(type(value)), str(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.MethodType):
        return ["method", nested_fp(value.__func__, depth, seen), ["object", type_name(type(value.__self__))]]
    if isinstance(value, functools.partial):
        return ["partial", nested_fp(value.func, depth, seen), nested_fp(value.args, depth, seen),
                nested_fp(value.keywords, depth, seen)]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.ClassMethodDescriptorType)):
        return ["builtin", _builtin_name(value)]
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape)]
    wrapped = getattr(value, "__wrapped__", None) if not isinstance(value, torch.nn.Module) else None
    if type(wrapped) is types.FunctionType:                 # a decorator object around a function
        return ["wrapped", type_name(type(value)), nested_fp(wrapped, depth, seen)]
    return ["object", type_name(type(value))]


def _builtin_name(v: Any) -> str:
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or str(v)
    module = getattr(v, "__module__", None) or getattr(getattr(v, "__objclass__", None), "__module__", "")
    return f"{module}.{name}"


def _sort_key(fp: Any) -> str:
    return json.dumps(fp, sort_keys=True, default=repr)


def _digest(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:24]
