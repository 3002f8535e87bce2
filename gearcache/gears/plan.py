"""Gears: shape buckets. A call is padded up to the smallest gear that fits, run, and its outputs cut back.

Marking (torchair's API)::

    set_dim_gears(x, dim_gears={0: [1, 2, 4, 8]})     # or config.inference_config.dim_gears = {"x": {0: [...]}}
    mark_static(t)                                     # pin every dim of t (never padded)

A :class:`GearPlan` is built once per cached method from the first call's marks:

* ``dims``: the marked (input leaf, dim) pairs with their sorted sizes;
* ``groups``: marked dims that must stay equal. ``zip`` puts every marked dim in one group that walks the i-th sizes
  together; ``product`` forms one group per distinct symbol of a symbolic trace (two inputs whose batch dims meet in
  the graph share a symbol), so no combination the model cannot run is ever formed;
* ``cuts``: for each output leaf of the method, the output dims equal to a marked input dim (from the symbolic
  trace's output shapes), cut back to the call's real size;
* ``padding``: what the padding analysis of the symbolic trace found (padding.py): ops that may mix padded rows into
  real ones, writes that padding would spread into state, and the inputs the method writes in place. A padded input
  the method writes is written in its padded copy; ``copy_back`` copies the copy's real rows into the caller's tensor
  after the call. ``lockstep``: under ``zip``, marked dims that meet in the graph (their real sizes must be equal).

The gear plan is stored beside the method's entries, so a warm process builds it without tracing. Resolving a call is a
table lookup per marked dim (``first[size]`` = index of the smallest gear size >= size), never a loop over gears.
On disk (the ``"plan"`` of a stored plan record): ``{"dims", "groups", "policy", "cuts", "lockstep", "padding"}``;
:data:`PLAN_FORMAT` is part of the gear plan's key.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from typing import Any, Hashable, NamedTuple, Protocol

import torch

from .._torch import capture as torch_capture
from ..call import memory, signature
from ..config import normalise_dim_gears
from ..counters import counters
from ..errors import ConfigError, UnsupportedInputError
from ..keys.guard_sets import GuardSet
from .pad_values import PadValue, exact
from .padding_report import PaddingReport

GEARS_ATTR = "_gearcache_dim_gears"
STATIC_ATTR = "_gearcache_static"
PAD_ATTR = "_gearcache_pad_value"
MAX_COMBINATIONS_BEFORE_WARNING = 1000
PLAN_FORMAT = 3
"""The stored gear plan's format (a factor of its key). 2: gear plans carry the padding analysis and zip's lockstep.
3: the analysis proves padding exact with a pad value per padded input (chosen where the user gave none)."""


def set_dim_gears(tensor: torch.Tensor, dim_gears: dict[int, list[int]], *,
                  pad_value: PadValue | None = None) -> torch.Tensor:
    """Declare the sizes ("gears") each listed dim of ``tensor`` may take; returns ``tensor``.

    Sizes are deduplicated and sorted; negative dims count from the end. Marking a tensor that already has other gears
    is an error. ``pad_value`` fills the padding (a pad token id, a mask value); default: chosen by gearcache's
    padding analysis so that every op reading the padded rows is exact (0 where any value is:
    gearcache/gears/padding.py).
    A value the tensor's dtype cannot hold (``-inf`` or ``0.5`` in an integer tensor) is a ``ConfigError``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"set_dim_gears: tensor={type(tensor).__qualname__} is not a torch.Tensor")
    try:
        gears = normalise_dim_gears(dim_gears, "set_dim_gears(dim_gears)")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    resolved: dict[int, list[int]] = {}
    for dim, sizes in gears.items():
        if not -tensor.dim() <= dim < tensor.dim():
            raise ConfigError(f"set_dim_gears: dim {dim} is out of range for a tensor with {tensor.dim()} dims "
                              f"(shape {list(tensor.shape)})")
        resolved[dim % tensor.dim()] = sizes
    if getattr(tensor, STATIC_ATTR, False):
        raise ConfigError("set_dim_gears: the tensor was marked static with gearcache.mark_static")
    existing = getattr(tensor, GEARS_ATTR, None)
    if existing is not None and existing != resolved:
        raise ConfigError(f"set_dim_gears: the tensor already has gears {existing}; got {resolved}. Mark each tensor "
                          f"once (or use a fresh tensor)")
    if pad_value is not None:
        pad_value = _exact_pad(pad_value, tensor.dtype, "set_dim_gears(pad_value)")
    setattr(tensor, GEARS_ATTR, resolved)
    setattr(tensor, PAD_ATTR, pad_value)
    for dim, sizes in resolved.items():
        if sizes[-1] >= 2:
            torch_capture.mark_dynamic(tensor, dim)       # for the torch.compile(backend=get_backend()) route
    return tensor


def mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """Pin every dim of ``tensor``: it is never padded and config gears by name do not apply to it."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"mark_static: tensor={type(tensor).__qualname__} is not a torch.Tensor")
    if getattr(tensor, GEARS_ATTR, None):
        raise ConfigError("mark_static: the tensor already has gears from set_dim_gears")
    setattr(tensor, STATIC_ATTR, True)
    return tensor


class PaddedEntry(Protocol):
    """What a gear plan reads and counts on the entry that served a padded call (a loaded entry): its manifest (which
    graph output is which method output) and its padding counts (flushed to the index: ``gearcache stats``)."""

    manifest: dict[str, Any]
    real_elements: int
    padded_elements: int


@dataclasses.dataclass
class MarkedDim:
    leaf: int               # index into the call's flattened inputs
    dim: int
    sizes: list[int]
    name: str               # for messages: "x", "kv[0]" or "input 3"
    pad_value: PadValue | None = None   # the user's (None: chosen by the padding analysis); a plan's: the one used


@dataclasses.dataclass
class MarkedCall:
    """A call as the gears read it, derived once from its arguments: its flattened ``leaves`` and signature ``key``,
    the argument ``names`` of its tensor leaves (gearcache/call/signature.py), its ``marks`` (:func:`find_marks`),
    and whether ``set_dim_gears`` marked its tensors (``tagged``: :func:`has_marks`, config gears by name aside)."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: tuple[Any, ...]
    key: tuple[Hashable, ...]
    names: dict[int, str]
    marks: list[MarkedDim]
    tagged: bool


