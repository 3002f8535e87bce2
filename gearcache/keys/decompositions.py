"""Custom decompositions (``cache_compile(custom_decompositions=...)``): the table checked, and what each entry
computes as a key factor.

A decomposition replaces an ATen op in the graph that is compiled (gearcache/compiling/pipeline.py ``decomposed``)
and in the gear plan's trace that the padding proof reads (gearcache/_torch/aten.py). No guard watches it, so what it
computes is in every key that depends on it (entry, artifact, gear plan): a process whose table computes something
else never loads another's entry. A decomposition counts by

* a function: its code, and by :func:`_value_fp` its defaults, keyword defaults, closure contents and the module
  globals its code reads (the names of its code and of the code nested in it, found in its ``__globals__``; of a
  module or class it reads, the attributes its code names): plain data, numpy values and tensors by value, enums,
  sets, lists and dicts by their items, functions by this same rule (recursion met once, to :data:`_DEPTH`),
  modules, torch's op namespaces and ops by name, loggers by name; and
  its attributes (``fn.scale``); the names it reads include its code's identifier strings (``getattr(cfg, "S")``);
  a module or class reached by attribute (``pkg.sub.SCALE``) is followed attribute by attribute;
* a function of torch's own (its code under torch's folder): its name (torch's version is a key factor) and the
  functions it wraps (``@torch.no_grad()`` around a user's function: the user's, by the rule above); a builtin or
  another callable without state of its own (a numpy ufunc): its name; a classmethod: its class's attributes it
  names and its function;
* an op (a decomposition into another op): its name; ``functools.partial``: its function, arguments and keywords; a
  wrapper with ``__wrapped__`` (``functools.lru_cache``): the function it wraps.

Anything else (an object holding state, a bound method, a global that is neither) is refused with a
``ConfigError`` naming the op, the value and the fix: what it computes cannot be read into a key. The factor is
computed when a key is (a miss, a load): a value a decomposition reads that changes while an entry is served is seen
at the next miss or in a fresh process (no guard watches it per call). Not followed: a value reached through a
computed name (``sys.modules[name]``, ``getattr(m, f"S{i}")``).

The table's keys are ops: an overload (``aten.gelu.default``), or a packet (``aten.gelu``), which stands for each of
its overloads (as ``torch._decomp.get_decompositions`` expands them; ``make_fx`` looks overloads up only). A pointwise
op's decomposition also stands for its in-place variant where the table has none of its own (``add_`` as
``self.copy_(add(self, ...))``, as AOTAutograd's functionalisation would decompose it): a method's ``acc.add_(x)``
computes what its ``acc + x`` does.
"""
from __future__ import annotations

import enum
import functools
import logging
import os
import types
from typing import Any, Callable

import torch

from .._torch.aten import OpOverload, in_place_variant, is_op_or_namespace, op_overloads
from ..errors import ConfigError
from . import fingerprints
from .key import sha256_text, tensor_digest

Decompositions = dict[OpOverload, Callable[..., Any]]
"""A checked table: each ATen overload and the callable that replaces it."""

_DEPTH = 6          # how deep functions a decomposition reads through globals and closures are followed
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep     # torch's own functions: keyed by name (its version is)
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def checked(table: dict[Any, Callable[..., Any]] | None) -> Decompositions | None:
    """``table`` with packets expanded to their overloads, every value keyed once (:func:`factor` raises for one it
    cannot key); ``ConfigError`` for a key that is not an ATen op or a value that is not callable."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"custom_decompositions={table!r}: expected a dict {{torch op: function}}")
    out: Decompositions = {}
    for op, fn in table.items():
        if not callable(fn):
            raise ConfigError(f"custom_decompositions[{op}]={fn!r}: not callable. Fix: map the op to a function")
        overloads = op_overloads(op)
        if overloads is None:
            raise ConfigError(f"custom_decompositions: key {op!r} is not a torch op. Fix: an ATen op such as "
                              f"torch.ops.aten.gelu.default (or the packet torch.ops.aten.gelu for all its overloads)")
        out.update(dict.fromkeys(overloads, fn))
    for op, fn in list(out.items()):
        variant = in_place_variant(op)
        if variant is not None and variant not in out and variant not in table:
            out[variant] = _in_place(fn)
    factor(out)
    return out


def _in_place(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The decomposition of an op's in-place variant from the op's (``fn``): its result written into ``self`` (a
    partial of a module function: keyed through ``fn`` by :func:`_callable_fp`)."""
    return functools.partial(_written_into_self, fn)


def _written_into_self(fn: Callable[..., Any], self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self.copy_(fn(self, *args, **kwargs))


def factor(table: Decompositions | None) -> list[list[str]]:
    """The key factor: ``[[op name, digest of what its decomposition computes], ...]`` sorted by op."""
    if not table:
        return []
    return sorted([str(op), sha256_text(repr(_callable_fp(fn, f"custom_decompositions[{op}]", _DEPTH, frozenset())))
                   [:24]] for op, fn in table.items())


def _callable_fp(fn: Any, where: str, depth: int, seen: frozenset[int]) -> Any:
    if is_op_or_namespace(fn):
        return ["op", str(fn)]
    if isinstance(fn, functools.partial):
        return ["partial", _callable_fp(fn.func, where, depth, seen),
                [_value_fp(a, where, depth, seen) for a in fn.args],
                sorted([k, _value_fp(v, where, depth, seen)] for k, v in fn.keywords.items())]
    if type(fn) is types.FunctionType:
        return _function_fp(fn, where, depth, seen)
    if isinstance(fn, types.MethodType) and isinstance(fn.__self__, type) and type(fn.__func__) is types.FunctionType:
        names = sorted(_names(fn.__func__.__code__))          # a classmethod: its class's attributes it names
        return ["classmethod", _namespace_fp(fn.__self__, names, where, depth - 1, seen),
                _function_fp(fn.__func__, where, depth, seen)]
    wrapped = getattr(fn, "__wrapped__", None)
    if type(wrapped) is types.FunctionType and not isinstance(fn, torch.nn.Module):     # functools.lru_cache, ...
        return ["wrapped", fingerprints.type_name(type(fn)), _function_fp(wrapped, where, depth, seen)]
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
            callable(fn) and not hasattr(fn, "__dict__") and not isinstance(fn, torch.Tensor)):
        return ["named", fingerprints.type_name(type(fn)), getattr(fn, "__qualname__", getattr(fn, "__name__", ""))]
    raise ConfigError(f"{where}={fn!r}: a {type(fn).__name__} cannot be keyed by what it computes (its state is not "
                      f"read into the cache key, so another process's table could be served). Fix: pass a plain "
                      f"function (def or lambda) that holds its values in a closure, a default or a module constant")


