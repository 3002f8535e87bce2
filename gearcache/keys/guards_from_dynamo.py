"""Dynamo's guards of a capture turned into value guards (:func:`from_dynamo`, gearcache/keys/guard_sets.py tells
what value guards are for).

Every guard kind Dynamo emits is handled one of four ways (docs/DESIGN.md, "Value guards", has the table): a value
guard (re-checked at load, watched per call: ``_KINDS``); the signature key (guards on the call's arguments: their
structure, scalars' values, tensors' shape, stride, dtype and device: :func:`_argument_covered`); the key's
``global_state`` factor with the per-call state snapshot (grad mode, autocast, ...: ``_ELSEWHERE``); or refused
(:class:`~gearcache.errors.UnguardableError`: no entry is served: ``_REFUSED``). A guard on a parameter or buffer
(``TENSOR_MATCH``) is a ``tensor`` value guard: its dtype, shape, stride and device, re-checked at load and, per call,
by the watch (gearcache/keys/guard_watch.py). The hook dicts of every module the graph called, and torch's global
ones, get a ``length`` guard each (:func:`_hook_guards`).

A guard on an object known only by its identity (an ``ID_MATCH`` on a plain instance) makes the entry *local*: it is
compiled and served in this process (checked by identity, watched per call) but never written to the store; one
warning names the guard. A guard whose source gearcache cannot read at all (gearcache/keys/dynamo_sources.py), or
whose kind it cannot check, refuses the capture (``UnguardableError``) rather than serve an entry nothing checks.
"""
from __future__ import annotations

import builtins
import dataclasses
import logging
import types
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from .._torch import distributed as torch_distributed, guards as torch_guards
from ..errors import UnguardableError, Unpersistable
from .dynamo_sources import parse_source
from .fingerprints import type_name
from .guard_fingerprints import fingerprint, hashable, value_fp
from .guard_paths import GuardPath, PathValues, Scope, evaluate
from .guard_sets import GuardSet
from .value_guard import LiveObject, ValueGuard


log = logging.getLogger("gearcache.keys.guards_from_dynamo")


# Dynamo guard types gearcache enforces elsewhere, with where (docs/DESIGN.md's table has the reasons):
_ELSEWHERE = {
    # the key's global_state factor, and per call the state snapshot (signature.state_tag, the shortcut's matcher)
    "GRAD_MODE": "key", "DETERMINISTIC_ALGORITHMS": "key", "GLOBAL_STATE": "key", "TORCH_FUNCTION_STATE": "key",
    "DEFAULT_DEVICE": "key", "FUNCTORCH_STACK_MATCH": "key", "DUAL_LEVEL": "key",
    "TORCH_FUNCTION_MODE_STACK": "key",
    # a static capture: every size is in the signature key (a gear plan's size guards go to its padding analysis)
    "SHAPE_ENV": "key",
    # inference only: no tensor is saved for backward (grad off, or no input or weight requires grad)
    "AUTOGRAD_SAVED_TENSORS_HOOKS": "inference",
}


# Dynamo guard types no entry can be served under: what they check has no fingerprint and no watch
_REFUSED = {
    "TENSOR_SUBCLASS_METADATA_MATCH": "pass plain tensors (a tensor subclass's metadata is not part of any key)",
    "DTENSOR_SPEC_MATCH": "pass plain tensors (a DTensor's placement is not part of any key)",
    "TUPLE_ITERATOR_LEN": "read a tuple or list, not an iterator (its position changes as it is consumed)",
    "RANGE_ITERATOR_MATCH": "read a range, not an iterator over it",
    "COUNT_ITERATOR_MATCH": "read a number, not an itertools.count",
    "WEAKREF_ALIVE": "hold a strong reference (an attribute or a module) instead of a weakref",
    "OPAQUE_OBJ_GUARD_FN_MATCH": "keep the value the graph depends on in a plain attribute",
    "FSDP_TRAINING_STATE": "cache an unwrapped module (gearcache serves inference, not FSDP training)",
    "COW_TENSOR_MATCH": "do not branch on torch._C._is_cow_tensor in the cached method",
}


