"""``CachedFunction``: what ``cache_compile`` returns. Dispatches each call to a compiled entry.

Hot path (``_call``): compute the call's signature key (shapes, strides, dtypes, devices, grad mode), look it up
in a dict of loaded entries, run the entry. No Dynamo, no guards, no disk. A call of positional tensors like the
last such call does not get here: the base class's ``__call__`` (dispatch.py, C where ``gearcache.call._callpath`` is
built) serves it with one C++ check of the tensors' metadata (``signature.matcher``) and the entry's ``run``.

Miss path (``EntryLife.miss``, gearcache/compiling/entry_life.py), once per signature per process: build the entry key
from its factors; if the store has a valid manifest and artifact for it whose value guards hold here
(gearcache/keys/guard_sets.py), load it (no tracing, no compiler); otherwise capture the method with Dynamo, compile it
with Inductor (once across all processes sharing the folder), publish, and load.

Value guards per call: the entries in memory stay valid while nothing on their guards' paths changes; a
:class:`~gearcache.keys.guard_watch.GuardWatch` notices a change at the cost of a comparison per call (in C on the
shortcut), and the next call re-checks the guards (``_revalidate``): entries whose guards no longer hold are dropped,
so that call misses and loads or compiles the entry for the new values.

Gears (``call_geared``): a call padded up to its gear, run, and cut back; the gear plan's own stages (marks, key,
load or build, verification, the past-largest policy) are ``self.gear_life``'s
(gearcache/compiling/gear_plan_life.py), beside ``self.life``'s entry stages. ``warmup`` hands the example call to
gearcache/warmup/method.py, which drives these public stages.
"""
from __future__ import annotations

import copy
import logging
import operator
import re
import types
from typing import Any, Callable, Hashable, cast

import torch

from ._torch import distributed as torch_distributed, state as torch_state
from .call import memory, signature, state_alias
from .call.dispatch import Dispatcher
from .call.entry import Entry, writes_a_leaf
from .recompiles import RecompileWatch
from .compiling.background import StandIn
from .compiling.entry_life import EntryLife, Loaded
from .config import CompilerConfig
from .counters import counters
from .errors import DispatchModeError, GradModeError, SignatureMismatchError, UnsupportedInputError
from .compiling.gear_plan_life import GearPlanLife
from .gears.plan import GearPlan, MarkedCall, has_marks
from .graphs.cuda_graphs import CudaGraphs
from .keys import guard_watch
from .keys import guard_paths, guard_sets
from .keys.naming import importable_module
from .ranks.topology import Topology, process_groups_factor
from .store import Store
from .warmup.method import warm_up
from .timeline import Timeline

TensorMeta = tuple[type, torch.dtype, torch.device]
"""An argument's class, dtype and device (``_tensor_metas``)."""

log = logging.getLogger("gearcache")


