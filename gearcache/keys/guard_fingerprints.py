"""What a value guard checks about the object at its path, as a *fingerprint*: a JSON value that means the same in
every process. :func:`fingerprint` computes it at capture (``Unpersistable`` where it would mean nothing in another
process: the guard is then local), :func:`live_fingerprint` on the live object at a check (never raises: a value
that has none gets one that equals no recorded one). One function per guard kind, in ``_FINGERPRINT``: ``value`` (a
constant's type and value, :func:`value_fp`), ``type`` (the class's fingerprint), ``identity`` (what identifies the
object in any process, :func:`identity_fp`: functions and classes by what they do, gearcache/keys/fingerprints.py),
``length``, ``keys``, ``hasattr``, ``in_dict``, ``contains``, ``same_as``, ``not_none`` and ``tensor`` (a parameter's
or buffer's dtype, device, shape and stride, :func:`tensor_fp`).
"""
from __future__ import annotations

import enum
import functools
import json
import types
from typing import Any, Callable

import torch

from .._torch import distributed as torch_distributed
from ..errors import Unpersistable
from .fingerprints import class_fp, code_digest, function_digest, type_name
from .guard_paths import MISSING_OBJECT, PathValues, Scope, evaluate
from .value_guard import LiveObject, ValueGuard


MISSING = ["missing"]                   # the fingerprint of a path that no longer leads anywhere


def live_fingerprint(guard: ValueGuard, scope: Scope, values: PathValues | None = None) -> Any:
    """``guard``'s fingerprint of the live object at its path: never raises (a value that has none, or that the check
    cannot read, such as the length of a ``__defaults__`` that became None, gets one that equals no recorded one)."""
    obj = evaluate(guard.path, scope, values)
    if guard.kind == "live":
        return LiveObject(obj)
    try:
        return fingerprint(guard, obj, scope, values)
    except Unpersistable as exc:
        return ["unreadable", str(exc)]
    except (TypeError, AttributeError, ValueError, KeyError, IndexError, RuntimeError) as exc:
        return ["unreadable", f"{type(exc).__name__} reading {type_name(type(obj))}"]


def fingerprint(guard: ValueGuard, obj: Any, scope: Scope, values: PathValues | None = None) -> Any:
    """What ``guard`` checks about ``obj``, as JSON (Unpersistable where that has no meaning across processes)."""
    if obj is MISSING_OBJECT:
        return MISSING
    return _FINGERPRINT[guard.kind](obj, guard, scope, values)


def _contains(obj: Any, g: ValueGuard, scope: Scope, values: PathValues | None) -> Any:
    try:
        return [key_fp(g.arg), g.arg in obj]
    except TypeError:
        return [key_fp(g.arg), "unhashable"]


def tensor_fp(t: Any) -> Any:
    """A parameter's or buffer's fingerprint (``TENSOR_MATCH``): what a compiled graph assumes of an input tensor."""
    if not isinstance(t, torch.Tensor):
        return ["not a tensor", type_name(type(t))]
    if t.layout != torch.strided:
        return ["tensor", str(t.layout), str(t.dtype), str(t.device)]
    return ["tensor", str(t.dtype), str(t.device), list(t.shape), list(t.stride())]


def _class_fp(cls: type, values: PathValues | None) -> list[str]:
    """``class_fp(cls)``, once per class in a pass over the guards (``values``: the pass's objects read)."""
    if values is None:
        return class_fp(cls)
    mark = ("class_fp", cls)                # never a path: a path's root is a str or a (kind, name) pair of str
    fp = values.get(mark)
    if fp is None:
        fp = values[mark] = class_fp(cls)
    return fp


