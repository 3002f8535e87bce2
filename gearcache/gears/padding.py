"""Padding analysis: can padding a geared method's call change its results or its state? Proved from the graph.

A call is padded up to its gear (gears.py): its marked dims get extra rows of a pad value, the gear's entry runs, the
outputs are cut back. That is exact when the real rows never see the padded ones, or see them only through an op the
pad value leaves unchanged, and when nothing outside the padded copies is written through them. This module proves
that, once per gear plan, for every op of the method's graph, from the plan's symbolic trace (capture.symbolic_shapes:
a Dynamo graph whose marked dims are SymInts), retraced to ATen ops (``_torch.aten.aten_graph``), where every op has
a schema saying which arguments it writes and which it returns a view of. Nothing runs on real data, so a result
holds for every call, device and dtype: no sample is taken.

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

**Rules**, by op (the rest of the module): pointwise ops (``torch.Tag.pointwise``), views, and ops that work row by
row (a matmul over an unpadded contraction dim, norms over unpadded dims, ``all_reduce``) keep padded rows in line.
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

On disk (the gear plan's JSON, key ``"padding"``): see padding_report.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
import re
from typing import TYPE_CHECKING, Any, Callable, Union, cast

import sympy
import torch

from .._torch import aten as torch_aten, shapes as torch_shapes
from . import pad_values as pv
from .pad_values import UNKNOWN, PadValue
from .padding_report import Finding, PaddingReport

if TYPE_CHECKING:
    from ..compiling.capture import SymbolicTrace

log = logging.getLogger("gearcache")
Dim = tuple  # factors outer to inner: an int (a plain factor > 1) or a sympy expression (a padded one); () is size 1
MAX_WALKS = 48
"""Walks of the graph the pad value search may take (each with other pad values for the inputs a finding needs)."""


def analyse(trace: "SymbolicTrace", names: dict[int, str], padded_leaves: set[int],
            pads: dict[int, PadValue] | None = None, bounds: dict[str, int] | None = None) -> PaddingReport:
    """Analyse the gear plan's symbolic trace (capture.symbolic_shapes); ``names``: leaf index -> argument name, for
    messages; ``padded_leaves``: the leaves with marked dims; ``pads``: the pad values the user gave (exact in the
    leaf's dtype, see ``pad_values.exact``), kept as they are; the others are chosen (``report.pad_values``);
    ``bounds``: each marked dim's symbol (as in ``trace.symbols``) -> its largest gear (positions ``arange`` makes
    over a padded size are valid indices below it)."""
    given = dict(pads or {})
    try:
        symbols = _gear_symbols(trace.graph, trace.inputs, padded_leaves, trace.same)     # before a lowering fixes one
        aten = torch_aten.aten_graph(trace.graph)
        dtypes = _leaf_dtypes(trace.graph, trace.inputs, padded_leaves)
        # the lowering to ATen may have guarded or specialized a padded size (torch 2.11's matmul): read after it
        guard_findings = _guard_findings(_unique(trace.size_guards + torch_shapes.shape_guards(trace.graph)), symbols,
                                         trace.same) + _specialized_findings(trace.graph, symbols)

        def walk(assigned: dict[int, PadValue]) -> _Walk:
            analysis = _Analysis(aten, trace.inputs, trace.outputs, names, padded_leaves, symbols, trace.same,
                                 assigned, bounds)
            report = analysis.run()
            report.mixing.extend(guard_findings)
            report.pad_values = dict(sorted(assigned.items()))
            cost = (len(report.mixing) + len(report.unsafe_writes), len(analysis.pad_origins))
            return _Walk(report, frozenset(analysis.sensitive), cost)

        free = {leaf: pv.candidates(dtype) for leaf, dtype in dtypes.items() if leaf not in given}
        return _choose(walk, free, {leaf: v for leaf, v in given.items() if leaf in dtypes})
    except Exception as exc:          # noqa: BLE001 - an unreadable graph is treated as mixing (refused), not trusted
        log.info("gearcache: the padding analysis failed", exc_info=True)
        reason = f"the graph could not be analysed ({type(exc).__name__}: {str(exc).strip()[:200]})"
        return PaddingReport(False, [Finding("(whole graph)", "", reason, "every output")], [],
                             sorted({r[1] for r in trace.inputs if r[0] == "leaf"}),
                             sorted({r[1] for r in trace.inputs if r[0] == "state"}), pad_values=given)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """One walk of the graph with some pad values: its report, the padded leaves whose pad values could change a
    finding, and its cost (findings, then ops other pad values could make exact: fewer is better)."""
    report: PaddingReport
    sensitive: frozenset
    cost: tuple[int, int]


def _choose(walk: Callable[[dict], _Walk], free: dict[int, list], given: dict[int, PadValue]) -> PaddingReport:
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


def _leaf_dtypes(graph: torch.fx.GraphModule, inputs: list[list], padded_leaves: set[int]) -> dict[int, torch.dtype]:
    """The dtype of each padded leaf that is a graph input (a padded leaf the graph never reads is not one)."""
    out = {}
    for node, recipe in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        value = node.meta.get("example_value")
        if recipe[0] == "leaf" and recipe[1] in padded_leaves and isinstance(value, torch.Tensor):
            out[recipe[1]] = value.dtype
    return out


def _gear_symbols(graph: torch.fx.GraphModule, inputs: list[list], padded_leaves: set[int], same: dict) -> frozenset:
    """The sympy symbols of the marked dims: every free symbol of a padded leaf's example sizes."""
    symbols: set = set()
    for node, recipe in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        if recipe[0] == "leaf" and recipe[1] in padded_leaves:
            for size in getattr(node.meta.get("example_value"), "shape", ()):
                symbols |= getattr(_size(size, same), "free_symbols", set())
    return frozenset(symbols)


def _guard_findings(guards: list[tuple[Any, str]], symbols: frozenset, same: dict) -> list[Finding]:
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


def _specialized_findings(graph: torch.fx.GraphModule, symbols: frozenset) -> list[Finding]:
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


# ---------------------------------------------------------------------------------------------- abstract values
@dataclasses.dataclass(frozen=True)
class _Origin:
    """Why a value's real rows may differ from eager's: the op that made it so."""
    op: str
    where: str
    why: str
    positional: bool        # the op moves rows (a write through such a view lands elsewhere than eager's)
    pads: frozenset | None = None   # the padded leaves whose pad values could make the op exact (None: none could)


@dataclasses.dataclass(frozen=True)
class _Positions:
    """The pad of ``arange(start, start + s)`` over a padded size ``s``: element i holds ``start + i``, so the padded
    rows hold positions past every real one, below ``start + bound`` (``bound``: the largest gear of ``s``; None if
    unknown)."""
    start: int
    bound: int | None


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """The pad of ``index_select(src, dim, index)`` along a padded index: every element holds ``src``'s value at
    ``index`` along ``dim`` (``src``, ``index``: their nodes; ``writes``: ``src``'s storage's writes then)."""
    src: str
    writes: int
    dim: int
    index: str


@dataclasses.dataclass(frozen=True)
class _Broadcast:
    """A pad region that repeats real data: each padded element equals the element at a real index of the padded dim
    (a tensor without the padded dim expanded over it, and what row-wise ops make of it): as valid an index as the
    real rows, never a neutral value."""


BROADCAST = _Broadcast()
Held = Union[PadValue, _Positions, _Gathered, _Broadcast, None]
"""What a pad region holds: a constant, positions, values gathered from a tensor, copies of real rows, or UNKNOWN."""


@dataclasses.dataclass(frozen=True)
class _Pad:
    """What a value's pad region holds: a constant (exact in the value's dtype), a symbolic value, or UNKNOWN."""
    value: Held = UNKNOWN
    leaves: frozenset = frozenset()     # the padded leaves whose pad values it follows from (or that could make an
    #                                     UNKNOWN one known: a result that was not exact)
    follows: bool = True                # its pad region lies inside its storage's (a write into it reaches it)


NO_PAD = _Pad()
"""Real data in the pad region (or no pad region): no pad value of any input changes that."""


@dataclasses.dataclass
class _Tensor:
    dims: tuple             # one Dim per dim
    dirty: _Origin | None
    base: str               # the storage it views: the name of the node that made it
    moved: _Origin | None = None    # an op on the way here moved rows (a write through it lands elsewhere)
    pad: _Pad = NO_PAD      # its pad region's values when it was made (see _Analysis.pad: writes change them)
    dtype: torch.dtype = torch.float32
    seen: int = 0           # how many writes its storage had when it was made
    name: str = ""          # the node that made it


@dataclasses.dataclass
class _Storage:
    """A storage the graph reads or makes: its dims, what its pad region holds, how often it was written."""
    dims: tuple
    pad: _Pad
    writes: int = 0
    fresh: bool = False     # made by a factory op (empty, zeros, full...): no real rows of its own until written
    const: Held = UNKNOWN   # the value of every element (a fill never written since), or UNKNOWN


@dataclasses.dataclass
class _Size:
    """A SymInt, SymFloat or SymBool the graph computes."""
    padded: bool            # depends on a marked dim's size
    dirty: _Origin | None


def _size(value: Any, same: dict) -> Any:
    """A size as an int, or a sympy expression when it involves a symbol (each symbol replaced by the one ``same``
    says it equals: see capture.size_classes)."""
    expr = torch_shapes.sym_expr(value)
    if isinstance(expr, (int, bool)):
        return int(expr)
    return int(expr) if getattr(expr, "is_number", False) else expr.xreplace(same)