# Dynamo guard type -> gearcache kind
_KINDS = {
    "CONSTANT_MATCH": "value", "EQUALS_MATCH": "value", "BOOL_MATCH": "value", "NONE_MATCH": "value",
    "CONSTANT_SUBCLASS_MATCH": "value", "DICT_VERSION": "value", "DISPATCH_KEY_SET_MATCH": "value",
    "TYPE_MATCH": "type", "FAKE_SCRIPT_TYPE_MATCH": "type",
    "NN_MODULE": "identity", "ID_MATCH": "identity", "CLASS_MATCH": "identity", "MODULE_MATCH": "identity",
    "BUILTIN_MATCH": "identity", "FUNCTION_MATCH": "identity", "CLOSURE_MATCH": "identity",
    "SEQUENCE_LENGTH": "length", "DICT_LENGTH": "length", "EMPTY_NN_MODULE_HOOKS_DICT": "length",
    "DICT_KEYS_MATCH": "keys", "DICT_KEYS": "keys", "MAPPING_KEYS_CHECK": "keys",
    "HASATTR": "hasattr", "NOT_PRESENT_IN_GENERIC_DICT": "in_dict",
    "DICT_CONTAINS": "contains", "DICT_NOT_CONTAINS": "contains", "SET_CONTAINS": "contains",
    "SET_NOT_CONTAINS": "contains",
    "DUPLICATE_INPUT": "same_as", "NOT_NONE_MATCH": "not_none", "TENSOR_MATCH": "tensor",
}


# The hook dicts of a module whose __call__ the graph went through, and torch's global ones: each guarded empty (or
# as long as at capture) whatever Dynamo guards (``skip_nnmodule_hook_guards`` drops its own guards on them)
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                     "_global_forward_hooks_always_called")
_HOOKS_MODULE = "torch.nn.modules.module"


def from_dynamo(recording: torch_guards.GuardRecording, method: types.MethodType,
                passed: Iterable[str] | None = None) -> GuardSet:
    """The value guards of a capture of the bound ``method``, from Dynamo's guards (``_torch.guards.GuardRecording``).
    ``passed``: the names of the parameters the captured call passed (a guard on one of them is the signature key's;
    on one it did not pass, a guard on the function's default); None: all of them. Raises ``UnguardableError`` for a
    guard no entry can be served under."""
    func = method.__func__
    reader = _Reader(method, recording, passed)
    guards: dict[tuple[str, GuardPath, object], ValueGuard] = {}
    for dg in recording.guards:
        guard = reader.guard(dg)
        if guard is not None:
            guards.setdefault((guard.kind, guard.path, hashable(guard.arg)), guard)
    for guard in _hook_guards(list(guards.values()), reader.scope, reader.values):
        guards.setdefault((guard.kind, guard.path, hashable(guard.arg)), guard)
    message = None
    if reader.local:
        message = f"{len(reader.local)} guard(s) cannot be checked in another process, e.g. {reader.local[0]}"
        log.debug("local guards of %s: %s", func.__qualname__, reader.local)
    return GuardSet(list(guards.values()), message)


