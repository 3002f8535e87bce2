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

Sharing is told by memory: a leaf whose storage's bytes overlap a module tensor's storage's (``memory.Forbidden``),
so a tensor on another storage object over the same bytes (``torch.from_numpy`` views of one array) is refused too.
torch compiles tensors on distinct storage objects as apart whatever their bytes (``memory``), so two more rules
refuse what it would compile wrong: an entry that writes a leaf its signature marks as overlapping leaves on other
storage objects, and an entry that writes a module tensor overlapping another module tensor's bytes on another
storage object, refuse every call (a leaf's rule over every byte; the rule ``CALL``). So does an entry that writes a
leaf or a module tensor whose own elements overlap (``memory.elements_may_overlap``: ``as_strided`` windows): eager's
in-place op writes them one after another, each seen by the next, the graph each from values read before (``x.add_(1);
return x * 2``: eager [2, 6, 6, 8, 8, 8], gearcache [2, 4, 6, 6, 8, 8]).

Cost per call, for an entry with rules: one storage range per leaf a rule names and one bisection. In the
shortcut (``signature.matcher``) they are compared in the same C++ call as the tensors' metadata (gearcache's native
``TensorMatch``, which also tells the arguments of an entry writing one apart), else in Python around Dynamo's check
(~0.2-0.3 us on CPU, reusing the addresses computed to tell the arguments apart).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import UnsupportedInputError
from .memory import elements_may_overlap, everywhere, forbidden_ranges, memory_groups, storage_range
from .signature import CALL, StateRules, leaf_names, unflatten

Rules = StateRules
"""``((leaf index, memory.Forbidden), ...)``: the memory each named call leaf must not overlap (module tensors', or
every byte); the index ``CALL`` stands for every call (refused: its Forbidden's one name says why)."""

NO_RULES: Rules = ()


def rules(recipe: Sequence[int | tuple[dict[str, Any], str]], manifest: dict[str, Any],
          mutated: list[int] | None) -> Rules:
    """The rules of an entry whose graph inputs are ``recipe`` (a leaf index, or a module tensor's (dict, name) slot,
    as ``Entry`` resolved them; the ``manifest``'s ``inputs``, ``[kind, ref]`` each, name the module tensors) and
    whose graph writes the inputs ``mutated`` (None: unknown, every input). Empty when the graph writes nothing or
    reads no module tensor, and its signature has no leaves over memory shared across storage objects."""
    written = set(range(len(recipe))) if mutated is None else set(mutated)
    if not written:
        return NO_RULES
    inputs = manifest["inputs"]
    return (_state_call_rules(recipe, inputs, written) + _state_rules(recipe, inputs, written)
            + _overlap_rules(recipe, manifest, written))


def _state_call_rules(recipe: Sequence[int | tuple[dict[str, Any], str]], inputs: list[list[Any]],
                      written: set[int]) -> Rules:
    """``((CALL, why),)`` where the graph writes a module tensor whose bytes overlap another module tensor's on
    another storage object (buffers made by ``torch.from_numpy`` of views of one array: torch compiled the two as
    apart, so a read of the other after the write would see the old values), or whose own elements overlap (an
    ``as_strided`` buffer: a read after the write would see values eager's in-place op does not leave). Else empty."""
    slots = [(j, item[0][item[1]]) for j, item in enumerate(recipe) if not isinstance(item, int)]
    groups = memory_groups([tensor for _, tensor in slots])
    for k, (j, tensor) in enumerate(slots):
        if j not in written or not isinstance(tensor, torch.Tensor):
            continue
        if k in groups and groups[k][1] is not None:
            others = [inputs[slots[o][0]][1] for o, (_, head) in groups.items() if o != k and head == groups[k][1]]
            return ((CALL, everywhere(
                f"the module tensor {inputs[j][1]}, which the compiled entry writes, shares memory with the module "
                f"tensors {others} on other storage objects (as torch.from_numpy views of one array): torch compiles "
                f"them as apart, so the method's reads of one after its writes to the other would not see them. Fix: "
                f"make them views of one tensor (one storage object), or .clone() them")),)
        if elements_may_overlap(tensor.shape, tensor.stride()):
            return ((CALL, everywhere(
                f"the module tensor {inputs[j][1]}, which the compiled entry writes, has elements over one memory "
                f"(sizes {list(tensor.shape)}, strides {list(tensor.stride())}): eager's in-place op writes them one "
                f"after another, each seen by the next, the compiled entry each from values read before. Fix: "
                f"register a .clone() of it")),)
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
        name = f"the module's {'parameter' if isinstance(tensor, torch.nn.Parameter) else 'buffer'} {inputs[j][1]}"
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
    """``(leaf index, what it overlaps)`` of the first call leaf on memory its rule forbids (``(CALL, why)`` for an
    entry whose every call is refused); None for most calls."""
    for i, forbidden in rules_:
        if i == CALL:
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
    if i == CALL:
        raise UnsupportedInputError(f"{name}: {owner}")
    names = leaf_names(method, *unflatten(key[0], leaves), leaves) if method is not None and key is not None else {}
    argument = names.get(i, f"at flattened position {i}")
    raise UnsupportedInputError(
        f"{name}: argument {argument} shares memory with {owner}, which the compiled entry reads or writes as a "
        f"tensor of its own: it would run the method's reads and writes of that memory in the compiled order, not "
        f"eager's. Fix: pass a .clone() of it")

