"""The torch.compile route for gears: ``torch.compile(model, fullgraph=True, backend=get_backend(compiler_config=c))``.

Dynamo traces once with the gear-marked dims dynamic (``set_dim_gears`` marks them), so changing sizes never
recompiles. Inside the backend, :class:`GearedGraph` resolves each call to its gear, pads, runs a static compiled
entry for that gear (specialised from the dynamic graph, compiled by Inductor once and persisted in the store through
the compile/load seam ``cache_compile``'s entries use, gearcache/compiling/pipeline.py), and cuts the outputs back.
Dynamo's own guards still run on this route (it is torch.compile's); ``cache_compile`` is the guard-free route.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .._torch import aten as torch_aten, shapes as torch_shapes
from ..gears import plan as gears
from ..call import signature
from ..config import CompilerConfig
from ..counters import counters
from ..errors import ConfigError, GearcacheError, PastLargestGearError
from ..keys import key as cache_keys
from ..store import Store
from .pipeline import ArtifactPipeline


def get_backend(compiler_config: CompilerConfig | None = None, *, cache_dir: str | None = None) -> Callable[..., Any]:
    """A Dynamo backend serving every gear of a graph from one trace. Pass it to ``torch.compile(backend=...)``."""
    config = compiler_config if compiler_config is not None else CompilerConfig()
    if not isinstance(config, CompilerConfig):
        raise ConfigError(f"compiler_config={config!r}: expected a gearcache.CompilerConfig")
    store = Store.from_config(cache_dir, config)

    def gearcache_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return GearedGraph(gm, list(example_inputs), config, store)

    return gearcache_backend


def _checked_gear_plan(gm: torch.fx.GraphModule, fakes: list[Any], marks: list[Any], symbols: list[str],
                       output_dims: dict[int, list[tuple[int, str]]], config: CompilerConfig) -> gears.GearPlan:
    """The graph's gear plan, with the padding analysis of the graph (gearcache/gears/padding.py) applied as
    ``inference_config.padding_check`` says (gearcache/gears/padding_check.py): a graph the analysis cannot prove exact
    under padding is refused unless the check is ``"off"``. This route has no method to run eagerly, so
    ``"verify"``'s test against eager does not run here (its proof does)."""
    from ..gears import padding, padding_check
    from ..gears.plan import SymbolicTrace
    from .symbolic_trace import size_classes
    from ..keys.guard_sets import GuardSet

    ic = config.inference_config
    guards = torch_shapes.shape_guards(gm)
    inputs = [["size"] if isinstance(f, torch.SymInt) else ["leaf", i] for i, f in enumerate(fakes)]
    n_outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    trace = SymbolicTrace(symbols, output_dims, [], GuardSet([]), gm, inputs, {j: j for j in range(n_outputs)},
                          guards, size_classes(guards))
    bounds: dict[str, int] = {}
    for m, sym in zip(marks, symbols):
        bounds[sym] = max(bounds.get(sym, 0), m.sizes[-1])
    report = padding.analyse(trace, {i: f"input {i}" for i in range(len(fakes))}, {m.leaf for m in marks},
                             {m.leaf: m.pad_value for m in marks if m.pad_value is not None}, bounds)
    gear_plan = gears.build_plan(marks, ic.dynamic_gears_merge_policy, ic.past_largest_gear, symbols, output_dims,
                                 report)
    padding_check.apply("torch.compile(backend=gearcache.get_backend(...))", gear_plan, ic.padding_check)
    gear_plan.verify_first = False
    return gear_plan


def _expr(size: Any) -> str | None:
    return str(size.node.expr) if isinstance(size, torch.SymInt) else None


def _views_of_geared(fakes: list[Any], marks: list[gears.MarkedDim], outputs: Any) -> str | None:
    """Why the graph cannot be served geared where an output views an input with gears (their example values share
    a storage): a padded call copies that input, so the output would view the copy and eager's later writes through
    either would not show in the other (as ``symbolic_trace.refuse_views_of_padded`` on the cached-method route);
    None where no output does."""
    storages = {id(fakes[m.leaf].untyped_storage()): m.leaf for m in marks if isinstance(fakes[m.leaf], torch.Tensor)}
    for j, node in enumerate(outputs):
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and id(value.untyped_storage()) in storages:
            return (f"torch.compile(backend=gearcache.get_backend(...)): output {j} is a view of graph input "
                    f"{storages[id(value.untyped_storage())]}, whose dims have gears: a padded call copies that input, "
                    f"so the output would be a view of the copy (in eager, writes through either show in the other). "
                    f"Fix: return a .clone() of it, or remove the gears of that input")
    return None