class _Reader:
    """Turns Dynamo's guards of one capture into value guards (:func:`from_dynamo`)."""

    def __init__(self, method: types.MethodType, recording: torch_guards.GuardRecording, passed: Iterable[str] | None):
        func = cast(types.FunctionType, method.__func__)       # a function of the module's class
        self.name = func.__qualname__
        self.self_name = func.__code__.co_varnames[0]
        self.scope = Scope(cast(torch.nn.Module, method.__self__), {**func.__globals__, **recording.installed}, func)
        self.scope.installed = recording.installed
        self.code = code = func.__code__
        n_params = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        self.params = set(code.co_varnames[:n_params])
        self.passed = self.params if passed is None else set(passed)
        self.values: PathValues = {}
        self.local: list[str] = []

    def guard(self, dg: torch_guards.DynamoGuard) -> ValueGuard | None:
        """The value guard of Dynamo's guard ``dg``; None where the key or the state snapshot enforces it."""
        if dg.kind in _ELSEWHERE or (not dg.source and dg.kind not in _REFUSED):
            return None
        if dg.kind in _REFUSED and not _process_group(dg):
            raise UnguardableError(self.name, dg.kind, dg.source, _REFUSED[dg.kind])
        kind = "identity" if _process_group(dg) else _KINDS.get(dg.kind)
        if kind is None:
            raise UnguardableError(self.name, dg.kind, dg.source, "a guard kind this gearcache does not know (a newer "
                                   "torch?): pin torch to a version gearcache supports, or report it")
        if dg.kind == "NN_MODULE":            # a module whose weights the graph holds: this object only
            return self._local(dg, "a module the graph specialises on, weights and all")
        if _in_namedtuple_namespace(dg.source, self.scope):
            return None                         # Python's own constant namespace of a named tuple's __new__
        path = self._path(dg)
        if path is None:
            return None                                 # an argument: the signature key has it
        try:
            return self._value_guard(dg, kind, path)
        except Unpersistable as exc:
            return self._local(dg, str(exc), path)

    def _path(self, dg: torch_guards.DynamoGuard) -> GuardPath | None:
        """``resolve`` of Dynamo's guard ``dg``; a source gearcache cannot follow refuses the entry."""
        try:
            return self.resolve(dg.source, dg.kind)
        except Unpersistable as exc:
            raise UnguardableError(self.name, dg.kind, dg.source, f"read the value through attributes, items and "
                                   f"globals gearcache can follow ({exc})") from None

    def resolve(self, source: str, kind: str) -> GuardPath | None:
        """The path of ``source`` from a gearcache root; None for an argument the call passed (the signature key
        covers it: see :func:`_argument_covered`)."""
        path = parse_source(source)
        where, name = path[0]
        if where == "L" and name != self.self_name:
            if name in self.passed:
                _argument_covered(self.name, kind, source, path)
                return None
            if name in self.code.co_freevars:
                return (("closure", name),) + path[1:]
            if name in self.params:
                return (("default", name),) + path[1:]
            raise Unpersistable(f"{name} is a local of the cached method that is neither an argument nor a closure")
        return _resolve(path, self.self_name, self.scope)

    def _value_guard(self, dg: torch_guards.DynamoGuard, kind: str, path: GuardPath) -> ValueGuard | None:
        obj = evaluate(path, self.scope, self.values)
        if dg.has_value and not _same_object(obj, dg.value):
            raise Unpersistable(f"gearcache's reading of {dg.source} is not the object Dynamo guarded")
        arg = dg.detail.get("attr", dg.detail.get("key"))
        if kind == "same_as":
            arg = self.resolve(dg.detail["other"], dg.kind)
            if arg is None:                             # an argument the same object as a module's value
                raise UnguardableError(self.name, dg.kind, f"{dg.source} is {dg.detail['other']}", "pass a tensor "
                                       "that is not also an attribute, parameter or buffer of the module (a clone)")
        guard = ValueGuard(kind, path, arg, None)
        return dataclasses.replace(guard, expected=fingerprint(guard, obj, self.scope, self.values))

    def _local(self, dg: torch_guards.DynamoGuard, why: str, path: GuardPath | None = None) -> ValueGuard:
        """An identity guard on the object Dynamo guarded, for an entry served in this process only."""
        self.local.append(f"{dg.kind} on {dg.source}: {why}")
        if path is None:
            path = self._path(dg)
            if path is None:
                raise UnguardableError(self.name, dg.kind, dg.source, "pass the object as a module attribute")
        return ValueGuard("live", path, None, LiveObject(evaluate(path, self.scope, self.values)))


# What the signature key holds of an argument (signature.call_key): its structure (tuples, lists, dicts and their
# keys), each scalar leaf's type and value (int, float, bool, str, None, dtype, device), each tensor's shape, stride,
# dtype and device, and which tensors are the same object. A guard rooted at an argument is covered when it reads only
# these: through items and types, of the kinds below.
_KEYED_KINDS = frozenset({"value", "type", "identity", "length", "keys", "contains", "not_none", "tensor", "same_as"})


def _argument_covered(method: str, kind: str, source: str, path: GuardPath) -> None:
    """Raise ``UnguardableError`` unless the signature key covers Dynamo's guard on an argument."""
    if _KINDS.get(kind) in _KEYED_KINDS and all(s[0] in ("item", "type") for s in path[1:]):
        return
    raise UnguardableError(method, kind, source, "pass the value as a tensor, a scalar or a tuple, list or dict of "
                           "them (an attribute of an argument is part of no key), or make it a module attribute")


