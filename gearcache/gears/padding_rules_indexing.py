"""Padding rules for indexing: reads and writes at positions an index tensor holds.

``embedding``, ``index_select``, ``gather`` and ``x[i]`` reading a padded index are exact when the index's pad is a
valid position (a constant in range, positions below the largest gear, copies of real rows); an index that is
``arange`` over the very padded size it indexes keeps rows in line. Reading or writing *along* a padded dim at
indexed positions moves rows. ``index_copy`` at a padded index is exact when the index's pad is positions and the
written rows' pad is what those slots hold (a KV cache update that keeps the old entry at a padding position). A
write's pad is kept where the written pad equals the target's, else unknown. Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

from typing import Any

import torch

from . import pad_values as pv
from .pad_values import UNKNOWN
from .padding_abstract import (NO_PAD, REAL_ROW_COPIES, Gathered, Held, Pad, Positions, TensorValue, constant_pad,
                               covers)
from .padding_factors import Dim, canonical, dim_size, is_padded_dim
from .padding_rule_context import MOVES, Out, Rule, RuleContext, invalid_index, norm_dim, op_name, view_pad


def _embedding(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """embedding: rows of an unpadded table looked up at ``indices``, whose pad must be a valid row
    (:func:`~gearcache.gears.padding_rule_context.invalid_index`); a padded table moves rows. Pad: copies of real rows
    when the indices' pad is, else real data."""
    weight, indices = args["weight"], args["indices"]
    why = ("looks rows up in a padded table", MOVES) if is_padded_dim(weight.dims[0]) else None
    why = why or invalid_index(a, indices, dim_size(weight.dims[0]), negative=False)
    pad = Pad(REAL_ROW_COPIES) if a.pad(indices).value is REAL_ROW_COPIES else NO_PAD     # rows at real positions
    return indices.dims + weight.dims[1:], why, pad


