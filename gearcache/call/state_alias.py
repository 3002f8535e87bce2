"""Calls whose arguments share memory with the module tensors an entry reads or writes: refused, never served in
compiled order (docs/CONCEPTS.md, "Arguments that are the module's own tensors").

Dynamo makes each parameter and buffer a graph input of its own, and Inductor orders a graph's reads and writes
assuming that inputs share no memory unless its example inputs did. An entry captured with plain tensors, then called
with (a view of) a module tensor, would run ``self.buf.add_(1); return x * 3`` with ``x`` read before the write.
A capture of such a call is refused (``compiling/capture._refuse_arguments_sharing_state``); this module refuses the
call of an entry captured without, on every path that runs an entry: the key's path (``CachedFunction._call``,
``call_geared``, ``call_uncaptured``), the CUDA-graph path (``CudaGraphs.call``, before a capture or a replay) and
the dispatcher's shortcut (the matcher answers False for such a call, which then takes the key's path and is refused
there). Padding does not make such a call safe: a padded argument is a copy, but what the graph writes into it is
copied back after the run, and what it reads was copied before the method's write to the module tensor. Refused
rather than served eagerly: the same call, made first, is refused at capture, so a call is refused whatever the order
of calls, as a padded call of arguments sharing memory is (``UnsupportedInputError``, the call path's policy for
inputs no entry can serve).

The rules (:func:`rules`), derived once per binding of an entry from its recipe and its run plan's
``mutated_inputs``: a call leaf the graph writes must share no storage with a module tensor the graph reads or
writes; a call leaf the graph only reads must share none with a module tensor the graph writes. Sharing where both
only read is harmless (two reads of one memory give eager's values), so an entry that writes nothing has no rules
and costs nothing per call; one whose writes are unknown (torch's loader, no plan) is taken to write every input.
The storages are those of the module tensors where the entry was bound: a module tensor replaced, or its ``.data``
swapped, changes what the method's value-guard watch reads (its ``tensor`` guard, its ``_buffers`` item), so the next
call rebinds the entry (``CachedFunction._revalidate``, ``Entry.state_moved``) and with it these rules.

Sharing is told by memory: a leaf whose storage's bytes overlap a module tensor's storage's (``signature.Forbidden``),
so a tensor on another storage object over the same bytes (``torch.from_numpy`` views of one array) is refused too.

Module tensors among themselves: two the graph reads on distinct storage objects over overlapping bytes (buffers made
with ``torch.from_numpy`` of overlapping views of one array), one of them written, are compiled as apart, so the
graph read the other before the write (eager 5498501, gearcache 3999001 for ``b1.mul_(2); return b2.sum() + x``).
Such an entry refuses every call: its rule is on :data:`EVERY_CALL`, not on a leaf (the shortcut has no matcher
for it). Views of one tensor (one storage object) are compiled as views of one base: served. So does an entry writing
a module tensor whose own elements overlap (``as_strided`` windows as a buffer: eager's in-place op writes them one
after another, each seen by the next; the graph writes each from values read before).

Cost per call, for an entry with rules: one storage range per leaf a rule names and one bisection. In the
shortcut (``signature.matcher``) they are compared in the same C++ call as the tensors' metadata (gearcache's native
``TensorMatch``, which also tells the arguments of an entry writing one apart), else in Python around Dynamo's check
(~0.2-0.3 us on CPU, reusing the addresses computed to tell the arguments apart).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..errors import UnsupportedInputError
from .memory import elements_may_overlap, everywhere, forbidden_ranges, storage_range
from .signature import StateRules, leaf_names, unflatten

Rules = StateRules
"""``((leaf index, signature.Forbidden), ...)``: the module tensors' memory each named call leaf must not overlap."""

NO_RULES: Rules = ()

EVERY_CALL = -1
"""The leaf index of a rule that refuses every call, whatever its leaves (module tensors over one memory on two
storage objects, one written: :func:`_shared_state_rules`)."""


def rules(recipe: Sequence[int | tuple[dict[str, Any], str]], manifest: dict[str, Any],
          mutated: list[int] | None) -> Rules:
    """The rules of an entry whose graph inputs are ``recipe`` (a leaf index, or a module tensor's (dict, name) slot,
    as ``Entry`` resolved them; the ``manifest``'s ``inputs``, ``[kind, ref]`` each, name the module tensors) and
    whose graph writes the inputs ``mutated`` (None: unknown, every input). Empty when the graph writes nothing or
    reads no module tensor, and its signature has no leaves over memory shared across storage objects."""
    written = set(range(len(recipe))) if mutated is None else set(mutated)
    if not written:
        return NO_RULES
    return (_shared_state_rules(recipe, manifest["inputs"], written) + _state_rules(recipe, manifest["inputs"], written)
            + _overlap_rules(recipe, manifest, written))


def _kind(tensor: torch.Tensor) -> str:
    """``parameter`` or ``buffer``."""
    return "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"


class _StateSpan(NamedTuple):
    start: int
    end: int
    j: int                              # its graph input
    storage: torch.UntypedStorage
    tensor: torch.Tensor


