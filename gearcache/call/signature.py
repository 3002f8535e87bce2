"""The input signature of a call: what the entry table is keyed by on the hot path.

``call_key(args, kwargs)`` returns ``(leaves, key)``: ``leaves`` are the call's flattened inputs (the tensors and
scalars a compiled graph reads), ``key`` a hashable tuple of everything about them that changes the compiled code:
the argument structure, each tensor's shape, stride, dtype and device, each scalar's type and value (a float zero's
sign too; every NaN alike), the grad / inference mode, and the thread's other global torch state (autocast, default
dtype, TF32, ...: see ``state_tag``). Plain positional tensors take a fast path with no pytree work.

``matcher(leaves, key)`` returns ``matches(args) -> bool``, a check mostly in C++ that a call's plain positional
tensors (and scalars beside them) have that key, without building it: the hot path's shortcut for a call like the one
before it.
"""
from __future__ import annotations

import inspect
import json
import math
import sys
import threading
from typing import Any, Callable, NamedTuple

import torch

from .._torch import state as torch_state, tensor_checks as torch_tensor_checks
from ..errors import UnsupportedInputError
from .memory import Forbidden, memory_groups, ranges_apart, storage_range

_Tensor = torch.Tensor


StateRules = tuple[tuple[int, Forbidden], ...]
"""An entry's ``state_alias.Rules``: ``((leaf index, the memory it must not overlap), ...)``; ``CALL`` for every
call."""
CALL = -1
"""The leaf index of a rule that refuses every call of its entry (``state_alias``)."""
_SCALARS = (int, float, bool, str, type(None))


def _leaf_key(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, _Tensor):
        if type(leaf) is _Tensor and not (leaf.dtype.is_complex and (leaf.is_conj() or leaf.is_neg())):
            return (leaf.shape, leaf.stride(), leaf.dtype, leaf.device)
        return (leaf.shape, leaf.stride(), leaf.dtype, leaf.device, type(leaf), leaf.is_conj(), leaf.is_neg())
    if isinstance(leaf, _SCALARS):
        if isinstance(leaf, float) and not leaf:
            return (type(leaf), leaf.hex())         # 0.0 and -0.0 compare equal but compile apart (1 / s)
        if isinstance(leaf, float) and leaf != leaf:
            return (type(leaf), "nan")              # a NaN equals no other (nor itself): one key for all
        return (type(leaf), leaf)
    if isinstance(leaf, (torch.dtype, torch.device)):
        return (type(leaf), str(leaf))
    raise UnsupportedInputError(
        f"cached methods take tensors, Python scalars, strings, None and lists/tuples/dicts of them; got an argument "
        f"of type {type(leaf).__qualname__}: {leaf!r:.80}. Fix: pass it as a tensor, or make it an attribute of the "
        f"module.")


def flatten(obj: Any, leaves: list[Any]) -> Any:
    """Append ``obj``'s leaves to ``leaves`` in order; return its structure (tuples, lists and dicts; others are
    leaves). gearcache's own flattening: cheaper than pytree, and the structure is a hashable tuple."""
    t = type(obj)
    if t is tuple or t is list:
        return (t, *[flatten(o, leaves) for o in obj])
    if t is dict:
        return (dict, tuple(obj), *[flatten(v, leaves) for v in obj.values()])
    leaves.append(obj)
    return None


class _StateSnapshot(threading.local):
    same: Callable[[], bool] | None = None
    tag: str = ""
    # torch_tensor_checks.plain_tensors_check(), found at the first call
    plain: Callable[[tuple[torch.Tensor, ...]], bool] | None = None


_snapshot = _StateSnapshot()