class GearCall(NamedTuple):
    """The call at one gear (:meth:`GearPlan.gear_calls`): the gear's ``sizes`` (one per marked dim), the call's
    ``leaves`` narrowed and padded to them, their signature ``key``, and the ``args`` and ``kwargs`` they rebuild."""
    sizes: list[int]
    leaves: tuple[Any, ...]
    key: tuple[Hashable, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _exact_pad(value: PadValue, dtype: torch.dtype, where: str) -> PadValue:
    """``value`` as a ``dtype`` tensor holds it, else ``ConfigError``."""
    try:
        return exact(value, dtype)
    except ValueError as exc:
        raise ConfigError(f"{where}={value!r}: {exc}. Fix: give a value of the tensor's dtype, or none (gearcache "
                          f"then chooses one that keeps every op exact)") from None


def _first_index(sizes: list[int]) -> list[int]:
    """``first[s]`` = index of the smallest size >= s, for s in 1..max(sizes); ``first[0]`` is ``len(sizes)``, past
    every gear: an empty dim is never padded (a reduction over it without an identity, ``amax``, raises in eager,
    and padded rows would answer), so ``GearPlan.targets`` gives None for it, at no cost to other calls."""
    first, i = [len(sizes)], 0
    for s in range(1, sizes[-1] + 1):
        while sizes[i] < s:
            i += 1
        first.append(i)
    return first


class GearPlan:
    """Resolves, pads and cuts calls of one cached method. Built by :func:`build_plan`; JSON round-trips."""

    def __init__(self, dims: list[MarkedDim], groups: list[list[int]], policy: str,
                 cuts: dict[int, list[list[int]]], past_largest: str, lockstep: list[list[int]] | None = None,
                 padding: PaddingReport | None = None):
        self.dims, self.groups, self.policy, self.past_largest = dims, groups, policy, past_largest
        self.cuts = {int(k): [tuple(c) for c in v] for k, v in cuts.items()}   # output leaf -> [(out dim, marked)]
        self.lockstep = [list(g) for g in lockstep or []]   # zip: marked dims whose sizes must be equal
        self.padding = padding or PaddingReport()
        marked = {d.leaf for d in dims}
        self.written_padded = [i for i in self.padding.written_leaves if i in marked]    # copied back after a call
        self.verify_first: bool = False     # a padded call's gear is verified first (set by padding_check.apply)
        self.verified: set[tuple[int, ...]] = set()        # gears verified in this process
        if policy == "zip":
            self._first = [_first_index(d.sizes) for d in dims]
        else:
            self._first = [_first_index(dims[g[0]].sizes) for g in groups]
        self._graph_cuts: dict[int, list[tuple[int, int, int]]] = {}
        self._warned_eager = False
        self._leaf_dims: dict[int, list[tuple[int, int]]] = {}      # marked leaf -> [(dim, marked dim index)]
        for m, d in enumerate(dims):
            self._leaf_dims.setdefault(d.leaf, []).append((d.dim, m))

    # ---------------------------------------------------------------------------------------------- hot path
    def targets(self, leaves: tuple[Any, ...]) -> list[int] | None:
        """Per marked dim, the gear size this call is padded to; None when a size is past the largest gear."""
        dims = self.dims
        try:
            if self.policy == "zip":
                i = max([f[leaves[d.leaf].shape[d.dim]] for f, d in zip(self._first, dims)])
                for g in self.lockstep:
                    if len({leaves[dims[m].leaf].shape[dims[m].dim] for m in g}) != 1:
                        raise ConfigError(self._lockstep_message(g, leaves))
                return [d.sizes[i] for d in dims]
            out = [0] * len(dims)
            for g, f in zip(self.groups, self._first):
                sizes = {leaves[dims[m].leaf].shape[dims[m].dim] for m in g}
                if len(sizes) != 1:
                    raise ConfigError(self._lockstep_message(g, leaves))
                size = dims[g[0]].sizes[f[sizes.pop()]]
                for m in g:
                    out[m] = size
            return out
        except IndexError:
            return None

    def pad(self, leaves: tuple[Any, ...], targets: list[int]) -> tuple[Any, ...]:
        """The call's leaves with every marked dim padded up to its target (untouched leaves are the same objects)."""
        by_leaf: dict[int, dict[int, int]] = {}
        for d, t in zip(self.dims, targets):
            if leaves[d.leaf].shape[d.dim] != t:
                by_leaf.setdefault(d.leaf, {})[d.dim] = t
        if not by_leaf:
            return leaves
        new = list(leaves)
        for leaf, dims in by_leaf.items():
            src = leaves[leaf]
            shape = [dims.get(i, s) for i, s in enumerate(src.shape)]
            pad_value = next(d.pad_value for d in self.dims if d.leaf == leaf)
            out = src.new_full(shape, 0 if pad_value is None else pad_value)
            out[tuple(slice(0, s) for s in src.shape)] = src
            new[leaf] = out
        return tuple(new)

    def refuse_overlapping_written(self, leaves: tuple[Any, ...], padded: tuple[Any, ...]) -> None:
        """``UnsupportedInputError`` where a written leaf that padding copied (``padded[i] is not leaves[i]``) has
        elements over one memory (``as_strided`` windows: ``memory.elements_may_overlap``): its padded copy is written
        from values read before the writes and copied back, not as eager's in-place op writes them one after
        another. Call it before the run. Cost: an ``is_contiguous()`` per written leaf padded."""
        for leaf in self.written_padded:
            src = leaves[leaf]
            if padded[leaf] is not src and not src.is_contiguous() and memory.elements_may_overlap(src.shape,
                                                                                                    src.stride()):
                raise UnsupportedInputError(
                    f"a padded argument (flattened position {leaf}; sizes {list(src.shape)}, strides "
                    f"{list(src.stride())}) has elements over one memory, and the method writes it: its padded copy "
                    f"is written from values read before the writes and copied back, not as eager's in-place op "
                    f"writes them one after another. Fix: pass a .clone() of it")

    def copy_back(self, padded: tuple[Any, ...], leaves: tuple[Any, ...]) -> None:
        """Copy the real rows of each padded input the method wrote in place back into the caller's tensor."""
        for i in self.written_padded:
            if padded[i] is not leaves[i]:
                leaves[i].copy_(padded[i][tuple(slice(0, s) for s in leaves[i].shape)])

    def record_padding(self, entry: PaddedEntry, leaves: tuple[Any, ...], targets: list[int]) -> None:
        """Count a served call's elements of its marked inputs, as passed and as run (padded to ``targets``): on
        ``entry`` (flushed to the index at exit: ``gearcache stats``' padding waste) and in ``counters``."""
        real = padded = 0
        for leaf, dims in self._leaf_dims.items():
            shape = list(leaves[leaf].shape)
            real += math.prod(shape)
            for dim, m in dims:
                shape[dim] = targets[m]
            padded += math.prod(shape)
        entry.real_elements += real
        entry.padded_elements += padded
        counters.real_elements += real
        counters.padded_elements += padded

    def cut(self, entry: PaddedEntry, outs: list[Any], leaves: tuple[Any, ...]) -> list[Any]:
        """Cut the compiled graph's outputs back to the call's real sizes along every dim that follows a marked dim."""
        cuts = self._graph_cuts.get(id(entry))
        if cuts is None:
            cuts = self._graph_cuts[id(entry)] = self._graph_cuts_for(entry)
        if not cuts:
            return outs
        outs = list(outs)
        for i, dim, m in cuts:
            d = self.dims[m]
            real = leaves[d.leaf].shape[d.dim]
            if outs[i].shape[dim] != real:
                outs[i] = outs[i].narrow(dim, 0, real)
        return outs

    def _graph_cuts_for(self, entry: PaddedEntry) -> list[tuple[int, int, int]]:
        """Translate cuts per method output leaf into cuts per graph output of this entry."""
        out: list[tuple[int, int, int]] = []
        for j, (kind, ref) in enumerate(entry.manifest["outputs"]["leaves"]):
            if kind == "out":
                out.extend((int(ref), dim, m) for dim, m in self.cuts.get(j, []))
        return out

    # -------------------------------------------------------------------------------------------- the rest
    def empty_call(self, leaves: tuple[Any, ...]) -> bool:
        """Whether a marked dim of the call has size 0 (``targets`` gives None for it: the caller runs the method
        itself, whatever ``past_largest_gear`` says)."""
        return any(leaves[d.leaf].shape[d.dim] == 0 for d in self.dims)

    def past_largest_message(self, leaves: tuple[Any, ...]) -> str:
        for d in self.dims:
            size = leaves[d.leaf].shape[d.dim]
            if size > d.sizes[-1]:
                return (f"argument {d.name}, dim {d.dim}: size {size} is larger than the largest gear "
                        f"{d.sizes[-1]} (gears {d.sizes}). Fix: add a larger gear, or set "
                        f"config.inference_config.past_largest_gear to 'eager' or 'compile'")
        return "a marked dim is larger than its largest gear"

    def _lockstep_message(self, group: list[int], leaves: tuple[Any, ...]) -> str:
        parts = [f"{self.dims[m].name} dim {self.dims[m].dim} = {leaves[self.dims[m].leaf].shape[self.dims[m].dim]}"
                 for m in group]
        return f"these dims must be equal (they meet in the graph) but the call has {', '.join(parts)}"

    def combinations(self) -> list[list[int]]:
        """Every gear as per-marked-dim sizes, smallest first."""
        if self.policy == "zip":
            return [[d.sizes[i] for d in self.dims] for i in range(len(self.dims[0].sizes))]
        combos = []
        for choice in itertools.product(*[self.dims[g[0]].sizes for g in self.groups]):
            sizes = [0] * len(self.dims)
            for g, s in zip(self.groups, choice):
                for m in g:
                    sizes[m] = s
            combos.append(sizes)
        return combos

    def gear_calls(self, call: MarkedCall) -> list[GearCall]:
        """``call`` at every gear (:meth:`combinations`' order): each marked dim narrowed to the gear's size where it
        is larger, padded up where it is smaller."""
        gears = []
        for sizes in self.combinations():
            leaves = self.pad(narrowed(call.leaves, self.dims, sizes), sizes)
            key = signature.rekey(call.key, leaves, call.leaves)
            gears.append(GearCall(sizes, leaves, key, *signature.unflatten(key[0], leaves)))
        return gears

    def to_json(self) -> dict[str, Any]:
        return {"dims": [dataclasses.asdict(d) for d in self.dims], "groups": self.groups, "policy": self.policy,
                "cuts": {str(k): [list(c) for c in v] for k, v in self.cuts.items()}, "lockstep": self.lockstep,
                "padding": self.padding.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any], past_largest: str) -> "GearPlan":
        return cls([MarkedDim(**d) for d in data["dims"]], data["groups"], data["policy"], data["cuts"], past_largest,
                   data["lockstep"], PaddingReport.from_json(data["padding"]))


