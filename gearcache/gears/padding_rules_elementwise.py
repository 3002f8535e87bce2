"""Padding rules for elementwise ops and new tensors: rows stay in line, the pad is evaluated exactly.

Pointwise ops (``torch.Tag.pointwise``), ``where``, casts and clones keep every padded row in line with the real
ones; operands whose padded dims differ *meet* (RuleContext.aligned). The output's pad is the op run on its operands'
pad values (:func:`evaluated`, pad_values.evaluate: kept only when exact in the output's dtype), or followed
symbolically (``where`` on a known condition, positions plus an int); a random op's is unknown. Factories (``zeros``,
``full``, ``arange``, ``*_like``) hold their fill (``arange`` over a padded size: positions); a padded size used as
a value mixes. Rule contract: padding_rule_context.py.
"""
from __future__ import annotations

from typing import Any

import torch

from .._torch import aten as torch_aten
from . import pad_values as pv
from .pad_values import UNKNOWN, PadValue
from .padding_abstract import (NO_PAD, REAL_ROW_COPIES, Pad, Positions, TensorValue, constant_pad, covers,
                               tensors_in)
from .padding_factors import Dim, is_padded_dim
from .padding_rule_context import (MIXES, MOVES, Out, Rule, RuleContext, broadcast_dims, meta_dims, meta_dtype,
                                   op_name, sizes_used_as_values)

RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "normal", "uniform",
          "multinomial", "randperm", "exponential", "native_dropout", "dropout"}
"""Ops that draw random numbers: over a padded dim they draw other numbers for the real rows than eager does."""


def _copies_real_rows(a: RuleContext, operands: list[Any], dims: tuple[Dim, ...]) -> bool:
    """Whether an elementwise op's output of ``dims`` repeats real rows in its pad region: every operand that covers
    its padded dims holds copies of real rows there (``REAL_ROW_COPIES``), the others are real data broadcast over
    them."""
    covering = [t for t in operands if isinstance(t, TensorValue) and covers(t.dims, dims)]
    return bool(covering) and all(isinstance(t, TensorValue) for t in operands) and all(
        a.pad(t).value is REAL_ROW_COPIES for t in covering)


def evaluated(a: RuleContext, node: torch.fx.Node, dims: tuple[Dim, ...], only: list[torch.fx.Node] | None = None
              ) -> Pad:
    """The pad of an elementwise op's output of ``dims``: the op run on its inputs' pad values (pad_values.
    evaluate), when every tensor input (or each of ``only``) covers every padded dim of the output; NO_PAD
    when one is real data there."""
    if not any(is_padded_dim(d) for d in dims):
        return NO_PAD
    inputs: list[tuple[torch.fx.Node, PadValue, torch.dtype, int]] = []
    leaves: frozenset[int] = frozenset()
    unknown = False
    args = only if only is not None else node.all_input_nodes
    operands = [a.value_of(arg) for arg in args]
    if _copies_real_rows(a, operands, dims):
        return Pad(REAL_ROW_COPIES)
    for arg, value in zip(args, operands):
        if not isinstance(value, TensorValue):
            return NO_PAD
        p = a.pad(value) if covers(value.dims, dims) else Pad(a.constant(value))
        if not covers(value.dims, dims) and not pv.known(p.value):
            return NO_PAD                           # real data where the output's padded rows are
        leaves |= p.leaves
        if not isinstance(p.value, (bool, int, float)):     # unknown, or symbolic (see _symbolic)
            if not p.leaves:
                return NO_PAD
            unknown = True
        else:
            inputs.append((arg, p.value, value.dtype, len(value.dims)))
    meta = node.meta.get("val")
    if unknown or not isinstance(meta, torch.Tensor):
        return Pad(UNKNOWN, leaves)
    return Pad(pv.evaluate(torch_aten.aten_op(node), tuple(node.args), dict(node.kwargs), inputs, meta.dtype), leaves)


