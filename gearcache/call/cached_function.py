"""``CachedFunction``: what ``cache_compile`` returns. Dispatches each call to a compiled entry.

Hot path (``_call``): compute the call's signature key (shapes, strides, dtypes, devices, grad mode), look it up
in a dict of loaded entries, run the entry. No Dynamo, no guards, no disk. A call of positional tensors like the
last such call does not get here: the base class's ``__call__`` (dispatch.py, C where ``gearcache.call._callpath`` is
built) serves it with one C++ check of the tensors' metadata (``signature.matcher``) and the entry's ``run``.

Miss path (``EntryLife.miss``, gearcache/compiling/entry_life.py), once per signature per process: build the entry key
from
its factors; if the store has a valid manifest and artifact for it whose value guards hold here
(gearcache/keys/guards.py),
load it (no tracing, no compiler); otherwise capture the method with Dynamo, compile it with Inductor (once across all
processes sharing the folder), publish, and load.

Value guards per call: the entries in memory stay valid while nothing on their guards' paths changes; a
:class:`~gearcache.keys.guard_watch.GuardWatch` notices a change at the cost of a comparison per call (in C on the
shortcut), and the next call re-checks the guards (``_revalidate``): entries whose guards no longer hold are dropped,
so that call misses and loads or compiles the entry for the new values.
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import re
import types
import warnings
from typing import Any, Callable, cast

import torch

from .._torch import state as torch_state, versions as torch_versions
from . import signature
from ..graphs import cuda_graphs
from ..gears import plan as gears, padding_check
from ..keys import guard_watch
from ..ranks import phases as ranks
from ..warmup import driver as warmup
from ..keys import guards as value_guards
from ..keys.naming import importable_module
from ..compiling.snapshot import kept
from .recompiles import RecompileWatch
from .dispatch import Dispatcher
from ..compiling.capture import dependencies_changed, symbolic_shapes
from ..runplan.collectives import communicates
from ..config import CompilerConfig
from ..compiling.background import Compiling
from ..graphs.cuda_graphs import CudaGraphs
from ..counters import counters
from .entry import Entry, writes_a_leaf
from ..compiling.entry_life import EntryLife, Loaded, entry_groups, module_state
from ..errors import GradModeError, PastLargestGearError, UnsupportedInputError
from ..keys.key import FORMAT_VERSION, build_key
from ..store import Store
from ..warmup.timeline import Timeline
from ..compiling.workers import WorkerPool
from ..ranks.topology import Topology

log = logging.getLogger("gearcache")


class CachedFunction(Dispatcher):
    """A bound method of an ``nn.Module`` served from compiled, persisted entries. Calling it runs
    ``Dispatcher.__call__`` (the shortcut for a call like the last one), then ``_call``."""

    def __init__(self, method: types.MethodType, *, config: CompilerConfig, store: Store, topology: Topology,
                 decompositions: dict[Any, Callable] | None):
        self._method = method
        self._module = cast(torch.nn.Module, method.__self__)     # api._check_method checked it
        self.config = config
        self.store = store
        self.topology = topology
        self._decompositions = decompositions
        self.name = _entry_point_name(method)
        self._scope = value_guards.Scope(self._module, method.__func__.__globals__,
                                         cast(types.FunctionType, method.__func__))
        self.life = EntryLife(method, config=config, store=store, topology=topology, decompositions=decompositions,
                              name=self.name, scope=self._scope,
                              remembered=self._remembered)      # the stages of its entries (entry_life.py)
        self._table = self.life.table   # signature key -> entry (the life's table, read directly on the call path)
        self._lock = self.life.lock
        self._first: Loaded | None = None
        self._matchers: dict[tuple, signature.Matcher | None] = {}     # per key, for the shortcut (dispatch.py)
        self.graphs = CudaGraphs(self, self.life) if config.mode == "reduce-overhead" else None
        self._gears: gears.GearPlan | None = None
        self._gears_checked = False
        self._watcher = guard_watch.Watcher(self._scope)     # grows self._watch as entries are added
        self._plan_guards: value_guards.GuardSet | None = None    # the gear plan's trace's value guards
        self._watch: Any = None         # GuardWatch over the value guards of the table's entries and the gear plan
        self._recompiles: RecompileWatch | None = RecompileWatch(self.name)   # warns when an argument compiles per
        #                                                                       value or size (None: the caller pads)
        self.warmup_timeline: Timeline | None = None    # the last warmup()'s phases (gearcache/warmup/timeline.py)

    # ----------------------------------------------------------------------------------------------- hot path
    def _call(self, *args: Any, **kwargs: Any) -> Any:
        watch = self._watch
        if watch is not None and not watch.valid():
            self._revalidate()
        if not self.config.check_signature and self._first is not None and self._gears is None:
            return self._first(args)
        leaves, key = signature.call_key(args, kwargs)
        if key[1][0]:                       # grad enabled: inference-only entries must not silently drop grads
            self._check_no_grad(leaves)
        gear_plan = self._gears
        if gear_plan is None and not self._gears_checked:
            gear_plan = self._init_gears(args, kwargs, leaves, key)
        if self.graphs is not None:
            return self.graphs.call(gear_plan, leaves, key, served=True)
        if gear_plan is not None:
            return self._call_geared(gear_plan, leaves, key, served=True)
        entry = self._table.get(key)
        if entry is None:
            if gears.has_marks(leaves):             # marked after an unmarked first call: gears from now on
                gear_plan = self._init_gears(args, kwargs, leaves, key, again=True)
                if gear_plan is not None:
                    return self._call_geared(gear_plan, leaves, key, served=True)
            self._note_miss(args, kwargs, leaves, geared=False)
            entry = self.life.miss(leaves, key, (args, kwargs))
        else:                               # (EntryLife.get_or_miss counts a hit alike; inline on this hot path)
            counters.hits += 1
            entry.hits += 1
        self._shortcut_to(key, leaves, entry)
        return entry(leaves)

    def _shortcut_to(self, key: tuple, leaves: tuple, entry: Loaded) -> None:
        """Serve the next calls with ``key`` through the base class's shortcut (none where ``key`` has no matcher)."""
        try:
            matcher = self._matchers[key]
        except KeyError:
            if isinstance(entry, Compiling):    # served eagerly until its background compile is loaded: ask again
                self._set_shortcut(None)
                return
            matcher = self._matchers[key] = signature.matcher(
                leaves, key, distinct_storages=writes_a_leaf(entry)) if isinstance(entry, Entry) else None
        if matcher is None:
            self._set_shortcut(None)
        else:
            self._set_shortcut(matcher, entry, counters, self._watch)

    def _revalidate(self) -> None:
        """An object on the paths of the value guards changed (``self._watch``), or a module tensor's metadata: drop
        the entries, and the gear plan, whose guards no longer hold (their next call misses), bind the rest to where
        the module holds its tensors now (a submodule replaced by one of the same class and shapes), and watch them
        anew."""
        with self._lock:
            reading = value_guards.Reading()        # the entries share most paths: each is read once
            for key, entry in list(self._table.items()):
                guards = getattr(entry, "guards", None)
                mismatch = guards.mismatch(self._scope, reading) if guards is not None else None
                if mismatch is not None:
                    log.info("%s: entry %s no longer applies (%s); its next call misses", self.name,
                             entry.manifest.get("ekey"), mismatch)
                    del self._table[key]
                    self._matchers.pop(key, None)
                elif isinstance(entry, Entry) and entry.state_moved(self._module):
                    self._table[key] = entry.rebound(self._module)
            if self._plan_guards is not None and self._plan_guards.mismatch(self._scope, reading) is not None:
                self._gears, self._gears_checked, self._plan_guards = None, False, None
            self._first = next(iter(self._table.values()), None)
            self._set_shortcut(None)
            if self.graphs is not None:
                self.graphs.drop_unless(set(map(id, self._table.values())))
            self._rewatch()

    def _remembered(self, entry: Loaded) -> None:
        """``EntryLife.remember`` put ``entry`` in the table: the first entry serves unchecked calls
        (``check_signature=False``); its value guards are watched."""
        if self._first is None:
            self._first = entry
        if getattr(entry, "guards", None) is not None:
            self._rewatch()

    def _rewatch(self) -> None:
        """Watch the paths of the value guards of every entry in the table and of the gear plan, as they are now."""
        self._watch = self._watcher.watch([getattr(e, "guards", None) for e in self._table.values()] +
                                          [self._plan_guards])

    def call_uncaptured(self, gear_plan: "gears.GearPlan | None", leaves: tuple, key: tuple,
                        served: bool = False) -> Any:
        """The call path without CUDA graphs (used by mode="reduce-overhead" for CPU inputs)."""
        if gear_plan is not None:
            return self._call_geared(gear_plan, leaves, key, served=served)
        return self.life.get_or_miss(leaves, key)(leaves)

    def _call_geared(self, gear_plan: "gears.GearPlan", leaves: tuple, key: tuple, served: bool = False) -> Any:
        """A call through the gear plan: padded, run, cut back. ``served``: a caller's call (not a warm-up's)."""
        targets = gear_plan.targets(leaves)
        if targets is None:
            return self.past_largest(gear_plan, leaves, key)
        if gear_plan.verify_first:
            self.verify_first_use(gear_plan, leaves, key, targets)
        padded = gear_plan.pad(leaves, targets)
        if padded is not leaves and signature.shares_memory(key):
            raise UnsupportedInputError(signature.shared_memory_message(
                self.name, key, "padding copies the padded ones to tensors of their own"))
        pkey = key if padded is leaves else signature.rekey(key, padded)
        entry = self._table.get(pkey)
        if entry is None:
            if served:
                self._note_miss(*signature.unflatten(key[0], leaves), leaves, geared=True)
            entry = self.life.miss(padded, pkey)
        else:                               # (as EntryLife.get_or_miss counts a hit; inline on this hot path)
            counters.hits += 1
            entry.hits += 1
        outs = entry.run(padded)
        if served:
            gear_plan.record_padding(entry, leaves, targets)
        if padded is not leaves:
            counters.pads += 1
            if gear_plan.written_padded:
                gear_plan.copy_back(padded, leaves)
            outs = gear_plan.cut(entry, outs, leaves)
        return entry.build(outs, leaves)

    def verify_first_use(self, gear_plan: "gears.GearPlan", leaves: tuple, key: tuple, targets: list[int]) -> None:
        """Before gear ``targets`` first serves a padded call in this process, test it against eager on this call
        (padding_check.verify; only under ``padding_check="verify"``: ``gear_plan.verify_first``). Nothing
        for a call at the gear's own sizes, or a gear already verified."""
        if tuple(targets) in gear_plan.verified or all(leaves[d.leaf].shape[d.dim] == t
                                                       for d, t in zip(gear_plan.dims, targets)):
            return
        with self._lock:
            if tuple(targets) not in gear_plan.verified:
                padding_check.verify(self.name, self._method, self._module, gear_plan, key[0], leaves, targets)

    def past_largest(self, gear_plan: "gears.GearPlan", leaves: tuple, key: tuple) -> Any:
        policy = self.config.inference_config.past_largest_gear
        if policy == "error":
            raise PastLargestGearError(f"{self.name}: {gear_plan.past_largest_message(leaves)}")
        if policy == "eager":
            counters.eager_calls += 1
            if not gear_plan._warned_eager:
                gear_plan._warned_eager = True
                warnings.warn(f"gearcache: {self.name}: {gear_plan.past_largest_message(leaves)}; running it "
                              f"uncompiled (warned once; counted in gearcache.counters.eager_calls)", stacklevel=3)
            args, kwargs = signature.unflatten(key[0], leaves)
            return self._method(*args, **kwargs)
        return self.life.get_or_miss(leaves, key)(leaves)

    def sizes_chosen_by_caller(self) -> None:
        """Say that the caller pads the method's inputs to sizes of its own choosing (an integration with gears of
        its own, such as ``integrations.transformers``): an entry per size is its design, not worth a warning."""
        self._recompiles = None

    def _note_miss(self, args: tuple, kwargs: dict, leaves: tuple, geared: bool) -> None:
        """Warn (once per argument) when a scalar argument or an ungeared dim compiles an entry per value or size."""
        if self._recompiles is None:
            return
        self._recompiles.miss(self._method, args, kwargs, leaves, geared=geared, gear_plans_stored=lambda: any(
            self.store.plan_path(self.topology.folder, self.name, "-").parent.glob("*.json")))

    def _init_gears(self, args: tuple, kwargs: dict, leaves: tuple, key: tuple,
                    again: bool = False) -> "gears.GearPlan | None":
        """Build (or load) the gear plan from the first call's marks; None when nothing is marked. ``again``: look
        for marks on this call too when an earlier call had none."""
        with self._lock:
            if self._gears_checked and not (again and self._gears is None):
                return self._gears
            marks = self._marks(args, kwargs, leaves)
            if marks:
                self._gears = self._load_or_build_plan(marks, leaves, key)
            self._gears_checked = True
            return self._gears

    def _marks(self, args: tuple, kwargs: dict, leaves: tuple) -> list:
        """The call's gear marks (``set_dim_gears`` on its tensors, or the config's ``dim_gears`` by name)."""
        ic = self.config.inference_config
        return gears.find_marks(leaves, _leaf_names(self._method, args, kwargs, leaves), ic.dim_gears, ic.pad_values)

    def _plan_key(self, marks: list, key: tuple) -> str:
        """The gear plan's key: everything its trace depends on."""
        ic = self.config.inference_config
        pkey, _ = build_key("gear plan", [
            ("format", FORMAT_VERSION),
            ("method", {"name": self.name, "source_sha256": self.life.method_digest}),
            ("structure", repr(key[0])),
            ("plan_format", gears.PLAN_FORMAT),
            ("marks", [[m.leaf, m.dim, m.sizes, m.pad_value] for m in marks]),
            ("policy", ic.dynamic_gears_merge_policy),
            ("module_state", module_state(self._module)),
            ("global_state", torch_state.global_state()),
            ("software", torch_versions.software_versions()),
        ])
        return pkey

    def _load_or_build_plan(self, marks: list, leaves: tuple, key: tuple) -> "gears.GearPlan":
        """The stored gear plan for these marks, else one built from a symbolic trace (with its padding analysis) and
        stored; either way checked against ``padding_check`` (padding_check.apply: may raise PaddingUnsafeError)."""
        ic = self.config.inference_config
        gears.check_marks(marks, ic.dynamic_gears_merge_policy)
        found = value_guards.choose(lambda k: self.store.read_plan(self.topology.folder, self.name, k),
                                    self._plan_key(marks, key), self._scope)
        saved, pkey = found.record, found.key
        if saved is not None and not dependencies_changed(saved.get("dependencies", [])):
            self._plan_guards = found.guards
            self._rewatch()
            gear_plan = gears.GearPlan.from_json(saved["plan"], ic.past_largest_gear)
        else:
            gear_plan = self._build_plan(marks, leaves, key, pkey)
        padding_check.apply(self.name, gear_plan, ic.padding_check)
        return gear_plan

    def _build_plan(self, marks: list, leaves: tuple, key: tuple, pkey: str) -> "gears.GearPlan":
        """Trace the method with the marked dims symbolic (at the largest gear), analyse its padding, and store the
        plan under ``pkey`` (unless its value guards read a local value, which no other process can check)."""
        ic = self.config.inference_config
        counters.traces += 1
        largest = tuple(max(m.sizes) if m.sizes[-1] >= 2 else leaves[m.leaf].shape[m.dim] for m in marks)
        traced = [(m.leaf, m.dim) for m in marks if m.sizes[-1] >= 2]
        sample = gears.GearPlan(marks, [[i] for i in range(len(marks))], "product", {}, "error").pad(
            gears.narrowed(leaves, marks, largest), list(largest))
        trace = symbolic_shapes(self._method, self._module, key[0], sample, traced)
        self.life.communicates = communicates(trace.graph)      # warm-up compiles such graphs in this thread
        names = _leaf_names(self._method, *signature.unflatten(key[0], leaves), leaves)
        from ..gears import padding  # the analysis (and sympy) only where a gear plan is built, never on a warm load

        bounds: dict[str, int] = {}
        for m, sym in zip([m for m in marks if m.sizes[-1] >= 2], trace.symbols):
            bounds[sym] = max(bounds.get(sym, 0), m.sizes[-1])
        report = padding.analyse(trace, names, {m.leaf for m in marks},
                                 {m.leaf: m.pad_value for m in marks if m.pad_value is not None}, bounds)
        it = iter(trace.symbols)
        symbols = [next(it) if m.sizes[-1] >= 2 else f"static:{m.leaf}:{m.dim}" for m in marks]
        gear_plan = gears.build_plan(marks, ic.dynamic_gears_merge_policy, ic.past_largest_gear, symbols,
                                trace.output_dims, report)
        self._plan_guards = trace.plan_guards
        self._rewatch()
        if trace.plan_guards.local is None:
            self.store.write_plan(self.topology.folder, self.name, pkey, {
                "format": FORMAT_VERSION, "pkey": pkey, "plan": gear_plan.to_json(), "dependencies": trace.dependencies,
                "guards": trace.plan_guards.to_json()})
        return gear_plan

    def warmup(self, *args: Any, **kwargs: Any) -> int:
        """Compile or load the entry of every gear now, from example inputs shaped like a real call (their marks or
        the config's gears by name apply); returns the number of gears. Missing gears are compiled in worker
        processes, several at once (``config.inference_config.warmup_workers``; see gearcache/warmup/driver.py). A gear
        plan whose padding the analysis cannot prove exact was refused before this (``PaddingUnsafeError``); with
        ``inference_config.padding_check="verify"`` or ``verify_padding``, each gear is first tested against eager
        in float64 on the example narrowed to the smallest real sizes that pad up to it, before anything is
        compiled (gearcache/gears/padding_check.py). The runs on the examples leave no trace:
        what they write in place (the module's buffers, the example tensors) is restored after them."""
        self.warmup_timeline = timeline = Timeline()
        early = None                            # worker processes started before the gear plan's trace
        try:
            with timeline.span("all", "signature and gears"):
                leaves, key = signature.call_key(args, kwargs)
                if not self._gears_checked:
                    early = self._early_workers(args, kwargs, leaves, key, timeline)
                gear_plan = self._gears if self._gears_checked else self._init_gears(args, kwargs, leaves, key)
                if gear_plan is None and gears.has_marks(leaves):    # an earlier call had no marks, these do
                    gear_plan = self._init_gears(args, kwargs, leaves, key, again=True)
            if gear_plan is None:
                with kept([*leaves, *self._module.buffers()]):
                    self(*args, **kwargs)
                return 1
            self._verify_gears(gear_plan, leaves, key, timeline)     # eager runs only: before anything is compiled
            lazy = self.config.inference_config.capture_graphs == "first_call"
            capture_now = self.graphs is not None and not lazy and cuda_graphs.on_cuda(leaves)
            pool, early = early, None           # compile_missing owns (and closes) it from here
            warmup.compile_missing(self.life, gear_plan, leaves, key, self.config.inference_config.warmup_workers,
                                   timeline, pool, defer_loads=capture_now)      # capture_all loads stored gears
        finally:
            if early is not None:
                early.close(wait=False)
        combos = gear_plan.combinations()
        call: Callable[..., Any] = self._call_geared
        if self.graphs is not None:             # capture them now, largest first (or only load them: lazy capture)
            combos = cuda_graphs.capture_order(combos)
            call = self.graphs.prepare if lazy else self.graphs.call
            self.graphs.timeline = timeline
        try:
            gear_calls = []
            for sizes in combos:
                gear_leaves = gear_plan.pad(gears.narrowed(leaves, gear_plan.dims, sizes), sizes)
                gear_calls.append((gear_leaves, signature.rekey(key, gear_leaves)))
            fence = functools.partial(self._fence_before_runs, combos, timeline=timeline)
            if capture_now:
                assert self.graphs is not None      # capture_now: graphs are captured (reduce-overhead)
                with timeline.span("all", "capture every gear"):    # entries, warm-up runs at once, records
                    self.graphs.capture_all(gear_plan, gear_calls, before_runs=fence)
            elif not lazy:
                fence([self._table.get(gear_key) for _, gear_key in gear_calls])
            with kept(self._written_by(gear_calls, [*leaves, *self._module.buffers()])):
                for sizes, (gear_leaves, gear_key) in zip(combos, gear_calls):
                    with timeline.span(f"gear {sizes}", "first run"):
                        call(gear_plan, gear_leaves, gear_key)
        finally:
            if self.graphs is not None:
                self.graphs.timeline = None
        return len(combos)

    def _fence_before_runs(self, combos: list[list[int]], entries: list[Any], timeline: Timeline) -> None:
        """Between warmup()'s compile phase and its runs: wait until every rank of the process groups the gears'
        graphs name is here with the same gears in the same order (ranks.fence; nothing without collectives, or
        when an entry does not say which groups it uses)."""
        groups: dict[str, dict] = {}
        for entry in entries:
            named = entry_groups(entry) if entry is not None else None
            if named is None:
                log.debug("%s: an entry does not say which process groups it uses; no fence before its runs",
                          self.name)
                return
            groups.update(named)
        if groups:
            with timeline.span("all", "wait for the other ranks"):
                ranks.fence(ranks.group_ranks(groups.values()), f"{self.name} warm-up runs",
                            f"gears {combos}", self.config.rank_timeout_s)

    def _written_by(self, gear_calls: list[tuple[tuple, tuple]], unknown: list) -> list:
        """What the gears' first runs may write in place (their entries' ``mutated_inputs``); ``unknown`` where a
        gear's entry is not found yet (it is found by its first run)."""
        written: list = []
        for gear_leaves, gear_key in gear_calls:
            entry = self._table.get(gear_key)
            written += unknown if entry is None else cuda_graphs.written_tensors(entry, gear_leaves)
        return written

    def _early_workers(self, args: tuple, kwargs: dict, leaves: tuple, key: tuple,
                       timeline: Timeline) -> "WorkerPool | None":
        """Worker processes started before the gear plan is traced, when no plan is stored for these marks yet: such
        a warm-up has gears to compile, and the workers' start (importing torch and Inductor: ~10 s each on the H200
        host) then overlaps the trace (~7 s there) instead of following it. None when the plan is stored, nothing is
        marked, or warm-up is serial."""
        marks = self._marks(args, kwargs, leaves)
        if not marks or self.config.inference_config.warmup_workers == 1:
            return None
        if value_guards.choose(lambda k: self.store.read_plan(self.topology.folder, self.name, k),
                               self._plan_key(marks, key), self._scope).record is not None:
            return None
        policy = self.config.inference_config.dynamic_gears_merge_policy
        return warmup.start_workers(self.life, gears.most_combinations(marks, policy), leaves,
                                    self.config.inference_config.warmup_workers, timeline)

    def _verify_gears(self, gear_plan: "gears.GearPlan", leaves: tuple, key: tuple, timeline: Timeline) -> None:
        """warmup()'s test of every gear against eager (padding_check.verify), where ``padding_check="verify"`` or
        ``verify_padding`` asks for it."""
        if gear_plan.verify_first or self.config.inference_config.verify_padding:
            for sizes in gear_plan.combinations():
                with timeline.span(f"gear {sizes}", "verify padding"):
                    self._verify_gear(gear_plan, leaves, key, sizes)

    def _verify_gear(self, gear_plan: "gears.GearPlan", leaves: tuple, key: tuple, sizes: list[int]) -> None:
        """Test gear ``sizes`` against eager on warmup()'s example narrowed to the smallest real sizes that pad up to
        it (padding_check.verify), unless no size pads up to it or it passed already."""
        real = padding_check.real_sizes(gear_plan, sizes)
        if real == sizes or tuple(sizes) in gear_plan.verified:
            return
        real_leaves = gear_plan.pad(gears.narrowed(leaves, gear_plan.dims, real), real)
        with self._lock:
            padding_check.verify(self.name, self._method, self._module, gear_plan, key[0], real_leaves, sizes)

    def _check_no_grad(self, leaves: tuple) -> None:
        needs = [f"argument leaf {i}" for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        needs += [f"parameter {n}" for n, p in self._module.named_parameters() if p.requires_grad][:3]
        if needs:
            raise GradModeError(
                f"{self.name} was called with grad enabled and {', '.join(needs[:3])} requiring grad; gearcache "
                f"entries are inference only. Fix: call it under torch.inference_mode() (or torch.no_grad()), or "
                f"call model.requires_grad_(False) and detach the inputs.")

    # ------------------------------------------------------------------------------------------------- public
    @property
    def entries(self) -> int:
        """How many signatures this process has an entry for."""
        return len(self._table)

    def __repr__(self) -> str:
        return f"<gearcache.CachedFunction {self.name} entries={len(self._table)} store={self.store.root}>"

    def __deepcopy__(self, memo: dict) -> "CachedFunction":
        """``copy.deepcopy(model)``: the copy's cached method is rebuilt (its entries load again, nothing is copied),
        bound to the copy of the module, sharing this one's store and config."""
        module = copy.deepcopy(self._module, memo)
        return CachedFunction(types.MethodType(self._method.__func__, module), config=self.config, store=self.store,
                              topology=self.topology, decompositions=self._decompositions)

    def __reduce__(self) -> tuple:
        """``pickle`` / ``torch.save(model)``: stored as what rebuilds it (the module, the method's name, the config,
        the store's folder, the topology, the decompositions); unpickled, it loads its entries from that folder."""
        return _unpickle, (self._module, self._method.__name__, self.config, str(self.store.root), self.topology,
                           self._decompositions)


def _unpickle(module: torch.nn.Module, name: str, config: CompilerConfig, root: str, topology: Topology,
              decompositions: dict[Any, Callable] | None) -> CachedFunction:
    """Rebuild a pickled ``CachedFunction`` (``CachedFunction.__reduce__``). The module may not have its state yet
    (pickle sets it after its attributes are rebuilt): only its class is read here."""
    method = types.MethodType(getattr(type(module), name), module)
    return CachedFunction(method, config=config, store=Store.from_config(root, config), topology=topology,
                          decompositions=decompositions)


def _leaf_names(method: Callable, args: tuple, kwargs: dict, leaves: tuple) -> dict[int, str]:
    """Leaf index -> argument name for tensor arguments (``x``, or ``kv[1]`` for an item of a list argument)."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return {}
    names: dict[int, str] = {}
    ids = {id(leaf): i for i, leaf in enumerate(leaves)}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor) and id(value) in ids:
            names[ids[id(value)]] = name
        elif isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                if isinstance(item, torch.Tensor) and id(item) in ids:
                    names[ids[id(item)]] = f"{name}[{k}]"
    return names


def _entry_point_name(method: types.MethodType) -> str:
    """``module.Class.method``, the method's folder in the store: the same however the module is run."""
    cls = type(method.__self__)
    raw = f"{importable_module(cls.__module__)}.{cls.__qualname__}.{method.__name__}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)
