"""Padding analysis: can padding a geared method's call change its results or its state? Proved from the graph.

A call is padded up to its gear (gears.py): its marked dims get extra rows of a pad value, the gear's entry runs, the
outputs are cut back. That is exact when the real rows never see the padded ones, or see them only through an op the pad
value leaves unchanged, and when nothing outside the padded copies is written through them. This module proves that,
once per gear plan, for every op of the method's graph, from the plan's symbolic trace (symbolic_trace.symbolic_shapes:
a Dynamo graph whose marked dims are SymInts), retraced to ATen ops (``_torch.aten.aten_graph``), where every op has a
schema saying which arguments it writes and which it returns a view of. Nothing runs on real data, so a result holds for
every call, device and dtype: no sample is taken.

**Padded values.** A dim whose size involves a marked dim's symbol is *padded*: its first (real size) rows are the
real ones, the rest are padding. Each tensor value carries its dims as lists of *factors*, outer to inner (a
``view`` that merges ``[s, 4]`` into ``[4 * s]`` gives one dim of factors ``(s, 4)``; a factor is an int, or a sympy
expression for a padded one), so a later view that splits it again is followed exactly. A value is *clean* while
its real rows equal those eager would compute from the unpadded call; ops that could make them differ make it
*dirty*, with the op as its origin, and dirt flows on through every op that reads it (and through every view of a
storage written with dirty data). Each value also carries its **pad**: what its pad region (the elements past the
real size of a padded dim) holds, a constant (``0``, ``1``, ``+inf``, ``c``) or unknown (gearcache/gears/pad_values.py),
followed exactly through pointwise ops (``(-x).amin(0)`` with ``+inf`` in ``x``'s padding takes the min over
``-inf``), views, fills and in-place writes.

**Rules**, by op (padding_rules.py, one module per op family): pointwise ops (``torch.Tag.pointwise``), views,
and ops that work row by row (a matmul over an unpadded contraction dim, norms over unpadded dims, ``all_reduce``)
keep padded rows in line.
A reduction over a padded dim is exact when its input's pad is neutral for it: ``0`` before ``sum``, ``1`` before
``prod``, ``+inf`` (an integer dtype's largest value) before ``min``/``amin``/``argmin``, ``-inf`` (the smallest)
before ``max``/``amax``/``argmax``/``logsumexp`` and a softmax along it; a contraction over a padded dim when one
operand's pad is ``0`` and the other's a finite constant. Cumulative ops along a padded dim are exact (the padding
comes after every real row). Anything else along a padded dim mixes rows in: ``mean``, ``var``, a layer norm over
it, sort and top-k, convolution, pooling, attention over padded keys (unless causal with queries padded alike),
``cat``, flip, roll, a gather along it; a view that cannot keep rows in line moves them; a padded size used as a
*value* (``x * x.shape[0]``) differs from eager; collectives along dim 0 (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``) keep rows in line only where dim 0's padded factor stays inside
each rank's block; an op without a rule that reads a padded or dirty value is assumed to mix. A size guard of the
trace beyond ``s >= 2`` or an upper bound (a Python branch on a padded size) also counts as mixing. A tensor whose pad
is read as an index (``embedding``, ``gather``, ``index_select``, ``x[ids]``) needs a pad that is a valid index.

**Pad values** are chosen per padded input (:func:`analyse`): a value the user gave (``set_dim_gears(...,
pad_value=)``, ``inference_config.pad_values``) is kept; every other padded input gets the first of its candidates
(``0``, ``-inf``, ``+inf``, ``1``; for integers ``0``, the dtype's smallest and largest, ``1``) for which every use
is exact, trying the combinations of the inputs a finding depends on.

**Findings**, on what the method leaves behind (graph outputs and in-place writes into its inputs or state):

* ``unsafe_writes``: an in-place write into a module parameter or buffer, or an input that is not padded, whose
  written region spans a padded extent (``self.seen[:B].copy_(x)``), whose positions come from padded rows (an index
  tensor with a padded dim) or move with the padded size. Such a write changes state eager leaves alone.
* ``mixing``: a dirty value reaching an output, or written into the state or an input, with the op that made it
  dirty and why (the pad it needed and the pad it got). padding_check.py refuses both unless told not to.
* ``written_leaves`` / ``written_state``: the call leaves and the parameters or buffers the graph writes in place. A
  padded leaf is written in its padded copy: after the call the copy's real rows are copied back into the caller's
  tensor (``GearPlan.copy_back``), which is exact when no mixing reaches it.
* ``pad_values``: the pad value of each padded leaf.
* ``complete``: False when the graph could not be analysed (an ATen retrace failed): then ``mixing`` holds one
  finding saying why, and every tensor the method may write is treated as written.

The modules: this one (:func:`analyse`, the pad value search, the trace's size guards), padding_walk.py (the walk
over the graph), padding_abstract.py and padding_factors.py (what it follows), padding_rules.py (the rules table).
On disk (the gear plan's JSON, key ``"padding"``): see padding_report.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any, Callable

import sympy
import torch

from .._torch import aten as torch_aten, shapes as torch_shapes
from . import pad_values as pv
from .pad_values import PadValue
from .padding_cache import Roles
from .padding_factors import size_expr
from .padding_report import Finding, PaddingReport
from .padding_walk import GraphWalk

if TYPE_CHECKING:
    from .plan import SymbolicTrace

log = logging.getLogger("gearcache")
MAX_WALKS = 48
"""Walks of the graph the pad value search may take (each with other pad values for the inputs a finding needs)."""


def analyse(trace: "SymbolicTrace", names: dict[int, str], padded_leaves: set[int],
            pads: dict[int, PadValue] | None = None, bounds: dict[str, int] | None = None,
            roles: Roles | None = None,
            decompositions: dict[torch_aten.OpOverload, Callable[..., Any]] | None = None) -> PaddingReport:
    """Analyse the gear plan's symbolic trace (symbolic_trace.symbolic_shapes); ``names``: leaf index -> argument name,
    for messages; ``padded_leaves``: the leaves with marked dims; ``pads``: the pad values the user gave (exact in the
    leaf's dtype, see ``pad_values.exact``), kept as they are; the others are chosen (``report.pad_values``);
    ``bounds``: each marked dim's symbol (as in ``trace.symbols``) -> its largest gear (positions ``arange`` makes
    over a padded size are valid indices below it); ``roles``: leaves taken as a KV cache and a causal mask
    (padding_cache.py); ``decompositions``: the method's custom ones, applied in the ATen graph the proof reads
    (as in the graph that is compiled)."""
    given = dict(pads or {})
    try:
        symbols = _gear_symbols(trace.graph, trace.inputs, padded_leaves, trace.same)     # before a lowering fixes one
        aten = torch_aten.aten_graph(trace.graph, decompositions)
        dtypes = _leaf_dtypes(trace.graph, trace.inputs, padded_leaves)
        # the lowering to ATen may have guarded or specialized a padded size (torch 2.11's matmul): read after it
        guard_findings = _guard_findings(_unique(trace.size_guards + torch_shapes.shape_guards(trace.graph)), symbols,
                                         trace.same) + _specialized_findings(trace.graph, symbols)

        def walk(assigned: dict[int, PadValue]) -> _WalkResult:
            walker = GraphWalk(aten, trace.inputs, trace.outputs, names, padded_leaves, symbols, trace.same,
                               assigned, bounds, roles)
            report = walker.run()
            report.mixing.extend(guard_findings)
            report.pad_values = dict(sorted(assigned.items()))
            cost = (len(report.mixing) + len(report.unsafe_writes), len(walker.pad_origins))
            return _WalkResult(report, frozenset(walker.sensitive), cost)

        free = {leaf: pv.candidates(dtype) for leaf, dtype in dtypes.items() if leaf not in given}
        return _choose(walk, free, {leaf: v for leaf, v in given.items() if leaf in dtypes})
    except Exception as exc:          # noqa: BLE001 - an unreadable graph is treated as mixing (refused), not trusted
        log.info("gearcache: the padding analysis failed", exc_info=True)
        reason = f"the graph could not be analysed ({type(exc).__name__}: {str(exc).strip()[:200]})"
        return PaddingReport(False, [Finding("(whole graph)", "", reason, "every output")], [],
                             sorted({r[1] for r in trace.inputs if r[0] == "leaf"}),
                             sorted({r[1] for r in trace.inputs if r[0] == "state"}), pad_values=given)


@dataclasses.dataclass(frozen=True)
class _WalkResult:
    """One walk of the graph with some pad values: its report, the padded leaves whose pad values could change a
    finding, and its cost (findings, then ops other pad values could make exact: fewer is better)."""
    report: PaddingReport
    sensitive: frozenset[Any]
    cost: tuple[int, int]


def _choose(walk: Callable[[dict[int, PadValue]], _WalkResult], free: dict[int, list[PadValue]],
            given: dict[int, PadValue]) -> PaddingReport:
    """The report of the first pad values (``given`` kept, each ``free`` leaf from its candidates, the first of each
    to begin with) that leave no finding a pad value could change; else the report of the lowest cost. Only the
    leaves such findings depend on are varied, all their combinations, at most :data:`MAX_WALKS` walks."""
    best = walk({**{leaf: c[0] for leaf, c in free.items()}, **given})
    walks = 1
    for _ in range(3):
        vary = sorted(best.sensitive & set(free))
        if not vary or walks >= MAX_WALKS or best.cost[1] == 0:
            break
        improved = False
        for combo in itertools.product(*[free[leaf] for leaf in vary]):
            trial = {**best.report.pad_values, **dict(zip(vary, combo))}
            if trial == best.report.pad_values or walks >= MAX_WALKS:
                continue
            tried = walk(trial)
            walks += 1
            if tried.cost < best.cost:
                best, improved = tried, True
                if best.cost[1] == 0:
                    break
        if not improved:
            break
    return best.report


def _leaf_dtypes(graph: torch.fx.GraphModule, inputs: list[list[Any]],
                 padded_leaves: set[int]) -> dict[int, torch.dtype]:
    """The dtype of each padded leaf that is a graph input (a padded leaf the graph never reads is not one)."""
    out = {}
    for node, recipe in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        value = node.meta.get("example_value")
        if recipe[0] == "leaf" and recipe[1] in padded_leaves and isinstance(value, torch.Tensor):
            out[recipe[1]] = value.dtype
    return out


def _gear_symbols(graph: torch.fx.GraphModule, inputs: list[list[Any]], padded_leaves: set[int],
                  same: dict[Any, Any]) -> frozenset[Any]:
    """The sympy symbols of the marked dims: every free symbol of a padded leaf's example sizes."""
    symbols: set[Any] = set()       # sympy symbols
    for node, recipe in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        if recipe[0] == "leaf" and recipe[1] in padded_leaves:
            for size in getattr(node.meta.get("example_value"), "shape", ()):
                symbols |= getattr(size_expr(size, same), "free_symbols", set())
    return frozenset(symbols)