class GearedGraph:
    """One Dynamo graph; one static compiled entry per gear."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], config: CompilerConfig, store: Store):
        self.gm, self.config = gm, config
        self.pipeline = ArtifactPipeline(store, config)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [n.meta.get("example_value") for n in placeholders]
        marks, symbols = [], []
        for i, (real, fake) in enumerate(zip(example_inputs, fakes)):
            for dim, sizes in sorted((getattr(real, gears.GEARS_ATTR, None) or {}).items()):
                marks.append(gears.MarkedDim(i, dim, list(sizes), f"input {i}", getattr(real, gears.PAD_ATTR, None)))
                symbols.append(_expr(fake.shape[dim]) or f"static:{i}:{dim}")
        # SymInt inputs (sizes Dynamo passes separately) follow the marked dim with the same symbol.
        self._size_inputs = [(i, symbols.index(e)) for i, f in enumerate(fakes)
                             if isinstance(f, torch.SymInt) and (e := _expr(f)) is not None and e in symbols]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        output_dims: dict[int, list[tuple[int, str]]] = {}
        for j, node in enumerate(outputs):
            shape = getattr(node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None, "shape", [])
            dims = [(d, e) for d, s in enumerate(shape) if (e := _expr(s)) is not None and e in symbols]
            if dims:
                output_dims[j] = dims
        # the gear plan is made at the first call: its padding analysis retraces the graph, which it cannot do
        # inside Dynamo's backend call (under Dynamo's fake mode)
        self._gear_plan_parts = (fakes, marks, symbols, output_dims) if marks else None
        self._view_error = _views_of_geared(fakes, marks, outputs)
        self.gear_plan: gears.GearPlan | None = None
        self._entries: dict[tuple[object, ...], Callable[..., Any]] = {}

    def __call__(self, *flat: Any) -> Any:
        if self._gear_plan_parts is not None:
            if self._view_error is not None:
                raise GearcacheError(self._view_error)
            self.gear_plan = _checked_gear_plan(self.gm, *self._gear_plan_parts, self.config)
            self._gear_plan_parts = None
        gear_plan = self.gear_plan
        if gear_plan is None:
            return self._run(flat, flat)
        targets = gear_plan.targets(flat)
        if targets is None:
            if gear_plan.empty_call(flat):          # never padded: the graph itself (GearPlanLife.past_largest)
                counters.eager_calls += 1
                return self.gm(*flat)
            policy = self.config.inference_config.past_largest_gear
            if policy == "error":
                raise PastLargestGearError(gear_plan.past_largest_message(flat))
            if policy == "eager":
                counters.eager_calls += 1
                return self.gm(*flat)
            targets = [flat[d.leaf].shape[d.dim] for d in gear_plan.dims]
        padded = list(gear_plan.pad(flat, targets))
        for i, m in self._size_inputs:
            padded[i] = targets[m]
        outs = self._run(tuple(padded), flat)
        if any(p is not f for p, f in zip(padded, flat)):
            counters.pads += 1
            gear_plan.copy_back(tuple(padded), flat)    # real rows of the padded inputs the graph wrote in place
            outs = list(outs)
            for i, cuts in gear_plan.cuts.items():
                for dim, m in cuts:
                    d = gear_plan.dims[m]
                    outs[i] = outs[i].narrow(dim, 0, flat[d.leaf].shape[d.dim])
        return outs

    def _run(self, inputs: tuple[Any, ...], original: tuple[Any, ...]) -> Any:
        key = tuple((x.shape, x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in inputs)
        fn = self._entries.get(key)
        if fn is None:
            fn = self._entries[key] = self._compile(list(inputs))
        else:
            counters.hits += 1
        return fn(*inputs)

    def _compile(self, inputs: list[Any]) -> Callable[..., Any]:
        """Specialise the dynamic graph to these inputs' shapes, key it (``keys.key.artifact_key``), compile or load it
        (``ArtifactPipeline.compile_or_load``, the same seam as a cached method's entries), return the callable."""
        from torch.fx.experimental.proxy_tensor import make_fx

        counters.misses += 1
        with torch.no_grad():
            static = make_fx(self.gm, tracing_mode="fake")(*inputs)
        torch_aten.forget_unbacked_bindings(static)     # a float argument's .item(): AOT binds its own symbols
        devices = sorted({str(x.device) for x in inputs if isinstance(x, torch.Tensor)}) or ["cpu"]
        akey, _ = cache_keys.artifact_key(graph_code=static.code,
                                          graph_constants=cache_keys.graph_constants_factor(static),
                                          inputs=signature.inputs_meta(inputs), config=self.config.compile_factors(),
                                          environment=cache_keys.environment_factors(devices, []))
        published = self.pipeline.compile_or_load(akey, static, inputs)
        if published.compiled is None:                      # the store failed and on_cache_error="eager"
            def uncompiled(*args: Any) -> Any:
                counters.eager_calls += 1
                return static(*args)
            return uncompiled
        return published.compiled
