"""Padding rules for reductions, ops along one dim and norms: exact over a padded dim only with a neutral pad.

A reduction over a padded dim is exact when its input's pad is neutral for it (pad_values.REDUCTIONS): ``0`` before
``sum``, ``1`` before ``prod``, ``+inf`` (an integer dtype's largest value) before ``min``/``amin``/``argmin``,
``-inf`` (the smallest) before ``max``/``amax``/``argmax``/``logsumexp``; positions (``argmax``) also need the
padded factor outermost. A softmax along a padded dim is exact with ``-inf`` in its pad; a cumulative op along one
is exact (the padding comes after every real row) unless its padded factor is not the outermost; ``mean``, ``var``,
a median, sort and top-k, and a layer, group or training batch norm over a padded dim never are. The indices ``topk``,
``sort`` and ``argmax`` return along an unpadded dim of size n are integers in ``[0, n)`` in the pad region too
(``InRange``): a valid index into a dim of at least n (a mixture of experts' routing reads its experts' weights so).
Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from . import pad_values as pv
from .pad_values import UNKNOWN
from .padding_abstract import NO_PAD, InRange, Pad, TensorValue
from .padding_factors import Dim, canonical, is_padded_dim
from .padding_rule_context import (MIXES, MOVES, Out, Rule, RuleContext, any_padded, dim_list, needs_neutral, norm_dim,
                                   op_name)


NEVER_NEUTRAL = {"mean": "a mean divides by the padded count", "var": "a variance counts the padded rows",
                 "var_mean": "a variance counts the padded rows", "std": "a deviation counts the padded rows",
                 "std_mean": "a deviation counts the padded rows", "median": "a median ranks the padded rows",
                 "nanmedian": "a median ranks the padded rows", "mode": "a mode counts the padded rows",
                 "kthvalue": "a k-th value ranks the padded rows", "aminmax": "no one pad is neutral for min and max"}


WITH_INDICES = {"max", "min", "median", "nanmedian", "mode", "kthvalue"}
"""Reductions whose second output is the indices of the first (``max(dim)``); ``aminmax``'s and ``var_mean``'s is a
value (a maximum, a mean), not a position in ``[0, n)``."""


def _reduce(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Any:
    """Reductions (sum, mean, amax, var, argmax, norm, ...): exact over a padded dim when the pad is neutral for the
    op (pad_values.REDUCTIONS); a mean or variance never is. Positions (argmax, ``max(dim)``'s indices) are exact
    when the padded factor is the outermost of the dims reduced."""
    x = args["self"]
    src = x.dims
    reduced = dim_list(args.get("dim"), len(src)) if "dim" in args else list(range(len(src)))
    name = op_name(node)
    why = _reduction_why(a, node, x, name) if any_padded(src, reduced) else None
    factors = [f for k in sorted(reduced) for f in canonical(src[k])]
    moved = ("returns positions along dims whose padded factor is not the outermost (the real rows' positions move "
             "with the padded size)", MOVES) if any(not isinstance(f, int) for f in factors[1:]) else None
    meta = node.meta["val"]
    metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
    outs = []
    for k, m in enumerate(metas):
        keep = m.dim() == len(src)
        dims = tuple(() if i in reduced else d for i, d in enumerate(src)) if keep else tuple(
            d for i, d in enumerate(src) if i not in reduced)
        positions = name in ("argmin", "argmax") or (k == 1 and name in WITH_INDICES)
        pad = _indices_pad(node, reduced) if positions else _reduced_pad(a.pad(x), name, m.dtype)
        outs.append((dims, (why or moved) if positions else why, pad))
    return outs if isinstance(meta, (list, tuple)) else outs[0]


def _reduction_why(a: RuleContext, node: torch.fx.Node, x: TensorValue, name: str) -> Any:
    """Why a reduction over a padded dim of ``x`` is not exact (None when its pad is neutral for it)."""
    kind = pv.REDUCTIONS.get(name)
    if name == "linalg_vector_norm":
        order = node.kwargs.get("ord", node.args[1] if len(node.args) > 1 else 2)
        kind = "zero" if isinstance(order, (int, float)) and order >= 0 else None
    if kind is None:
        reason = NEVER_NEUTRAL.get(name, "no pad value is known to leave it unchanged")
        return f"reduces over a padded dim ({name}: {reason})", MIXES
    return needs_neutral(a, x, kind, f"takes the {name}")


def _reduced_pad(p: Pad, name: str, dtype: torch.dtype) -> Pad:
    """The pad of a reduction's output: each element of its pad region reduces padded elements only."""
    v = p.value
    infinite = isinstance(v, float) and math.isinf(v)
    if v is UNKNOWN or not (name in ("amin", "amax", "min", "max", "any", "all") or (
            name in ("sum", "nansum", "mean") and (infinite or v == 0)) or (name == "logsumexp" and infinite) or (
            name == "prod" and not isinstance(v, bool) and v in (0, 1))):
        return Pad(UNKNOWN, p.leaves)
    return Pad(pv.convert(v, dtype), p.leaves)


CUMULATIVE = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}