def _padded(dim: Dim) -> bool:
    return any(not isinstance(f, int) for f in dim)


def _dim_size(dim: Dim) -> Any:
    return sympy.Mul(*dim) if any(not isinstance(f, int) for f in dim) else math.prod(dim)


def _canonical(dim: Dim) -> tuple:
    """Adjacent plain factors merged: two dims hold their padded rows in line iff these are equal."""
    out: list = []
    for f in dim:
        if isinstance(f, int) and out and isinstance(out[-1], int):
            out[-1] *= f
        elif f != 1:
            out.append(f)
    return tuple(out)




def _whole(x: Any) -> bool:
    """A positive integer, or an expression with no denominator (``4 * s / s``, ``s``)."""
    if isinstance(x, int):
        return x >= 1
    x = sympy.cancel(x)
    return bool(sympy.fraction(x)[1] == 1) and not (x.is_number and x < 1)


def _regroup(dims: tuple, sizes: list) -> tuple | None:
    """The factors of ``dims`` (in row-major order) regrouped into dims of ``sizes``, as ``view``/``reshape`` does;
    None when that would split a padded factor (its rows would no longer line up)."""
    queue = [f for d in dims for f in d if f != 1]
    out = []
    for size in sizes:
        group, prod = [], 1
        while not _equal(prod, size):
            if not queue:
                return None
            f = queue[0]
            rest = _divide(size, _mul(prod, f))
            if rest is not None:
                group.append(queue.pop(0))
                prod = _mul(prod, f)
                continue
            need = _divide(size, prod)
            left = _divide(f, need) if need is not None and isinstance(f, int) and isinstance(need, int) else None
            if left is None:
                return None
            group.append(need)
            queue[0] = left
            prod = size
        out.append(tuple(group))
    return tuple(out) if not queue else None


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0)


def _mul(a: Any, b: Any) -> Any:
    return a * b if isinstance(a, int) and isinstance(b, int) else sympy.sympify(a) * b