def _function_fp(fn: types.FunctionType, where: str, depth: int, seen: frozenset[int]) -> Any:
    """A function by its code, defaults, keyword defaults, closure contents and the globals its code reads, each by
    :func:`_value_fp`; torch's own functions (their code under torch's folder) by name; one met again (recursion)
    by name."""
    if id(fn) in seen:
        return ["fn again", fingerprints.type_name(fn)]
    if depth < 0:
        raise ConfigError(f"{where}: reads functions {_DEPTH} levels deep through globals and closures ("
                          f"{fingerprints.type_name(fn)}). Fix: pass the values it needs in a closure or as defaults")
    seen = seen | {id(fn)}
    if fn.__code__.co_filename.startswith(_TORCH_DIR):      # and the functions it wraps (torch.no_grad(), ...)
        inner = [getattr(fn, "__wrapped__", None), *(fingerprints.cell_contents(c, None) for c in fn.__closure__ or ())]
        return ["torch function", fingerprints.type_name(fn),
                [_function_fp(f, where, depth - 1, seen) for f in inner if type(f) is types.FunctionType]]
    value = functools.partial(_value_fp, where=where, depth=depth - 1, seen=seen)
    return ["fn", fingerprints.code_digest(fn.__code__), [value(d) for d in fn.__defaults__ or ()],
            sorted([k, value(v)] for k, v in (fn.__kwdefaults__ or {}).items()),
            [value(fingerprints.cell_contents(c, None)) for c in fn.__closure__ or ()],
            sorted([k, value(v)] for k, v in vars(fn).items() if not _is_dunder(k)),     # fn.scale = 2.0
            _globals_fp(fn, where, depth, seen)]


def _globals_fp(fn: types.FunctionType, where: str, depth: int, seen: frozenset[int]) -> list[Any]:
    """The module globals ``fn``'s code reads, each by :func:`_value_fp`; of a module or class it reads, the
    attributes its code names (``cfg.SCALE``) too (builtins and names it does not find: by name only, as Python
    looks them up at run time)."""
    names = sorted(_names(fn.__code__))
    return [[name, _namespace_fp(fn.__globals__[name], names, f"{where} (global {name})", depth - 1, seen)]
            for name in names if name in fn.__globals__]


def _namespace_fp(value: Any, names: list[str], where: str, depth: int, seen: frozenset[int]) -> Any:
    """``value`` by :func:`_value_fp`; a module or class outside torch with the attributes ``names`` names, each
    the same way (``pkg.sub.SCALE``: ``pkg``'s ``sub``, ``sub``'s ``SCALE``)."""
    fp = _value_fp(value, where, depth, seen)
    if not isinstance(value, (types.ModuleType, type)) or _is_torchs(value) or id(value) in seen or depth < 0:
        return fp
    inside = seen | {id(value)}
    return [fp, [[attr, _namespace_fp(getattr(value, attr), names, f"{where}.{attr}", depth - 1, inside)]
                 for attr in names if attr in vars(value) and not _is_dunder(attr)]]


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` (and the code nested in it) reads: attribute and global names, and string constants that
    could name one (``getattr(cfg, "SCALE")``, ``globals()["V"]``)."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const)
        elif isinstance(const, str) and const.isidentifier():
            found.add(const)
    return found


def _value_fp(value: Any, where: str, depth: int, seen: frozenset[int]) -> Any:
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device, torch.layout)):
        return [type(value).__name__, repr(value)]
    if isinstance(value, enum.Enum):
        return ["enum", fingerprints.type_name(type(value)), value.name]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_value_fp(v, where, depth, seen) for v in value]]
    if isinstance(value, (set, frozenset)):
        return [type(value).__name__, sorted(repr(_value_fp(v, where, depth, seen)) for v in value)]
    if isinstance(value, dict):
        return ["dict", sorted([repr(k), _value_fp(v, where, depth, seen)] for k, v in value.items())]
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), tensor_digest(value)]
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):     # a numpy scalar or array, by its bytes
        return ["numpy", repr(getattr(value, "dtype", None)), repr(getattr(value, "shape", None)),
                sha256_text(value.tobytes())]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if is_op_or_namespace(value):
        return ["op", str(value)]
    if isinstance(value, type):
        return fingerprints.class_fp(value)
    if isinstance(value, logging.Logger):           # what it logs does not change what is computed
        return ["logger", value.name]
    return _callable_fp(value, where, depth, seen)


def _is_torchs(value: Any) -> bool:
    module = getattr(value, "__name__", "") if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
    return module == "torch" or (module or "").startswith("torch.")
