"""Value guards: the Python values a captured graph bakes in, recorded at capture and checked before it is served.

Dynamo specialises a capture on every Python value the method reads — module attributes (``self.heads``,
``self.ln.eps``, ``self.training``), globals and constants of any module (``SCALE``, ``helper.ALPHA``), closure
cells, config objects, the identity of the functions and classes it calls, empty hook dicts — and records each as a
*guard*. ``torch.compile`` checks its guards at every call; a gearcache entry keeps them as value guards:

* at capture, :func:`from_dynamo` turns Dynamo's guards (``_torch.guards.DynamoGuard``) into :class:`ValueGuard`
  records: a path from a root (the module, a Python module's globals, builtins) to the guarded object, what is
  checked about it (``kind``) and the expected *fingerprint*, a JSON value that means the same in every process;
* an entry or a gear plan is served only where every fingerprint computed on the live objects equals the recorded
  one (:meth:`GuardSet.mismatch`, at load and whenever :mod:`gearcache.keys.guard_watch` sees a guarded object change);
* stored entries of one call signature whose guards differ live side by side: the first is stored under the
  signature's entry key, each other one under :func:`variant_key` (that key plus the live fingerprints of the first
  one's guards), so a lookup reads at most two manifests.

Every guard kind Dynamo emits is handled one of four ways (docs/DESIGN.md, "Value guards", has the table): a value
guard here (re-checked at load, watched per call); the signature key (guards on the call's arguments: their
structure, scalars' values, tensors' shape, stride, dtype and device); the key's ``global_state`` factor with the
per-call state snapshot (grad mode, autocast, ...); or refused (:class:`~gearcache.errors.UnguardableError`: no
entry is served). A guard on a parameter or buffer (``TENSOR_MATCH``) is a ``tensor`` value guard: its dtype,
shape, stride and device, re-checked at load and, per call, by the watch (gearcache/keys/guard_watch.py).

On-disk form, the entry manifest's ``"guards"``: ``[[kind, path, arg, expected], ...]``. ``path`` is
``[root, step, ...]``: root ``"self"`` (the module), ``["global", name]`` (the method's module's globals),
``["module", name]`` (a Python module, ``sys.modules[name]``), ``"builtins"``, ``["closure", name]`` (the cell of
the cached function's free variable ``name``: a class built by a factory reads its ``scale`` there) or
``["default", name]`` (the default of the cached function's parameter ``name``, for a call that does not pass it);
a step is ``["attr", name]``,
``["generic_attr", name]`` (``object.__getattribute__(x, name)``, as Dynamo reads past a custom ``__getattribute__``),
``["item", key]`` (a str, int, float, bool or None key), ``["item_at", i]`` (the value at a dict's i-th key),
``["key_at", i]`` (a dict's i-th key) or ``["type"]``. ``arg`` is None, an attribute name (``hasattr``,
``in_dict``), a key (``contains``) or another path (``same_as``). The kinds and their fingerprints are in
``_FINGERPRINT``.

A guard on an object known only by its identity (an ``ID_MATCH`` on a plain instance) makes the entry *local*: it is
compiled and served in this process (checked by identity, watched per call) but never written to the store; one
warning names the guard. A guard whose source gearcache cannot read at all, or whose kind it cannot check, refuses
the capture (``UnguardableError``) rather than serve an entry nothing checks.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import sys
import types
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._torch import distributed as torch_distributed
from ..errors import UnguardableError, Unpersistable
from .fingerprints import class_fp, code_digest, function_digest, type_name

log = logging.getLogger("gearcache.keys.guards")

MISSING = ["missing"]                   # the fingerprint of a path that no longer leads anywhere

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


@dataclasses.dataclass(frozen=True)
class ValueGuard:
    kind: str
    path: tuple                 # (root, *steps), steps as tuples
    arg: Any                    # see the module docstring
    expected: Any               # the fingerprint (JSON); for a local guard, the live object itself

    def text(self) -> str:
        """``self.ln.eps``-style, for messages."""
        return path_text(self.path)

    def to_json(self) -> list:
        arg = _path_json(self.arg) if self.kind == "same_as" else self.arg
        return [self.kind, _path_json(self.path), arg, self.expected]

    @classmethod
    def from_json(cls, data: list) -> "ValueGuard":
        kind, path, arg, expected = data
        if kind == "same_as":
            arg = _path_tuple(arg)
        return cls(kind, _path_tuple(path), arg, expected)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The first guard whose live fingerprint differs from the recorded one."""
    guard: ValueGuard
    live: Any

    def __str__(self) -> str:
        return (f"{self.guard.text()} ({self.guard.kind}): compiled with {_show(self.guard.expected)}, "
                f"now {_show(self.live)}")