def pointwise(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """Pointwise ops (``torch.Tag.pointwise``, and ``where``, ``masked_fill``...): operands broadcast with their padded
    rows in line (two marked dims meet); a padded size as a value mixes. Pad: followed symbolically (:func:`_symbolic`)
    or evaluated exactly (:func:`evaluated`); a random op's is unknown."""
    dims, why = broadcast_dims(a, node, tensors_in(list(args.values())))
    if why is None and sizes_used_as_values([v for v in args.values() if not isinstance(v, TensorValue)]):
        why = ("uses the size of a padded dim as a value", MIXES)
    random = torch.Tag.nondeterministic_seeded in torch_aten.aten_op(node).tags
    if random:
        return dims, why, NO_PAD
    return dims, why, _symbolic(a, node, args, dims) or evaluated(a, node, dims)


def _symbolic(a: RuleContext, node: torch.fx.Node, args: dict[str, Any], dims: tuple[Dim, ...]) -> Pad | None:
    """The pad of ``where`` when its condition's pad is a known bool (the chosen operand's, positions or gathered
    values included, remembering that the condition's padded inputs chose it), or of positions plus or minus an int;
    None for the general case (``evaluated``)."""
    name = op_name(node)
    if name == "where":
        cond = args.get("condition")
        if not isinstance(cond, TensorValue) or not covers(cond.dims, dims) or not isinstance(a.pad(cond).value, bool):
            return None
        chosen = args.get("self") if a.pad(cond).value else args.get("other")
        out = meta_dtype(node)
        if isinstance(chosen, TensorValue):
            p = a.pad(chosen) if covers(chosen.dims, dims) else Pad(a.constant(chosen))
            value = p.value if chosen.dtype == out or not pv.known(p.value) else pv.convert(p.value, out)
            if not pv.known(value) and chosen.dtype != out:
                value = UNKNOWN
        else:
            p, value = NO_PAD, constant_pad(chosen, out).value
        return Pad(value, p.leaves | a.pad(cond).leaves)
    if name in ("add", "sub") and args.get("alpha", 1) == 1:
        x, y = args.get("self"), args.get("other")
        if isinstance(x, TensorValue) and isinstance(y, int) and not isinstance(y, bool):
            p = a.pad(x)
            if isinstance(p.value, Positions) and covers(x.dims, dims):
                return Pad(Positions(p.value.start + (y if name == "add" else -y), p.value.bound))
    return None


def no_rule(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Any:
    """An op without a rule: mixing if it reads anything padded (or a padded size)."""
    values = list(args.values())
    touches = any(any(is_padded_dim(d) for d in t.dims) for t in tensors_in(values)) or sizes_used_as_values(values)
    why = ("has no padding rule in gearcache, so it is assumed to mix padded rows in", MOVES) if touches else None
    meta = node.meta.get("val")
    if isinstance(meta, (list, tuple)):
        return [(None if not isinstance(m, torch.Tensor) else a.dims_of(m.shape), why) for m in meta]
    return (None if not isinstance(meta, torch.Tensor) else a.dims_of(meta.shape)), why


def _same(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """Same dims as ``self`` (or the first tensor argument), nothing mixed: clone, copy to a dtype, tril, alias."""
    self_arg = args.get("self")
    first = self_arg if isinstance(self_arg, TensorValue) else tensors_in(list(args.values()))[0]
    symbolic = [v for k, v in args.items() if k in ("diagonal",)]
    why = ("shifts rows by the size of a padded dim", MOVES) if sizes_used_as_values(symbolic) else None
    if op_name(node) in ("tril", "triu"):          # zeros in part of the pad region, the pad elsewhere
        p = a.pad(first)
        return first.dims, why, p if pv.is_neutral("zero", p.value, first.dtype) else NO_PAD
    tensor_args = [n for n in node.all_input_nodes if isinstance(a.value_of(n), TensorValue)][:1]
    return first.dims, why, evaluated(a, node, first.dims, tensor_args)


_FILLS = {"zeros": 0, "new_zeros": 0, "zeros_like": 0, "zero": 0, "ones": 1, "new_ones": 1, "ones_like": 1}


def fresh(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """A new tensor (zeros, full, arange, *_like): dims from its shape; mixing only if a value is a padded size."""
    name = op_name(node)
    values = [v for k, v in args.items() if k in ("fill_value", "value", "start", "step", "low", "high")]
    if name == "scalar_tensor":
        values = [args.get("s")]
    if name == "linspace":
        values += [args.get("end"), args.get("steps")]
    random = name in RANDOM and any(is_padded_dim(d) for d in meta_dims(a, node))
    why = ("uses the size of a padded dim as a value", MIXES) if sizes_used_as_values(values) else None
    fill = _FILLS.get(name, args.get("fill_value", args.get("s")) if name in (
        "full", "new_full", "full_like", "scalar_tensor") else None)
    dims = meta_dims(a, node)
    pad = constant_pad(fill, meta_dtype(node))
    start, step = args.get("start", 0), args.get("step", 1)
    if name == "arange" and len(dims) == 1 and is_padded_dim(dims[0]) and isinstance(start, int) and step == 1:
        pad = Pad(Positions(start, a.bound(dims[0])))
    return dims, (("draws random numbers over a padded dim", MIXES) if random else why), pad


def like(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """zeros_like, full_like, ...: a new tensor of ``self``'s dims holding the fill (see :func:`fresh`)."""
    _, why, pad = fresh(a, node, args)
    return args["self"].dims, why, pad


def _fill(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """fill_: ``self``'s dims holding the value (a tensor value broadcasts in line)."""
    value = args.get("value")
    if isinstance(value, TensorValue):
        return broadcast_dims(a, node, [args["self"], value])
    return args["self"].dims, (("uses the size of a padded dim as a value", MIXES)
                               if sizes_used_as_values([value]) else None), constant_pad(value, args["self"].dtype)


def _copy(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """copy_(self, src): ``src``'s values (and pad, converted to ``self``'s dtype) in ``self``'s place. A new tensor
    the graph made and never wrote (``torch.empty(n * B)`` filled by a collective) takes the layout of what fills it
    whole (its dim of ``n * B`` rows becomes ``src``'s ``(n, B)``)."""
    a.adopt(args["self"], args["src"])
    dims, why = broadcast_dims(a, node, [args["self"], args["src"]])
    src = args["src"]
    p = a.pad(src) if covers(src.dims, dims) else Pad(a.constant(src))
    return dims, why, Pad(pv.convert(p.value, args["self"].dtype), p.leaves)


def _sym_size(a: RuleContext, node: torch.fx.Node, args: dict[str, Any]) -> Out:
    """sym_size, sym_numel, ...: a size (the walk makes it a SizeValue: padded when it involves a marked dim)."""
    return None, None


RULES: dict[str, Rule] = {
    **dict.fromkeys(["clone", "_to_copy", "alias", "detach", "lift_fresh_copy", "lift_fresh", "contiguous",
                     "tril", "triu", "_assert_tensor_metadata", "to", "type_as", "_conj", "resolve_conj",
                     "resolve_neg", "positive"], _same),
    **dict.fromkeys(["zeros", "ones", "empty", "empty_strided", "full", "scalar_tensor", "arange", "eye",
                     "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "rand", "randn",
                     "randint", "randperm", "linspace"], fresh),
    **dict.fromkeys(["zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                     "randint_like"], like),
    "fill": _fill, "zero": like, "copy": _copy,
    # elementwise ops whose overloads (or in-place forms) lack torch.Tag.pointwise
    **dict.fromkeys(["where", "masked_fill", "rsub", "hardswish"], pointwise),
    **dict.fromkeys(["sym_size", "sym_numel", "sym_stride", "sym_storage_offset"], _sym_size),
}
"""Elementwise ops and factories by ATen name (pointwise ops are found by their tag, padding_rules.rule_for)."""
FACTORIES = (fresh, like)
"""The rules of ops that make a new tensor (its storage is *fresh*: no real rows of its own until written)."""
