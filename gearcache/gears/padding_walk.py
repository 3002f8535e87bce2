"""The padding walk: one pass over a gear plan's ATen graph in program order, following each node's abstract value.

:class:`GraphWalk` keeps, per node, its abstract value (padding_abstract.py: a ``TensorValue`` or ``SizeValue``), per
storage what its pad region holds and how often it was written, and applies to each op the rule the table
(padding_rules.py) names for it; it is the :class:`~gearcache.gears.padding_rule_context.RuleContext` rules read. It
follows in-place writes (an op's schema says which argument it writes; batch norm's running statistics by hand) and
reports, once the graph's outputs are reached, a :class:`~gearcache.gears.padding_report.PaddingReport`:

* ``mixing``: a dirty value reaching an output, or written into the state or an input (the op that made it dirty,
  where, why, what it reaches);
* ``unsafe_writes``: an in-place write into a module tensor or an unpadded input through a padded dim, through a view
  that moved rows, or with a padded tensor;
* ``written_leaves`` / ``written_state``: the call leaves and module tensors the graph writes in place;
* ``meets``: marked dims taken as equal because the graph combines them.

The walk runs with one pad value per padded leaf; ``sensitive`` and ``pad_origins`` (after :meth:`GraphWalk.run`)
tell the pad value search (padding.py) which leaves other values could help.
"""
from __future__ import annotations

import operator
from typing import Any, cast

import torch

from .._torch import aten as torch_aten
from .._torch.capture import source_line
from . import pad_values as pv
from .pad_values import UNKNOWN, PadValue
from .padding_cache import (CACHE_PADS, WRITTEN_OUT_STEPS, Roles, cache_from_leaf, mask_argument,
                            mask_from_leaf, written_out_attention)
from .padding_abstract import (NO_PAD, AbstractValue, Held, Origin, Pad, SizeValue, Storage, TensorValue, describe_held,
                               graph_constant, tensors_in)
from .padding_factors import Dim, canonical, dim_size, is_padded_dim, numel, same_size, size_expr
from .padding_report import Finding, PaddingReport
from .padding_rule_context import MOVES, Out, op_name
from .padding_rules import UNDECLARED_WRITES, rule_for
from .padding_rules_elementwise import FACTORIES


