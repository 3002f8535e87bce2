"""What a padding rule sees and returns: the contract every rule of the table (padding_rules.py) keeps.

A rule is ``rule(context, node, args) -> Out`` for one ATen op: ``context`` a :class:`RuleContext` (the walk's view of
the values so far: padding_walk.GraphWalk is one), ``node`` the op's FX node (its ``meta["val"]`` the fake output),
``args`` its arguments by schema name, each an abstract value (padding_abstract.py: a ``TensorValue``, a
``SizeValue``, a list of them) or the constant itself. It returns ``(dims, why[, pad])`` for the op's output, or a
list of such tuples for an op with several outputs:

* ``dims``: one Dim (padding_factors.py) per output dim, or None to take them from the node's shape (the walk then
  trusts nothing: a rule whose dims do not match the shape makes the output dirty);
* ``why``: None, or ``(reason, positional[, pads])`` when the op itself may make the output's real rows differ from
  eager's: ``positional`` is :data:`MOVES` (the op moves rows: a write through such a view lands elsewhere) or
  :data:`MIXES`; ``pads`` the padded leaves whose pad values could make it exact (the pad value search varies them);
* ``pad``: what the output's pad region holds (``NO_PAD`` when omitted).

A rule reads and never changes the walk's state, except :meth:`RuleContext.adopt` and :meth:`RuleContext.aligned`
(two marked dims met). Also here: the helpers rules of several families share.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .._torch import aten as torch_aten
from . import pad_values as pv
from .padding_abstract import (NO_PAD, REAL_ROW_COPIES, AbstractValue, Gathered, Held, InRange, Pad, Positions,
                               SizeValue, TensorValue, describe_held)
from .padding_factors import Dim, is_padded_dim

Out = tuple[Any, ...]
"""A rule's result: ``(dims, why[, pad])`` (see the module docstring)."""
MOVES, MIXES = True, False
"""A ``why``'s ``positional``: the op moves rows (MOVES) or mixes them in place (MIXES)."""


class RuleContext(Protocol):
    """The padding walk as a rule sees it."""

    def pad(self, t: TensorValue) -> Pad:
        """What ``t``'s pad region holds now (writes to its storage since it was made included)."""

    def constant(self, t: TensorValue) -> Held:
        """The value every element of ``t`` holds (a fill never written since), else UNKNOWN."""

    def writes(self, t: TensorValue) -> int:
        """How many writes ``t``'s storage has had."""

    def bound(self, dim: Dim) -> int | None:
        """The largest gear of a dim that is one marked dim's symbol; None if unknown."""

    def aligned(self, x: Dim, y: Dim) -> bool:
        """Whether two dims hold their padded rows in line (two different marked dims meet here)."""

    def adopt(self, target: TensorValue, src: TensorValue) -> None:
        """A fresh, never written ``target`` about to be filled whole by ``src`` takes ``src``'s dims."""

    def dims_of(self, shape: Any) -> tuple[Dim, ...]:
        """The dims of a (fake) shape, every symbolic size taken as padded."""

    def size_of(self, value: Any) -> Any:
        """A size as an int or a sympy expression (padding_factors.size_expr)."""

    def value_of(self, node: torch.fx.Node) -> AbstractValue:
        """The abstract value of a node already walked (None if none)."""

    def cache_attention(self, node: torch.fx.Node, reads: list[TensorValue], is_causal: bool) -> bool:
        """Whether an attention reading ``reads`` is exact as far as a KV cache goes (padding_cache.py)."""


Rule = Callable[[RuleContext, torch.fx.Node, dict[str, Any]], Any]
"""A padding rule: ``(context, node, args) -> Out`` or a list of ``Out`` (see the module docstring)."""




def op_name(node: torch.fx.Node) -> str:
    """The name of the ATen op ``node`` calls, without its overload (``"add"``, ``"index_put_"``)."""
    name: str = torch_aten.aten_op(node).overloadpacket.__name__
    return name


def meta_dims(a: RuleContext, node: torch.fx.Node, k: int | None = None) -> tuple[Dim, ...]:
    """The dims of the node's (fake) output, or of its ``k``-th output: every symbolic size taken as padded."""
    meta: Any = node.meta.get("val")
    if k is not None:
        meta = meta[k]
    return a.dims_of(meta.shape)