def state_tag() -> str:
    """The calling thread's global torch state (``torch_state.global_state()``: autocast, default dtype, deterministic
    algorithms, TF32 and reduced-precision flags, SDPA backends) as a canonical JSON string, part of every key.

    Per thread, the last tag is kept with a C++ snapshot of the state it was computed in (``torch_state.state_guard``);
    while the snapshot still holds, the tag is returned without recomputing it. Neither snapshot covers cuDNN's TF32
    flag or the float32 matmul precision (beyond what it does to cuBLAS TF32), and Dynamo's (without gearcache's
    native module) not the SDPA backends either: a change of only those in a running process is seen by the next
    miss (whose entry key computes the state afresh), not by signatures already served, as with ``torch.compile``."""
    snap = _snapshot
    same = snap.same
    if same is not None and same():
        return snap.tag
    same = torch_state.state_guard()
    tag = sys.intern(json.dumps(torch_state.global_state(), sort_keys=True, separators=(",", ":")))
    snap.same, snap.tag = same, tag
    return tag


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(leaves, key)`` of a call (see the module docstring). A tensor passed twice (the same object) is keyed
    ``("same", i)`` at its second place, ``i`` its first (a graph captured with it reads one input for both); a tensor
    subclass, or a complex tensor with its conjugate or negative bit set, adds its type and bits to its key."""
    mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), state_tag())
    if kwargs:
        return _nested_call_key(args, kwargs, mode)
    try:
        key = (len(args), mode, *[(a.shape, a.stride(), a.dtype, a.device) for a in args])
    except AttributeError:          # not all plain tensors
        return _nested_call_key(args, kwargs, mode)
    plain = _snapshot.plain
    if plain is None:
        plain = _snapshot.plain = torch_tensor_checks.plain_tensors_check()
    if plain(args) and not memory_groups(args):
        return args, key
    return args, (len(args), mode, *_leaf_keys(args))


def _nested_call_key(args: tuple[Any, ...], kwargs: dict[str, Any],
                     mode: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``call_key``'s general path: keyword arguments, or arguments that are not all tensors (lists, scalars...)."""
    found: list[Any] = []
    structure = (flatten(args, found), flatten(kwargs, found))
    return tuple(found), (structure, mode, *_leaf_keys(found))


def _leaf_keys(leaves: Any) -> list[tuple[Any, ...]]:
    """Each leaf's key; a tensor seen before at place ``i``: ``("same", i)``; a tensor that shares memory with
    another leaf (not the same object) adds ``("storage", j, storage_offset, base)``, ``j`` the first leaf on its
    storage object, ``base`` what AOTAutograd compiles it over (:func:`_memory_mark`): Dynamo compiles such inputs as
    views of one base, which distinct tensors are not (and the other way round); ``("storage", j, storage_offset,
    base, c)`` where its bytes overlap leaves on other storage objects too, ``c`` the first of them all
    (memory.memory_groups: torch compiles those as apart). The memory marks are added last, in a pass of their own."""
    keys: list[tuple[Any, ...]] = []
    first: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        j = first.setdefault(id(leaf), i) if isinstance(leaf, _Tensor) else i
        keys.append(("same", j) if j != i else _leaf_key(leaf))
    for i, group in memory_groups(leaves).items():
        if keys[i][0] != "same":
            keys[i] = keys[i] + (_memory_mark(group, leaves[i]),)
    return keys


def _memory_mark(group: tuple[int, int | None], leaf: torch.Tensor) -> tuple[Any, ...]:
    """A shared leaf's mark (see :func:`_leaf_keys`): ``("storage", j, storage_offset, base(, c))``. ``base``: what
    AOTAutograd compiles views of one tensor over, one of them written (a graph input of its own, its sizes checked
    by Inductor at every call): the leaf's ``_base`` (its sizes, strides and storage offset), else its storage's
    bytes (``tensor_checks.aliased_base``); views alike over another base were keyed alike, and the entry raised
    AssertionError."""
    over = torch_tensor_checks.aliased_base(leaf)
    offset = leaf.storage_offset()
    return ("storage", group[0], offset, over) if group[1] is None else ("storage", group[0], offset, over, group[1])


def on_cuda(leaves: tuple[Any, ...]) -> bool:
    """Whether a call has a CUDA tensor among its inputs (CUDA graphs serve such calls; calls with none run without
    graphs, on the same entries)."""
    return any(isinstance(x, _Tensor) and x.is_cuda for x in leaves)


def shares_storage(key: tuple[Any, ...]) -> list[int]:
    """The leaves of the call keyed ``key`` that share a storage with another leaf (distinct tensor objects: see
    :func:`_leaf_keys`); ``[]`` for most calls."""
    return [i for i, k in enumerate(key[2:]) if type(k) is tuple and len(k) in (5, 8) and type(k[-1]) is tuple
            and k[-1][:1] == ("storage",)]


def shares_memory(key: tuple[Any, ...]) -> list[int]:
    """:func:`shares_storage`'s leaves and those passed as the same tensor object twice (``("same", i)``: both)."""
    same = {i for i, k in enumerate(key[2:]) if type(k) is tuple and k[:1] == ("same",)}
    same |= {key[2 + i][1] for i in same}
    return sorted(same | set(shares_storage(key)))