def _shared_state_rules(recipe: Sequence[int | tuple[dict[str, Any], str]], inputs: list[list[Any]],
                        written: set[int]) -> Rules:
    """One rule on :data:`EVERY_CALL` where two module tensors the graph reads sit on distinct storage objects over
    overlapping bytes and the graph writes one of them (see the module docstring), or where it writes one whose own
    elements overlap (``memory.elements_may_overlap``: ``as_strided`` windows); else none. Cost: a storage range
    per module tensor and a sort, at a binding only."""
    spans = []
    for j, item in enumerate(recipe):
        tensor = None if isinstance(item, int) else item[0][item[1]]
        if isinstance(tensor, torch.Tensor) and (where := storage_range(tensor))[1] > where[0]:
            spans.append(_StateSpan(*where, j, tensor.untyped_storage(), tensor))
    spans.sort(key=lambda s: (s.start, s.end, s.j))
    reaching: list[_StateSpan] = []
    for span in spans:
        reaching = [o for o in reaching if o.end > span.start]      # those whose bytes reach this one's start
        for other in reaching:
            if other.storage is not span.storage and (other.j in written or span.j in written):
                first, second = sorted((other, span), key=lambda s: s.j)
                what = (f"the module's {_kind(first.tensor)} {inputs[first.j][1]} and {_kind(second.tensor)} "
                        f"{inputs[second.j][1]} are tensors on two storage objects over the same bytes "
                        f"(torch.from_numpy views of one array), which torch compiles as apart")
                return ((EVERY_CALL, everywhere(what)),)
        reaching.append(span)
    for span in spans:
        if span.j in written and elements_may_overlap(span.tensor.shape, span.tensor.stride()):
            return ((EVERY_CALL, everywhere(
                f"the module's {_kind(span.tensor)} {inputs[span.j][1]} has elements over one memory (sizes "
                f"{list(span.tensor.shape)}, strides {list(span.tensor.stride())}), which the compiled entry writes "
                f"from values read before its writes")),)
    return NO_RULES


def _state_rules(recipe: Sequence[int | tuple[dict[str, Any], str]], inputs: list[list[Any]],
                 written: set[int]) -> Rules:
    """Each leaf's module tensors it must not overlap (see the module docstring)."""
    every: dict[tuple[int, int], str] = {}
    written_state: dict[tuple[int, int], str] = {}
    for j, item in enumerate(recipe):
        if isinstance(item, int):
            continue
        tensor = item[0][item[1]]
        if not isinstance(tensor, torch.Tensor):
            continue
        name = f"the module's {_kind(tensor)} {inputs[j][1]}"
        address = storage_range(tensor)
        every.setdefault(address, name)
        if j in written:
            written_state.setdefault(address, name)
    if not every:
        return NO_RULES
    found = []
    for j, item in enumerate(recipe):
        if isinstance(item, int):
            forbidden = every if j in written else written_state
            if forbidden:
                found.append((item, forbidden_ranges(forbidden)))
    return tuple(found)


def _overlap_rules(recipe: Sequence[int | tuple[dict[str, Any], str]], manifest: dict[str, Any],
                   written: set[int]) -> Rules:
    """A rule refusing every call for each leaf the graph writes that the entry's signature marks as overlapping
    leaves on other storage objects (``"overlaps"``: ``memory.memory_groups``): torch compiled them as apart, so the
    graph's write would not show through the others; and for each whose own elements overlap by its sizes and strides
    (``memory.elements_may_overlap``: eager's in-place op writes them one after another, each seen by the next)."""
    leaves = manifest.get("signature", {}).get("leaves", [])
    found = []
    for j in sorted(written):
        i = recipe[j] if j < len(recipe) else None
        if isinstance(i, int) and i < len(leaves) and "shape" in leaves[i] and elements_may_overlap(
                leaves[i]["shape"], leaves[i]["stride"]):
            found.append((i, everywhere(f"itself (sizes {leaves[i]['shape']}, strides {leaves[i]['stride']}: its "
                                        f"elements overlap, and the compiled entry writes each from values read "
                                        f"before its writes)")))
        elif isinstance(i, int) and i < len(leaves) and "overlaps" in leaves[i]:
            others = [k for k, leaf in enumerate(leaves) if k != i and leaf.get("overlaps") == leaves[i]["overlaps"]]
            found.append((i, everywhere(f"the arguments at flattened positions {others} (tensors on other storage "
                                        f"objects over the same bytes, as torch.from_numpy views of one array, which "
                                        f"torch compiles as apart)")))
    return tuple(found)


def first_alias(rules_: Rules, leaves: Sequence[Any]) -> tuple[int, str] | None:
    """``(leaf index, module tensor)`` of the first call leaf on a storage its rule forbids; None for most calls."""
    for i, forbidden in rules_:
        if i == EVERY_CALL:
            return i, forbidden.names[0]
        leaf = leaves[i]
        if isinstance(leaf, torch.Tensor):
            owner = forbidden.owner(*storage_range(leaf))
            if owner is not None:
                return i, owner
    return None


def refuse(name: str, method: Callable[..., Any] | None, rules_: Rules, leaves: tuple[Any, ...],
           key: tuple[Any, ...] | None) -> None:
    """Raise ``UnsupportedInputError`` for a call (flattened ``leaves``, keyed ``key``: its structure names the
    arguments by ``method``'s parameters; None: by flattened position) that :func:`first_alias` finds sharing memory
    with a module tensor the entry of ``name`` reads or writes; return for any other call (at once without rules)."""
    if not rules_:
        return
    found = first_alias(rules_, leaves)
    if found is None:
        return
    i, owner = found
    if i == EVERY_CALL:
        raise UnsupportedInputError(
            f"{name}: {owner}; the compiled entry writes that memory, and would run the method's reads and writes of "
            f"it in the compiled order, not eager's. Fix: register a .clone() of the one written (or, for "
            f"torch.from_numpy views of one array, make them views of one tensor: one torch.from_numpy of the array, "
            f"then slices of it)")
    names = leaf_names(method, *unflatten(key[0], leaves), leaves) if method is not None and key is not None else {}
    argument = names.get(i, f"at flattened position {i}")
    raise UnsupportedInputError(
        f"{name}: argument {argument} shares memory with {owner}, which the compiled entry reads or writes as a "
        f"tensor of its own: it would run the method's reads and writes of that memory in the compiled order, not "
        f"eager's. Fix: pass a .clone() of it")