# ------------------------------------------------------------------------------------------------ plan building
def find_marks(leaves: tuple[Any, ...], names: dict[int, str], by_name: dict[str, dict[int, list[int]]],
               pad_values: dict[str, PadValue]) -> list[MarkedDim]:
    """The marked dims of a call: ``set_dim_gears`` marks on its tensors, then config gears by argument name; each
    with the pad value the user gave (``set_dim_gears``'s, else ``pad_values[name]``), None where none was given."""
    marks: list[MarkedDim] = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        name = names.get(i, f"input {i}")
        gears = getattr(leaf, GEARS_ATTR, None)
        pad = getattr(leaf, PAD_ATTR, None)
        if gears is None and name in by_name and not getattr(leaf, STATIC_ATTR, False):
            gears = {}
            for dim, sizes in by_name[name].items():
                if not -leaf.dim() <= dim < leaf.dim():
                    raise ConfigError(f"inference_config.dim_gears[{name!r}]: dim {dim} is out of range for "
                                      f"argument {name} of shape {list(leaf.shape)}")
                gears[dim % leaf.dim()] = sizes
        if gears:
            value = pad if pad is not None else pad_values.get(name)
            if value is not None:
                value = _exact_pad(value, leaf.dtype, f"inference_config.pad_values[{name!r}]")
            marks.extend(MarkedDim(i, dim, list(sizes), name, value) for dim, sizes in sorted(gears.items()))
    unknown = set(by_name) - set(names.values())
    if unknown:
        raise ConfigError(f"inference_config.dim_gears names {sorted(unknown)}, which are not tensor arguments of the "
                          f"method (its tensor arguments: {sorted(set(names.values()))})")
    return marks


