"""Padding rules for views and ops that move rows: which rows stay real when a tensor is reshaped or rearranged.

Views (``view``, ``permute``, ``expand``, ``slice``, ``split`` of unpadded dims, ...) keep padded rows in line when
the factors regroup (padding_factors.regroup); else they *move* rows (a write through such a view lands elsewhere
than eager's). ``x[:1]`` and ``select(0)`` of a padded dim keep the first row, which is real in every call. ``cat``
of equal padded blocks gives a dim ``(blocks, s)``, rows in line inside each; ``flip``, ``roll``, ``repeat`` and
``constant_pad_nd`` along a padded dim, ``squeeze`` of one, a slice to a fixed size move rows. A view's pad is its
source's (values gathered along a dim are not followed through it). Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

from typing import Any

import torch

from . import pad_values as pv
from .pad_values import UNKNOWN
from .padding_abstract import NO_PAD, REAL_ROW_COPIES, Pad, TensorValue, constant_pad, covers
from .padding_factors import Dim, canonical, dim_size, is_padded_dim, regroup
from .padding_rule_context import (MOVES, Out, Rule, RuleContext, any_padded, dim_list, meta_dims, norm_dim,
                                   op_name, sizes_used_as_values, view_pad)


def _view(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """view, reshape: the factors regrouped into the new sizes (padding_factors.regroup): rows in line; a padded
    factor that would be split moves rows. Pad: the source's."""
    sizes = [a.size_of(s) for s in node.meta["val"].shape]
    dims = regroup(args["self"].dims, sizes)
    if dims is None:
        return None, ("reshapes a padded dim so that its rows no longer line up", MOVES)
    return dims, None, view_pad(a, args["self"])


