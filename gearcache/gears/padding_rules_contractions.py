"""Padding rules for ops that combine rows: matmuls, attention, convolution, pooling and resampling.

A matmul over an unpadded contraction dim keeps rows in line; contracting a padded dim is exact when one operand's
pad is ``0`` and the other's a finite constant (each padded term is then 0). Attention passes batch, head and query
dims through; a padded key dim mixes unless ``is_causal`` with queries padded alike; keys read from a KV cache the
padded rows wrote need the causal mask the walk knows (padding_cache.py). Convolution, pooling and
resampling mix neighbouring rows of every dim past the leading ones. Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

from typing import Any, cast

import torch

from . import pad_values as pv
from .padding_abstract import TensorValue, describe_held, tensors_in
from .padding_factors import Dim, is_padded_dim
from .padding_rule_context import MIXES, MOVES, Out, Rule, RuleContext, any_padded, broadcast_dims, op_name


def _contract(a: RuleContext, pairs: list[tuple[TensorValue, int, TensorValue, int]]) -> Any:
    """Why contracting each ``(x, i, y, j)`` (x's dim i with y's dim j) is not exact: a padded one is, when one
    operand's pad is 0 and the other's a finite constant (each padded term is then 0)."""
    for x, i, y, j in pairs:
        if not (is_padded_dim(x.dims[i]) or is_padded_dim(y.dims[j])):
            continue
        px, py = a.pad(x), a.pad(y)
        if (pv.is_neutral("zero", px.value, x.dtype) and pv.finite(py.value)) or (
                pv.is_neutral("zero", py.value, y.dtype) and pv.finite(px.value)):
            continue
        return (f"contracts over a padded dim (a matmul summing padded rows in): exact only if one operand's padded "
                f"rows hold 0 and the other's a finite number, but they hold {describe_held(px.value)} and "
                f"{describe_held(py.value)}", MIXES, px.leaves | py.leaves)
    return None


def _mm(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """mm, addmm (``self`` is addmm's bias)."""
    x, y = (args["mat1"], args["mat2"]) if "mat1" in args else (args["self"], args["mat2"])
    dims = (x.dims[0], y.dims[1])
    why = _contract(a, [(x, 1, y, 0)])
    bias = args["self"] if "mat1" in args else None
    if isinstance(bias, TensorValue) and why is None:
        _, why = broadcast_dims(a, node, [bias, TensorValue(dims, None, "")])
    return dims, why


def _bmm(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """bmm, baddbmm, addbmm (``self`` is the latter two's bias)."""
    x, y = (args["batch1"], args["batch2"]) if "batch1" in args else (args["self"], args["mat2"])
    why = _contract(a, [(x, 2, y, 1)])
    if why is None and not a.aligned(x.dims[0], y.dims[0]):
        why = ("multiplies batches whose padded rows do not line up", MOVES)
    dims: tuple[Dim, ...] = (x.dims[0] or y.dims[0], x.dims[1], y.dims[2])
    bias = args["self"] if "batch1" in args else None
    if op_name(node) == "addbmm":
        dims, why = (x.dims[1], y.dims[2]), why or _contract(a, [(x, 0, y, 0)])
    if isinstance(bias, TensorValue) and why is None:
        _, why = broadcast_dims(a, node, [bias, TensorValue(dims, None, "")])
    return dims, why


def _mv(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """mv, addmv (``self`` is addmv's bias)."""
    x, v = args["mat"] if "mat" in args else args["self"], args["vec"]
    why = _contract(a, [(x, 1, v, 0)])
    if "mat" in args and why is None:
        _, why = broadcast_dims(a, node, [args["self"], TensorValue((x.dims[0],), None, "")])
    return (x.dims[0],), why


def _dot(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """dot, vdot: a contraction of one dim (see :func:`_contract`)."""
    x, y = tensors_in(list(args.values()))[:2]
    return (), _contract(a, [(x, 0, y, 0)])


def _attention(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Any:
    """``scaled_dot_product_attention`` and its kernels: batch and head dims and the query dim pass through; the key
    dim is summed over (exact with ``is_causal`` when queries and keys are padded alike: a real query never sees a
    later, padded key); the feature dim is contracted."""
    q, k, v = args["query"], args["key"], args["value"]
    mask = args.get("attn_mask", args.get("attn_bias"))
    keys, why = k.dims[-2], None
    causal = bool(args.get("is_causal")) and mask is None and is_padded_dim(keys) and a.aligned(q.dims[-2], keys)
    if is_padded_dim(keys) and not causal:
        why = ("attends over a padded key dim (softmax and sum over padded keys)", MIXES)
    if why is None and not a.cache_attention(node, [k, v], bool(args.get("is_causal"))):
        why = ("attends over the KV cache, whose positions after the real tokens hold the padded rows' keys, with a "
               "mask the proof does not know is causal (not the layer's attention mask argument, is_causal=True, "
               "or no mask)", MIXES)
    why = why or _contract(a, [(q, len(q.dims) - 1, k, len(k.dims) - 1)])
    batch = [q.dims[:-2], k.dims[:-2], v.dims[:-2]]
    if why is None and not all(len(b) == len(batch[0]) and all(a.aligned(x, y) for x, y in zip(b, batch[0]))
                               for b in batch[1:]):
        why = ("attends across batch or head dims whose padded rows do not line up", MOVES)
    if why is None and isinstance(mask, TensorValue):
        _, why = broadcast_dims(a, node, [mask, TensorValue(q.dims[:-1] + (keys,), None, "")])
    out = (q.dims[:-1] + (v.dims[-1],), why)
    meta = node.meta["val"]
    if not isinstance(meta, (list, tuple)):
        return out
    extra = []            # the kernels' other outputs: log-sum-exp per query ([..., L]), seeds, sizes
    for m in meta[1:]:
        per_query = isinstance(m, torch.Tensor) and m.dim() == len(q.dims) - 1
        extra.append((q.dims[:-1] if per_query else None, why))
    return [out] + extra


def _spatial(leading: int) -> Rule:
    """Convolution, pooling, upsampling: the first ``leading`` dims pass through (batch, and channels where the op
    keeps them apart); the others are mixed."""
    def rule(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Any:
        x = cast(TensorValue, args.get("input", args.get("self")))
        others = [t for t in tensors_in(list(args.values())) if t is not x]
        why = ("mixes neighbouring rows of a padded dim (convolution, pooling or resampling)", MIXES) if (
            any_padded(x.dims, list(range(leading, len(x.dims)))) or any(
                is_padded_dim(d) for t in others for d in t.dims)) else None
        meta = node.meta["val"]
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        outs = [(x.dims[:leading] + a.dims_of(m.shape)[leading:] if m.dim() == len(x.dims) else None, why)
                for m in metas]
        return outs if isinstance(meta, (list, tuple)) else outs[0]
    return rule


RULES: dict[str, Rule] = {
    **dict.fromkeys(["mm", "addmm"], _mm), **dict.fromkeys(["bmm", "baddbmm", "addbmm"], _bmm),
    **dict.fromkeys(["mv", "addmv"], _mv), **dict.fromkeys(["dot", "vdot"], _dot),
    **dict.fromkeys(["scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"], _attention),
    **dict.fromkeys(["convolution", "_convolution", "conv2d", "conv1d", "conv3d"], _spatial(1)),
    **dict.fromkeys(["max_pool1d", "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d",
                     "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d",
                     "adaptive_max_pool2d", "adaptive_max_pool3d", "upsample_nearest1d", "upsample_nearest2d",
                     "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
                     "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                     "_upsample_nearest_exact3d"], _spatial(2)),
}
"""Matmuls, attention, convolution, pooling and resampling, by ATen name."""