def meta_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype of the node's (fake) output (float32 for a non-tensor one)."""
    meta = node.meta.get("val")
    return meta.dtype if isinstance(meta, torch.Tensor) else torch.float32


def norm_dim(d: int, rank: int) -> int:
    """A dim index made non-negative for a tensor of ``rank`` dims."""
    return d + rank if d < 0 else d


def dim_list(dim: Any, rank: int) -> list[int]:
    """A ``dim`` argument as a list of non-negative dims; None or [] means every dim."""
    if dim is None or dim == []:
        return list(range(rank))
    dims = dim if isinstance(dim, list) else [dim]
    return [norm_dim(int(d), rank) for d in dims]


def any_padded(dims: tuple[Dim, ...], which: list[int]) -> bool:
    """Whether any of the dims at indices ``which`` is padded."""
    return any(is_padded_dim(dims[d]) for d in which if d < len(dims))


def sizes_used_as_values(values: list[Any]) -> bool:
    """Whether any of ``values`` (nested lists included) is a size that involves a marked dim."""
    return any(isinstance(v, SizeValue) and v.padded for v in values) or any(
        sizes_used_as_values(v) for v in values if isinstance(v, list))


def needs_neutral(a: RuleContext, t: TensorValue, kind: str, what: str) -> Any:
    """Why ``what`` over a padded dim of ``t`` is not exact (None when ``t``'s pad is neutral for ``kind``)."""
    p = a.pad(t)
    if pv.is_neutral(kind, p.value, t.dtype):
        return None
    return (f"{what} over a padded dim: exact only if its padded rows hold {pv.describe(pv.neutral(kind, t.dtype))}, "
            f"but they hold {describe_held(p.value)}", MIXES, p.leaves)


def invalid_index(a: RuleContext, index: Any, size: Any, negative: bool) -> Any:
    """Why reading positions from ``index``'s pad region could go out of range (None when its pad is a valid
    position into a dim of ``size``; ``negative``: the op takes positions from the end too)."""
    if not isinstance(index, TensorValue) or not any(is_padded_dim(d) for d in index.dims):
        return None
    if index.dtype in (torch.bool, torch.uint8):
        return ("indexes with a padded mask (the padded rows choose elements too)", MOVES)
    p = a.pad(index)
    v = p.value
    low = -size if negative and isinstance(size, int) else (-1 if negative else 0)
    high = size if isinstance(size, int) else 1
    if isinstance(v, int) and not isinstance(v, bool) and low <= v < high:
        return None
    if isinstance(v, Positions) and v.bound is not None and low <= v.start and v.start + v.bound <= high:
        return None
    if v is REAL_ROW_COPIES:                  # the real rows' positions again: valid where eager's are
        return None
    if isinstance(v, InRange) and isinstance(size, int) and low <= v.low and v.high <= size:
        return None                           # topk's / argmax's indices along a dim no larger than this one
    return (f"reads positions from padded rows that hold {describe_held(v)}, which is not a valid position (0 to "
            f"{size if isinstance(size, int) else 'its size'} - 1)", MOVES, p.leaves)


def broadcast_dims(a: RuleContext, node: torch.fx.Node, tensors: list[TensorValue]) -> Out:
    """Dims of a broadcasting op's output, and whether its operands hold padded rows in line."""
    meta = node.meta.get("val")
    rank = meta.dim() if isinstance(meta, torch.Tensor) else max((len(t.dims) for t in tensors), default=0)
    out, why = [], None
    for k in range(rank):
        dims = [t.dims[len(t.dims) - rank + k] for t in tensors if len(t.dims) - rank + k >= 0]
        dims = [d for d in dims if d != ()]
        if dims and not all(a.aligned(dims[0], d) for d in dims[1:]):
            why = ("combines tensors whose padded rows do not line up", MOVES)
        out.append(dims[0] if dims else ())
    return tuple(out), why


def view_pad(a: RuleContext, t: TensorValue) -> Pad:
    """The pad of a view of ``t`` (or of an op that moves its elements along unpadded dims): ``t``'s, but values
    gathered along a dim (``Gathered``, which names that dim) are not followed through it."""
    p = a.pad(t)
    return NO_PAD if isinstance(p.value, Gathered) else p