def _index_select(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """index_select: along an unpadded dim at an index whose pad is a valid position; along a padded dim moves
    rows. Pad: the source's for an unpadded index; values gathered from the source (``Gathered``) for a padded one."""
    src, index = args["self"].dims, args["index"].dims
    dim = norm_dim(args["dim"], len(src))
    why = ("gathers along a padded dim", MOVES) if is_padded_dim(src[dim]) else None
    why = why or invalid_index(a, args["index"], dim_size(src[dim]), negative=False)
    pad = view_pad(a, args["self"]) if not any(is_padded_dim(d) for d in index) else NO_PAD
    if why is None and any(is_padded_dim(d) for d in index):      # every element: self's value at index
        pad = Pad(Gathered(args["self"].name, a.writes(args["self"]), dim, args["index"].name))
    return src[:dim] + (index[0] if index else (),) + src[dim + 1:], why, pad


def _gather(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """gather: along an unpadded dim with an index whose padded rows line up with the source's and whose pad is a
    valid position; along a padded dim moves rows."""
    src, index = args["self"].dims, args["index"].dims
    dim = norm_dim(args["dim"], len(src))
    why = ("gathers along a padded dim", MOVES) if is_padded_dim(src[dim]) else None
    if why is None and not all(a.aligned(s, i) or not is_padded_dim(s) and not is_padded_dim(i)
                               for k, (s, i) in enumerate(zip(src, index)) if k != dim):
        why = ("gathers with an index whose padded rows do not line up with the source's", MOVES)
    return index, why or invalid_index(a, args["index"], dim_size(src[dim]), negative=False)


def _indexed(a: RuleContext, src: tuple[Dim, ...], indices: list[Any]) -> tuple[tuple[Dim, ...] | None, Any]:
    """Dims of ``src[indices]`` (advanced indexing), and why it mixes (an indexed dim is padded, or an index's pad is
    not a valid position)."""
    used = [k for k, ix in enumerate(indices) if ix is not None]
    if any(is_padded_dim(src[k]) and not _identity(a, indices[k], src[k]) for k in used):
        return None, ("indexes into a padded dim", MOVES)
    for k in used:
        why = None if _identity(a, indices[k], src[k]) else invalid_index(a, indices[k], dim_size(src[k]), True)
        if why is not None:
            return None, why
    tensors = [ix for ix in indices if isinstance(ix, TensorValue)]
    rank = max((len(t.dims) for t in tensors), default=0)
    index_dims = []
    for k in range(rank):
        dims = [t.dims[len(t.dims) - rank + k] for t in tensors if len(t.dims) - rank + k >= 0]
        dims = [d for d in dims if d != ()]
        if dims and not all(a.aligned(dims[0], d) for d in dims[1:]):
            return None, ("indexes with tensors whose padded rows do not line up", MOVES)
        index_dims.append(dims[0] if dims else ())
    adjacent = used == list(range(used[0], used[-1] + 1)) if used else True
    rest = [d for k, d in enumerate(src) if k not in used]
    if adjacent and used:
        return tuple(src[:used[0]]) + tuple(index_dims) + tuple(src[used[-1] + 1:]), None
    return tuple(index_dims) + tuple(rest), None


def _identity(a: RuleContext, index: Any, dim: Dim) -> bool:
    """Whether ``index`` picks along the padded ``dim`` row i at its own row i: ``arange`` over that very padded size
    (positions from 0, its one padded dim in line with ``dim``), as transformers' mask functions index a padding
    mask by ``batch_idx``: rows stay in line."""
    if not isinstance(index, TensorValue) or not is_padded_dim(dim):
        return False
    p = a.pad(index).value
    padded = [d for d in index.dims if is_padded_dim(d)]
    return isinstance(p, Positions) and p.start == 0 and len(padded) == 1 and len(canonical(dim)) == 1 and \
        a.aligned(padded[0], dim)


def _index(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """index (``x[i]``, advanced indexing): see :func:`_indexed`. Pad: the source's when no index is padded."""
    indices = list(args["indices"]) + [None] * (len(args["self"].dims) - len(args["indices"]))
    dims, why = _indexed(a, args["self"].dims, indices)
    plain = not any(isinstance(ix, TensorValue) and any(is_padded_dim(d) for d in ix.dims) for ix in indices)
    return dims, why, view_pad(a, args["self"]) if plain else NO_PAD


def _index_put(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """index_put (``x[i] = v``): positions from a padded index move rows; the values' padded rows must line up
    with where they go. Pad: kept where the written pad equals the target's (:func:`_kept_pad`)."""
    src = args["self"].dims
    indices = list(args["indices"]) + [None] * (len(src) - len(args["indices"]))
    if any(isinstance(ix, TensorValue) and any(is_padded_dim(d) for d in ix.dims) for ix in indices):
        return src, ("writes at positions taken from padded rows", MOVES)
    region, why = _indexed(a, src, indices)
    values = args["values"].dims
    if why is None and region is not None:
        for v, r in zip(reversed(values), reversed(region)):
            if v != () and not a.aligned(v, r):
                why = ("writes values whose padded rows do not line up with where they go", MOVES)
    return src, why, _kept_pad(a, args["self"], args["values"], region or src)


def _kept_pad(a: RuleContext, target: TensorValue, values: Any, region: tuple[Any, ...]) -> Pad:
    """The pad of ``target`` after ``values`` are written into its ``region``: kept when they hold the same pad
    (or a scalar equal to it), else unknown."""
    p = a.pad(target)
    written: Held
    if isinstance(values, TensorValue):
        q = a.pad(values) if covers(values.dims, region) else NO_PAD
        written = pv.convert(q.value, target.dtype)
    else:
        written = constant_pad(values, target.dtype).value
    if pv.known(p.value) and pv.known(written) and pv.same(p.value, written):
        return p
    return Pad(UNKNOWN, frozenset())


def _index_copy(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """index_copy, index_add, index_fill, scatter*: rows of ``dim`` chosen by an index, whose pad must be a valid
    position (a scatter's padded rows, in line with the target's, write there)."""
    src = args["self"].dims
    dim = norm_dim(args["dim"], len(src))
    index = args.get("index")
    why: tuple[Any, ...] | None = None
    source = args.get("source", args.get("src"))
    if is_padded_dim(src[dim]):
        why = ("writes into a padded dim at positions an index picks", MOVES)
    elif isinstance(index, TensorValue) and any(is_padded_dim(d) for d in index.dims) and (
            op_name(node).startswith("index_") or len(index.dims) <= 1) and not _writes_back(a, node, args):
        leaves = a.pad(index).leaves | (a.pad(source).leaves if isinstance(source, TensorValue) else frozenset())
        why = ("writes at positions taken from padded rows", MOVES, leaves)
    if why is None and isinstance(index, TensorValue):    # scatter's padded rows write at their own index's pad
        why = invalid_index(a, index, dim_size(src[dim]), negative=False)
    if why is None and isinstance(source, TensorValue):
        for k, (s, d) in enumerate(zip(source.dims, src)):
            if k != dim and s != () and not a.aligned(s, d):
                why = ("writes values whose padded rows do not line up with where they go", MOVES)
        if why is None and isinstance(index, TensorValue) and len(index.dims) > 1 and not all(
                a.aligned(i, d) or i == () for i, d in zip(index.dims, src)):
            why = ("scatters with an index whose padded rows do not line up", MOVES)
    written = source if isinstance(source, TensorValue) else args.get("value")
    adds = op_name(node) in ("index_add", "scatter_add", "scatter_reduce")
    return src, why, NO_PAD if adds else _kept_pad(a, args["self"], written, src)


def _writes_back(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> bool:
    """``self.index_copy(dim, index, source)`` whose padded rows write back what their slots hold: ``index``'s pad
    is positions past the real ones (``arange`` over the padded size: no padded row shares a slot with a real one;
    valid below the largest gear), and ``source``'s pad is ``self.index_select(dim, index)`` of ``self`` as it is
    now (as a KV cache update that keeps the old entry where a token is padding does)."""
    self_t, index, source = args["self"], args["index"], args.get("source")
    dim = norm_dim(args["dim"], len(self_t.dims))
    if op_name(node) != "index_copy" or not isinstance(source, TensorValue) or len(index.dims) != 1:
        return False
    if invalid_index(a, index, dim_size(self_t.dims[dim]), negative=False) is not None:
        return False
    if not isinstance(a.pad(index).value, Positions) or not covers(source.dims, source.dims):
        return False
    return a.pad(source).value == Gathered(self_t.name, a.writes(self_t), dim, index.name)


RULES: dict[str, Rule] = {
    "embedding": _embedding, "index_select": _index_select, "gather": _gather,
    **dict.fromkeys(["index", "_unsafe_index"], _index), **dict.fromkeys(["index_put", "_unsafe_index_put"],
                                                                        _index_put),
    **dict.fromkeys(["index_copy", "index_add", "index_fill", "scatter", "scatter_add", "scatter_reduce"],
                    _index_copy),
}
"""Indexed reads and writes, by ATen name."""