def _expand(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """expand: the source's dims where it has them; new or size-1 dims spread over a padded size repeat real rows
    (pad: copies of real rows) or, for a source with a padded dim of its own, an unknown pad."""
    src, out = args["self"].dims, list(meta_dims(a, node))
    lead = len(out) - len(src)
    spread = any(is_padded_dim(out[k]) for k in range(lead)) or any(
        d == () and is_padded_dim(out[lead + k]) for k, d in enumerate(src))
    for k, d in enumerate(src):
        if d != ():
            out[lead + k] = d
    if spread and not any(map(is_padded_dim, src)):      # real rows repeated over the padded dims
        return tuple(out), None, Pad(REAL_ROW_COPIES, frozenset(), False)
    return tuple(out), None, Pad(UNKNOWN, frozenset(), False) if spread else view_pad(a, args["self"])


def _permute(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """permute: the dims reordered, rows in line. Pad: the source's."""
    src = args["self"].dims
    return tuple(src[norm_dim(d, len(src))] for d in args["dims"]), None, view_pad(a, args["self"])


def _transpose(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """transpose, t: two dims swapped, rows in line. Pad: the source's."""
    src = list(args["self"].dims)
    if len(src) < 2:
        return tuple(src), None, view_pad(a, args["self"])
    i, j = (norm_dim(args["dim0"], len(src)), norm_dim(args["dim1"], len(src))) if "dim0" in args else (0, 1)
    src[i], src[j] = src[j], src[i]
    return tuple(src), None, view_pad(a, args["self"])


def _unsqueeze(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """unsqueeze: a size-1 dim inserted, rows in line. Pad: the source's."""
    src = list(args["self"].dims)
    src.insert(norm_dim(args["dim"], len(src) + 1), ())
    return tuple(src), None, view_pad(a, args["self"])


def _squeeze(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """squeeze: size-1 dims removed; naming a padded dim moves rows (a real size of 1 would remove it)."""
    src = args["self"].dims
    named = dim_list(args.get("dim"), len(src))
    if any_padded(src, named):
        return None, ("squeezes a padded dim, which a real size of 1 would remove", MOVES)
    return tuple(d for k, d in enumerate(src) if not (k in named and d == ())), None, view_pad(a, args["self"])


def _slice(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """slice: along an unpadded dim, or along a padded one to a size that is still padded, the sliced dim takes the
    output's size; ``x[:1]`` keeps the first (always real) row; a fixed-size slice of a padded dim, a slice of a dim
    that merges a padded factor with others, or a start or step that moves with a padded size moves rows. Pad: the
    source's."""
    src = list(args["self"].dims)
    dim = norm_dim(args["dim"], len(src))
    out = list(meta_dims(a, node))
    if sizes_used_as_values([args.get("start"), args.get("step")]):
        return None, ("slices from a position that moves with the size of a padded dim", MOVES)
    if is_padded_dim(src[dim]) and args.get("start") in (0, None) and out[dim] == ():    # x[:1]: the first row is real
        return tuple(src[:dim] + [()] + src[dim + 1:]), None, view_pad(a, args["self"])
    if is_padded_dim(src[dim]) and len(canonical(src[dim])) > 1:
        return None, ("slices a dim that merges a padded dim with others", MOVES)
    if is_padded_dim(src[dim]) and not is_padded_dim(out[dim]):
        return None, ("slices a padded dim to a fixed size, which may take padding rows in", MOVES)
    return tuple(src[:dim] + [out[dim]] + src[dim + 1:]), None, view_pad(a, args["self"])


def _select(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """select: a row of an unpadded dim, or row 0 of a padded one (always real); any other row of a padded dim
    moves with the padding. Pad: the source's."""
    src = list(args["self"].dims)
    dim = norm_dim(args["dim"], len(src))
    index = args.get("index")
    if is_padded_dim(src[dim]) and not (isinstance(index, int) and index == 0 and len(canonical(src[dim])) == 1):
        return None, ("selects a row of a padded dim other than the first (the last real row moves with the "
                      "padding)", MOVES)
    return tuple(src[:dim] + src[dim + 1:]), None, view_pad(a, args["self"])


def _split(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> list[Out]:
    """split, chunk, unbind, ...: pieces of an unpadded dim keep rows in line; splitting a padded dim moves rows.
    One output per piece, each with the source's pad."""
    src = list(args["self"].dims)
    dim = norm_dim(args.get("dim", 0) or 0, len(src))
    metas = node.meta["val"]
    why = ("splits a padded dim into pieces", MOVES) if is_padded_dim(src[dim]) else None
    unbind = op_name(node) == "unbind"
    pad = view_pad(a, args["self"])
    return [((tuple(src[:dim] + src[dim + 1:]) if unbind else
              tuple(src[:dim] + [a.dims_of(m.shape)[dim]] + src[dim + 1:])) if why is None else None, why, pad)
            for m in metas]


def _cat(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """cat, stack: tensors whose padded rows line up; equal padded blocks along the concatenated dim become one dim
    ``(blocks, s)`` (rows in line inside each block), unequal ones move rows. Pad: their common pad
    (:func:`_common_pad`)."""
    tensors = [t for t in args["tensors"] if isinstance(t, TensorValue)]
    rank = node.meta["val"].dim()
    stack = op_name(node) == "stack"
    dim = norm_dim(args.get("dim", 0) or 0, rank)
    tensors = [t for t in tensors if len(t.dims) == rank - (1 if stack else 0)]
    along = [t.dims[dim] for t in tensors if dim_size(t.dims[dim]) != 0] if not stack else []
    blocks = len(along) > 1 and any(map(is_padded_dim, along))
    if blocks and not all(a.aligned(along[0], d) for d in along[1:]):
        return None, ("concatenates along a padded dim (padding rows end up between real ones)", MOVES)
    others = [list(t.dims) for t in tensors]
    out = list(meta_dims(a, node))
    if blocks:                          # equal padded blocks one after another: dim ``(blocks, dim)``, rows in line
        out[dim] = (len(along),) + along[0]
    why = None
    for k in range(rank):
        if k == dim:
            continue
        src_k = k - 1 if stack and k > dim else k
        dims = [o[src_k] for o in others if o[src_k] != ()]
        if dims and not all(a.aligned(dims[0], d) for d in dims[1:]):
            why = ("concatenates tensors whose padded rows do not line up", MOVES)
        if dims:
            out[k] = dims[0]
    return tuple(out), why, _common_pad(a, tensors, tuple(t for k, t in enumerate(out) if not (stack and k == dim)))


def _common_pad(a: RuleContext, tensors: list[TensorValue], dims: tuple[Dim, ...]) -> Pad:
    """The pad of tensors put side by side (cat, stack): theirs when each covers the padded ``dims`` and all hold
    one value."""
    pads = [a.pad(t) for t in tensors]
    if not pads or not all(covers(t.dims, dims) for t in tensors) or any(p.value is UNKNOWN for p in pads):
        return NO_PAD
    if not all(pv.same(p.value, pads[0].value) and t.dtype == tensors[0].dtype for p, t in zip(pads, tensors)):
        return NO_PAD
    return Pad(pads[0].value, frozenset().union(*(p.leaves for p in pads)))


def _along_dims(kind: str) -> Rule:
    """flip, roll, repeat, constant_pad_nd: mixing if they act on a padded dim."""
    def rule(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
        src = args["self"].dims
        rank = len(src)
        if kind == "dims":
            acted = dim_list(args.get("dims"), rank)
        elif kind == "pad":
            pad = args["pad"]
            acted = [rank - 1 - k // 2 for k in range(len(pad)) if not (isinstance(pad[k], int) and pad[k] == 0)]
        else:           # repeat: leading new dims, then one factor per dim
            reps = args["repeats"]
            lead = len(reps) - rank
            acted = [k for k in range(rank) if not (isinstance(reps[lead + k], int) and reps[lead + k] == 1)]
        if any_padded(src, acted):
            return None, ("moves rows along a padded dim (flip, roll, repeat or pad)", MOVES)
        out = list(meta_dims(a, node))
        lead = len(out) - rank
        for k, d in enumerate(src):
            if k not in acted:
                out[lead + k] = d
        p = view_pad(a, args["self"])
        if kind == "pad" and acted:         # the new border of a padded row holds the border value
            p = p if pv.same(constant_pad(args.get("value", 0), args["self"].dtype).value, p.value) else NO_PAD
        return tuple(out), None, p
    return rule


RULES: dict[str, Rule] = {
    **dict.fromkeys(["view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy"], _view),
    "expand": _expand, "permute": _permute, "transpose": _transpose, "t": _transpose, "unsqueeze": _unsqueeze,
    "squeeze": _squeeze, "slice": _slice, "select": _select,
    **dict.fromkeys(["split", "split_with_sizes", "unbind", "chunk", "tensor_split", "unsafe_split",
                     "unsafe_split_with_sizes"], _split),
    **dict.fromkeys(["cat", "stack"], _cat),
    **dict.fromkeys(["flip", "roll"], _along_dims("dims")), "constant_pad_nd": _along_dims("pad"),
    "repeat": _along_dims("repeat"),
}
"""Views, concatenation and ops that move rows, by ATen name."""
