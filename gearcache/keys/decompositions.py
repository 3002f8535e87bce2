"""Custom decompositions (``cache_compile(custom_decompositions=...)``): the table checked, and what each entry
computes as a key factor.

A decomposition replaces an ATen op in the graph that is compiled (gearcache/compiling/pipeline.py ``decomposed``)
and in the gear plan's trace that the padding proof reads (gearcache/_torch/aten.py). No guard watches it, so what it
computes is in every key that depends on it (entry, artifact, gear plan): a process whose table computes something
else never loads another's entry. A decomposition counts by

* a function: its code, defaults, keyword defaults and closure contents (``fingerprints.function_digest``) and the
  module globals its code reads (the names of its code and of the code nested in it, found in its ``__globals__``),
  each by :func:`_value_fp`: plain data and tensors by value, functions by this same rule (to :data:`_DEPTH`),
  modules and torch's op namespaces and ops by name, classes by ``fingerprints.class_digest``;
* a function of torch's own (its module ``torch`` or under it): its name (torch's version is a key factor);
* an op (a decomposition into another op): its name; ``functools.partial``: its function, arguments and keywords.

Anything else (an object holding state, a bound method, a global that is neither) is refused with a
``ConfigError`` naming the op, the value and the fix: what it computes cannot be read into a key.

The table's keys are ops: an overload (``aten.gelu.default``), or a packet (``aten.gelu``), which stands for each of
its overloads (as ``torch._decomp.get_decompositions`` expands them; ``make_fx`` looks overloads up only). An op's
decomposition also stands for its in-place variant where the table has none of its own (``add_`` as
``self.copy_(add(self, ...))``, as AOTAutograd's functionalisation would decompose it): a method's ``acc.add_(x)``
computes what its ``acc + x`` does.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

from .._torch.aten import OpOverload, in_place_variant, is_op_or_namespace, op_overloads
from ..errors import ConfigError
from . import fingerprints
from .key import sha256_text, tensor_digest

Decompositions = dict[OpOverload, Callable[..., Any]]
"""A checked table: each ATen overload and the callable that replaces it."""

_DEPTH = 3          # how deep functions a decomposition reads through its globals are followed
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
    return sorted([str(op), sha256_text(repr(_callable_fp(fn, f"custom_decompositions[{op}]", _DEPTH)))[:24]]
                  for op, fn in table.items())


def _callable_fp(fn: Any, where: str, depth: int) -> Any:
    if is_op_or_namespace(fn):
        return ["op", str(fn)]
    if isinstance(fn, functools.partial):
        return ["partial", _callable_fp(fn.func, where, depth), [_value_fp(a, where, depth) for a in fn.args],
                sorted([k, _value_fp(v, where, depth)] for k, v in fn.keywords.items())]
    if type(fn) is types.FunctionType:
        if _is_torchs(fn):
            return ["torch function", fingerprints.type_name(fn)]
        return ["fn", fingerprints.function_digest(fn), _globals_fp(fn, where, depth)]
    raise ConfigError(f"{where}={fn!r}: a {type(fn).__name__} cannot be keyed by what it computes (its state is not "
                      f"read into the cache key, so another process's table could be served). Fix: pass a plain "
                      f"function (def or lambda) that holds its values in a closure, a default or a module constant")


def _globals_fp(fn: types.FunctionType, where: str, depth: int) -> list[Any]:
    """The module globals ``fn``'s code reads, each by :func:`_value_fp` (builtins and names it does not find: by
    name only, as Python looks them up at run time)."""
    names = sorted(_names(fn.__code__))
    return [[name, _value_fp(fn.__globals__[name], f"{where} (global {name})", depth)]
            for name in names if name in fn.__globals__]


def _names(code: types.CodeType) -> set[str]:
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const)
    return found


def _value_fp(value: Any, where: str, depth: int) -> Any:
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device, torch.layout)):
        return [type(value).__name__, repr(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_value_fp(v, where, depth) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted([repr(k), _value_fp(v, where, depth)] for k, v in value.items())]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if is_op_or_namespace(value):
        return ["op", str(value)]
    if isinstance(value, type):
        return fingerprints.class_fp(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), tensor_digest(value)]
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or _is_torchs(value):
        return ["named", fingerprints.type_name(value)]
    if depth <= 0 and type(value) is types.FunctionType:
        raise ConfigError(f"{where}: reads functions through globals deeper than {_DEPTH} levels. Fix: pass the "
                          f"values it needs in a closure or as defaults")
    return _callable_fp(value, where, depth - 1)


def _is_torchs(value: Any) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")