def narrowed(leaves: tuple[Any, ...], dims: list[MarkedDim], sizes: Any) -> tuple[Any, ...]:
    """``leaves`` with each marked dim cut down to ``sizes`` where it is larger (copies with a fresh tensor's strides,
    as a real call's inputs and padded copies have: a strided view would key another entry, and so would
    ``.contiguous()``'s, which keeps a size-1 dim's old stride; padding is separate)."""
    new = list(leaves)
    cut = set()
    for d, s in zip(dims, sizes):
        if new[d.leaf].shape[d.dim] > s:
            new[d.leaf] = new[d.leaf].narrow(d.dim, 0, s)
            cut.add(d.leaf)
    for leaf in cut:
        t = new[leaf]
        new[leaf] = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return tuple(new)


def has_marks(leaves: tuple[Any, ...]) -> bool:
    """Whether a call's tensors carry ``set_dim_gears`` marks (checked on a miss, not on every call)."""
    return any(isinstance(leaf, torch.Tensor) and getattr(leaf, GEARS_ATTR, None) for leaf in leaves)


def check_marks(marks: list[MarkedDim], policy: str) -> None:
    """Errors that need no trace: under ``zip`` every marked dim needs as many sizes."""
    if policy == "zip" and len({len(m.sizes) for m in marks}) != 1:
        listing = ", ".join(f"{m.name} dim {m.dim}: {m.sizes}" for m in marks)
        raise ConfigError(f"dynamic_gears_merge_policy='zip' pairs the i-th sizes of every marked dim, so every list "
                          f"must have the same length; got {listing}. Fix: give every dim as many sizes, or use "
                          f"'product'")