def shared_memory_message(name: str, key: tuple[Any, ...], why: str, method: Callable[..., Any] | None = None,
                          leaves: tuple[Any, ...] = ()) -> str:
    """The refusal of a call whose inputs share memory where gearcache would copy them apart (``why``), naming the
    arguments (by ``method``'s parameter names, from the call's ``leaves``; else by flattened position)."""
    names = leaf_names(method, *unflatten(key[0], leaves), leaves) if method is not None and leaves else {}
    shared = ", ".join(names.get(i, f"flattened position {i}") for i in shares_memory(key))
    return (f"{name}: arguments {shared} are one tensor or views of one storage; "
            f"{why}, so a write through one would not show through the others. Fix: pass tensors that do not share "
            f"memory (a .clone() of each)")


def inputs_meta(inputs: Any) -> list[Any]:
    """A graph's example inputs as an artifact key factor: each tensor's shape, stride, dtype and device (plus
    ``["storage", j, storage_offset, base(, c)]`` as :func:`_leaf_keys` marks it: AOTAutograd compiles aliased inputs as
    views of one base), ``repr`` of anything else."""
    shared = memory_groups(inputs)
    meta: list[Any] = []
    for i, t in enumerate(inputs):
        if not isinstance(t, _Tensor):
            meta.append(repr(t))
            continue
        meta.append([list(t.shape), list(t.stride()), str(t.dtype), str(t.device)])
        if i in shared:
            meta[-1].append(list(_memory_mark(shared[i], t)))
    return meta


class Matcher(NamedTuple):
    """``matches(args) -> bool`` (see :func:`matcher`). A tuple, so the C dispatcher reads its fields directly."""

    check: Callable[..., bool]                  # C++: the tensors' metadata (torch_tensor_checks.tensor_match)
    n: int                                      # positional arguments
    inference: bool                             # inference mode on
    same_state: Callable[[], bool]              # C++: grad off and the global state as at creation (state_guard)
    is_inference_mode_enabled: Callable[[], bool] | None    # None: same_state covers inference mode
    plain: bool                                 # autocast off in that state (the C runner then skips its checks)

    def __call__(self, args: tuple[Any, ...]) -> bool:
        return (len(args) == self.n and self.same_state()
                and (self.is_inference_mode_enabled is None or self.is_inference_mode_enabled() == self.inference)
                and self.check(*args))


def matcher(leaves: tuple[Any, ...], key: tuple[Any, ...], distinct_storages: bool = False,
            state_rules: StateRules = ()) -> Matcher | None:
    """``matches(args) -> bool`` for a call with positional arguments only: True only if ``call_key(args, {})`` would
    return ``key``: as many tensors, each with the sizes, strides, dtype and device of ``leaves``' tensor at its place,
    grad off, the same inference mode and the same global state. Call it in the state ``key`` was computed in (the
    state is snapshotted here). It checks more than the key (Python type, dispatch keys, ``requires_grad``, the thread
    count), so it may answer False for a call with this key; the caller then computes the key. Positional scalars
    (int, float, bool, None) beside the tensors are compared by type and value (a served step's ``keep_last``). None
    when ``key`` is not of that kind (keyword arguments, nested or other non-tensors, no tensor, grad on, tensors
    sharing memory), its state is not the thread's, or torch has no C++ check. ``distinct_storages``: the entry
    writes an input, so the matcher also answers False for a call two of whose tensors' storages overlap in memory
    (such a call takes the key's path, whose key tells them apart: ``memory.memory_groups``). ``state_rules``: the
    entry's ``state_alias.rules`` (by leaf index): the matcher also answers False for a call with a leaf on a storage
    its rule forbids (a module tensor's: the key's path refuses it); None where a rule is on ``CALL`` (one refusing
    every call)."""
    tensors = tuple(leaf for leaf in leaves if isinstance(leaf, _Tensor))
    if key[1][0] or not tensors or not (type(key[0]) is int and len(tensors) == len(leaves) or
                                        _flat_with_scalars(key[0], leaves)):
        return None
    if any(leaf_key[0] == "same" for leaf_key in key[2:]) or shares_storage(key):
        return None             # inputs that share memory: every call takes the key's path, which tells them apart
    if any(i == CALL for i, _ in state_rules):
        return None             # an entry whose every call is refused, on the key's path
    same_state = torch_state.state_guard()
    if same_state is None or torch.is_grad_enabled() or state_tag() != key[1][2]:
        return None
    check = _storages_check(leaves, tensors, distinct_storages and len(tensors) > 1, state_rules)
    if check is None:
        return None
    if len(tensors) < len(leaves):
        check = _and_scalars(check, leaves)
    inference = None if torch_state.state_guard_covers_inference_mode(same_state) else torch.is_inference_mode_enabled
    return Matcher(check, len(leaves), bool(key[1][1]), same_state, inference, not torch_state.any_autocast_enabled())