def _along(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Any:
    """Ops along one dim with the same shape out: a softmax along a padded dim is exact with ``-inf`` in its pad; a
    cumulative op along one is exact (the padding comes after every real row) unless its padded factor is not the
    outermost; sort and top-k along one mix."""
    x = args["self"]
    src = x.dims
    dim = norm_dim(args.get("dim", -1) if args.get("dim") is not None else -1, len(src))
    name = op_name(node)
    why, pad = None, NO_PAD
    if dim < len(src) and is_padded_dim(src[dim]):
        if name in pv.SOFTMAX:
            why = needs_neutral(a, x, "bottom", f"takes a {name.strip('_')}")
            if why is None and sum(map(is_padded_dim, src)) == 1:    # exp(-inf) = 0 in the pad region
                pad = Pad(-math.inf if "log" in name else 0.0, a.pad(x).leaves)
        elif name in CUMULATIVE:
            if any(not isinstance(f, int) for f in canonical(src[dim])[1:]):
                why = ("works along a dim that merges a padded dim inside others (padding rows come before real "
                       "ones there)", MIXES)
        else:
            why = ("sorts or ranks along a padded dim", MIXES)
    meta = node.meta["val"]
    metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
    indices = _indices_pad(node, [dim]) if name in ("sort", "topk", "argsort") else NO_PAD
    outs = [(src[:dim] + (a.dims_of(m.shape)[dim],) + src[dim + 1:] if m.dim() == len(src) else None, why,
             indices if k == 1 or name == "argsort" else pad) for k, m in enumerate(metas)]
    return outs if isinstance(meta, (list, tuple)) else outs[0]


def _indices_pad(node: torch.fx.Node, dims: list[int]) -> Pad:
    """The pad of indices an op returns along ``dims`` of its input (``topk``, ``sort``, ``argmax``): integers in
    ``[0, n)`` whatever the data, ``n`` the size of that one dim when it is a number (an unpadded dim); else
    unknown."""
    source = node.args[0] if node.args else None
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if len(dims) != 1 or not isinstance(value, torch.Tensor) or dims[0] >= value.dim():
        return NO_PAD
    size = value.shape[dims[0]]
    return Pad(InRange(0, size)) if isinstance(size, int) and size > 0 else NO_PAD


def _normalise(src: tuple[Dim, ...], reduced: list[int]) -> Any:
    """Why normalising over the ``reduced`` dims of ``src`` mixes (None when none of them is padded)."""
    return ("normalises over a padded dim (its mean and variance count the padded rows)", MIXES) \
        if any_padded(src, reduced) else None


def _layer_norm(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> list[Out]:
    """native_layer_norm (and the fused RMS norm): over the last dims; its statistics keep the others."""
    src = args["input"].dims
    reduced = list(range(len(src) - len(args["normalized_shape"]), len(src)))
    why = _normalise(src, reduced)
    stats = tuple(() if k in reduced else d for k, d in enumerate(src))
    return [(src, why)] + [(stats, why)] * (len(node.meta["val"]) - 1)


def _group_norm(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> list[Out]:
    """native_group_norm: over every dim but the batch; its statistics are [batch, groups]."""
    src = args["input"].dims
    why = _normalise(src, list(range(1, len(src))))
    return [(src, why)] + [((src[0],) + a.dims_of(m.shape)[1:], why) for m in list(node.meta["val"])[1:]]


def _batch_norm(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> list[Out]:
    """Batch norm: per channel from running statistics (nothing mixed), or from the batch's (training)."""
    src = args["input"].dims
    name = op_name(node)
    training = name != "_native_batch_norm_legit_no_training" and bool(args.get("training"))
    why = _normalise(src, [k for k in range(len(src)) if k != 1] if training else [])
    return [(src, why)] + [(None, why)] * (len(node.meta["val"]) - 1)


RULES: dict[str, Rule] = {
    **dict.fromkeys(["sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "var_mean",
                     "std", "std_mean", "any", "all", "logsumexp", "linalg_vector_norm", "norm", "nansum",
                     "count_nonzero", "median", "nanmedian", "mode", "kthvalue", "aminmax"], _reduce),
    **dict.fromkeys(["_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "cumsum", "cumprod",
                     "logcumsumexp", "cummax", "cummin", "sort", "argsort", "topk"], _along),
    "native_layer_norm": _layer_norm, "_fused_rms_norm": _layer_norm, "native_group_norm": _group_norm,
    **dict.fromkeys(["_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm"],
                    _batch_norm),
}
"""Reductions, ops along one dim and norms, by ATen name."""
