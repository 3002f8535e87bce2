"""A KV cache and a causal mask in the padding walk: what ``enable()``'s prompt padding rests on, proved per graph.

A served causal LM's prompt of T tokens runs padded to its gear G: the padded rows are the positions after every
real one. Inside a decoder layer they are written into the KV cache (positions ``[start + T, start + G)``), which the
call's attention then reads whole: a real query sees them unless the attention's mask hides every key after the
query. gearcache's own code writes the cache and drops the pads' keys and values after the call
(gearcache/integrations/hf_regions.py: ``LayerCache.update``, ``drop_pads``), so the walk takes *roles*:

* ``cache`` leaves (a layer's keys, values and position counter): a write into them is the cache's write, not a
  finding of its own (its positions move with the padded size by construction); it leaves the storage holding the
  padded rows' keys (:data:`CACHE_PADS`, a dirt every later read carries);
* ``causal`` leaves (the layer's attention mask, built by transformers' masking utilities from the 2D mask and the
  cache position: ``kv_idx <= q_idx`` and the padding and window terms, which only remove keys).

An attention (``scaled_dot_product_attention`` and its kernels) that reads a cache storage holding
:data:`CACHE_PADS` is exact when its mask is a causal leaf reached through views that keep every key at its place
(:func:`mask_from_leaf`) and ``is_causal`` is off (sdpa's own ``is_causal`` aligns a cached query top-left): then its
output does not carry the cache's dirt. So is an attention written out (transformers' eager attention: the softmax of
``Q·Kᵀ`` plus the additive causal mask, times the values: :func:`written_out_attention`), step by step. Any other read
of such a storage (a mask built or changed in the layer, ``is_causal=True`` or no mask, keys moved before the mask, the
weights changed per key) keeps it, and the dirt reaching an output is a finding (the padded step is then not served).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, cast

import torch

from .padding_abstract import Origin

CACHE_PADS = Origin("(KV cache)", "", "reads the KV cache, whose positions after the real tokens hold the padded "
                    "rows' keys and values, without a mask the proof knows is causal (a real query may see them)",
                    False)
"""The dirt a cache storage carries once the padded rows wrote it (see the module docstring)."""

KEEPS_PLACES = {"where", "slice", "alias", "expand", "view", "_unsafe_view", "unsqueeze", "squeeze", "detach",
                "constant_pad_nd"}
"""View ops a mask may pass through on its way to the attention and still be the causal leaf (a slice from 0; a pad
of the last dim on the right only, with 0, as sdpa's memory-efficient path aligns a bias before slicing it back), and
``where(mask, 0, -inf)``, ``where(mask.logical_not(), -inf, 0)`` (``-65504`` for cuDNN: :data:`HIDING`) or
``zeros_like(mask).masked_fill_(mask.logical_not(), -inf)`` (a bool mask made additive, as the CPU and CUDA kernels'
lowerings do)."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """The leaves the walk takes as a KV cache and as a causal mask (leaf indices)."""
    cache: frozenset[int] = frozenset()
    causal: frozenset[int] = frozenset()


class Reads(Protocol):
    """What the walk tells the proof of an attention about a node it reads (padding_walk.GraphWalk is one)."""

    def no_cache_pads(self, node: Any) -> bool:
        """Whether ``node``'s value does not carry the cache's pads (:data:`CACHE_PADS`)."""

    def untouched(self, node: Any) -> bool:
        """Whether no tensor ``node`` is computed from was written in place by a node it is not computed from (a KV
        cache's own writes aside): the mask, keys and values the proof traced are the ones the attention reads."""


def mask_argument(node: torch.fx.Node) -> Any:
    """The node an attention op takes as its mask (``attn_mask``, positional or keyword), or None."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    for name in ("attn_mask", "attn_bias"):
        if name in node.kwargs:
            return node.kwargs[name]
        if name in names and names.index(name) < len(node.args):
            return node.args[names.index(name)]
    return None


COPIES = {"index_copy_", "clone", "_to_copy", "reshape", "contiguous"}
"""Ops keys and values may pass through from the cache to the attention: the cache's write (its result is the
cache), copies that keep every key at its place (``repeat_kv``'s expand and reshape, a dtype cast)."""


def cache_from_leaf(node: Any, placeholder_leaf: dict[torch.fx.Node, int], cache: frozenset[int]) -> bool:
    """Whether ``node`` (an attention's keys or values) is a cache leaf through :data:`KEEPS_PLACES` views and
    :data:`COPIES` only, every slice from 0, each step keeping the positions (dim -2) and the head dim (dim -1) as
    they are (:func:`_positions_in_place`): the keys at the cache's positions, the pads' after the real ones."""
    return _positions_in_place(node) and mask_from_leaf(node, placeholder_leaf, cache, COPIES, keys_last=False)


def _positions_in_place(node: Any) -> bool:
    """Whether every step from ``node`` back to its leaf (following first arguments) keeps its input's last two
    sizes, except a slice of the positions (dim -2, a prefix: each kept position stays at its place) and a pad of the
    head dim (a ``constant_pad_nd`` of the last dim): a view regrouping positions and head dims (``[L, H]`` seen as
    ``[L / 2, 2 H]``) moves a pad's key next to a real one's."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        src, out = node.args[0], _trailing(node)
        if not isinstance(src, torch.fx.Node) or out is None or _trailing(src) is None:
            return False
        before = cast(tuple[str, ...], _trailing(src))
        rank = node.meta["val"].dim()
        if _op(node) == "slice" and node.args[1] in (-2, rank - 2):
            ok = before[1] == out[1]
        elif _op(node) == "constant_pad_nd":
            ok = before[0] == out[0]
        else:
            ok = before == out
        if not ok:
            return False
        node = src
    return True


def mask_from_leaf(mask: Any, placeholder_leaf: dict[torch.fx.Node, int], causal: frozenset[int],
                   also: frozenset[str] | set[str] = frozenset(), keys_last: bool = True) -> bool:
    """Whether ``mask`` (a node) is a causal leaf through :data:`KEEPS_PLACES` views (and ``also``) only, every
    slice from 0. ``keys_last`` (a mask: its keys along the last dim): every key of ``mask`` is the leaf's key at the
    same place, so each step keeps its input's last size (:func:`_keys_kept`: no key broadcast from a size of 1, no
    view regrouping keys), except a slice of the last dim from 0 and a pad on its right of an input that holds every
    key ``mask`` has (sdpa's alignment, sliced back): a pad's new keys (an additive 0) would show what was hidden."""
    final = _keys(mask)
    while isinstance(mask, torch.fx.Node):
        if mask.op == "placeholder":
            return placeholder_leaf.get(mask) in causal
        name = _op(mask)
        if keys_last and not _keys_kept(mask, final):
            return False
        if name in ("masked_fill", "masked_fill_"):     # zeros_like(m).masked_fill_(m.logical_not(), -inf): CUDA's
            base, cond = mask.args[0], mask.args[1]
            if not (_op(base) == "zeros_like" and _op(cond) == "logical_not" and _hides(mask.args[2])
                    and _floating(mask)):           # zeros_like of a bool mask: -inf filled in as True
                return False
            mask = cast(torch.fx.Node, cond).args[0]
            continue
        if name in FLOAT_COPIES and mask.op == "call_function" and _floating(mask.args[0]) and _floating(mask):
            mask = mask.args[0]         # an additive mask cast or copied: 0 stays 0, -inf -inf, -65504 below -65000
            continue
        if mask.op != "call_function" or (name not in KEEPS_PLACES and name not in also):
            return False
        if name == "where":
            cond = mask.args[0]
            if _scalar(mask.args[1], 0.0) and _hides(mask.args[2]):          # where(m, 0, -inf)
                mask = cond
                continue
            if _op(cond) == "logical_not" and _hides(mask.args[1]) and _scalar(mask.args[2], 0.0):
                mask = cast(torch.fx.Node, cond).args[0]                     # where(~m, -inf, 0): the kernels' own
                continue
            return False
        if name == "constant_pad_nd":
            # sdpa's memory-efficient path aligns the bias: pad the last (key) dim on the right, slice back from 0
            pad, value = mask.args[1], (mask.args[2] if len(mask.args) > 2 else 0)
            if not (isinstance(pad, (list, tuple)) and len(pad) == 2 and _scalar(pad[0], 0.0) and _scalar(value, 0.0)):
                return False
            mask = mask.args[0]
            continue
        if name == "slice" and ((mask.args[2] if len(mask.args) > 2 else 0) not in (None, 0)
                                or (mask.args[4] if len(mask.args) > 4 else 1) != 1):
            return False
        mask = mask.args[0]
    return False


FLOAT_COPIES = {"_to_copy", "clone", "contiguous"}
"""Copies a mask may pass through when it is additive already (a floating tensor): a dtype cast or a copy keeps every
key's place and hides what it hid. A bool mask cast to a number is refused (1 and 0 added to scores hide nothing), so is
an additive mask cast to bool (its hidden keys, non-zero, become the ones a bool mask keeps)."""


def _keys_kept(node: torch.fx.Node, final: str | None) -> bool:
    """Whether the step ``node`` of a mask's path (see :func:`mask_from_leaf`) keeps every key of the mask at the
    last dim's place in its input (``where``'s and ``masked_fill``'s: their condition): the same last size, or a slice
    of the last dim from 0 (checked by the caller), or a pad on its right of an input holding the mask's ``final``
    keys."""
    if node.op != "call_function":
        return True
    name = _op(node)
    src = node.args[1] if name in ("masked_fill", "masked_fill_") else node.args[0]
    if name in ("masked_fill", "masked_fill_"):
        src = cast(torch.fx.Node, src).args[0] if _op(src) == "logical_not" else src
    if name == "slice":
        return True
    if name == "constant_pad_nd":
        before = _keys(src)
        return before == final or (before is not None and final is not None and before.isdigit()
                                   and final.isdigit() and int(before) >= int(final))
    return _keys(src) == _keys(node)


def _floating(node: Any) -> bool:
    """Whether ``node``'s value (its traced metadata) is a floating-point tensor; False when unknown."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _op(node: Any) -> str:
    """The ATen op name a node calls (``"slice"``), or ""."""
    return getattr(getattr(getattr(node, "target", None), "overloadpacket", None), "__name__", "")


def _scalar(node: Any, value: float) -> bool:
    """Whether ``node`` is ``scalar_tensor(value)`` or the number ``value`` itself."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node) == value
    return isinstance(node, torch.fx.Node) and _op(node) == "scalar_tensor" and node.args[:1] == (value,)


HIDING = (float("-inf"), -65504.0)
"""The additive values a bool mask's False becomes: ``-inf`` (CPU, flash, memory-efficient), ``-65504`` (torch's cuDNN
attention, ``convert_boolean_attn_mask_cudnn``: fp16's lowest, a finite stand-in). A key so masked gets a softmax weight
of exactly 0 (``exp`` of a score 65504 below the row's largest underflows in the kernels' float32 softmax) as long as
the row's real scores lie within ~65000 of each other, the same condition under which eager's own masked keys (the
cache's empty slots) get none."""


def _hides(node: Any) -> bool:
    """Whether ``node`` is one of the :data:`HIDING` fills (a number or its ``scalar_tensor``)."""
    return any(_scalar(node, value) for value in HIDING)


# ------------------------------------------------------------------ an attention written out: softmax(Q·Kᵀ + M)·V
WRITTEN_OUT_STEPS = {"_softmax", "bmm"}
"""The ops of an attention written out in ATen (transformers' ``eager_attention_forward``: ``matmul(q, k.T) * c``,
``+ mask``, ``softmax`` in float32, ``.to(dtype)``, dropout off, ``matmul(p, v)``) at which the cache's dirt is
dropped: the softmax of the causally masked scores, and that softmax's product with the cache's values."""

SCORE_STEPS = {"mul", "div", "tanh", "_to_copy", "clone", "view", "_unsafe_view", "alias"}
"""Ops the scores may pass through from ``Q·Kᵀ`` to the mask's add, each keeping every key at its place: a scale (by
a number only), a soft cap's ``tanh``, a cast, views that keep the last (key) dim."""

PROBS_STEPS = {"_to_copy", "clone", "expand", "view", "_unsafe_view", "alias", "detach"}
"""Ops the softmax's weights may pass through to their product with the values: a cast, dropout off (a clone),
``matmul``'s broadcast and batch views, each keeping the last (key) dim."""


def written_out_attention(node: torch.fx.Node, placeholder_leaf: dict[torch.fx.Node, int], roles: Roles,
                          reads: Reads) -> bool:
    """Whether ``node`` is a step of an attention written out that drops the cache's dirt (:data:`WRITTEN_OUT_STEPS`):

    * a ``_softmax`` over the last dim of ``S + M``: ``M`` a floating causal leaf (:func:`mask_from_leaf`) whose last
      dim is the keys', ``S`` = ``bmm(Q, Kᵀ)`` through :data:`SCORE_STEPS`, ``Kᵀ`` the transpose of the last two dims
      of a cache leaf's keys (:func:`cache_from_leaf`, the positions at dim -2 on the way): every key the mask hides
      gets a weight of exactly 0 (its fill, ``finfo.min`` or ``-inf``, underflows ``exp``), so the weights equal
      eager's, whose hidden keys are the cache's empty slots; ``Q`` does not carry the cache's pads (a query made
      from the cache sees them whatever the mask), the add has no ``alpha``, the softmax's input is
      ``reads.untouched`` (scores, a mask or keys written in place after they were made are not what the proof
      traced);
    * a ``bmm(P, V)``: ``P`` such a softmax through :data:`PROBS_STEPS`, ``V`` a cache leaf's values (positions at dim
      -2, the product's contraction), both ``reads.untouched`` (weights written at a pad's key after the softmax):
      a pad's value counts with a weight of 0 (the pads' values are finite: the same condition as sdpa's, see
      :data:`HIDING`)."""
    if _op(node) == "_softmax":
        return _masked_scores_softmax(node, placeholder_leaf, roles, reads)
    if _op(node) != "bmm":
        return False
    probs = _through(node.args[0], PROBS_STEPS, _keys(node.args[0]))
    return (isinstance(probs, torch.fx.Node) and _op(probs) == "_softmax"
            and _masked_scores_softmax(probs, placeholder_leaf, roles, reads)
            and _cache_positions(node.args[1], placeholder_leaf, roles.cache, transposed=False)
            and reads.untouched(node.args[0]) and reads.untouched(node.args[1]))


def _masked_scores_softmax(node: torch.fx.Node, placeholder_leaf: dict[torch.fx.Node, int], roles: Roles,
                           reads: Reads) -> bool:
    """The first case of :func:`written_out_attention`."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or node.args[1] not in (-1, value.dim() - 1):
        return False
    keys = _keys(node)
    if not reads.untouched(node.args[0]):      # scores (or mask, keys) written in place after: not what is traced
        return False
    added = _through(node.args[0], FLOAT_COPIES, keys)
    if not isinstance(added, torch.fx.Node) or _op(added) != "add" or len(added.args) != 2 or \
            added.kwargs.get("alpha", 1) != 1:         # scores - mask (alpha -1) shows what the mask hides
        return False
    for mask, scores in (added.args, added.args[::-1]):
        if (_floating(mask) and _keys(mask) == keys
                and mask_from_leaf(mask, placeholder_leaf, roles.causal)):
            product = _through(scores, SCORE_STEPS, keys)
            if (isinstance(product, torch.fx.Node) and _op(product) == "bmm" and reads.no_cache_pads(product.args[0])
                    and _cache_positions(product.args[1], placeholder_leaf, roles.cache, transposed=True)):
                return True
    return False


def _cache_positions(node: Any, placeholder_leaf: dict[torch.fx.Node, int], cache: frozenset[int],
                     transposed: bool) -> bool:
    """Whether ``node`` (a ``bmm`` operand) is a cache leaf with its positions at dim -2 (``transposed``: at dim -1,
    through a transpose of the last two dims), the last two dims kept on the way (broadcast and batch views)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    trailing = _trailing(node)
    while isinstance(node, torch.fx.Node) and _op(node) in ("expand", "view", "_unsafe_view", "clone", "alias"):
        node = node.args[0]
        if not isinstance(node, torch.fx.Node) or _trailing(node) != trailing:
            return False
    if transposed:
        if not (isinstance(node, torch.fx.Node) and _op(node) == "transpose"):
            return False
        rank = node.meta["val"].dim()
        dims = [d % rank for d in node.args[1:3] if isinstance(d, int)]
        if sorted(dims) != [rank - 2, rank - 1]:
            return False
        node = node.args[0]
    return _positions_kept(node) and cache_from_leaf(node, placeholder_leaf, cache)


def _positions_kept(node: Any) -> bool:
    """Whether every node from ``node`` back to its leaf through views and copies has the same last two sizes."""
    trailing = _trailing(node)
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        node = node.args[0]
        if isinstance(node, torch.fx.Node) and _trailing(node) != trailing:
            return False
    return trailing is not None


def _through(node: Any, steps: set[str], keys: str | None) -> Any:
    """The first node back from ``node`` (following first arguments) that is not one of ``steps``, each step keeping
    the last dim's size ``keys`` and scaling by numbers only; None when a step breaks that."""
    while isinstance(node, torch.fx.Node) and _op(node) in steps:
        if _keys(node) != keys or (_op(node) in ("mul", "div") and not isinstance(node.args[1], (int, float))):
            return None
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and _keys(node) == keys else None


def _keys(node: Any) -> str | None:
    """The last dim's size of ``node``'s value as text (a number, or a symbol's name: read without a guard)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return str(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() else None



def _trailing(node: Any) -> tuple[str, ...] | None:
    """The last two dims' sizes of ``node``'s value as text."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(map(str, value.shape[-2:])) if isinstance(value, torch.Tensor) and value.dim() >= 2 else None