def _divide(a: Any, b: Any) -> Any:
    """``a / b`` when it is whole (see :func:`_whole`), else None."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b if b and a % b == 0 else None
    q = sympy.cancel(sympy.sympify(a) / b)
    if not _whole(q):
        return None
    return int(q) if q.is_number else q


def _numel(dims: tuple) -> Any:
    return _dim_size(tuple(f for d in dims for f in d))


_LIBRARY = re.compile(r"/(torch|gearcache)/|/(contextlib|functools)\.py$")


def _where(node: torch.fx.Node) -> str:
    """``file:line in function: code`` of the user's source line that made ``node`` (from its stack trace): the
    innermost frame outside torch and gearcache, else the innermost frame."""
    lines = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((m.group(1), f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}: {code}"))
    user = [text for path, text in frames if not _LIBRARY.search(path)]
    return (user or [text for _, text in frames] or [""])[-1]


# ------------------------------------------------------------------------------------------------------ analysis
class _Analysis:
    """One pass over the ATen graph in program order (see the module docstring), with a pad value per padded leaf."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: list[list], outputs: dict[int, int],
                 names: dict[int, str], padded_leaves: set[int], symbols: frozenset, same: dict,
                 pads: dict[int, PadValue], bounds: dict[str, int] | None = None):
        self.graph, self.inputs, self.outputs, self.names = graph, inputs, outputs, names
        self.padded_leaves, self.symbols, self.same, self.pads = padded_leaves, symbols, same, pads
        self.bounds = bounds or {}                      # symbol -> its largest gear
        self.met: dict = {}                             # symbol -> the symbol it met (see ``aligned``)
        self.env: dict[torch.fx.Node, Any] = {}
        self.input_of: dict[str, list] = {}             # base name -> input recipe, for the graph's inputs
        self.storage_dirty: dict[str, _Origin] = {}     # base name -> why data written into it is dirty
        self.storage: dict[str, _Storage] = {}          # base name -> its dims, pad and writes
        self.sensitive: set[int] = set()                # padded leaves whose pad values a finding depends on
        self.pad_origins: set[_Origin] = set()          # ops other pad values could make exact
        self.report = PaddingReport()

    def run(self) -> PaddingReport:
        placeholders = iter(self.inputs)
        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self._placeholder(node, next(placeholders))
            elif node.op == "get_attr":
                value = getattr(self.graph, node.target)
                self.env[node] = self._new(node.name, self._dims(getattr(value, "shape", ())),
                                           getattr(value, "dtype", torch.float32), NO_PAD)
                self.storage[node.name].const = _graph_constant(value)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                self._outputs(node)
        r = self.report
        r.written_leaves, r.written_state = sorted(set(r.written_leaves)), sorted(set(r.written_state))
        r.mixing, r.unsafe_writes = list(dict.fromkeys(r.mixing)), list(dict.fromkeys(r.unsafe_writes))
        return r

    def _placeholder(self, node: torch.fx.Node, recipe: list) -> Any:
        value = node.meta.get("val", node.meta.get("example_value"))
        if not isinstance(value, torch.Tensor):
            return _Size(self._is_padded(value), None)
        self.input_of[node.name] = recipe
        pad = NO_PAD
        if recipe[0] == "leaf" and recipe[1] in self.pads:
            pad = _Pad(self.pads[recipe[1]], frozenset([recipe[1]]))
        return self._new(node.name, self._dims(value.shape), value.dtype, pad)

    def _new(self, base: str, dims: tuple, dtype: torch.dtype, pad: _Pad) -> _Tensor:
        """A tensor with a storage of its own (a graph input, or an op's new output)."""
        self.storage[base] = _Storage(dims, pad)
        return _Tensor(dims, None, base, pad=pad, dtype=dtype, name=base)

    def pad(self, t: _Tensor) -> _Pad:
        """What ``t``'s pad region holds now: as when it was made, unless its storage was written since."""
        storage = self.storage.get(t.base)
        if storage is None or storage.writes == t.seen:
            return t.pad
        return storage.pad if t.pad.follows else _Pad(UNKNOWN, frozenset(), False)

    def constant(self, t: _Tensor) -> Held:
        """The value every element of ``t`` holds, when its storage is a fill never written since (a scalar tensor,
        ``torch.zeros``): an operand that holds it everywhere, its pad included; else UNKNOWN."""
        storage = self.storage.get(t.base)
        return storage.const if storage is not None else UNKNOWN

    def writes(self, t: _Tensor) -> int:
        """How many writes ``t``'s storage has had."""
        storage = self.storage.get(t.base)
        return storage.writes if storage is not None else 0

    def bound(self, dim: Dim) -> int | None:
        """The largest size a dim that is one marked dim's symbol takes (its largest gear); None if unknown."""
        factors = _canonical(dim)
        if len(factors) != 1 or isinstance(factors[0], int):
            return None
        return self.bounds.get(str(factors[0].xreplace(self.met)))

    def adopt(self, target: _Tensor, src: _Tensor) -> None:
        """A fresh tensor the graph made and never wrote (``_Storage.fresh``), about to be filled whole by ``src``
        of the same shape: it takes ``src``'s dims (their factors: which rows are real), as it holds no rows of its
        own yet."""
        storage = self.storage.get(target.base)
        if storage is None or not storage.fresh or storage.writes or target.dims != storage.dims or \
                len(src.dims) != len(target.dims) or target.dims == src.dims:
            return
        if all(_equal(_dim_size(x), _dim_size(y)) for x, y in zip(target.dims, src.dims)):
            target.dims = storage.dims = src.dims

    def evaluated(self, node: torch.fx.Node, dims: tuple, only: list[torch.fx.Node] | None = None) -> _Pad:
        """The pad of an elementwise op's output of ``dims``: the op run on its inputs' pad values (pad_values.
        evaluate), when every tensor input (or each of ``only``) covers every padded dim of the output; NO_PAD
        when one is real data there."""
        if not any(_padded(d) for d in dims):
            return NO_PAD
        inputs: list[tuple[torch.fx.Node, PadValue, torch.dtype, int]] = []
        leaves: frozenset = frozenset()
        unknown = False
        args = only if only is not None else node.all_input_nodes
        operands = [self.env.get(arg) for arg in args]
        if _copies_real_rows(self, operands, dims):
            return _Pad(BROADCAST)
        for arg, value in zip(args, operands):
            if not isinstance(value, _Tensor):
                return NO_PAD
            p = self.pad(value) if _covers(value.dims, dims) else _Pad(self.constant(value))
            if not _covers(value.dims, dims) and not pv.known(p.value):
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
            return _Pad(UNKNOWN, leaves)
        return _Pad(pv.evaluate(torch_aten.aten_op(node), tuple(node.args), dict(node.kwargs), inputs, meta.dtype),
                    leaves)

    def _is_padded(self, value: Any) -> bool:
        return bool(getattr(self._size(value), "free_symbols", set()) & self.symbols)

    def _dims(self, shape: Any) -> tuple:
        """Dims of a shape. Every symbolic size is taken as padded (the trace's only symbols are the marked dims';
        any other, e.g. a data-dependent size, is treated as padded too: the safe side)."""
        return tuple(() if s == 1 else (s,) for s in map(self._size, shape))

    def _size(self, value: Any) -> Any:
        return _size(value, self.same)

    def aligned(self, x: Dim, y: Dim) -> bool:
        """Whether two dims hold their padded rows in line. Two dims that are each one marked dim's symbol, and
        differ, *meet* here: they are taken as equal from now on (``report.meets``; the gear plan then keeps them in
        lockstep, and a call whose real sizes differ there is refused instead of broadcast)."""
        if not _padded(x) and not _padded(y):
            return True
        cx, cy = (tuple(f.xreplace(self.met) if not isinstance(f, int) else f for f in _canonical(d)) for d in (x, y))
        if cx == cy:
            return True
        if len(cx) == len(cy) == 1 and cx[0] in self.symbols and cy[0] in self.symbols:
            low, high = sorted((cx[0], cy[0]), key=str)
            self.met = {k: (low if v == high else v) for k, v in self.met.items()}
            self.met[high] = low
            self.report.meets.append([str(low), str(high)])
            return True
        return False

    def _outputs(self, node: torch.fx.Node) -> None:
        for i, arg in enumerate(node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]):
            value = self.env.get(arg) if isinstance(arg, torch.fx.Node) else None
            dirty = self._dirt(value)
            if dirty is not None:
                self._mixing(dirty, f"output {self.outputs.get(i, i)}")
            elif isinstance(value, _Size) and value.padded:
                self.report.mixing.append(Finding(str(arg.target), _where(arg), "returns the size of a padded dim",
                                                  f"output {self.outputs.get(i, i)}"))

    def _mixing(self, origin: _Origin, reaches: str) -> None:
        self.report.mixing.append(Finding(origin.op, origin.where, origin.why, reaches))

    # -------------------------------------------------------------------------------------------- one op
    def _call(self, node: torch.fx.Node) -> Any:
        if node.target is operator.getitem:
            return self.env[cast(torch.fx.Node, node.args[0])][node.args[1]]
        schema = torch_aten.op_schema(node.target)
        if schema is None:
            return self._python_op(node)
        args = self._bind(schema, node)
        name = _op_name(node)
        functional = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        rule = _pointwise if torch.Tag.pointwise in torch_aten.aten_op(node).tags else RULES.get(functional, _unknown)
        produced = rule(self, node, args)
        value = self._values(node, schema, args, produced)
        if rule in (_fresh, _like) and isinstance(value, _Tensor) and value.base in self.storage:
            storage = self.storage[value.base]
            storage.fresh = True
            if isinstance(value.pad.value, (bool, int, float)):   # a fill: every element holds it
                storage.const = value.pad.value
        for arg, spec in zip(schema.arguments, node.args):
            if spec is not None and arg.alias_info is not None and arg.alias_info.is_write:
                self._write(node, args[arg.name], value, args)
        if functional in UNDECLARED_WRITES and args.get("training"):
            for name in UNDECLARED_WRITES[functional]:
                self._write(node, args.get(name), value, args)
        return value

    def _bind(self, schema: Any, node: torch.fx.Node) -> dict[str, Any]:
        """The op's arguments by schema name, each as an abstract value (or the constant itself)."""
        bound = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args):
                raw = node.args[i]
            elif arg.name in node.kwargs:
                raw = node.kwargs[arg.name]
            else:
                raw = arg.default_value if arg.has_default_value() else None
            bound[arg.name] = self._value(raw)
        return bound

    def _value(self, raw: Any) -> Any:
        if isinstance(raw, torch.fx.Node):
            return self.env.get(raw)
        if isinstance(raw, (list, tuple)):
            return [self._value(r) for r in raw]
        return raw

    def _python_op(self, node: torch.fx.Node) -> Any:
        """Arithmetic on sizes (``operator.mul``, ``sym_float``, ...): a size, dirty if its operands are."""
        inputs = [self.env.get(a) for a in node.all_input_nodes]
        dirty = next((d for d in map(self._dirt, inputs) if d is not None), None)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            t = self._new(node.name, self._dims(value.shape), value.dtype, NO_PAD)
            t.dirty = dirty or self._origin(node, ("an op without a rule", False))
            return t
        return _Size(self._is_padded(value), dirty)

    def _dirt(self, value: Any) -> _Origin | None:
        """Why ``value`` (a tensor, a size, or a list of them) may differ from eager's; None if it cannot."""
        if isinstance(value, _Tensor):
            return value.dirty or self.storage_dirty.get(value.base)
        if isinstance(value, _Size):
            return value.dirty
        if isinstance(value, list):
            return next((d for d in map(self._dirt, value) if d is not None), None)
        return None

    def _origin(self, node: torch.fx.Node, why: tuple) -> _Origin:
        """``why``: ``(reason, positional)`` or ``(reason, positional, pads)`` (see :class:`_Origin`). An origin other
        pad values could remove is counted (``pad_origins``) and its leaves noted (``sensitive``), also where the
        value it makes dirty was dirty already: the pad search then sees every op it has to satisfy at once."""
        origin = _Origin(str(node.target), _where(node), why[0], why[1], why[2] if len(why) > 2 else None)
        if origin.pads is not None:
            self.pad_origins.add(origin)
            self.sensitive |= origin.pads
        return origin

    def _values(self, node: torch.fx.Node, schema: Any, args: dict[str, Any], produced: Any) -> Any:
        """The node's abstract value(s) from what its rule produced: ``(dims, why[, pad])``, or a list of them."""
        inherited = self._dirt(list(args.values()))
        moved = next((t.moved for t in _tensors(list(args.values())) if t.moved is not None), None)
        meta = node.meta.get("val")
        base = self._aliased_base(schema, args)
        if isinstance(produced, list):
            metas = list(meta) if isinstance(meta, (list, tuple)) else [None] * len(produced)
            return [self._one(node, p, m, (inherited, moved), base or f"{node.name}.{k}", f"{node.name}.{k}")
                    for k, (p, m) in enumerate(zip(produced, metas))]
        return self._one(node, produced, meta, (inherited, moved), base or node.name, node.name)

    def _one(self, node: torch.fx.Node, produced: tuple, meta: Any, given: tuple, base: str, name: str) -> Any:
        """One output: its dims checked against the node's shape; dirty from its inputs (``given``: their dirt and
        whether a view on their way moved rows) or from the op itself; its pad (a view's follows its storage)."""
        (inherited, moved), (dims, why) = given, produced[:2]
        pad = produced[2] if len(produced) > 2 else NO_PAD
        own = None if why is None else self._origin(node, why)
        if not isinstance(meta, torch.Tensor):
            return _Size(self._is_padded(meta), inherited or own) if meta is not None else None
        if dims is None or len(dims) != meta.dim() or not all(
                _equal(_dim_size(d), self._size(s)) for d, s in zip(dims, meta.shape)):
            dims = self._dims(meta.shape)               # a rule that does not follow the shapes: trust nothing
            own = own or self._origin(node, ("its shapes do not follow the analysis' rule for it", True))
            pad = NO_PAD
        dirty, moved = inherited or own, own if own is not None and own.positional else moved
        storage = self.storage.get(base)
        if storage is None:
            t = self._new(base, tuple(dims), meta.dtype, pad)
            t.dirty, t.moved = dirty, moved
            return t
        return _Tensor(tuple(dims), dirty, base, moved, pad, meta.dtype, storage.writes, name)

    @staticmethod
    def _aliased_base(schema: Any, args: dict[str, Any]) -> str | None:
        """The base of the argument the op returns a view of (or writes in place and returns), if any."""
        ret = schema.returns[0] if schema.returns else None
        sets = set(ret.alias_info.before_set) if ret is not None and ret.alias_info is not None else set()
        for arg in schema.arguments:
            value = args.get(arg.name)
            if arg.alias_info is not None and isinstance(value, _Tensor) and (
                    sets & set(arg.alias_info.before_set) or (ret is not None and str(ret.type).endswith("[]"))):
                return value.base
        return None

    # ------------------------------------------------------------------------------------------ writes
    def _write(self, node: torch.fx.Node, target: Any, value: Any, args: dict[str, Any]) -> None:
        """An in-place write into ``target`` (see the module docstring, "Findings")."""
        if not isinstance(target, _Tensor):
            return
        result = value[0] if isinstance(value, list) else value
        written = result if isinstance(result, _Tensor) and result.base == target.base else None
        dirty = self._dirt(result) if isinstance(result, _Tensor) else self._dirt(list(args.values()))
        dirty = dirty or self._lands_in_real_rows(node, target, written)
        if dirty is not None:
            self.storage_dirty.setdefault(target.base, dirty)
        self._write_pad(target, written)
        recipe = self.input_of.get(target.base)
        if recipe is None or recipe[0] == "size":
            return                                          # a tensor the graph made itself
        what = self._input_name(recipe)
        if recipe[0] == "leaf" and recipe[1] in self.padded_leaves:
            self.report.written_leaves.append(recipe[1])
            if dirty is not None:
                self._mixing(dirty, what)
            return
        if recipe[0] == "leaf":
            self.report.written_leaves.append(recipe[1])
        elif recipe[0] == "state":
            self.report.written_state.append(recipe[1])
        why = self._unsafe_write(target, args)
        if why is not None:
            self.report.unsafe_writes.append(Finding(str(node.target), _where(node), why, what))
        elif dirty is not None:
            self._mixing(dirty, what)

    def _lands_in_real_rows(self, node: torch.fx.Node, target: _Tensor, written: _Tensor | None) -> _Origin | None:
        """Why a write through ``target`` puts padding rows where its storage has real ones: ``target`` has a
        padded factor its storage lacks (``buf[:B] = x`` into a ``buf`` of 8 rows: the padded rows land on rows
        eager leaves alone). Harmless when they write what those rows hold (a fill never written since: zeros
        written over zeros); None then, and for a target whose padded factors are its storage's."""
        storage = self.storage.get(target.base)
        if storage is None:
            return None
        own = {self._factor(f) for d in storage.dims for f in _canonical(d) if not isinstance(f, int)}
        if all(self._factor(f) in own for d in target.dims for f in _canonical(d) if not isinstance(f, int)):
            return None
        p = self.pad(written) if written is not None else NO_PAD
        if pv.known(storage.const) and pv.known(p.value) and pv.same(p.value, storage.const):
            return None
        return self._origin(node, (f"writes padding rows into rows that are real in the tensor it writes (they "
                                   f"hold {_held(p.value)} there; eager leaves {_held(storage.const)})", MOVES,
                                   p.leaves))

    def _factor(self, f: Any) -> Any:
        return f.xreplace(self.met) if not isinstance(f, int) else f

    def _write_pad(self, target: _Tensor, result: _Tensor | None) -> None:
        """The pad of ``target``'s storage after the write (``result``: the op's output viewing it, holding what was
        written): the written pad where the write covers the whole storage; kept where the written pad equals it;
        else unknown. Every view of the storage made before sees it from now on (:meth:`pad`)."""
        storage = self.storage.get(target.base)
        if storage is None:
            return
        new = self.pad(result) if result is not None else NO_PAD
        whole = target.pad.follows and _equal(_numel(target.dims), _numel(storage.dims))
        old = storage.pad
        if not whole and not (old.value is not UNKNOWN and new.value is not UNKNOWN and pv.same(old.value, new.value)):
            new = _Pad(UNKNOWN, old.leaves | new.leaves if old.leaves and new.leaves else frozenset())
        storage.pad = _Pad(new.value, new.leaves)
        storage.writes += 1
        storage.const = UNKNOWN

    def _unsafe_write(self, target: _Tensor, args: dict[str, Any]) -> str | None:
        if any(_padded(d) for d in target.dims):
            return "writes through a padded dim, so the padding rows land in it too"
        if target.moved is not None:
            return f"writes where {target.moved.op} ({target.moved.why}) points, which moves with the padded size"
        for value in _tensors(list(args.values())):
            if value is not target and any(_padded(d) for d in value.dims):
                return "writes with a padded tensor (its padding rows are written too, or pick where to write)"
        return None

    def _input_name(self, recipe: list) -> str:
        if recipe[0] == "state":
            return f"parameter or buffer {recipe[1]}"
        if recipe[0] == "leaf":
            return f"argument {self.names.get(recipe[1], f'input {recipe[1]}')}"
        return "a graph input"