def _storages_check(leaves: tuple[Any, ...], tensors: tuple[_Tensor, ...], distinct: bool,
                    state_rules: StateRules) -> Callable[..., bool] | None:
    """The matcher's check of the call's tensors (``tensors``, the tensor ``leaves``): their metadata, and where
    asked their storages (``distinct``: no two on one; ``state_rules``, by leaf index: none on a storage its rule
    forbids), in one C++ call where gearcache's native module is built, else in Python around the C++ metadata
    check. None where torch has no such check."""
    place = {i: k for k, i in enumerate(i for i, leaf in enumerate(leaves) if isinstance(leaf, _Tensor))}
    rules = tuple((place[i], forbidden) for i, forbidden in state_rules)
    if distinct or rules:
        by_place: dict[int, Forbidden] = dict(rules)
        forbidden = tuple(tuple(zip(by_place[k].starts, by_place[k].ends)) if k in by_place else None
                          for k in range(len(tensors))) if rules else None
        native = torch_tensor_checks.tensor_storage_match(tensors, forbidden, distinct)
        if native is not None:
            return native
    check = torch_tensor_checks.tensor_match(tensors)
    if check is None:
        return None
    if rules:
        return _and_storages(check, rules, distinct)
    return _and_distinct_storages(check) if distinct else check


def _flat_with_scalars(structure: Any, leaves: tuple[Any, ...]) -> bool:
    """Whether ``structure`` (a general key's) is a call of positional arguments only, each a tensor or a plain int,
    float, bool or None (the scalars a matcher compares by type and value)."""
    return (structure == ((tuple, *[None] * len(leaves)), (dict, ())) and
            all(isinstance(leaf, _Tensor) or type(leaf) in _MATCHED_SCALARS for leaf in leaves))


_MATCHED_SCALARS = (int, float, bool, type(None))


def _and_scalars(check: Callable[..., bool], leaves: tuple[Any, ...]) -> Callable[..., bool]:
    """``check`` (over the tensors of ``leaves``, in order) of a call's tensors, and each scalar argument of the same
    type and value as in ``leaves`` (what its key holds: ``(type, value)``), a float zero of the same sign too (0.0
    and -0.0 have keys of their own). A NaN never matches (the key's path then tells)."""
    at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, _Tensor))
    scalars = tuple((i, type(leaf), leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, _Tensor))
    zeros = tuple((i, math.copysign(1.0, leaf)) for i, kind, leaf in scalars if kind is float and not leaf)
    only = at[0] if len(at) == 1 else None

    def matches(*args: Any) -> bool:
        for i, kind, value in scalars:
            arg = args[i]
            if type(arg) is not kind or arg != value:
                return False
        for i, sign in zeros:
            if math.copysign(1.0, args[i]) != sign:
                return False
        if only is not None:
            return check(args[only])
        return check(*[args[i] for i in at])
    return matches


def _and_distinct_storages(check: Callable[..., bool]) -> Callable[..., bool]:
    """``check``, and no two of the call's tensors over overlapping memory (a matcher for an entry that writes an
    input: its graph was compiled for inputs that do not share memory, and a write through one would not show
    through another)."""
    def matches(*args: Any) -> bool:
        return check(*args) and ranges_apart(args)
    return matches


def _and_storages(check: Callable[..., bool], rules: StateRules, distinct: bool) -> Callable[..., bool]:
    """``check`` (over a call's tensors), and no tensor on a storage its rule in ``rules`` (by place among the
    tensors) forbids; with ``distinct``, also no two tensors over overlapping memory (as
    :func:`_and_distinct_storages`)."""
    def matches(*args: Any) -> bool:
        if not check(*args) or (distinct and not ranges_apart(args)):
            return False
        return all(forbidden.owner(*storage_range(args[k])) is None for k, forbidden in rules)
    return matches