class Scope:
    """Where guard paths start in a process: the cached method's module, its function's globals and the function itself
    (its closure cells and defaults)."""

    def __init__(self, module: torch.nn.Module, globals_: dict[str, Any], func: types.FunctionType | None = None):
        self.module, self.globals, self.func = module, globals_, func
        self.installed: dict[str, Any] = {}         # at capture: the globals Dynamo added for the trace

    def root(self, root: Any) -> Any:
        if root == "self":
            return self.module
        if root == "builtins":
            return builtins.__dict__
        kind, name = root
        if kind == "global":
            return self.globals[name]
        if kind == "closure":
            return self.cell(name).cell_contents        # ValueError for an empty cell: evaluate() says missing
        if kind == "default":
            holder, key = self.default_holder(name)
            return holder[key]
        module = sys.modules.get(name)
        if module is None:
            import importlib
            module = importlib.import_module(name)
        return module

    def cell(self, name: str) -> Any:
        """The cell of the cached function's free variable ``name`` (KeyError where there is none)."""
        func = self.func
        if func is None or func.__closure__ is None or name not in func.__code__.co_freevars:
            raise KeyError(name)
        return func.__closure__[func.__code__.co_freevars.index(name)]

    def default_holder(self, name: str) -> tuple[Any, Any]:
        """``(func.__defaults__, index)`` or ``(func.__kwdefaults__, name)``: where the default of the cached function's
        parameter ``name`` is (KeyError where it has none)."""
        func = self.func
        if func is None:
            raise KeyError(name)
        code = func.__code__
        positional = code.co_varnames[:code.co_argcount]
        defaults = func.__defaults__ or ()
        if name in positional:
            i = positional.index(name) - (len(positional) - len(defaults))
            if i < 0:
                raise KeyError(name)
            return defaults, i
        if name in (func.__kwdefaults__ or {}):
            return func.__kwdefaults__, name
        raise KeyError(name)


class GuardSet:
    """The value guards of one capture. ``local`` (a message) when one of them cannot be checked in another process:
    the entry is then served in this process only."""

    def __init__(self, guards: list[ValueGuard], local: str | None = None):
        self.guards = guards
        self.local = local

    def __len__(self) -> int:
        return len(self.guards)

    def to_json(self) -> list:
        if self.local is not None:
            raise Unpersistable(self.local)
        return [g.to_json() for g in self.guards]

    @classmethod
    def from_json(cls, data: list | None) -> "GuardSet":
        return cls([ValueGuard.from_json(g) for g in data or []])

    def mismatch(self, scope: Scope, reading: "Reading | None" = None) -> Mismatch | None:
        """The first guard that does not hold on the live objects, or None. ``reading``: objects and fingerprints
        already read in this pass (several guard sets checked at once share the paths they have in common)."""
        reading = reading if reading is not None else Reading()
        for g in self.guards:
            if unloaded_torch_module(g):
                continue
            live = reading.fingerprint(g, scope)
            if live != g.expected:
                return Mismatch(g, live)
        return None

    def live_fingerprints(self, scope: Scope) -> list:
        reading = Reading()
        return [g.expected if unloaded_torch_module(g) else reading.fingerprint(g, scope) for g in self.guards]


class Reading:
    """One pass over live objects: the object at each path and each guard's live fingerprint, read once (nothing may
    change them during the pass: use one per check, under the method's lock)."""

    def __init__(self) -> None:
        self.values: dict[tuple, Any] = {}
        self._fps: dict[tuple, Any] = {}

    def fingerprint(self, guard: ValueGuard, scope: Scope) -> Any:
        mark = (guard.kind, guard.path, hashable(guard.arg))
        try:
            return self._fps[mark]
        except KeyError:
            fp = self._fps[mark] = live_fingerprint(guard, scope, self.values)
            return fp


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
    record: dict | None
    guards: GuardSet | None
    key: str
    mismatch: Mismatch | None = None