def _hook_guards(guards: list[ValueGuard], scope: Scope, values: PathValues) -> list[ValueGuard]:
    """Guards on the hook dicts of every module whose ``__call__`` the graph went through (Dynamo guards each such
    module's ``forward`` against an instance patch, ``in_dict forward``, and some of its hook dicts) and, if there is
    one, on torch's global module hooks: the length each had at capture (their hooks themselves, where there were
    any, the trace inlined and Dynamo guards)."""
    called = {g.path for g in guards if g.kind == "in_dict" and g.arg == "forward"}
    called |= {g.path[:-1] for g in guards if g.kind == "length" and len(g.path) > 1
               and g.path[-1][0] == "attr" and g.path[-1][1] in MODULE_HOOK_DICTS}    # Dynamo's own hook guards
    paths = [p + (("attr", name),) for p in sorted(called, key=repr) for name in MODULE_HOOK_DICTS]
    if called:
        paths += [(("module", _HOOKS_MODULE), ("attr", name)) for name in GLOBAL_HOOK_DICTS]
    made = []
    for path in paths:
        obj = evaluate(path, scope, values)
        if isinstance(obj, dict):
            guard = ValueGuard("length", path, None, None)
            made.append(dataclasses.replace(guard, expected=fingerprint(guard, obj, scope, values)))
    return made


def _resolve(path: GuardPath, self_name: str, scope: Scope) -> GuardPath | None:
    """Replace Dynamo's root (``L[name]``, ``G[name]``) by a gearcache root; None for an argument other than self.
    ``scope.installed`` holds the globals Dynamo added for the trace (gone from the module once its cache entries are
    reset): modules become module roots, builtins the builtins root."""
    where, name = path[0]
    if where == "L":
        return ("self",) + path[1:] if name == self_name else None
    if name in scope.installed:                     # a global Dynamo added for the trace (a module, builtins, ...)
        value = scope.installed[name]
        if isinstance(value, types.ModuleType):
            return (("module", value.__name__),) + path[1:]
        if value is builtins.__dict__:
            return ("builtins",) + path[1:]
        raise Unpersistable(f"Dynamo reads it through {name}, an object of type {type_name(type(value))} it "
                            f"installed by identity")
    return (("global", name),) + path[1:]


def _in_namedtuple_namespace(source: str, scope: Scope) -> bool:
    """Whether ``source`` reads the namespace ``collections.namedtuple`` builds each class's ``__new__`` in
    (``{"_tuple_new": tuple.__new__, "__builtins__": {}, "__name__": "namedtuple_<name>"}``), which Dynamo installs by
    identity when it inlines the class's construction: Python's constant, which no program changes, so nothing to
    check (the class itself is guarded where the method reads it)."""
    if not source.startswith("G['___unnamed_scope_"):
        return False
    value = scope.installed.get(parse_source(source)[0][1])
    return (type(value) is dict and set(value) == {"_tuple_new", "__builtins__", "__name__"}
            and value["_tuple_new"] is tuple.__new__ and str(value["__name__"]).startswith("namedtuple_"))


def _process_group(dg: torch_guards.DynamoGuard) -> bool:
    """An ``OPAQUE_OBJ_GUARD_FN_MATCH`` on a ``ProcessGroup`` (torch 2.13 guards ``dist.group.WORLD`` so): checked as
    the group's identity, its c10d name and ranks (``torch_distributed.process_group_identity``)."""
    return (dg.kind == "OPAQUE_OBJ_GUARD_FN_MATCH" and dg.has_value
            and torch_distributed.process_group_identity(dg.value) is not None)


def _same_object(obj: Any, value: Any) -> bool:
    """Whether gearcache's reading of a source is what Dynamo guarded: the same object, a mapping with the same items
    (Dynamo reads a class's ``__dict__`` through a copy), or an equal constant."""
    if obj is value:
        return True
    if isinstance(obj, Mapping) and isinstance(value, Mapping):
        return obj.keys() == value.keys() and all(obj[k] is value[k] for k in obj)
    try:
        same: bool = value_fp(obj) == value_fp(value)
        return same
    except Unpersistable:
        return False