def describe(leaves: tuple[Any, ...], key: tuple[Any, ...]) -> dict[str, Any]:
    """A JSON-able description of a call signature (a key factor, and what error messages show)."""
    grad, inference = key[1][0], key[1][1]
    desc: list[dict[str, Any]] = []
    for leaf, leaf_key in zip(leaves, key[2:]):
        if leaf_key[0] == "same":
            desc.append({"same_as": leaf_key[1]})
        elif isinstance(leaf, _Tensor):
            desc.append({"shape": list(leaf.shape), "stride": list(leaf.stride()), "dtype": str(leaf.dtype),
                         "device": str(leaf.device), "contiguous": leaf.is_contiguous()})
            if len(leaf_key) >= 7:
                desc[-1]["type"], desc[-1]["conj"], desc[-1]["neg"] = (
                    f"{type(leaf).__module__}.{type(leaf).__qualname__}", leaf.is_conj(), leaf.is_neg())
            if len(leaf_key) in (5, 8):         # ("storage", first leaf on it, storage offset, base(, cluster))
                desc[-1]["storage_of"], desc[-1]["storage_offset"] = leaf_key[-1][1], leaf_key[-1][2]
                desc[-1]["base"] = leaf_key[-1][3]
                if len(leaf_key[-1]) > 4:
                    desc[-1]["overlaps"] = leaf_key[-1][4]
        else:
            desc.append({"type": type(leaf).__qualname__, "value": repr(leaf)})
    autocast = json.loads(key[1][2])["autocast"]
    return {"structure": str(key[0]), "grad_enabled": grad, "inference_mode": inference, "autocast": autocast,
            "leaves": desc}


def short(desc: dict[str, Any]) -> str:
    """One line for messages: ``(float32[4, 16] cpu, float32[4, 8] cpu) grad=off`` (`` autocast=cpu:bfloat16`` added
    where autocast is on)."""
    parts = []
    for leaf in desc["leaves"]:
        if "same_as" in leaf:
            parts.append(f"<leaf {leaf['same_as']}>")
        elif "shape" in leaf:
            dt = leaf["dtype"].replace("torch.", "")
            parts.append(f"{dt}{leaf['shape']} {leaf['device']}")
        else:
            parts.append(f"{leaf['type']}={leaf['value']}")
    autocast = "".join(f" autocast={d}:{t.replace('torch.', '')}" for d, t in (desc.get("autocast") or {}).items())
    return f"({', '.join(parts)}) grad={'on' if desc['grad_enabled'] else 'off'}{autocast}"


def rekey(key: tuple[Any, ...], leaves: tuple[Any, ...], before: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The key of a call with the same argument structure and mode as ``key`` but other leaves (padded ones); a leaf
    keyed as a repeat of an earlier one (``("same", i)``) stays so (its graph reads leaf ``i`` for both), and so
    does a leaf that is the very object at its place in ``before`` (the leaves ``key`` was made from: an argument
    padding left as it was keeps its memory mark, :func:`_memory_mark`)."""
    kept = len(before) == len(leaves)
    return (key[0], key[1], *[old if old[0] == "same" or kept and leaf is before[i] else _leaf_key(leaf)
                              for i, (old, leaf) in enumerate(zip(key[2:], leaves))])


def rebuild(node: Any, leaves: Any) -> Any:
    """Rebuild one structure node (from ``flatten``) taking its leaves from the iterator ``leaves``."""
    if node is None:
        return next(leaves)
    kind = node[0]
    if kind is dict:
        return {k: rebuild(child, leaves) for k, child in zip(node[1], node[2:])}
    return kind(rebuild(child, leaves) for child in node[1:])


def unflatten(structure: Any, leaves: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild ``(args, kwargs)`` from a key's structure (``key[0]``) and leaves: the inverse of ``call_key``."""
    if isinstance(structure, int):
        return tuple(leaves), {}
    it = iter(leaves)
    return rebuild(structure[0], it), rebuild(structure[1], it)


def leaf_names(method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               leaves: tuple[Any, ...] | None = None) -> dict[int, str]:
    """Leaf index -> argument name for tensor arguments (``x``, or ``kv[1]`` for an item of a list argument).
    ``leaves``: the call's (``call_key``'s); None: flattened here."""
    if leaves is None:
        found: list[Any] = []
        flatten(args, found)
        flatten(kwargs, found)
        leaves = tuple(found)
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return {}
    names: dict[int, str] = {}
    ids: dict[int, list[int]] = {}            # a tensor passed twice is two leaves: each gets one of its names
    for i, leaf in enumerate(leaves):
        ids.setdefault(id(leaf), []).append(i)

    def name_it(value: Any, name: str) -> None:
        if isinstance(value, _Tensor) and ids.get(id(value)):
            names[ids[id(value)].pop(0)] = name

    for name, value in bound.arguments.items():
        if isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                name_it(item, f"{name}[{k}]")
        else:
            name_it(value, name)
    return names