def choose(read: Any, key: str, scope: Scope) -> Choice:
    """The stored record (an entry manifest or a gear plan) of ``key`` whose guards hold on ``scope``: the one stored
    under ``key`` or its variant (:func:`variant_key`). ``read(key) -> record or None``."""
    first = read(key)
    if first is None:
        return Choice(None, None, key)
    first_guards = GuardSet.from_json(first.get("guards"))
    mismatch = first_guards.mismatch(scope)
    if mismatch is None:
        return Choice(first, first_guards, key)
    vkey = variant_key(key, first_guards, scope)
    variant = read(vkey)
    if variant is not None:
        variant_guards = GuardSet.from_json(variant.get("guards"))
        if variant_guards.mismatch(scope) is None:
            return Choice(variant, variant_guards, vkey)
    return Choice(None, None, vkey, mismatch)


# ------------------------------------------------------------------------------------------------------- capture
def from_dynamo(recording: Any, method: Any, passed: Iterable[str] | None = None) -> GuardSet:
    """The value guards of a capture of the bound ``method``, from Dynamo's guards (``_torch.guards.GuardRecording``).
    ``passed``: the names of the parameters the captured call passed (a guard on one of them is the signature key's;
    on one it did not pass, a guard on the function's default); None: all of them. Raises ``UnguardableError`` for a
    guard no entry can be served under."""
    func = method.__func__
    reader = _Reader(method, recording, passed)
    guards: dict[tuple, ValueGuard] = {}
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

    def __init__(self, method: Any, recording: Any, passed: Iterable[str] | None):
        func = method.__func__
        self.name = func.__qualname__
        self.self_name = func.__code__.co_varnames[0]
        self.scope = Scope(method.__self__, {**func.__globals__, **recording.installed}, func)
        self.scope.installed = recording.installed
        self.code = code = func.__code__
        n_params = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        self.params = set(code.co_varnames[:n_params])
        self.passed = self.params if passed is None else set(passed)
        self.values: dict[tuple, Any] = {}
        self.local: list[str] = []

    def guard(self, dg: Any) -> ValueGuard | None:
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
        path = self._path(dg)
        if path is None:
            return None                                 # an argument: the signature key has it
        try:
            return self._value_guard(dg, kind, path)
        except Unpersistable as exc:
            return self._local(dg, str(exc), path)

    def _path(self, dg: Any) -> tuple | None:
        """``resolve`` of Dynamo's guard ``dg``; a source gearcache cannot follow refuses the entry."""
        try:
            return self.resolve(dg.source, dg.kind)
        except Unpersistable as exc:
            raise UnguardableError(self.name, dg.kind, dg.source, f"read the value through attributes, items and "
                                   f"globals gearcache can follow ({exc})") from None

    def resolve(self, source: str, kind: str) -> tuple | None:
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

    def _value_guard(self, dg: Any, kind: str, path: tuple) -> ValueGuard | None:
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

    def _local(self, dg: Any, why: str, path: tuple | None = None) -> ValueGuard:
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


def _argument_covered(method: str, kind: str, source: str, path: tuple) -> None:
    """Raise ``UnguardableError`` unless the signature key covers Dynamo's guard on an argument."""
    if _KINDS.get(kind) in _KEYED_KINDS and all(s[0] in ("item", "type") for s in path[1:]):
        return
    raise UnguardableError(method, kind, source, "pass the value as a tensor, a scalar or a tuple, list or dict of "
                           "them (an attribute of an argument is part of no key), or make it a module attribute")


def _hook_guards(guards: list[ValueGuard], scope: Scope, values: dict) -> list[ValueGuard]:
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


@dataclasses.dataclass(frozen=True, eq=False)
class LiveObject:
    """A local guard's expected value: equal only to the same object."""
    obj: Any

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, LiveObject) and other.obj is self.obj

    __hash__ = object.__hash__