def _copies_real_rows(a: _Analysis, operands: list, dims: tuple) -> bool:
    """Whether an elementwise op's output of ``dims`` repeats real rows in its pad region: every operand that covers
    its padded dims holds copies of real rows there (``_Broadcast``), the others are real data broadcast over them."""
    covering = [t for t in operands if isinstance(t, _Tensor) and _covers(t.dims, dims)]
    return bool(covering) and all(isinstance(t, _Tensor) for t in operands) and all(
        a.pad(t).value is BROADCAST for t in covering)


def _graph_constant(value: Any) -> Held:
    """The value of a one-element constant tensor of the graph (its every element); UNKNOWN for anything else."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex() or value.is_meta:
        return UNKNOWN
    try:
        return value.reshape(()).item()
    except Exception:                   # noqa: BLE001 - a tensor without data (fake): unknown
        return UNKNOWN


def _tensors(values: list) -> list[_Tensor]:
    out = []
    for v in values:
        if isinstance(v, _Tensor):
            out.append(v)
        elif isinstance(v, list):
            out.extend(_tensors(v))
    return out


def _covers(op: tuple, out: tuple) -> bool:
    """Whether an operand of dims ``op``, broadcast to ``out``, has every padded dim of ``out`` (so each element of
    the output's pad region reads the operand's pad region)."""
    lead = len(out) - len(op)
    return all(k >= lead and _padded(op[k - lead]) for k, d in enumerate(out) if _padded(d))


# --------------------------------------------------------------------------------------------------------- rules
# A rule takes (analysis, node, arguments by schema name) and returns (dims, why[, pad]) for the op's output -- dims:
# one Dim per output dim, or None to take them from the node's shape; why: None, or (reason, positional[, pads]) when
# the op itself may make the output's real rows differ from eager's (pads: the padded leaves whose pad values could
# make it exact); pad: what the output's pad region holds (NO_PAD when omitted) -- or a list of such tuples for an op
# with several outputs.
Out = tuple
MOVES, MIXES = True, False


def _op_name(node: torch.fx.Node) -> str:
    """The name of the ATen op ``node`` calls, without its overload (``"add"``, ``"index_put_"``)."""
    return torch_aten.aten_op(node).overloadpacket.__name__


def _meta_dims(a: _Analysis, node: torch.fx.Node, k: int | None = None) -> tuple:
    meta: Any = node.meta.get("val")
    if k is not None:
        meta = meta[k]
    return a._dims(meta.shape)


def _meta_dtype(node: torch.fx.Node) -> torch.dtype:
    meta = node.meta.get("val")
    return meta.dtype if isinstance(meta, torch.Tensor) else torch.float32


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _dim_list(dim: Any, rank: int) -> list[int]:
    """A ``dim`` argument as a list of non-negative dims; None or [] means every dim."""
    if dim is None or dim == []:
        return list(range(rank))
    dims = dim if isinstance(dim, list) else [dim]
    return [_norm_dim(int(d), rank) for d in dims]


def _any_padded(dims: tuple, which: list[int]) -> bool:
    return any(_padded(dims[d]) for d in which if d < len(dims))


def _sizes_used_as_values(values: list) -> bool:
    return any(isinstance(v, _Size) and v.padded for v in values) or any(
        _sizes_used_as_values(v) for v in values if isinstance(v, list))


def _constant(value: Any, dtype: torch.dtype) -> _Pad:
    """The pad of a tensor filled with ``value`` (a Python number; anything else: real data)."""
    if isinstance(value, (bool, int, float)):
        try:
            return _Pad(pv.exact(value, dtype))
        except ValueError:
            return NO_PAD
    return NO_PAD


def _needs(a: _Analysis, t: _Tensor, kind: str, what: str) -> Any:
    """Why ``what`` over a padded dim of ``t`` is not exact (None when ``t``'s pad is neutral for ``kind``)."""
    p = a.pad(t)
    if pv.is_neutral(kind, p.value, t.dtype):
        return None
    return (f"{what} over a padded dim: exact only if its padded rows hold {pv.describe(pv.neutral(kind, t.dtype))}, "
            f"but they hold {_held(p.value)}", MIXES, p.leaves)


def _index_valid(a: _Analysis, index: Any, size: Any, negative: bool) -> Any:
    """Why reading positions from ``index``'s pad region could go out of range (None when its pad is a valid
    position into a dim of ``size``; ``negative``: the op takes positions from the end too)."""
    if not isinstance(index, _Tensor) or not any(_padded(d) for d in index.dims):
        return None
    if index.dtype in (torch.bool, torch.uint8):
        return ("indexes with a padded mask (the padded rows choose elements too)", MOVES)
    p = a.pad(index)
    v = p.value
    low = -size if negative and isinstance(size, int) else (-1 if negative else 0)
    high = size if isinstance(size, int) else 1
    if isinstance(v, int) and not isinstance(v, bool) and low <= v < high:
        return None
    if isinstance(v, _Positions) and v.bound is not None and low <= v.start and v.start + v.bound <= high:
        return None
    if v is BROADCAST:                  # the real rows' positions again: valid where eager's are
        return None
    return (f"reads positions from padded rows that hold {_held(v)}, which is not a valid position (0 to "
            f"{size if isinstance(size, int) else 'its size'} - 1)", MOVES, p.leaves)


def _held(v: Held) -> str:
    """What a pad region holds, for a message."""
    if v is BROADCAST:
        return "copies of real rows"
    if isinstance(v, _Positions):
        bound = f"below {v.start + v.bound}" if v.bound is not None else "with no known bound"
        return f"the positions after the real ones ({v.start} + row, {bound})"
    if isinstance(v, _Gathered):
        return "values gathered from another tensor"
    return pv.describe(v)


def _broadcast(a: _Analysis, node: torch.fx.Node, tensors: list[_Tensor]) -> Out:
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


def _pointwise(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    dims, why = _broadcast(a, node, _tensors(list(args.values())))
    if why is None and _sizes_used_as_values([v for v in args.values() if not isinstance(v, _Tensor)]):
        why = ("uses the size of a padded dim as a value", MIXES)
    random = torch.Tag.nondeterministic_seeded in torch_aten.aten_op(node).tags
    if random:
        return dims, why, NO_PAD
    return dims, why, _symbolic(a, node, args, dims) or a.evaluated(node, dims)


def _symbolic(a: _Analysis, node: torch.fx.Node, args: dict, dims: tuple) -> _Pad | None:
    """The pad of ``where`` when its condition's pad is a known bool (the chosen operand's, positions or gathered
    values included, remembering that the condition's padded inputs chose it), or of positions plus or minus an int;
    None for the general case (``evaluated``)."""
    name = _op_name(node)
    if name == "where":
        cond = args.get("condition")
        if not isinstance(cond, _Tensor) or not _covers(cond.dims, dims) or not isinstance(a.pad(cond).value, bool):
            return None
        chosen = args.get("self") if a.pad(cond).value else args.get("other")
        out = _meta_dtype(node)
        if isinstance(chosen, _Tensor):
            p = a.pad(chosen) if _covers(chosen.dims, dims) else _Pad(a.constant(chosen))
            value = p.value if chosen.dtype == out or not pv.known(p.value) else pv.convert(p.value, out)
            if not pv.known(value) and chosen.dtype != out:
                value = UNKNOWN
        else:
            p, value = NO_PAD, _constant(chosen, out).value
        return _Pad(value, p.leaves | a.pad(cond).leaves)
    if name in ("add", "sub") and args.get("alpha", 1) == 1:
        x, y = args.get("self"), args.get("other")
        if isinstance(x, _Tensor) and isinstance(y, int) and not isinstance(y, bool):
            p = a.pad(x)
            if isinstance(p.value, _Positions) and _covers(x.dims, dims):
                return _Pad(_Positions(p.value.start + (y if name == "add" else -y), p.value.bound))
    return None


def _unknown(a: _Analysis, node: torch.fx.Node, args: dict) -> Any:
    """An op without a rule: mixing if it reads anything padded (or a padded size)."""
    values = list(args.values())
    touches = any(any(_padded(d) for d in t.dims) for t in _tensors(values)) or _sizes_used_as_values(values)
    why = ("has no padding rule in gearcache, so it is assumed to mix padded rows in", MOVES) if touches else None
    meta = node.meta.get("val")
    if isinstance(meta, (list, tuple)):
        return [(None if not isinstance(m, torch.Tensor) else a._dims(m.shape), why) for m in meta]
    return (None if not isinstance(meta, torch.Tensor) else a._dims(meta.shape)), why


def _same(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """Same dims as ``self`` (or the first tensor argument), nothing mixed: clone, copy to a dtype, tril, alias."""
    self_arg = args.get("self")
    first = self_arg if isinstance(self_arg, _Tensor) else _tensors(list(args.values()))[0]
    symbolic = [v for k, v in args.items() if k in ("diagonal",)]
    why = ("shifts rows by the size of a padded dim", MOVES) if _sizes_used_as_values(symbolic) else None
    if _op_name(node) in ("tril", "triu"):          # zeros in part of the pad region, the pad elsewhere
        p = a.pad(first)
        return first.dims, why, p if pv.is_neutral("zero", p.value, first.dtype) else NO_PAD
    tensor_args = [n for n in node.all_input_nodes if isinstance(a.env.get(n), _Tensor)][:1]
    return first.dims, why, a.evaluated(node, first.dims, tensor_args)


_FILLS = {"zeros": 0, "new_zeros": 0, "zeros_like": 0, "zero": 0, "ones": 1, "new_ones": 1, "ones_like": 1}


def _fresh(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """A new tensor (zeros, full, arange, *_like): dims from its shape; mixing only if a value is a padded size."""
    name = _op_name(node)
    values = [v for k, v in args.items() if k in ("fill_value", "value", "start", "step", "low", "high")]
    if name == "scalar_tensor":
        values = [args.get("s")]
    if name == "linspace":
        values += [args.get("end"), args.get("steps")]
    random = name in RANDOM and any(_padded(d) for d in _meta_dims(a, node))
    why = ("uses the size of a padded dim as a value", MIXES) if _sizes_used_as_values(values) else None
    fill = _FILLS.get(name, args.get("fill_value", args.get("s")) if name in (
        "full", "new_full", "full_like", "scalar_tensor") else None)
    dims = _meta_dims(a, node)
    pad = _constant(fill, _meta_dtype(node))
    start, step = args.get("start", 0), args.get("step", 1)
    if name == "arange" and len(dims) == 1 and _padded(dims[0]) and isinstance(start, int) and step == 1:
        pad = _Pad(_Positions(start, a.bound(dims[0])))
    return dims, (("draws random numbers over a padded dim", MIXES) if random else why), pad


def _like(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    _, why, pad = _fresh(a, node, args)
    return args["self"].dims, why, pad


def _fill(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    value = args.get("value")
    if isinstance(value, _Tensor):
        return _broadcast(a, node, [args["self"], value])
    return args["self"].dims, (("uses the size of a padded dim as a value", MIXES)
                               if _sizes_used_as_values([value]) else None), _constant(value, args["self"].dtype)


def _copy(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """copy_(self, src): ``src``'s values (and pad, converted to ``self``'s dtype) in ``self``'s place. A new tensor
    the graph made and never wrote (``torch.empty(n * B)`` filled by a collective) takes the layout of what fills it
    whole (its dim of ``n * B`` rows becomes ``src``'s ``(n, B)``)."""
    a.adopt(args["self"], args["src"])
    dims, why = _broadcast(a, node, [args["self"], args["src"]])
    src = args["src"]
    p = a.pad(src) if _covers(src.dims, dims) else _Pad(a.constant(src))
    return dims, why, _Pad(pv.convert(p.value, args["self"].dtype), p.leaves)


def _sym_size(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    return None, None


# ------------------------------------------------------------------------------------------------ views
def _view_pad(a: _Analysis, t: _Tensor) -> _Pad:
    """The pad of a view of ``t`` (or of an op that moves its elements along unpadded dims): ``t``'s, but values
    gathered along a dim (``_Gathered``, which names that dim) are not followed through it."""
    p = a.pad(t)
    return NO_PAD if isinstance(p.value, _Gathered) else p


def _view(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    sizes = [a._size(s) for s in node.meta["val"].shape]
    dims = _regroup(args["self"].dims, sizes)
    if dims is None:
        return None, ("reshapes a padded dim so that its rows no longer line up", MOVES)
    return dims, None, _view_pad(a, args["self"])


def _expand(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src, out = args["self"].dims, list(_meta_dims(a, node))
    lead = len(out) - len(src)
    spread = any(_padded(out[k]) for k in range(lead)) or any(
        d == () and _padded(out[lead + k]) for k, d in enumerate(src))
    for k, d in enumerate(src):
        if d != ():
            out[lead + k] = d
    if spread and not any(map(_padded, src)):      # real rows repeated over the padded dims
        return tuple(out), None, _Pad(BROADCAST, frozenset(), False)
    return tuple(out), None, _Pad(UNKNOWN, frozenset(), False) if spread else _view_pad(a, args["self"])


def _permute(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = args["self"].dims
    return tuple(src[_norm_dim(d, len(src))] for d in args["dims"]), None, _view_pad(a, args["self"])


def _transpose(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = list(args["self"].dims)
    if len(src) < 2:
        return tuple(src), None, _view_pad(a, args["self"])
    i, j = (_norm_dim(args["dim0"], len(src)), _norm_dim(args["dim1"], len(src))) if "dim0" in args else (0, 1)
    src[i], src[j] = src[j], src[i]
    return tuple(src), None, _view_pad(a, args["self"])


def _unsqueeze(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = list(args["self"].dims)
    src.insert(_norm_dim(args["dim"], len(src) + 1), ())
    return tuple(src), None, _view_pad(a, args["self"])


def _squeeze(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = args["self"].dims
    named = _dim_list(args.get("dim"), len(src))
    if _any_padded(src, named):
        return None, ("squeezes a padded dim, which a real size of 1 would remove", MOVES)
    return tuple(d for k, d in enumerate(src) if not (k in named and d == ())), None, _view_pad(a, args["self"])


def _slice(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = list(args["self"].dims)
    dim = _norm_dim(args["dim"], len(src))
    out = list(_meta_dims(a, node))
    if _sizes_used_as_values([args.get("start"), args.get("step")]):
        return None, ("slices from a position that moves with the size of a padded dim", MOVES)
    if _padded(src[dim]) and args.get("start") in (0, None) and out[dim] == ():    # x[:1]: the first row is real
        return tuple(src[:dim] + [()] + src[dim + 1:]), None, _view_pad(a, args["self"])
    if _padded(src[dim]) and len(_canonical(src[dim])) > 1:
        return None, ("slices a dim that merges a padded dim with others", MOVES)
    if _padded(src[dim]) and not _padded(out[dim]):
        return None, ("slices a padded dim to a fixed size, which may take padding rows in", MOVES)
    return tuple(src[:dim] + [out[dim]] + src[dim + 1:]), None, _view_pad(a, args["self"])


def _select(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = list(args["self"].dims)
    dim = _norm_dim(args["dim"], len(src))
    index = args.get("index")
    if _padded(src[dim]) and not (isinstance(index, int) and index == 0 and len(_canonical(src[dim])) == 1):
        return None, ("selects a row of a padded dim other than the first (the last real row moves with the "
                      "padding)", MOVES)
    return tuple(src[:dim] + src[dim + 1:]), None, _view_pad(a, args["self"])


def _split(a: _Analysis, node: torch.fx.Node, args: dict) -> list:
    src = list(args["self"].dims)
    dim = _norm_dim(args.get("dim", 0) or 0, len(src))
    metas = node.meta["val"]
    why = ("splits a padded dim into pieces", MOVES) if _padded(src[dim]) else None
    unbind = _op_name(node) == "unbind"
    pad = _view_pad(a, args["self"])
    return [((tuple(src[:dim] + src[dim + 1:]) if unbind else
              tuple(src[:dim] + [a._dims(m.shape)[dim]] + src[dim + 1:])) if why is None else None, why, pad)
            for m in metas]


# ---------------------------------------------------------------------------------------------- reductions
NEVER_NEUTRAL = {"mean": "a mean divides by the padded count", "var": "a variance counts the padded rows",
                 "var_mean": "a variance counts the padded rows", "std": "a deviation counts the padded rows",
                 "std_mean": "a deviation counts the padded rows", "median": "a median ranks the padded rows",
                 "nanmedian": "a median ranks the padded rows", "mode": "a mode counts the padded rows",
                 "kthvalue": "a k-th value ranks the padded rows", "aminmax": "no one pad is neutral for min and max"}


def _reduce(a: _Analysis, node: torch.fx.Node, args: dict) -> Any:
    """Reductions (sum, mean, amax, var, argmax, norm, ...): exact over a padded dim when the pad is neutral for the
    op (pad_values.REDUCTIONS); a mean or variance never is. Positions (argmax, ``max(dim)``'s indices) are exact
    when the padded factor is the outermost of the dims reduced."""
    x = args["self"]
    src = x.dims
    reduced = _dim_list(args.get("dim"), len(src)) if "dim" in args else list(range(len(src)))
    name = _op_name(node)
    why = _reduction_why(a, node, x, name) if _any_padded(src, reduced) else None
    factors = [f for k in sorted(reduced) for f in _canonical(src[k])]
    moved = ("returns positions along dims whose padded factor is not the outermost (the real rows' positions move "
             "with the padded size)", MOVES) if any(not isinstance(f, int) for f in factors[1:]) else None
    meta = node.meta["val"]
    metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
    outs = []
    for k, m in enumerate(metas):
        keep = m.dim() == len(src)
        dims = tuple(() if i in reduced else d for i, d in enumerate(src)) if keep else tuple(
            d for i, d in enumerate(src) if i not in reduced)
        positions = name in ("argmin", "argmax") or k == 1
        pad = NO_PAD if positions else _reduced_pad(a.pad(x), name, m.dtype)
        outs.append((dims, (why or moved) if positions else why, pad))
    return outs if isinstance(meta, (list, tuple)) else outs[0]


def _reduction_why(a: _Analysis, node: torch.fx.Node, x: _Tensor, name: str) -> Any:
    """Why a reduction over a padded dim of ``x`` is not exact (None when its pad is neutral for it)."""
    kind = pv.REDUCTIONS.get(name)
    if name == "linalg_vector_norm":
        order = node.kwargs.get("ord", node.args[1] if len(node.args) > 1 else 2)
        kind = "zero" if isinstance(order, (int, float)) and order >= 0 else None
    if kind is None:
        reason = NEVER_NEUTRAL.get(name, "no pad value is known to leave it unchanged")
        return f"reduces over a padded dim ({name}: {reason})", MIXES
    return _needs(a, x, kind, f"takes the {name}")


def _reduced_pad(p: _Pad, name: str, dtype: torch.dtype) -> _Pad:
    """The pad of a reduction's output: each element of its pad region reduces padded elements only."""
    v = p.value
    infinite = isinstance(v, float) and math.isinf(v)
    if v is UNKNOWN or not (name in ("amin", "amax", "min", "max", "any", "all") or (
            name in ("sum", "nansum", "mean") and (infinite or v == 0)) or (name == "logsumexp" and infinite) or (
            name == "prod" and not isinstance(v, bool) and v in (0, 1))):
        return _Pad(UNKNOWN, p.leaves)
    return _Pad(pv.convert(v, dtype), p.leaves)


CUMULATIVE = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}


def _along(a: _Analysis, node: torch.fx.Node, args: dict) -> Any:
    """Ops along one dim with the same shape out: a softmax along a padded dim is exact with ``-inf`` in its pad; a
    cumulative op along one is exact (the padding comes after every real row) unless its padded factor is not the
    outermost; sort and top-k along one mix."""
    x = args["self"]
    src = x.dims
    dim = _norm_dim(args.get("dim", -1) if args.get("dim") is not None else -1, len(src))
    name = _op_name(node)
    why, pad = None, NO_PAD
    if dim < len(src) and _padded(src[dim]):
        if name in pv.SOFTMAX:
            why = _needs(a, x, "bottom", f"takes a {name.strip('_')}")
            if why is None and sum(map(_padded, src)) == 1:    # exp(-inf) = 0 in the pad region
                pad = _Pad(-math.inf if "log" in name else 0.0, a.pad(x).leaves)
        elif name in CUMULATIVE:
            if any(not isinstance(f, int) for f in _canonical(src[dim])[1:]):
                why = ("works along a dim that merges a padded dim inside others (padding rows come before real "
                       "ones there)", MIXES)
        else:
            why = ("sorts or ranks along a padded dim", MIXES)
    meta = node.meta["val"]
    metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
    outs = [(src[:dim] + (a._dims(m.shape)[dim],) + src[dim + 1:] if m.dim() == len(src) else None, why, pad)
            for m in metas]
    return outs if isinstance(meta, (list, tuple)) else outs[0]


def _normalise(src: tuple, reduced: list[int]) -> Any:
    return ("normalises over a padded dim (its mean and variance count the padded rows)", MIXES) \
        if _any_padded(src, reduced) else None


def _layer_norm(a: _Analysis, node: torch.fx.Node, args: dict) -> list:
    """native_layer_norm (and the fused RMS norm): over the last dims; its statistics keep the others."""
    src = args["input"].dims
    reduced = list(range(len(src) - len(args["normalized_shape"]), len(src)))
    why = _normalise(src, reduced)
    stats = tuple(() if k in reduced else d for k, d in enumerate(src))
    return [(src, why)] + [(stats, why)] * (len(node.meta["val"]) - 1)


def _group_norm(a: _Analysis, node: torch.fx.Node, args: dict) -> list:
    """native_group_norm: over every dim but the batch; its statistics are [batch, groups]."""
    src = args["input"].dims
    why = _normalise(src, list(range(1, len(src))))
    return [(src, why)] + [((src[0],) + a._dims(m.shape)[1:], why) for m in list(node.meta["val"])[1:]]


def _batch_norm(a: _Analysis, node: torch.fx.Node, args: dict) -> list:
    """Batch norm: per channel from running statistics (nothing mixed), or from the batch's (training)."""
    src = args["input"].dims
    name = _op_name(node)
    training = name != "_native_batch_norm_legit_no_training" and bool(args.get("training"))
    why = _normalise(src, [k for k in range(len(src)) if k != 1] if training else [])
    return [(src, why)] + [(None, why)] * (len(node.meta["val"]) - 1)


# ------------------------------------------------------------------------------------------- contractions
def _contract(a: _Analysis, pairs: list[tuple[_Tensor, int, _Tensor, int]]) -> Any:
    """Why contracting each ``(x, i, y, j)`` (x's dim i with y's dim j) is not exact: a padded one is, when one
    operand's pad is 0 and the other's a finite constant (each padded term is then 0)."""
    for x, i, y, j in pairs:
        if not (_padded(x.dims[i]) or _padded(y.dims[j])):
            continue
        px, py = a.pad(x), a.pad(y)
        if (pv.is_neutral("zero", px.value, x.dtype) and pv.finite(py.value)) or (
                pv.is_neutral("zero", py.value, y.dtype) and pv.finite(px.value)):
            continue
        return (f"contracts over a padded dim (a matmul summing padded rows in): exact only if one operand's padded "
                f"rows hold 0 and the other's a finite number, but they hold {_held(px.value)} and "
                f"{_held(py.value)}", MIXES, px.leaves | py.leaves)
    return None


def _mm(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """mm, addmm (``self`` is addmm's bias)."""
    x, y = (args["mat1"], args["mat2"]) if "mat1" in args else (args["self"], args["mat2"])
    dims = (x.dims[0], y.dims[1])
    why = _contract(a, [(x, 1, y, 0)])
    bias = args["self"] if "mat1" in args else None
    if isinstance(bias, _Tensor) and why is None:
        _, why = _broadcast(a, node, [bias, _Tensor(dims, None, "")])
    return dims, why


def _bmm(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """bmm, baddbmm, addbmm (``self`` is the latter two's bias)."""
    x, y = (args["batch1"], args["batch2"]) if "batch1" in args else (args["self"], args["mat2"])
    why = _contract(a, [(x, 2, y, 1)])
    if why is None and not a.aligned(x.dims[0], y.dims[0]):
        why = ("multiplies batches whose padded rows do not line up", MOVES)
    dims: tuple = (x.dims[0] or y.dims[0], x.dims[1], y.dims[2])
    bias = args["self"] if "batch1" in args else None
    if _op_name(node) == "addbmm":
        dims, why = (x.dims[1], y.dims[2]), why or _contract(a, [(x, 0, y, 0)])
    if isinstance(bias, _Tensor) and why is None:
        _, why = _broadcast(a, node, [bias, _Tensor(dims, None, "")])
    return dims, why


def _mv(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """mv, addmv (``self`` is addmv's bias)."""
    x, v = args["mat"] if "mat" in args else args["self"], args["vec"]
    why = _contract(a, [(x, 1, v, 0)])
    if "mat" in args and why is None:
        _, why = _broadcast(a, node, [args["self"], _Tensor((x.dims[0],), None, "")])
    return (x.dims[0],), why


def _dot(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    x, y = _tensors(list(args.values()))[:2]
    return (), _contract(a, [(x, 0, y, 0)])


def _attention(a: _Analysis, node: torch.fx.Node, args: dict) -> Any:
    """``scaled_dot_product_attention`` and its kernels: batch and head dims and the query dim pass through; the key
    dim is summed over (exact with ``is_causal`` when queries and keys are padded alike: a real query never sees a
    later, padded key); the feature dim is contracted."""
    q, k, v = args["query"], args["key"], args["value"]
    mask = args.get("attn_mask", args.get("attn_bias"))
    keys, why = k.dims[-2], None
    causal = bool(args.get("is_causal")) and mask is None and _padded(keys) and a.aligned(q.dims[-2], keys)
    if _padded(keys) and not causal:
        why = ("attends over a padded key dim (softmax and sum over padded keys)", MIXES)
    why = why or _contract(a, [(q, len(q.dims) - 1, k, len(k.dims) - 1)])
    batch = [q.dims[:-2], k.dims[:-2], v.dims[:-2]]
    if why is None and not all(len(b) == len(batch[0]) and all(a.aligned(x, y) for x, y in zip(b, batch[0]))
                               for b in batch[1:]):
        why = ("attends across batch or head dims whose padded rows do not line up", MOVES)
    if why is None and isinstance(mask, _Tensor):
        _, why = _broadcast(a, node, [mask, _Tensor(q.dims[:-1] + (keys,), None, "")])
    out = (q.dims[:-1] + (v.dims[-1],), why)
    meta = node.meta["val"]
    if not isinstance(meta, (list, tuple)):
        return out
    extra = []            # the kernels' other outputs: log-sum-exp per query ([..., L]), seeds, sizes
    for m in meta[1:]:
        per_query = isinstance(m, torch.Tensor) and m.dim() == len(q.dims) - 1
        extra.append((q.dims[:-1] if per_query else None, why))
    return [out] + extra


def _spatial(leading: int) -> Callable:
    """Convolution, pooling, upsampling: the first ``leading`` dims pass through (batch, and channels where the op
    keeps them apart); the others are mixed."""
    def rule(a: _Analysis, node: torch.fx.Node, args: dict) -> Any:
        x = cast(_Tensor, args.get("input", args.get("self")))
        others = [t for t in _tensors(list(args.values())) if t is not x]
        why = ("mixes neighbouring rows of a padded dim (convolution, pooling or resampling)", MIXES) if (
            _any_padded(x.dims, list(range(leading, len(x.dims)))) or any(
                _padded(d) for t in others for d in t.dims)) else None
        meta = node.meta["val"]
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        outs = [(x.dims[:leading] + a._dims(m.shape)[leading:] if m.dim() == len(x.dims) else None, why)
                for m in metas]
        return outs if isinstance(meta, (list, tuple)) else outs[0]
    return rule


# ---------------------------------------------------------------------------------------------- indexing
def _embedding(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    weight, indices = args["weight"], args["indices"]
    why = ("looks rows up in a padded table", MOVES) if _padded(weight.dims[0]) else None
    why = why or _index_valid(a, indices, _dim_size(weight.dims[0]), negative=False)
    pad = _Pad(BROADCAST) if a.pad(indices).value is BROADCAST else NO_PAD     # rows looked up at real positions
    return indices.dims + weight.dims[1:], why, pad


def _index_select(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src, index = args["self"].dims, args["index"].dims
    dim = _norm_dim(args["dim"], len(src))
    why = ("gathers along a padded dim", MOVES) if _padded(src[dim]) else None
    why = why or _index_valid(a, args["index"], _dim_size(src[dim]), negative=False)
    pad = _view_pad(a, args["self"]) if not any(_padded(d) for d in index) else NO_PAD
    if why is None and any(_padded(d) for d in index):      # every element: self's value at index
        pad = _Pad(_Gathered(args["self"].name, a.writes(args["self"]), dim, args["index"].name))
    return src[:dim] + (index[0] if index else (),) + src[dim + 1:], why, pad


def _gather(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src, index = args["self"].dims, args["index"].dims
    dim = _norm_dim(args["dim"], len(src))
    why = ("gathers along a padded dim", MOVES) if _padded(src[dim]) else None
    if why is None and not all(a.aligned(s, i) or not _padded(s) and not _padded(i)
                               for k, (s, i) in enumerate(zip(src, index)) if k != dim):
        why = ("gathers with an index whose padded rows do not line up with the source's", MOVES)
    return index, why or _index_valid(a, args["index"], _dim_size(src[dim]), negative=False)


def _indexed(a: _Analysis, src: tuple, indices: list) -> tuple[tuple | None, Any]:
    """Dims of ``src[indices]`` (advanced indexing), and why it mixes (an indexed dim is padded, or an index's pad is
    not a valid position)."""
    used = [k for k, ix in enumerate(indices) if ix is not None]
    if any(_padded(src[k]) and not _identity(a, indices[k], src[k]) for k in used):
        return None, ("indexes into a padded dim", MOVES)
    for k in used:
        why = None if _identity(a, indices[k], src[k]) else _index_valid(a, indices[k], _dim_size(src[k]), True)
        if why is not None:
            return None, why
    tensors = [ix for ix in indices if isinstance(ix, _Tensor)]
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


def _identity(a: _Analysis, index: Any, dim: Dim) -> bool:
    """Whether ``index`` picks along the padded ``dim`` row i at its own row i: ``arange`` over that very padded size
    (positions from 0, its one padded dim in line with ``dim``), as transformers' mask functions index a padding
    mask by ``batch_idx``: rows stay in line."""
    if not isinstance(index, _Tensor) or not _padded(dim):
        return False
    p = a.pad(index).value
    padded = [d for d in index.dims if _padded(d)]
    return isinstance(p, _Positions) and p.start == 0 and len(padded) == 1 and len(_canonical(dim)) == 1 and \
        a.aligned(padded[0], dim)


def _index(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    indices = list(args["indices"]) + [None] * (len(args["self"].dims) - len(args["indices"]))
    dims, why = _indexed(a, args["self"].dims, indices)
    plain = not any(isinstance(ix, _Tensor) and any(_padded(d) for d in ix.dims) for ix in indices)
    return dims, why, _view_pad(a, args["self"]) if plain else NO_PAD


def _index_put(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    src = args["self"].dims
    indices = list(args["indices"]) + [None] * (len(src) - len(args["indices"]))
    if any(isinstance(ix, _Tensor) and any(_padded(d) for d in ix.dims) for ix in indices):
        return src, ("writes at positions taken from padded rows", MOVES)
    region, why = _indexed(a, src, indices)
    values = args["values"].dims
    if why is None and region is not None:
        for v, r in zip(reversed(values), reversed(region)):
            if v != () and not a.aligned(v, r):
                why = ("writes values whose padded rows do not line up with where they go", MOVES)
    return src, why, _kept_pad(a, args["self"], args["values"], region or src)


def _kept_pad(a: _Analysis, target: _Tensor, values: Any, region: tuple) -> _Pad:
    """The pad of ``target`` after ``values`` are written into its ``region``: kept when they hold the same pad
    (or a scalar equal to it), else unknown."""
    p = a.pad(target)
    written: Held
    if isinstance(values, _Tensor):
        q = a.pad(values) if _covers(values.dims, region) else NO_PAD
        written = pv.convert(q.value, target.dtype)
    else:
        written = _constant(values, target.dtype).value
    if pv.known(p.value) and pv.known(written) and pv.same(p.value, written):
        return p
    return _Pad(UNKNOWN, frozenset())


def _index_copy(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """index_copy, index_add, index_fill, scatter*: rows of ``dim`` chosen by an index."""
    src = args["self"].dims
    dim = _norm_dim(args["dim"], len(src))
    index = args.get("index")
    why: tuple | None = None
    source = args.get("source", args.get("src"))
    if _padded(src[dim]):
        why = ("writes into a padded dim at positions an index picks", MOVES)
    elif isinstance(index, _Tensor) and any(_padded(d) for d in index.dims) and (
            _op_name(node).startswith("index_") or len(index.dims) <= 1) and not _writes_back(a, node, args):
        leaves = a.pad(index).leaves | (a.pad(source).leaves if isinstance(source, _Tensor) else frozenset())
        why = ("writes at positions taken from padded rows", MOVES, leaves)
    if why is None and isinstance(source, _Tensor):
        for k, (s, d) in enumerate(zip(source.dims, src)):
            if k != dim and s != () and not a.aligned(s, d):
                why = ("writes values whose padded rows do not line up with where they go", MOVES)
        if why is None and isinstance(index, _Tensor) and len(index.dims) > 1 and not all(
                a.aligned(i, d) or i == () for i, d in zip(index.dims, src)):
            why = ("scatters with an index whose padded rows do not line up", MOVES)
    written = source if isinstance(source, _Tensor) else args.get("value")
    adds = _op_name(node) in ("index_add", "scatter_add", "scatter_reduce")
    return src, why, NO_PAD if adds else _kept_pad(a, args["self"], written, src)


def _writes_back(a: _Analysis, node: torch.fx.Node, args: dict) -> bool:
    """``self.index_copy(dim, index, source)`` whose padded rows write back what their slots hold: ``index``'s pad
    is positions past the real ones (``arange`` over the padded size: no padded row shares a slot with a real one;
    valid below the largest gear), and ``source``'s pad is ``self.index_select(dim, index)`` of ``self`` as it is
    now (as a KV cache update that keeps the old entry where a token is padding does)."""
    self_t, index, source = args["self"], args["index"], args.get("source")
    dim = _norm_dim(args["dim"], len(self_t.dims))
    if _op_name(node) != "index_copy" or not isinstance(source, _Tensor) or len(index.dims) != 1:
        return False
    if _index_valid(a, index, _dim_size(self_t.dims[dim]), negative=False) is not None:
        return False
    if not isinstance(a.pad(index).value, _Positions) or not _covers(source.dims, source.dims):
        return False
    return a.pad(source).value == _Gathered(self_t.name, a.writes(self_t), dim, index.name)


def _cat(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    tensors = [t for t in args["tensors"] if isinstance(t, _Tensor)]
    rank = node.meta["val"].dim()
    stack = _op_name(node) == "stack"
    dim = _norm_dim(args.get("dim", 0) or 0, rank)
    tensors = [t for t in tensors if len(t.dims) == rank - (1 if stack else 0)]
    along = [t.dims[dim] for t in tensors if _dim_size(t.dims[dim]) != 0] if not stack else []
    blocks = len(along) > 1 and any(map(_padded, along))
    if blocks and not all(a.aligned(along[0], d) for d in along[1:]):
        return None, ("concatenates along a padded dim (padding rows end up between real ones)", MOVES)
    others = [list(t.dims) for t in tensors]
    out = list(_meta_dims(a, node))
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


def _common_pad(a: _Analysis, tensors: list[_Tensor], dims: tuple) -> _Pad:
    """The pad of tensors put side by side (cat, stack): theirs when each covers the padded ``dims`` and all hold
    one value."""
    pads = [a.pad(t) for t in tensors]
    if not pads or not all(_covers(t.dims, dims) for t in tensors) or any(p.value is UNKNOWN for p in pads):
        return NO_PAD
    if not all(pv.same(p.value, pads[0].value) and t.dtype == tensors[0].dtype for p, t in zip(pads, tensors)):
        return NO_PAD
    return _Pad(pads[0].value, frozenset().union(*(p.leaves for p in pads)))


def _along_dims(kind: str) -> Callable:
    """flip, roll, repeat, constant_pad_nd: mixing if they act on a padded dim."""
    def rule(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
        src = args["self"].dims
        rank = len(src)
        if kind == "dims":
            acted = _dim_list(args.get("dims"), rank)
        elif kind == "pad":
            pad = args["pad"]
            acted = [rank - 1 - k // 2 for k in range(len(pad)) if not (isinstance(pad[k], int) and pad[k] == 0)]
        else:           # repeat: leading new dims, then one factor per dim
            reps = args["repeats"]
            lead = len(reps) - rank
            acted = [k for k in range(rank) if not (isinstance(reps[lead + k], int) and reps[lead + k] == 1)]
        if _any_padded(src, acted):
            return None, ("moves rows along a padded dim (flip, roll, repeat or pad)", MOVES)
        out = list(_meta_dims(a, node))
        lead = len(out) - rank
        for k, d in enumerate(src):
            if k not in acted:
                out[lead + k] = d
        p = _view_pad(a, args["self"])
        if kind == "pad" and acted:         # the new border of a padded row holds the border value
            p = p if pv.same(_constant(args.get("value", 0), args["self"].dtype).value, p.value) else NO_PAD
        return tuple(out), None, p
    return rule


# ------------------------------------------------------------------------------------------- collectives
def _collective(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """all_reduce, broadcast (``_c10d_functional``): each element combines the same element on every rank, so rows
    stay in line (every rank pads alike: they run one program on calls of one size). What the other ranks' padded
    rows hold is not followed: the output's pad is unknown."""
    return args["input"].dims, None


def _wait(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    return args["tensor"].dims, None, a.pad(args["tensor"])


def _rank_blocks(dim: Dim, n: int) -> tuple[Dim, Dim] | None:
    """``dim`` split into ``n`` rank blocks, outer to inner: (the blocks' factor, each block's factors); None when a
    padded factor would be cut across blocks (its rows would move between ranks with the padded size)."""
    if n == 1:
        return (), dim
    size = _divide(_dim_size(dim), n)
    groups = _regroup((dim,), [n, size]) if size is not None else None
    if groups is None or _padded(groups[0]):
        return None
    return groups[0], groups[1]


def _all_gather(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """all_gather_into_tensor: the ranks' inputs one after another along dim 0: dim 0 becomes ``(ranks, dim 0)``,
    each rank's rows in line inside its block (a view splitting it back keeps them)."""
    src, n = args["input"].dims, int(args["group_size"])
    if not src:
        return None, None
    return (((n,) if n > 1 else ()) + src[0],) + src[1:], None


def _reduce_scatter(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """reduce_scatter_tensor: dim 0 cut into one block per rank, each rank keeping the sum of its block: exact when
    dim 0's padded factor lies inside each block (a dim 0 of ``(ranks, s)``), so real rows stay real rows."""
    src, n = args["input"].dims, int(args["group_size"])
    blocks = _rank_blocks(src[0], n) if src else None
    if blocks is None:
        return None, ("reduce-scatters a padded dim 0 across ranks (each rank's block takes other rows with the "
                      "padded size)", MOVES)
    return (blocks[1],) + src[1:], None


def _all_to_all(a: _Analysis, node: torch.fx.Node, args: dict) -> Out:
    """all_to_all_single: dim 0 cut into one block per rank (equal splits) and the blocks exchanged: exact when dim 0
    is not padded, or its padded factor lies inside each block."""
    src = args["input"].dims
    splits = [a._size(s) if not isinstance(s, _Size) else None for s in args["input_split_sizes"] or []]
    outs = [a._size(s) if not isinstance(s, _Size) else None for s in args["output_split_sizes"] or []]
    if not src or not _padded(src[0]):
        return (_meta_dims(a, node)[0],) + src[1:] if src else (), None
    n = len(splits) or len(outs)
    equal = all(s is not None and _equal(s, splits[0]) for s in splits + outs) if splits else not outs
    blocks = _rank_blocks(src[0], n) if equal and n else None
    if blocks is None:
        return None, ("exchanges blocks of a padded dim 0 between ranks whose rows move with the padded size", MOVES)
    return src, None


UNDECLARED_WRITES = {name: ("running_mean", "running_var") for name in (
    "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm")}
"""Ops that write these arguments in training mode without their schema saying so."""

RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "normal", "uniform",
          "multinomial", "randperm", "exponential", "native_dropout", "dropout"}

RULES: dict[str, Callable] = {
    **dict.fromkeys(["clone", "_to_copy", "alias", "detach", "lift_fresh_copy", "lift_fresh", "contiguous",
                     "tril", "triu", "_assert_tensor_metadata", "to", "type_as", "_conj", "resolve_conj",
                     "resolve_neg", "positive"], _same),
    **dict.fromkeys(["zeros", "ones", "empty", "empty_strided", "full", "scalar_tensor", "arange", "eye",
                     "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "rand", "randn",
                     "randint", "randperm", "linspace"], _fresh),
    **dict.fromkeys(["zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                     "randint_like"], _like),
    "fill": _fill, "zero": _like, "copy": _copy,
    # elementwise ops whose overloads (or in-place forms) lack torch.Tag.pointwise
    **dict.fromkeys(["where", "masked_fill", "rsub", "hardswish"], _pointwise),
    **dict.fromkeys(["sym_size", "sym_numel", "sym_stride", "sym_storage_offset"], _sym_size),
    **dict.fromkeys(["view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy"], _view),
    "expand": _expand, "permute": _permute, "transpose": _transpose, "t": _transpose, "unsqueeze": _unsqueeze,
    "squeeze": _squeeze, "slice": _slice, "select": _select,
    **dict.fromkeys(["split", "split_with_sizes", "unbind", "chunk", "tensor_split", "unsafe_split",
                     "unsafe_split_with_sizes"], _split),
    **dict.fromkeys(["sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "var_mean",
                     "std", "std_mean", "any", "all", "logsumexp", "linalg_vector_norm", "norm", "nansum",
                     "count_nonzero", "median", "nanmedian", "mode", "kthvalue", "aminmax"], _reduce),
    **dict.fromkeys(["_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "cumsum", "cumprod",
                     "logcumsumexp", "cummax", "cummin", "sort", "argsort", "topk"], _along),
    "native_layer_norm": _layer_norm, "_fused_rms_norm": _layer_norm, "native_group_norm": _group_norm,
    **dict.fromkeys(["_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm"],
                    _batch_norm),
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
    "embedding": _embedding, "index_select": _index_select, "gather": _gather,
    **dict.fromkeys(["index", "_unsafe_index"], _index), **dict.fromkeys(["index_put", "_unsafe_index_put"],
                                                                        _index_put),
    **dict.fromkeys(["index_copy", "index_add", "index_fill", "scatter", "scatter_add", "scatter_reduce"],
                    _index_copy),
    **dict.fromkeys(["cat", "stack"], _cat),
    **dict.fromkeys(["flip", "roll"], _along_dims("dims")), "constant_pad_nd": _along_dims("pad"),
    "repeat": _along_dims("repeat"),
    **dict.fromkeys(["all_reduce", "broadcast"], _collective), "wait_tensor": _wait,
    "all_gather_into_tensor": _all_gather, "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
}