def _guard_findings(guards: list[tuple[Any, str]], symbols: frozenset[Any], same: dict[Any, Any]) -> list[Finding]:
    """A size guard on a padded dim beyond ``s >= 2``, an upper bound or two marked dims being equal: the method took
    a Python branch on that size, which a smaller real size may take otherwise."""
    found = []
    for expr, where in guards:
        expr = expr.xreplace(same) if hasattr(expr, "xreplace") else expr
        if expr is sympy.true:
            continue            # Eq(s91, s77) once both are one symbol
        if getattr(expr, "free_symbols", set()) & symbols and not _benign_guard(expr):
            found.append(Finding("(size guard)", where.strip(), f"the traced graph holds only while {expr}: the "
                                 f"method branches on the size of a padded dim", "every output"))
    return found


def _unique(guards: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    out, seen = [], set()
    for expr, where in guards:
        if str(expr) not in seen:
            seen.add(str(expr))
            out.append((expr, where))
    return out


def _specialized_findings(graph: torch.fx.GraphModule, symbols: frozenset[Any]) -> list[Finding]:
    """A padded dim's symbol the shape environment replaced by a number (torch_shapes.specialized_sizes): the ATen graph
    holds that number where the size was, so the walk would read the padded dim as static and prove nothing."""
    return [Finding("(size specialized)", "", f"tracing the graph to ATen ops fixed the padded size {sym} to {value} "
                    f"(this torch's lowering), so the graph cannot be read for other sizes", "every output")
            for sym, value in torch_shapes.specialized_sizes(graph).items() if sym in symbols]


def _benign_guard(expr: Any) -> bool:
    """``s >= c`` with c <= 2 (Dynamo's own assumption for dynamic sizes) or ``s <= c`` (the trace ran at the largest
    gear, so every real size meets it)."""
    if not isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan, sympy.LessThan, sympy.StrictLessThan)):
        return False
    lhs, rhs = expr.lhs, expr.rhs
    if lhs.is_number and rhs.is_Symbol:                       # c < s  ->  s > c
        expr = expr.reversed
        lhs, rhs = expr.lhs, expr.rhs
    if not (lhs.is_Symbol and rhs.is_number):
        return False
    if isinstance(expr, (sympy.LessThan, sympy.StrictLessThan)):
        return True
    lowest = rhs + 1 if isinstance(expr, sympy.StrictGreaterThan) else rhs
    return bool(lowest <= 2)