# ------------------------------------------------------------------------------------------------ source parsing
def parse_source(text: str) -> tuple:
    """Dynamo's source expression (``L['self']._modules['ln'].eps``, ``G['SCALE']``,
    ``dict(type(G['c']).__mro__[1].__dict__)['f']``, ``dict.__getitem__(X, list(dict.keys(X))[1])``) as a path whose
    root is ``("L", name)`` or ``("G", name)``. Unpersistable for any other form."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise Unpersistable(f"source {text!r} is not an expression") from None
    return _parse(node, text)


def _parse(node: ast.AST, text: str) -> tuple:
    key_at = _key_at(node)
    if key_at is not None:
        return _parse(key_at[0], text) + (("key_at", key_at[1]),)
    if isinstance(node, ast.Subscript):
        key_at = _key_at(node.slice)
        if key_at is not None and ast.dump(key_at[0]) == ast.dump(node.value):    # X[list(dict.keys(X))[i]]
            return _parse(node.value, text) + (("item_at", key_at[1]),)
        key = _constant(node.slice, text)
        if isinstance(node.value, ast.Name) and node.value.id in ("L", "G"):
            return ((node.value.id, key),)
        return _parse(node.value, text) + (("item", key),)
    if isinstance(node, ast.Attribute):
        return _parse(node.value, text) + (("attr", node.attr),)
    if isinstance(node, ast.Call) and not node.keywords:
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id == "type" and len(args) == 1:
            return _parse(args[0], text) + (("type",),)
        if isinstance(func, ast.Name) and func.id == "dict" and len(args) == 1:
            return _parse(args[0], text)                # a copy of a mapping: items read the same
        if isinstance(func, ast.Name) and func.id == "___odict_getitem" and len(args) == 2:
            return _parse(args[0], text) + (("item", _constant(args[1], text)),)
        item_at = _dict_item_at(func, args)
        if item_at is not None:
            return _parse(args[0], text) + (("item_at", item_at),)
        if (isinstance(func, ast.Attribute) and func.attr == "__getattribute__" and isinstance(func.value, ast.Name)
                and func.value.id == "object" and len(args) == 2):
            return _parse(args[0], text) + (("generic_attr", _constant(args[1], text)),)
    raise Unpersistable(f"source {text!r} has a form gearcache does not read")


def _dict_item_at(func: ast.AST, args: list[ast.expr]) -> int | None:
    """``dict.__getitem__(X, list(dict.keys(X))[i])``, the value at X's i-th key: ``i``; None for any other form."""
    if not (isinstance(func, ast.Attribute) and func.attr == "__getitem__" and isinstance(func.value, ast.Name)
            and func.value.id == "dict" and len(args) == 2):
        return None
    key_at = _key_at(args[1])
    return key_at[1] if key_at is not None and ast.dump(key_at[0]) == ast.dump(args[0]) else None