class GraphWalk:
    """One pass over the ATen graph in program order (see the module docstring), with a pad value per padded leaf."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: list[list[Any]], outputs: dict[int, int],
                 names: dict[int, str], padded_leaves: set[int], symbols: frozenset[Any], same: dict[Any, Any],
                 pads: dict[int, PadValue], bounds: dict[str, int] | None = None, roles: Roles | None = None):
        self.roles = roles or Roles()                   # the KV cache and causal mask leaves (padding_cache.py)
        self.placeholder_leaf: dict[torch.fx.Node, int] = {}
        self.causal_reads: set[torch.fx.Node] = set()   # attentions whose cache read is masked causally
        self.graph, self.inputs, self.outputs, self.names = graph, inputs, outputs, names
        self.padded_leaves, self.symbols, self.same, self.pads = padded_leaves, symbols, same, pads
        self.bounds = bounds or {}                      # symbol -> its largest gear
        self.met: dict[Any, Any] = {}                   # symbol -> the symbol it met (see ``aligned``): sympy's
        self.env: dict[torch.fx.Node, AbstractValue] = {}
        self.input_of: dict[str, list[Any]] = {}             # base name -> input recipe, for the graph's inputs
        self.storage_dirty: dict[str, Origin] = {}     # base name -> why data written into it is dirty
        self.storage: dict[str, Storage] = {}          # base name -> its dims, pad and writes
        self.sensitive: set[int] = set()                # padded leaves whose pad values a finding depends on
        self.pad_origins: set[Origin] = set()          # ops other pad values could make exact
        self.report = PaddingReport()
        self.writers: dict[str, list[torch.fx.Node]] = {}     # base name -> the nodes that wrote it in place

    def run(self) -> PaddingReport:
        """Walk every node in program order, then return the report (findings deduplicated, written indices sorted)."""
        placeholders = iter(self.inputs)
        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self._placeholder(node, next(placeholders))
            elif node.op == "get_attr":
                value = getattr(self.graph, node.target)
                self.env[node] = self._new(node.name, self.dims_of(getattr(value, "shape", ())),
                                           getattr(value, "dtype", torch.float32), NO_PAD)
                self.storage[node.name].const = graph_constant(value)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                self._outputs(node)
        r = self.report
        r.written_leaves, r.written_state = sorted(set(r.written_leaves)), sorted(set(r.written_state))
        r.mixing, r.unsafe_writes = list(dict.fromkeys(r.mixing)), list(dict.fromkeys(r.unsafe_writes))
        return r

    def _placeholder(self, node: torch.fx.Node, recipe: list[Any]) -> TensorValue | SizeValue:
        """A graph input: a size, or a tensor with its own storage whose pad is the leaf's pad value (if padded)."""
        value = node.meta.get("val", node.meta.get("example_value"))
        if not isinstance(value, torch.Tensor):
            return SizeValue(self._is_padded(value), None)
        self.input_of[node.name] = recipe
        if recipe[0] == "leaf":
            self.placeholder_leaf[node] = recipe[1]
        pad = NO_PAD
        if recipe[0] == "leaf" and recipe[1] in self.pads:
            pad = Pad(self.pads[recipe[1]], frozenset([recipe[1]]))
        return self._new(node.name, self.dims_of(value.shape), value.dtype, pad)

    def _new(self, base: str, dims: tuple[Dim, ...], dtype: torch.dtype, pad: Pad) -> TensorValue:
        """A tensor with a storage of its own (a graph input, or an op's new output)."""
        self.storage[base] = Storage(dims, pad)
        return TensorValue(dims, None, base, pad=pad, dtype=dtype, name=base)

    def pad(self, t: TensorValue) -> Pad:
        """What ``t``'s pad region holds now: as when it was made, unless its storage was written since."""
        storage = self.storage.get(t.base)
        if storage is None or storage.writes == t.seen:
            return t.pad
        return storage.pad if t.pad.follows else Pad(UNKNOWN, frozenset(), False)

    def constant(self, t: TensorValue) -> Held:
        """The value every element of ``t`` holds, when its storage is a fill never written since (a scalar tensor,
        ``torch.zeros``): an operand that holds it everywhere, its pad included; else UNKNOWN."""
        storage = self.storage.get(t.base)
        return storage.const if storage is not None else UNKNOWN

    def writes(self, t: TensorValue) -> int:
        """How many writes ``t``'s storage has had."""
        storage = self.storage.get(t.base)
        return storage.writes if storage is not None else 0

    def bound(self, dim: Dim) -> int | None:
        """The largest size a dim that is one marked dim's symbol takes (its largest gear); None if unknown."""
        factors = canonical(dim)
        if len(factors) != 1 or isinstance(factors[0], int):
            return None
        return self.bounds.get(str(factors[0].xreplace(self.met)))

    def adopt(self, target: TensorValue, src: TensorValue) -> None:
        """A fresh tensor the graph made and never wrote (``Storage.fresh``), about to be filled whole by ``src``
        of the same shape: it takes ``src``'s dims (their factors: which rows are real), as it holds no rows of its
        own yet."""
        storage = self.storage.get(target.base)
        if storage is None or not storage.fresh or storage.writes or target.dims != storage.dims or \
                len(src.dims) != len(target.dims) or target.dims == src.dims:
            return
        if all(same_size(dim_size(x), dim_size(y)) for x, y in zip(target.dims, src.dims)):
            target.dims = storage.dims = src.dims

    def _is_padded(self, value: Any) -> bool:
        return bool(getattr(self.size_of(value), "free_symbols", set()) & self.symbols)

    def dims_of(self, shape: Any) -> tuple[Dim, ...]:
        """Dims of a shape. Every symbolic size is taken as padded (the trace's only symbols are the marked dims';
        any other, e.g. a data-dependent size, is treated as padded too: the safe side)."""
        return tuple(() if s == 1 else (s,) for s in map(self.size_of, shape))

    def size_of(self, value: Any) -> Any:
        return size_expr(value, self.same)

    def value_of(self, node: torch.fx.Node) -> AbstractValue:
        """The abstract value of a node already walked (None if none)."""
        return self.env.get(node)

    def aligned(self, x: Dim, y: Dim) -> bool:
        """Whether two dims hold their padded rows in line. Two dims that are each one marked dim's symbol, and
        differ, *meet* here: they are taken as equal from now on (``report.meets``; the gear plan then keeps them in
        lockstep, and a call whose real sizes differ there is refused instead of broadcast)."""
        if not is_padded_dim(x) and not is_padded_dim(y):
            return True
        cx, cy = (tuple(f.xreplace(self.met) if not isinstance(f, int) else f for f in canonical(d)) for d in (x, y))
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
        """Findings for the graph's outputs: a dirty one mixes; a padded size returned is mixing too."""
        for i, arg in enumerate(node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]):
            value = self.env.get(arg) if isinstance(arg, torch.fx.Node) else None
            dirty = self._dirt(value)
            if dirty is not None:
                self._mixing(dirty, f"output {self.outputs.get(i, i)}")
            elif isinstance(value, SizeValue) and value.padded:
                self.report.mixing.append(Finding(str(arg.target), source_line(arg), "returns the size of a padded dim",
                                                  f"output {self.outputs.get(i, i)}"))

    def _mixing(self, origin: Origin, reaches: str) -> None:
        self.report.mixing.append(Finding(origin.op, origin.where, origin.why, reaches))

    # -------------------------------------------------------------------------------------------- one op
    def _call(self, node: torch.fx.Node) -> AbstractValue:
        """One ATen op: its arguments bound by schema name, its rule (padding_rules.rule_for) applied, its output's
        value made (:meth:`_values`), then its in-place writes followed (:meth:`_write`)."""
        if node.target is operator.getitem:
            outputs = cast(list[AbstractValue], self.env[cast(torch.fx.Node, node.args[0])])
            return outputs[cast(int, node.args[1])]
        schema = torch_aten.op_schema(node.target)
        if schema is None:
            return self._python_op(node)
        args = self._bind(schema, node)
        name = op_name(node)
        functional = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        rule = rule_for(node, functional)
        produced = rule(self, node, args)
        if functional in WRITTEN_OUT_STEPS and self._written_out_attention(node, list(args.values())):
            self.causal_reads.add(node)         # a step of an attention written out that hides the cache's pads
        written = [args[a.name] for a, spec in zip(schema.arguments, node.args)
                   if spec is not None and a.alias_info is not None and a.alias_info.is_write]
        if any(self.is_cache(t) for t in written):     # the cache's own write: exact by construction
            produced = [(p[0], None) + tuple(p[2:]) for p in produced] if isinstance(produced, list) else \
                (produced[0], None) + tuple(produced[2:])
        value = self._values(node, schema, args, produced)
        if rule in FACTORIES and isinstance(value, TensorValue) and value.base in self.storage:
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

    def _python_op(self, node: torch.fx.Node) -> TensorValue | SizeValue:
        """Arithmetic on sizes (``operator.mul``, ``sym_float``, ...): a size, dirty if its operands are."""
        inputs = [self.env.get(a) for a in node.all_input_nodes]
        dirty = next((d for d in map(self._dirt, inputs) if d is not None), None)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            t = self._new(node.name, self.dims_of(value.shape), value.dtype, NO_PAD)
            t.dirty = dirty or self._origin(node, ("an op without a rule", False))
            return t
        return SizeValue(self._is_padded(value), dirty)

    def _dirt(self, value: object) -> Origin | None:
        """Why ``value`` (a tensor, a size, or a list of them) may differ from eager's; None if it cannot."""
        if isinstance(value, TensorValue):
            return value.dirty or self.storage_dirty.get(value.base)
        if isinstance(value, SizeValue):
            return value.dirty
        if isinstance(value, list):
            return next((d for d in map(self._dirt, value) if d is not None), None)
        return None

    def _origin(self, node: torch.fx.Node, why: tuple[Any, ...]) -> Origin:
        """``why``: ``(reason, positional)`` or ``(reason, positional, pads)`` (see :class:`Origin`). An origin other
        pad values could remove is counted (``pad_origins``) and its leaves noted (``sensitive``), also where the
        value it makes dirty was dirty already: the pad search then sees every op it has to satisfy at once."""
        origin = Origin(str(node.target), source_line(node), why[0], why[1], why[2] if len(why) > 2 else None)
        if origin.pads is not None:
            self.pad_origins.add(origin)
            self.sensitive |= origin.pads
        return origin

    def _values(self, node: torch.fx.Node, schema: Any, args: dict[str, Any], produced: Any) -> AbstractValue:
        """The node's abstract value(s) from what its rule produced: ``(dims, why[, pad])``, or a list of them."""
        if node in self.causal_reads:       # an attention whose mask hides the cache's pads (padding_cache.py)
            inherited = next((d for d in map(self._dirt, args.values()) if d is not None and d is not CACHE_PADS),
                             None)
        else:
            inherited = self._dirt(list(args.values()))
        moved = next((t.moved for t in tensors_in(list(args.values())) if t.moved is not None), None)
        meta = node.meta.get("val")
        base = self._aliased_base(schema, args)
        if isinstance(produced, list):
            metas = list(meta) if isinstance(meta, (list, tuple)) else [None] * len(produced)
            return [self._one(node, p, m, (inherited, moved), base or f"{node.name}.{k}", f"{node.name}.{k}")
                    for k, (p, m) in enumerate(zip(produced, metas))]
        return self._one(node, produced, meta, (inherited, moved), base or node.name, node.name)

    def _one(self, node: torch.fx.Node, produced: Out, meta: Any, given: tuple[Origin | None, Origin | None], base: str,
             name: str) -> TensorValue | SizeValue | None:
        """One output: its dims checked against the node's shape; dirty from its inputs (``given``: their dirt and
        whether a view on their way moved rows) or from the op itself; its pad (a view's follows its storage)."""
        (inherited, moved), (dims, why) = given, produced[:2]
        pad = produced[2] if len(produced) > 2 else NO_PAD
        own = None if why is None else self._origin(node, why)
        if not isinstance(meta, torch.Tensor):
            return SizeValue(self._is_padded(meta), inherited or own) if meta is not None else None
        if dims is None or len(dims) != meta.dim() or not all(
                same_size(dim_size(d), self.size_of(s)) for d, s in zip(dims, meta.shape)):
            dims = self.dims_of(meta.shape)               # a rule that does not follow the shapes: trust nothing
            own = own or self._origin(node, ("its shapes do not follow the analysis' rule for it", True))
            pad = NO_PAD
        dirty, moved = inherited or own, own if own is not None and own.positional else moved
        storage = self.storage.get(base)
        if storage is None:
            t = self._new(base, tuple(dims), meta.dtype, pad)
            t.dirty, t.moved = dirty, moved
            return t
        return TensorValue(tuple(dims), dirty, base, moved, pad, meta.dtype, storage.writes, name)

    @staticmethod
    def _aliased_base(schema: Any, args: dict[str, Any]) -> str | None:
        """The base of the argument the op returns a view of (or writes in place and returns), if any."""
        ret = schema.returns[0] if schema.returns else None
        sets = set(ret.alias_info.before_set) if ret is not None and ret.alias_info is not None else set()
        for arg in schema.arguments:
            value = args.get(arg.name)
            if arg.alias_info is not None and isinstance(value, TensorValue) and (
                    sets & set(arg.alias_info.before_set) or (ret is not None and str(ret.type).endswith("[]"))):
                return value.base
        return None

    # ------------------------------------------------------------------------------------------ writes
    def _write(self, node: torch.fx.Node, target: object, value: AbstractValue, args: dict[str, Any]) -> None:
        """An in-place write into ``target`` (see padding.py's docstring, "Findings", and this module's)."""
        if not isinstance(target, TensorValue):
            return
        self.writers.setdefault(target.base, []).append(node)
        result = value[0] if isinstance(value, list) else value
        written = result if isinstance(result, TensorValue) and result.base == target.base else None
        dirty = self._dirt(result) if isinstance(result, TensorValue) else self._dirt(list(args.values()))
        if self.is_cache(target):
            self._write_cache(target, dirty)
            return
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
            self.report.unsafe_writes.append(Finding(str(node.target), source_line(node), why, what))
        elif dirty is not None:
            self._mixing(dirty, what)

    def is_cache(self, t: object) -> bool:
        """Whether ``t`` views a leaf the walk takes as a KV cache (padding_cache.py)."""
        recipe = self.input_of.get(t.base) if isinstance(t, TensorValue) else None
        return recipe is not None and recipe[0] == "leaf" and recipe[1] in self.roles.cache

    def cache_attention(self, node: torch.fx.Node, reads: list[TensorValue], is_causal: bool) -> bool:
        """Whether the attention ``node`` reading ``reads`` is exact as far as the KV cache goes: it reads no cache
        storage holding the padded rows' keys, or its mask is a causal leaf that keeps every key at its place (then
        its output drops the cache's dirt: ``causal_reads``). padding_cache.py says why."""
        if not any(self._dirt(t) is CACHE_PADS for t in reads):
            return True
        kv = node.args[1:3]
        if not all(cache_from_leaf(n, self.placeholder_leaf, self.roles.cache) and self.untouched(n) for n in kv) \
                or not self.no_cache_pads(node.args[0]):         # a query made from the cache sees its pads
            return False
        mask = mask_argument(node)
        if _keys_at(mask, -1) != _keys_at(kv[0], -2) or not self.untouched(mask):     # 1 key broadcast to all
            return False
        if is_causal or self._causal_mask_written() or not mask_from_leaf(mask, self.placeholder_leaf,
                                                                            self.roles.causal):
            return False
        self.causal_reads.add(node)
        return True

    def _written_out_attention(self, node: torch.fx.Node, args: list[Any]) -> bool:
        """Whether ``node``, reading a cache storage that holds the pads' keys, is a step of an attention written out
        that drops that dirt (padding_cache.written_out_attention), the causal mask unchanged in the graph."""
        return (any(self._dirt(t) is CACHE_PADS for t in tensors_in(args)) and not self._causal_mask_written()
                and written_out_attention(node, self.placeholder_leaf, self.roles, self))

    def no_cache_pads(self, node: Any) -> bool:
        """Whether ``node``'s value does not carry the cache's pads (:data:`CACHE_PADS`): an attention's query."""
        return not isinstance(node, torch.fx.Node) or self._dirt(self.env.get(node)) is not CACHE_PADS

    def untouched(self, node: Any) -> bool:
        """Whether no tensor ``node`` is computed from (itself included) was written in place, so far, by a node it
        is not computed from (``mask = mask.clone(); mask[..., 5:] = 0``), a KV cache's storage aside (its writes are
        the cache's): what padding_cache traced back to a leaf is what the attention reads. O(its ancestors)."""
        seen: set[torch.fx.Node] = set()
        todo = [node] if isinstance(node, torch.fx.Node) else []
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return not any(isinstance(v, TensorValue) and not self.is_cache(v) and
                       any(w not in seen for w in self.writers.get(v.base, ())) for v in map(self.env.get, seen))

    def _causal_mask_written(self) -> bool:
        """Whether the graph wrote a causal mask leaf in place (so far): it is no longer the mask transformers built."""
        return any(self.storage[n.name].writes for n, leaf in self.placeholder_leaf.items()
                   if leaf in self.roles.causal and n.name in self.storage)

    def _write_cache(self, target: TensorValue, dirty: Origin | None) -> None:
        """A write into a KV cache leaf: its storage holds the padded rows' keys from now on (``CACHE_PADS``), or
        the dirt written into it; the latter reaches the cache the caller keeps (a finding)."""
        real = dirty if dirty is not CACHE_PADS else None
        if real is not None:
            self.storage_dirty[target.base] = real
            self._mixing(real, self._input_name(self.input_of[target.base]))
        else:
            self.storage_dirty.setdefault(target.base, CACHE_PADS)
        self._write_pad(target, None)
        self.report.written_leaves.append(self.input_of[target.base][1])

    def _lands_in_real_rows(self, node: torch.fx.Node, target: TensorValue,
                            written: TensorValue | None) -> Origin | None:
        """Why a write through ``target`` puts padding rows where its storage has real ones: ``target`` has a
        padded factor its storage lacks (``buf[:B] = x`` into a ``buf`` of 8 rows: the padded rows land on rows
        eager leaves alone). Harmless when they write what those rows hold (a fill never written since: zeros
        written over zeros); None then, and for a target whose padded factors are its storage's."""
        storage = self.storage.get(target.base)
        if storage is None:
            return None
        own = {self._factor(f) for d in storage.dims for f in canonical(d) if not isinstance(f, int)}
        if all(self._factor(f) in own for d in target.dims for f in canonical(d) if not isinstance(f, int)):
            return None
        p = self.pad(written) if written is not None else NO_PAD
        if pv.known(storage.const) and pv.known(p.value) and pv.same(p.value, storage.const):
            return None
        return self._origin(node, (f"writes padding rows into rows that are real in the tensor it writes (they "
                                   f"hold {describe_held(p.value)} there; eager leaves "
                                   f"{describe_held(storage.const)})", MOVES, p.leaves))

    def _factor(self, f: Any) -> Any:
        return f.xreplace(self.met) if not isinstance(f, int) else f

    def _write_pad(self, target: TensorValue, result: TensorValue | None) -> None:
        """The pad of ``target``'s storage after the write (``result``: the op's output viewing it, holding what was
        written): the written pad where the write covers the whole storage; kept where the written pad equals it;
        else unknown. Every view of the storage made before sees it from now on (:meth:`pad`)."""
        storage = self.storage.get(target.base)
        if storage is None:
            return
        new = self.pad(result) if result is not None else NO_PAD
        whole = target.pad.follows and same_size(numel(target.dims), numel(storage.dims))
        old = storage.pad
        if not whole and not (old.value is not UNKNOWN and new.value is not UNKNOWN and pv.same(old.value, new.value)):
            new = Pad(UNKNOWN, old.leaves | new.leaves if old.leaves and new.leaves else frozenset())
        storage.pad = Pad(new.value, new.leaves)
        storage.writes += 1
        storage.const = UNKNOWN

    def _unsafe_write(self, target: TensorValue, args: dict[str, Any]) -> str | None:
        """Why an in-place write into a module tensor or an unpadded input changes state eager leaves alone
        (through a padded dim, through a view that moved rows, or with a padded tensor); None if it does not."""
        if any(is_padded_dim(d) for d in target.dims):
            return "writes through a padded dim, so the padding rows land in it too"
        if target.moved is not None:
            return f"writes where {target.moved.op} ({target.moved.why}) points, which moves with the padded size"
        for value in tensors_in(list(args.values())):
            if value is not target and any(is_padded_dim(d) for d in value.dims):
                return "writes with a padded tensor (its padding rows are written too, or pick where to write)"
        return None

    def _input_name(self, recipe: list[Any]) -> str:
        """How a finding names a graph input: ``parameter or buffer NAME``, ``argument NAME``."""
        if recipe[0] == "state":
            return f"parameter or buffer {recipe[1]}"
        if recipe[0] == "leaf":
            return f"argument {self.names.get(recipe[1], f'input {recipe[1]}')}"
        return "a graph input"


def _keys_at(node: Any, dim: int) -> str | None:
    """The size of dim ``dim`` of ``node``'s value as text (as padding_cache compares sizes), or None."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return str(value.shape[dim]) if isinstance(value, torch.Tensor) and value.dim() >= abs(dim) else None