_FINGERPRINT: dict[str, Callable[[Any, ValueGuard, Scope, PathValues | None], Any]] = {
    "value": lambda obj, g, scope, values: value_fp(obj),
    "type": lambda obj, g, scope, values: _class_fp(type(obj), values),
    "identity": lambda obj, g, scope, values: identity_fp(obj),
    "length": lambda obj, g, scope, values: len(obj),
    "keys": lambda obj, g, scope, values: [key_fp(k) for k in (dict.keys(obj) if isinstance(obj, dict)
                                                                 else obj.keys())],
    "hasattr": lambda obj, g, scope, values: [g.arg, hasattr(obj, g.arg)],
    "in_dict": lambda obj, g, scope, values: [g.arg, g.arg in getattr(obj, "__dict__", {})],
    "contains": _contains,
    "same_as": lambda obj, g, scope, values: obj is evaluate(g.arg, scope, values),
    "not_none": lambda obj, g, scope, values: obj is not None,
    "tensor": lambda obj, g, scope, values: tensor_fp(obj),
}


def value_fp(v: Any) -> Any:
    """A constant's fingerprint: its type and value (containers element by element)."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return [t.__name__, v]
    if t is float or t is complex:
        return [t.__name__, repr(v)]                    # repr: exact, and nan/inf are valid JSON this way
    if t is bytes:
        return ["bytes", v.hex()]
    if isinstance(v, enum.Enum):
        return ["enum", type_name(t), v.name]
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type_name(t), str(v)]
    if t in (tuple, list) or isinstance(v, (tuple, list)):     # torch.Size, named tuples
        return [type_name(t), [value_fp(x) for x in v]]
    if isinstance(v, (set, frozenset)):
        return [type_name(t), sorted((value_fp(x) for x in v), key=_sort_key)]
    if isinstance(v, dict):
        return [type_name(t), [[key_fp(k), value_fp(x)] for k, x in v.items()]]
    if t in (slice, range):
        return [t.__name__, [value_fp(v.start), value_fp(v.stop), value_fp(v.step)]]
    if isinstance(v, (int, float, str)):                # other subclasses of the constant types
        return [type_name(t), repr(v)]
    if t.__name__ == "DispatchKeySet" and t.__module__.startswith("torch"):
        return ["DispatchKeySet", v.raw_repr()]
    return identity_fp(v)


def key_fp(k: Any) -> Any:
    if k is None or type(k) in (bool, int, str, float):
        return value_fp(k)
    return identity_fp(k) if not isinstance(k, tuple) else [value_fp(x) for x in k]


def identity_fp(v: Any) -> Any:
    """An object known by identity: what identifies it in any process (a module's name; a class's name and contents;
    a function's name, code, defaults and closure contents: gearcache/keys/fingerprints.py), Unpersistable for an object
    that has nothing but its identity."""
    if v is None or type(v) in (bool, int, str, float) or isinstance(v, (enum.Enum, torch.dtype, torch.device)):
        return value_fp(v)
    if isinstance(v, types.ModuleType):
        return ["module", v.__name__]
    if isinstance(v, type):
        return class_fp(v)
    if isinstance(v, types.CodeType):
        return ["code", v.co_qualname if hasattr(v, "co_qualname") else v.co_name, code_digest(v)]
    if isinstance(v, types.FunctionType):
        return ["function", type_name(v), function_digest(v)]
    if isinstance(v, types.MethodType):
        return ["method", identity_fp(v.__func__), identity_fp(v.__self__)]
    if isinstance(v, functools.partial):
        return ["partial", identity_fp(v.func), value_fp(v.args), value_fp(v.keywords)]
    if isinstance(v, torch.nn.Module):
        return ["nn.Module", class_fp(type(v))]
    group = torch_distributed.process_group_identity(v)
    if group is not None:
        return group
    if isinstance(v, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                      types.ClassMethodDescriptorType)) or type_name(type(v)).startswith("torch._ops."):
        name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or str(v)
        module = getattr(v, "__module__", None) or getattr(getattr(v, "__objclass__", None), "__module__", "")
        return ["builtin", f"{module}.{name}"]
    raise Unpersistable(f"an object of type {type_name(type(v))} known only by its identity")


def _sort_key(fp: Any) -> str:
    return json.dumps(fp, sort_keys=True, default=repr)


def hashable(arg: Any) -> Any:
    """``arg`` itself where it can be a dict key or set member, else its ``repr``."""
    try:
        hash(arg)
        return arg
    except TypeError:
        return repr(arg)