def _key_at(node: ast.AST) -> tuple[ast.expr, int] | None:
    """``list(dict.keys(X))[i]``, X's i-th key: ``(X, i)``; None for any other form."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "list" and len(node.value.args) == 1):
        return None
    keys = node.value.args[0]
    if (isinstance(keys, ast.Call) and isinstance(keys.func, ast.Attribute) and keys.func.attr == "keys"
            and isinstance(keys.func.value, ast.Name) and keys.func.value.id == "dict" and len(keys.args) == 1):
        return keys.args[0], node.slice.value
    return None


def _constant(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))):
        return -node.operand.value
    raise Unpersistable(f"source {text!r} indexes with a key that is not a constant")


def _resolve(path: tuple, self_name: str, scope: Scope) -> tuple | None:
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


# ------------------------------------------------------------------------------------------------------ evaluation
def evaluate(path: tuple, scope: Scope, values: dict | None = None) -> Any:
    """The object at ``path`` (``MISSING_OBJECT`` where a step fails). ``values`` caches prefixes across calls."""
    if values is not None and path in values:
        return values[path]
    if len(path) == 1:
        try:
            obj = scope.root(path[0])
        except (KeyError, IndexError, ValueError, ImportError):    # no such global, cell, default or module
            obj = MISSING_OBJECT
    else:
        obj = step(evaluate(path[:-1], scope, values), path[-1])
    if values is not None:
        values[path] = obj
    return obj


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING_OBJECT = _Missing()


def step(obj: Any, s: tuple) -> Any:
    """One step of a path from ``obj`` (``MISSING_OBJECT`` where it fails)."""
    if obj is MISSING_OBJECT:
        return obj
    try:
        op = s[0]
        if op == "attr":
            return getattr(obj, s[1])
        if op == "generic_attr":                # object.__getattribute__: past a class's own __getattribute__
            return object.__getattribute__(obj, s[1])
        if op == "item":
            return obj[s[1]]
        if op in ("item_at", "key_at"):
            key = list(dict.keys(obj) if isinstance(obj, dict) else obj.keys())[s[1]]
            return obj[key] if op == "item_at" else key
        if op == "type":
            return type(obj)
    except (AttributeError, KeyError, IndexError, TypeError):
        return MISSING_OBJECT
    raise ValueError(f"unknown path step {s!r}")


def live_fingerprint(guard: ValueGuard, scope: Scope, values: dict | None = None) -> Any:
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


def fingerprint(guard: ValueGuard, obj: Any, scope: Scope, values: dict | None = None) -> Any:
    """What ``guard`` checks about ``obj``, as JSON (Unpersistable where that has no meaning across processes)."""
    if obj is MISSING_OBJECT:
        return MISSING
    return _FINGERPRINT[guard.kind](obj, guard, scope, values)


def _contains(obj: Any, g: ValueGuard, scope: Scope, values: Any) -> Any:
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


def _class_fp(cls: type, values: dict | None) -> list:
    """``class_fp(cls)``, once per class in a pass over the guards (``values``: the pass's objects read)."""
    if values is None:
        return class_fp(cls)
    mark = ("class_fp", cls)                # never a path: a path's root is a str or a (kind, name) pair of str
    fp = values.get(mark)
    if fp is None:
        fp = values[mark] = class_fp(cls)
    return fp


_FINGERPRINT = {
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


# -------------------------------------------------------------------------------------------------- fingerprints
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


def _process_group(dg: Any) -> bool:
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
        return value_fp(obj) == value_fp(value)
    except Unpersistable:
        return False


def _sort_key(fp: Any) -> str:
    return json.dumps(fp, sort_keys=True, default=repr)


def hashable(arg: Any) -> Any:
    """``arg`` itself where it can be a dict key or set member, else its ``repr``."""
    try:
        hash(arg)
        return arg
    except TypeError:
        return repr(arg)


def _show(fp: Any) -> str:
    if isinstance(fp, list) and len(fp) == 2 and fp[0] in ("bool", "int", "str", "float", "NoneType"):
        return repr(fp[1]) if fp[0] != "float" else fp[1]
    if isinstance(fp, LiveObject):
        return f"<object at {id(fp.obj):#x}>"
    text = json.dumps(fp, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------------------------- paths
def _path_json(path: tuple) -> list:
    root = path[0]
    return [root if isinstance(root, str) else list(root)] + [list(s) for s in path[1:]]


def _path_tuple(data: list) -> tuple:
    root = data[0]
    return (root if isinstance(root, str) else tuple(root), *map(tuple, data[1:]))


def path_text(path: tuple) -> str:
    root = path[0]
    text = root if isinstance(root, str) else (root[1] if root[0] == "global" else root[1])
    for s in path[1:]:
        if s[0] in ("attr", "generic_attr"):
            text += f".{s[1]}"
        elif s[0] == "item":
            text += f"[{s[1]!r}]"
        elif s[0] == "item_at":
            text += f".<value at key {s[1]}>"
        elif s[0] == "key_at":
            text += f".<key {s[1]}>"
        else:
            text = f"type({text})"
    return text


def warn_local(method_name: str, guards: GuardSet, _warned: set = set()) -> None:   # noqa: B006 - once per method
    """Warn, once per method, that its entries are served in this process only (``guards.local`` says why)."""
    if guards.local is None or method_name in _warned:
        return
    _warned.add(method_name)
    warnings.warn(f"gearcache: {method_name}: {guards.local}; its entries are compiled and served in this process "
                  f"only, not stored. Fix: make the value a constant (int, float, str, enum, tuple) or a module "
                  f"attribute gearcache can read", stacklevel=4)
