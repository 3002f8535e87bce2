"""Padding rules for collectives (``_c10d_functional``): every rank pads alike, so rows stay in line per rank block.

``all_reduce`` and ``broadcast`` combine the same element on every rank: rows in line, pad unknown.
``all_gather_into_tensor`` makes dim 0 ``(ranks, dim 0)``: each rank's rows in line inside its block.
``reduce_scatter_tensor`` and ``all_to_all_single`` (equal splits) are exact when dim 0's padded factor lies inside
each rank's block (a dim 0 of ``(ranks, s)``), or dim 0 is not padded. Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

from typing import Any

import torch

from .padding_abstract import SizeValue
from .padding_factors import Dim, dim_size, divide, is_padded_dim, regroup, same_size
from .padding_rule_context import MOVES, Out, Rule, RuleContext, meta_dims


def _collective(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """all_reduce, broadcast (``_c10d_functional``): each element combines the same element on every rank, so rows
    stay in line (every rank pads alike: they run one program on calls of one size). What the other ranks' padded
    rows hold is not followed: the output's pad is unknown."""
    return args["input"].dims, None


def _wait(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """wait_tensor: its input as it is, pad included."""
    return args["tensor"].dims, None, a.pad(args["tensor"])


def _rank_blocks(dim: Dim, n: int) -> tuple[Dim, Dim] | None:
    """``dim`` split into ``n`` rank blocks, outer to inner: (the blocks' factor, each block's factors); None when a
    padded factor would be cut across blocks (its rows would move between ranks with the padded size)."""
    if n == 1:
        return (), dim
    size = divide(dim_size(dim), n)
    groups = regroup((dim,), [n, size]) if size is not None else None
    if groups is None or is_padded_dim(groups[0]):
        return None
    return groups[0], groups[1]


def _all_gather(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """all_gather_into_tensor: the ranks' inputs one after another along dim 0: dim 0 becomes ``(ranks, dim 0)``,
    each rank's rows in line inside its block (a view splitting it back keeps them)."""
    src, n = args["input"].dims, int(args["group_size"])
    if not src:
        return None, None
    return (((n,) if n > 1 else ()) + src[0],) + src[1:], None


def _reduce_scatter(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """reduce_scatter_tensor: dim 0 cut into one block per rank, each rank keeping the sum of its block: exact when
    dim 0's padded factor lies inside each block (a dim 0 of ``(ranks, s)``), so real rows stay real rows."""
    src, n = args["input"].dims, int(args["group_size"])
    blocks = _rank_blocks(src[0], n) if src else None
    if blocks is None:
        return None, ("reduce-scatters a padded dim 0 across ranks (each rank's block takes other rows with the "
                      "padded size)", MOVES)
    return (blocks[1],) + src[1:], None


def _all_to_all(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """all_to_all_single: dim 0 cut into one block per rank (equal splits) and the blocks exchanged: exact when dim 0
    is not padded, or its padded factor lies inside each block."""
    src = args["input"].dims
    splits = [a.size_of(s) if not isinstance(s, SizeValue) else None for s in args["input_split_sizes"] or []]
    outs = [a.size_of(s) if not isinstance(s, SizeValue) else None for s in args["output_split_sizes"] or []]
    if not src or not is_padded_dim(src[0]):
        return (meta_dims(a, node)[0],) + src[1:] if src else (), None
    n = len(splits) or len(outs)
    equal = all(s is not None and same_size(s, splits[0]) for s in splits + outs) if splits else not outs
    blocks = _rank_blocks(src[0], n) if equal and n else None
    if blocks is None:
        return None, ("exchanges blocks of a padded dim 0 between ranks whose rows move with the padded size", MOVES)
    return src, None


RULES: dict[str, Rule] = {
    **dict.fromkeys(["all_reduce", "broadcast"], _collective), "wait_tensor": _wait,
    "all_gather_into_tensor": _all_gather, "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
}
"""Functional collectives, by ATen name."""