class CachedFunction(Dispatcher):
    """A bound method of an ``nn.Module`` served from compiled, persisted entries. Calling it runs
    ``Dispatcher.__call__`` (the shortcut for a call like the last one), then ``_call``."""

    def __init__(self, method: types.MethodType, *, config: CompilerConfig, store: Store, topology: Topology,
                 decompositions: dict[Any, Callable[..., Any]] | None):
        self._method = method
        self._module = cast(torch.nn.Module, method.__self__)     # api._check_method checked it
        self.config = config
        self.store = store
        self.topology = topology
        self._decompositions = decompositions
        self.name = _entry_point_name(method)
        self._scope = guard_paths.Scope(self._module, method.__func__.__globals__,
                                         cast(types.FunctionType, method.__func__))
        self.life = EntryLife(method, config=config, store=store, topology=topology, decompositions=decompositions,
                              name=self.name, scope=self._scope,
                              remembered=self._remembered)      # the stages of its entries (entry_life.py)
        self._table = self.life.table   # signature key -> entry (the life's table, read directly on the call path)
        self._lock = self.life.lock
        self._first: Loaded | None = None
        # the first entry, whether it writes a call leaf, the (grad, inference mode, global state tag) of its key and
        # its leaves' (dtype, device), where it can serve calls without a key (_set_first)
        self._unchecked: tuple[Loaded, bool, Hashable, tuple[TensorMeta, ...]] | None = None
        # per key, for the shortcut: the entry it was made for, and its matcher
        self._matchers: dict[tuple[Hashable, ...], tuple[Loaded, signature.Matcher | None]] = {}
        self.gear_life = GearPlanLife(method, config=config, store=store, topology=topology, name=self.name,
                                      scope=self._scope, entries=self.life)     # its gear plan
        self.graphs = CudaGraphs(self, self.life) if config.mode == "reduce-overhead" else None
        self._watcher = guard_watch.Watcher(self._scope)     # grows self._watch as entries are added
        self._watch: guard_watch.Watch | None = None    # over the value guards of the table's entries and the
        #                                                 gear plan
        self._place: tuple[str, list[list[Any]]] | None = None   # rank folder and process groups at the last watch
        self._recompiles: RecompileWatch | None = RecompileWatch(self.name)   # warns when an argument compiles per
        #                                                                       value or size (None: the caller pads)
        self.warmup_timeline: Timeline | None = None    # the last warmup()'s phases (gearcache/timeline.py)

    # ----------------------------------------------------------------------------------------------- hot path
    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if torch_state.dispatch_mode_depth() or torch_state.function_mode_depth():   # ~50 ns each; a new mode
            self._refuse_modes()                    # fails the shortcut's state check (native, or Dynamo's and depth)
        watch = self._watch
        if watch is not None and not watch.valid():
            self._revalidate()
        gear_life = self.gear_life
        unchecked = self._unchecked
        if (unchecked is not None and not self.config.check_signature and not kwargs and gear_life.plan is None
                and (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), signature.state_tag()) == unchecked[2]
                and len(args) == len(unchecked[3]) and (not unchecked[1] or memory.ranges_apart(args))):
            metas = _tensor_metas(args)     # None: a Python scalar or another non-tensor (the checked path keys it)
            if metas is not None and metas != unchecked[3] and all(m[0] is torch.Tensor for m in metas):
                raise self._unchecked_mismatch(args, "another dtype or device")     # the graph checks no dtype
            if metas == unchecked[3]:       # not a tensor subclass either (eager runs its __torch_function__)
                first = unchecked[0]
                if isinstance(first, Entry) and first.state_aliases:
                    state_alias.refuse(self.name, self._method, first.state_aliases, args, None)
                try:
                    return first(args)
                except AssertionError as e:     # the graph's own input check: another signature than the first's
                    raise self._unchecked_mismatch(args, str(e)) from e
        leaves, key = signature.call_key(args, kwargs)
        if key[1][0]:                       # grad enabled: inference-only entries must not silently drop grads
            self._check_no_grad(leaves)
        gear_plan = gear_life.plan
        if gear_plan is None and not gear_life.checked:
            gear_plan = self.gear_plan(gear_life.marked_call(args, kwargs))
        if self.graphs is not None:
            result = self.graphs.call(gear_plan, leaves, key, served=True)
            self._shortcut_to_graph(gear_plan, leaves, key)
            return result
        if gear_plan is not None:
            return self.call_geared(gear_plan, leaves, key, served=True)
        entry = self._table.get(key)
        if entry is None:
            if has_marks(leaves):                   # marked after an unmarked first call: gears from now on
                gear_plan = self.gear_plan(self.gear_life.marked_call(args, kwargs), again=True)
                if gear_plan is not None:
                    return self.call_geared(gear_plan, leaves, key, served=True)
            self._note_miss(args, kwargs, leaves, geared=False)
            entry = self.life.miss(leaves, key, (args, kwargs))
            if isinstance(entry, Entry) and entry.state_aliases:
                state_alias.refuse(self.name, self._method, entry.state_aliases, leaves, key)
            if self._table.get(key) is not entry:   # dropped as it was remembered (a value changed meanwhile), or
                self._set_shortcut(None)            # a stand-in: serves this call, never the next ones
                return entry(leaves)
        else:                               # (EntryLife.get_or_miss counts a hit alike; inline on this hot path)
            counters.hits += 1
            entry.hits += 1
            if isinstance(entry, Entry) and entry.state_aliases:
                state_alias.refuse(self.name, self._method, entry.state_aliases, leaves, key)
        self._shortcut_to(key, leaves, entry)
        return entry(leaves)

    def _shortcut_to(self, key: tuple[Hashable, ...], leaves: tuple[Any, ...], entry: Loaded) -> None:
        """Serve the next calls with ``key`` through the base class's shortcut (none where ``key`` has no matcher, nor
        for an eager stand-in: its background compile is to be loaded, so every call asks again; checked before the
        matchers, which another thread's call may have filled for ``key`` once that compile was settled)."""
        if isinstance(entry, StandIn):
            self._set_shortcut(None)
            return
        made = self._matchers.get(key)
        if made is not None and made[0] is entry:
            matcher = made[1]
        else:                       # (another entry than the matcher's: one bound anew has rules of its own)
            matcher = signature.matcher(leaves, key, distinct_storages=writes_a_leaf(entry),
                                        state_rules=entry.state_aliases) if isinstance(entry, Entry) else None
            self._matchers[key] = entry, matcher
        if matcher is None:
            self._set_shortcut(None)
        else:
            self._set_shortcut(matcher, entry, counters, self._watch)

    def _shortcut_to_graph(self, gear_plan: GearPlan | None, leaves: tuple[Any, ...],
                           key: tuple[Hashable, ...]) -> None:
        """Serve the next calls like this one (no gear plan) through the base class's shortcut by a replay of the
        graph this call replayed (``CudaGraphs.shortcut``); none where it replayed none."""
        graphs = cast(CudaGraphs, self.graphs)
        replayed = graphs.replayed
        shortcut = None
        if gear_plan is None and replayed is not None:
            shortcut = graphs.shortcut(leaves, key, distinct_storages=True)
        if shortcut is None:
            self._set_shortcut(None)
        else:
            self._set_shortcut(shortcut[0], shortcut[1], counters, self._watch)

    def _revalidate(self) -> None:
        """An object on the paths of the value guards changed (``self._watch``), or a module tensor's metadata: drop
        the entries, and the gear plan, whose guards no longer hold (their next call misses), bind the rest to where
        the module holds its tensors now (a submodule replaced by one of the same class and shapes), and watch them
        anew."""
        with self._lock:
            reading = guard_sets.Reading()          # the entries share most paths: each is read once
            place = self.topology.folder, process_groups_factor()   # the process group may be new
            for key, entry in list(self._table.items()):
                guards = getattr(entry, "guards", None)
                mismatch: object = (guards.mismatch(self._scope, reading)
                                    if isinstance(guards, guard_sets.GuardSet) else None)
                if mismatch is None:
                    mismatch = _filed_elsewhere(entry.manifest, place)
                if mismatch is None and isinstance(entry, Entry):
                    mismatch = entry.sharing_changed(self._module) or entry.records_changed()
                if mismatch is not None:
                    log.info("%s: entry %s no longer applies (%s); its next call misses", self.name,
                             entry.manifest.get("ekey"), mismatch)
                    del self._table[key]
                    self._matchers.pop(key, None)
                elif isinstance(entry, Entry) and entry.state_moved(self._module):
                    self._table[key] = entry.rebound(self._module)
            self.gear_life.revalidate(reading, moved=self._place not in (None, place))
            self._set_first(next(iter(self._table.values()), None))
            self._set_shortcut(None)
            if self.graphs is not None:
                self.graphs.drop_unless(set(map(id, self._table.values())))
            self._rewatch()

    def _remembered(self, entry: Loaded) -> None:
        """``EntryLife.remember`` put ``entry`` in the table: the first entry serves unchecked calls
        (``check_signature=False``); its value guards are watched. An entry bound, at its look-up, to module tensors
        the module no longer holds there (a submodule replaced since, by another thread during a warm-up's look-ups:
        the watch, built or kept after the change, never sees it) is bound anew (``_revalidate``). Cost: the entry's
        state slots resolved once more per entry remembered, none on the call path."""
        if self._first is None:
            self._set_first(entry)
        if isinstance(entry, Entry) and entry.state_moved(self._module):
            self._revalidate()
        elif getattr(entry, "guards", None) is not None or self._watch is None:
            self._rewatch()

    def _set_first(self, entry: Loaded | None) -> None:
        """Make ``entry`` the first entry, which serves the calls of ``check_signature=False`` without a key (and with
        no gear plan) where it can: its signature is positional tensors only (a Python scalar's value is compiled in:
        a call passing one is keyed), none sharing memory with another
        (a call's arguments are its leaves, and their sharing is no part of what its caller guarantees); one whose
        graph writes a leaf serves only calls whose tensors are apart in memory (``memory.ranges_apart``); it serves
        only calls made under the grad mode, inference mode and global state (``signature.state_tag``: autocast,
        default dtype, ...) of its key, since a caller's one signature is its tensors', not the thread's state (it
        served a call under autocast float32 outputs, and one with grad enabled outputs without ``grad_fn``). Other
        calls take the checked path, which keys their sharing: as eager, or refused. Cost per unchecked call: a
        test of keywords, the mode's (two C calls and the state tag's C++ snapshot check: ~0.3-0.5 us), and for an
        entry writing a leaf a storage range per tensor (2 tensors: ~1.2 us on CPU)."""
        self._first = entry
        self._unchecked = None
        mode = next((key[1] for key, e in self._table.items() if e is entry), None)
        desc = entry.manifest.get("signature") if entry is not None else None
        if entry is not None and mode is not None and _positional_apart(desc):
            leaves = cast(dict[str, list[dict[str, str]]], desc)["leaves"]
            metas: tuple[TensorMeta, ...] = tuple(
                (torch.Tensor, getattr(torch, leaf["dtype"].removeprefix("torch.")), torch.device(leaf["device"]))
                for leaf in leaves)
            self._unchecked = entry, isinstance(entry, Entry) and writes_a_leaf(entry), mode, metas

    def _rewatch(self) -> None:
        """Watch the paths of the value guards of every entry in the table and of the gear plan, as they are now.

        A new watch sees the values as they are when it is built, which may be later than the check of the guards
        it watches (a warm-up checks its gears' guards in one pass, then watches them; a value set in between, by
        another thread, was seen by neither). So every set a new watch covers is checked again once it is built,
        and a set that no longer holds drops what it guards (``_revalidate``). A watch kept (``Watcher.watch``: no
        set added, nothing changed since it was built and its sets checked) needs no check. Cost: one check per
        distinct set when the watch is rebuilt (an entry or plan added or dropped), none on the call path.

        The default process group's slot is watched too (``_revalidate`` drops the entries filed under another rank
        folder or other process groups, and the gear plan when the place it was watched at, ``_place``, changed): a
        graph may hold its rank as a constant (Dynamo folds ``dist.get_rank()`` and ``dist.is_initialized()``), so an
        entry or plan made before ``init_process_group`` (or before the group was replaced) must not serve after it.
        Cost on the call path: one more dict item of the watch (on 3.11 a version tag compare of c10d's
        ``_world.__dict__``, which changes only when a group is made or destroyed)."""
        sets = [g for e in self._table.values() if isinstance(g := getattr(e, "guards", None), guard_sets.GuardSet)]
        plan_guards = self.gear_life.guards
        previous = self._watch
        self._place = self.topology.folder, process_groups_factor()
        slot = torch_distributed.default_group_slot()
        self._watch = self._watcher.watch(sets + [plan_guards], [] if slot is None else [slot])
        if self._watch is None or self._watch is previous:
            return
        reading = guard_sets.Reading()
        watched = {id(gs): gs for gs in [*sets, plan_guards] if gs is not None}
        if any(gs.mismatch(self._scope, reading) is not None for gs in watched.values()):
            self._revalidate()

    def call_uncaptured(self, gear_plan: GearPlan | None, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                        served: bool = False) -> Any:
        """The call path without CUDA graphs (used by mode="reduce-overhead" for CPU inputs)."""
        if gear_plan is not None:
            return self.call_geared(gear_plan, leaves, key, served=served)
        entry = self.life.get_or_miss(leaves, key)
        if isinstance(entry, Entry) and entry.state_aliases:
            state_alias.refuse(self.name, self._method, entry.state_aliases, leaves, key)
        return entry(leaves)

    def call_geared(self, gear_plan: GearPlan, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                    served: bool = False) -> Any:
        """A call through the gear plan: padded, run, cut back. ``served``: a caller's call (not a warm-up's)."""
        targets = gear_plan.targets(leaves)
        if targets is None:
            return self.gear_life.past_largest(gear_plan, leaves, key)
        if gear_plan.verify_first:
            self.gear_life.verify_first_use(gear_plan, leaves, key, targets)
        padded = gear_plan.pad(leaves, targets)
        if padded is not leaves and gear_plan.written_padded:
            gear_plan.refuse_overlapping_written(leaves, padded)
        if padded is not leaves and memory.copies_split(leaves, padded, signature.shares_memory(key)):
            raise UnsupportedInputError(signature.shared_memory_message(
                self.name, key, "padding copies the padded ones to tensors of their own", self.gear_life.method,
                leaves))
        pkey = key if padded is leaves else signature.rekey(key, padded, leaves)
        entry = self._table.get(pkey)
        if entry is None:
            if served:
                self._note_miss(*signature.unflatten(key[0], leaves), leaves, geared=True)
            entry = self.life.miss(padded, pkey)
        else:                               # (as EntryLife.get_or_miss counts a hit; inline on this hot path)
            counters.hits += 1
            entry.hits += 1
        if isinstance(entry, Entry) and entry.state_aliases:   # the call's own leaves: a padded copy is copied back
            state_alias.refuse(self.name, self._method, entry.state_aliases, leaves, key)
        outs = entry.run(padded)
        if served:
            gear_plan.record_padding(entry, leaves, targets)
        if padded is not leaves:
            counters.pads += 1
            if gear_plan.written_padded:
                gear_plan.copy_back(padded, leaves)
            outs = gear_plan.cut(entry, outs, leaves)
        return entry.build(outs, leaves)

    def sizes_chosen_by_caller(self) -> None:
        """Say that the caller pads the method's inputs to sizes of its own choosing (an integration with gears of
        its own, such as ``integrations.transformers``): an entry per size is its design, not worth a warning."""
        self._recompiles = None

    def _note_miss(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: tuple[Any, ...],
                   geared: bool) -> None:
        """Warn (once per argument) when a scalar argument or an ungeared dim compiles an entry per value or size."""
        if self._recompiles is None:
            return
        self._recompiles.miss(self._method, args, kwargs, leaves, geared=geared,
                                gear_plans_stored=self.gear_life.any_stored)

    def gear_plan(self, call: MarkedCall, again: bool = False,
                  found: guard_sets.Choice | None = None) -> GearPlan | None:
        """The gear plan of this call's marks (``GearPlanLife.plan_for``: built or loaded on the first marked call;
        None when nothing is marked); the value guards of its trace are watched with the entries'. ``again``: look
        for marks on this call too when an earlier call had none. ``found``: the store's plan record for this call,
        looked up already (``GearPlanLife.stored``: a warm-up's, before it starts its workers)."""
        with self._lock:
            guards = self.gear_life.guards
            try:
                return self.gear_life.plan_for(call, again, found)
            finally:
                if self.gear_life.guards is not guards:
                    self._rewatch()

    def warmup(self, *args: Any, **kwargs: Any) -> int:
        """Compile or load the entry of every gear now, from example inputs shaped like a real call (their marks or
        the config's gears by name apply); returns the number of gears. Missing gears are compiled in worker
        processes, several at once (``config.inference_config.warmup_workers``; see gearcache/warmup/driver.py). A gear
        plan whose padding the analysis cannot prove exact was refused before this (``PaddingUnsafeError``); with
        ``inference_config.padding_check="verify"``, each gear is first tested against eager
        in float64 on the example narrowed to the smallest real sizes that pad up to it, before anything is
        compiled (gearcache/gears/padding_check.py). The runs on the examples leave no trace:
        what they write in place (the module's buffers, the example tensors) is restored after them. The stages:
        gearcache/warmup/method.py; its phases are left at ``warmup_timeline``."""
        self.warmup_timeline = Timeline()
        return warm_up(self, args, kwargs, self.warmup_timeline)

    def _refuse_modes(self) -> None:
        """Raise ``DispatchModeError`` for a call under a user ``TorchDispatchMode``, which eager runs every op
        through and a compiled entry would not (a mode that rounds products: eager 2.0, the entry 2.43), or under a
        ``TorchFunctionMode`` other than ``torch.device``'s, which Dynamo traces into the graph and an entry does not
        follow (compiled under a mode adding 1 to products: eager 2.43, the entry 3.43; served under another mode of
        the same depth, or with none). Returns where only ``torch.device``'s mode is active."""
        modes = torch_state.dispatch_modes() if torch_state.dispatch_mode_depth() else []
        kind = "TorchDispatchMode" if modes else "TorchFunctionMode"
        modes = modes or torch_state.user_function_modes()
        if not modes:
            return
        raise DispatchModeError(
            f"{self.name} was called under the {kind} {', '.join(modes)}: a compiled entry runs its kernels without "
            f"the mode, which eager runs every op through, or with the mode it was compiled under (its answer, or "
            f"what it records, would differ). Fix: call the method itself under the mode "
            f"(model.{self._method.__name__}(...), eager), or call the cached method outside it")

    def _unchecked_mismatch(self, args: tuple[Any, ...], error: str) -> SignatureMismatchError:
        """The error for a call ``check_signature=False`` served with the first entry although its inputs differ
        (their dtypes or devices, or the compiled graph's input check raised ``error``: nothing ran)."""
        leaves, key = signature.call_key(args, {})
        first = self._unchecked[0] if self._unchecked is not None else None
        desc = first.manifest.get("signature") if isinstance(first, Entry) else None
        known = [signature.short(desc)] if desc else []
        fix = (f"check_signature=False serves every call with the first entry's signature, and this call differs "
               f"({(error.splitlines() or [''])[0]}): call with that signature, or leave check_signature=True (the "
               f"default) to look up or compile an entry per signature")
        return SignatureMismatchError(self.name, signature.short(signature.describe(leaves, key)), known, fix)

    def _check_no_grad(self, leaves: tuple[Any, ...]) -> None:
        needs = [f"argument leaf {i}" for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        needs += [f"parameter {n}" for n, p in self._module.named_parameters() if p.requires_grad][:3]
        if needs:
            raise GradModeError(
                f"{self.name} was called with grad enabled and {', '.join(needs[:3])} requiring grad; gearcache "
                f"entries are inference only. Fix: call it under torch.inference_mode() (or torch.no_grad()), or "
                f"call model.requires_grad_(False) and detach the inputs.")

    # ------------------------------------------------------------------------------------------------- public
    @property
    def module(self) -> torch.nn.Module:
        """The module whose method this serves."""
        return self._module

    @property
    def entries(self) -> int:
        """How many signatures this process has an entry for."""
        return len(self._table)

    def __repr__(self) -> str:
        return f"<gearcache.CachedFunction {self.name} entries={len(self._table)} store={self.store.root}>"

    def __deepcopy__(self, memo: dict[int, object]) -> "CachedFunction":
        """``copy.deepcopy(model)``: the copy's cached method is rebuilt (its entries load again, nothing is copied),
        bound to the copy of the module, sharing this one's store and config."""
        module = copy.deepcopy(self._module, memo)
        return CachedFunction(types.MethodType(self._method.__func__, module), config=self.config, store=self.store,
                              topology=self.topology, decompositions=self._decompositions)

    def __reduce__(self) -> tuple[Callable[..., CachedFunction], tuple[object, ...]]:
        """``pickle`` / ``torch.save(model)``: stored as what rebuilds it (the module, the method's name, the config,
        the store's folder, the topology, the decompositions); unpickled, it loads its entries from that folder."""
        return _unpickle, (self._module, self._method.__name__, self.config, str(self.store.root), self.topology,
                           self._decompositions)


def _unpickle(module: torch.nn.Module, name: str, config: CompilerConfig, root: str, topology: Topology,
              decompositions: dict[Any, Callable[..., Any]] | None) -> CachedFunction:
    """Rebuild a pickled ``CachedFunction`` (``CachedFunction.__reduce__``). The module may not have its state yet
    (pickle sets it after its attributes are rebuilt): only its class is read here."""
    method = types.MethodType(getattr(type(module), name), module)
    return CachedFunction(method, config=config, store=Store.from_config(root, config), topology=topology,
                          decompositions=decompositions)


def _entry_point_name(method: types.MethodType) -> str:
    """``module.Class.method``, the method's folder in the store: the same however the module is run."""
    cls = type(method.__self__)
    raw = f"{importable_module(cls.__module__)}.{cls.__qualname__}.{method.__name__}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


_CLASS_DTYPE_DEVICE = operator.attrgetter("__class__", "dtype", "device")


def _tensor_metas(args: tuple[Any, ...]) -> tuple[TensorMeta, ...] | None:
    """Each argument's ``(torch.Tensor, dtype, device)`` (an unchecked call's, compared with the first entry's:
    Inductor's input check reads sizes and strides only, and a float64 tensor in a float32 graph was read as float32
    bits; a tensor subclass, whose ``__torch_function__`` eager runs, was served as a plain tensor), or None where
    one is not a tensor (a Python scalar, a list). Cost: ~0.25 us per tensor (this 2-core host, loaded)."""
    try:
        return tuple(map(_CLASS_DTYPE_DEVICE, args))
    except AttributeError:
        return None


def _positional_apart(desc: object) -> bool:
    """Whether a signature (``signature.describe``) is of positional tensor leaves only (no keyword, list, tuple or
    dict arguments, no Python scalar: its value is compiled into the graph, and an unkeyed call would run the first
    entry's value), none the same tensor as another nor on another's storage."""
    if not isinstance(desc, dict) or not isinstance(desc.get("leaves"), list):
        return False
    leaves = desc["leaves"]
    flat = desc.get("structure") in (str(len(leaves)), str(((tuple, *[None] * len(leaves)), (dict, ()))))
    return flat and all("shape" in leaf and "storage_of" not in leaf and "type" not in leaf for leaf in leaves)


def _filed_elsewhere(manifest: dict[str, Any], place: tuple[str, list[list[Any]]]) -> str | None:
    """Why the entry of ``manifest`` no longer serves this process, whose rank folder and process groups
    (``process_groups_factor``) are ``place`` now, or None: it was filed under another rank folder or with other
    process groups (looked up before ``init_process_group``, or before the groups were replaced), and its graph may
    hold what ``dist.get_rank()`` / ``dist.is_initialized()`` said then."""
    folder, groups = place
    filed = manifest.get("topology", folder)
    filed_groups = manifest.get("factors", {}).get("values", {}).get("process_groups", groups)
    if filed != folder or filed_groups != groups:
        return f"filed under {filed} with process groups {filed_groups}; this process is {folder} with {groups}"
    return None