def build_plan(marks: list[MarkedDim], policy: str, past_largest: str, symbols: list[str],
               output_dims: dict[int, list[tuple[int, str]]], padding: PaddingReport | None = None) -> GearPlan:
    """Group marked dims by their symbol in a symbolic trace; map output dims equal to a symbol to cuts.

    ``symbols[m]``: the symbol of marked dim m; ``output_dims[j]``: for method output leaf j, ``(dim, symbol)`` for
    each of its dims whose size is exactly one symbol; ``padding``: the padding analysis, whose ``meets`` (marked
    dims that meet in an op the trace did not unify them in) join their symbols and whose ``pad_values`` the plan
    pads with.
    """
    check_marks(marks, policy)
    if padding is not None:             # the pad values the analysis proved exact (the user's, or chosen)
        marks = [dataclasses.replace(m, pad_value=padding.pad_values.get(m.leaf, m.pad_value)) for m in marks]
    joined = _joined(padding.meets if padding is not None else [])
    symbols = [joined.get(s, s) for s in symbols]
    output_dims = {j: [(dim, joined.get(s, s)) for dim, s in dims] for j, dims in output_dims.items()}
    by_symbol: dict[str, list[int]] = {}
    for m, sym in enumerate(symbols):
        by_symbol.setdefault(sym, []).append(m)
    lockstep = [g for g in by_symbol.values() if len(g) > 1] if policy == "zip" else []
    if policy == "zip":
        groups = [list(range(len(marks)))]
    else:
        groups = list(by_symbol.values())
        for g in groups:
            if len({tuple(marks[m].sizes) for m in g}) != 1:
                listing = ", ".join(f"{marks[m].name} dim {marks[m].dim}: {marks[m].sizes}" for m in g)
                raise ConfigError(f"these dims meet in the graph and must move together, so they need the same "
                                  f"gears; got {listing}")
        count = math.prod(len(marks[g[0]].sizes) for g in groups)
        if count > MAX_COMBINATIONS_BEFORE_WARNING:
            warnings.warn(f"gearcache: the product policy forms {count} gear combinations; each is compiled on first "
                          f"use (or by warmup())", stacklevel=3)
    first_of_symbol: dict[str, int] = {}
    for m, sym in enumerate(symbols):
        first_of_symbol.setdefault(sym, m)
    cuts = {j: [[dim, first_of_symbol[sym]] for dim, sym in dims if sym in first_of_symbol]
            for j, dims in output_dims.items()}
    return GearPlan(marks, groups, policy, {j: c for j, c in cuts.items() if c}, past_largest, lockstep, padding)


def _joined(meets: list[list[str]]) -> dict[str, str]:
    """symbol -> one representative symbol, for symbols joined by ``meets`` pairs."""
    return joined_classes([(a, b) for a, b in meets])


def joined_classes(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """x -> the representative of its class (the least by ``str``), for every x in ``pairs``, the classes being those
    the pairs join (a union-find: the symbols two marked dims that meet share)."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for a, b in pairs:
        low, high = sorted((find(a), find(b)), key=str)
        parent.setdefault(low, low)
        if low != high:
            parent[high] = low
    return {x: find(x) for x in parent}


@dataclasses.dataclass
class SymbolicTrace:
    """What the gear plan's symbolic trace found (``compiling.symbolic_trace.symbolic_shapes``): the padding analysis's
    input."""
    symbols: list[str]                          # the symbol of each marked dim (dims that meet share one)
    output_dims: dict[int, list[tuple[int, str]]]   # method output leaf -> (dim, symbol) for dims equal to a symbol
    dependencies: list[dict[str, Any]]          # the traced user functions
    plan_guards: GuardSet          # the trace's value guards (keys/guard_sets.py)
    graph: torch.fx.GraphModule                 # the Dynamo graph, its marked dims SymInts (gearcache/gears/padding.py)
    inputs: list[list[Any]]                          # per graph input: ["leaf", i], ["state", name] or ["size"]
    outputs: dict[int, int]                     # graph output index -> method output leaf
    size_guards: list[tuple[Any, str]]          # the trace's size guards: (sympy expression, user source line)
    same: dict[Any, Any]                        # symbol -> the symbol a guard says it equals (size_classes)
