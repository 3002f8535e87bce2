"""A gear plan's life as public stages: ``marked_call``, ``plan_key``, ``stored``, ``load_or_build``, ``build``,
``verify_first_use`` / ``verify``, ``past_largest``, ``revalidate``.

:class:`GearPlanLife` holds the gear plan (plan.py) of one cached method, beside its :class:`EntryLife` (the entries'
stages, gearcache/compiling/entry_life.py), and takes it from the first marked call to its last:

- ``marked_call``: a call as the gears read it, a :class:`~gearcache.gears.plan.MarkedCall`: its leaves, key
  and gear marks (``set_dim_gears`` on its tensors, or the config's ``dim_gears`` by name) and whether
  ``set_dim_gears`` marked it, derived once;
- ``plan_key``: the gear plan's key, every factor its trace depends on (:data:`~gearcache.gears.plan.PLAN_FORMAT`,
  the marks, the method's source, the module's state, torch's versions);
- ``stored``: the store's plan record for these marks whose value guards hold here (``guard_sets.choose``);
- ``load_or_build``: that record's plan, else ``build``: a symbolic trace with the marked dims symbolic (at the
  largest gear), its padding analysis (padding.py), the plan stored under its key; either way checked against
  ``padding_check`` (``padding_check.apply``: may raise ``PaddingUnsafeError``);
- ``verify_first_use`` / ``verify``: a gear tested against eager before it first serves a padded call, or at a
  warm-up's request (``padding_check.verify``; a warm-up chooses its cases: gearcache/warmup/method.py);
- ``past_largest``: a call past the largest gear, as ``inference_config.past_largest_gear`` says;
- ``revalidate``: the plan dropped when its trace's value guards no longer hold (its next call builds it anew).

State: ``plan`` (None: nothing marked yet, or not looked for), ``checked`` (the marks were looked for) and
``guards`` (the value guards of the plan's trace, watched by the owner with its entries').

On disk (``Entries.write_gear_plan``, gearcache/store/entries.py; one JSON record per plan key, beside the method's
entries):
``{"format": FORMAT_VERSION, "pkey", "plan": GearPlan.to_json(), "dependencies": [...], "guards": GuardSet.to_json()}``.
A plan whose value guards read a value local to this process is never stored (no other process can check it).
"""
from __future__ import annotations

import types
import warnings
from typing import TYPE_CHECKING, Any, Hashable, cast

import torch

from .._torch import state as torch_state, versions as torch_versions
from ..call import signature, state_alias
from ..call.entry import Entry
from .capture import dependencies_changed
from .symbolic_trace import refuse_views_of_padded, symbolic_shapes
from .entry_life import module_state
from ..config import CompilerConfig
from ..counters import counters
from ..errors import PastLargestGearError
from ..keys import decompositions as key_decompositions, guard_paths, guard_sets
from ..keys.key import FORMAT_VERSION, gear_plan_key
from ..ranks.topology import process_groups_factor
from ..runplan.collectives import communicates
from ..gears import padding_check
from ..gears.plan import (PLAN_FORMAT, GearPlan, MarkedCall, MarkedDim, build_plan, check_marks, find_marks, has_marks,
                          narrowed)

if TYPE_CHECKING:
    from .entry_life import EntryLife
    from ..ranks.topology import Topology
    from ..store import Store


class GearPlanLife:
    """The gear plan of one cached method (see the module docstring). ``entries``: the method's entry stages, which
    serve a call past the largest gear and learn whether its graphs call collectives; their lock guards the plan."""

    def __init__(self, method: types.MethodType, *, config: CompilerConfig, store: Store, topology: Topology,
                 name: str, scope: guard_paths.Scope, entries: EntryLife):
        self.method = method
        self.module = cast(torch.nn.Module, method.__self__)
        self.config = config
        self.store = store
        self.topology = topology
        self.name = name
        self.scope = scope
        self.entries = entries
        self.lock = entries.lock
        self.plan: GearPlan | None = None
        self.checked = False                    # the marks were looked for (plan None then: nothing marked)
        self.guards: guard_sets.GuardSet | None = None    # the plan's trace's value guards

    # --------------------------------------------------------------------------------------------- the plan
    def plan_for(self, call: MarkedCall, again: bool = False,
                 found: guard_sets.Choice | None = None) -> GearPlan | None:
        """The gear plan, built (or loaded) from the first call's marks; None when nothing is marked. ``again``: look
        for marks on this call too when an earlier call had none. ``found``: as ``load_or_build``'s."""
        with self.lock:
            if self.checked and not (again and self.plan is None):
                return self.plan
            if call.marks:
                self.plan = self.load_or_build(call, found)
            self.checked = True
            return self.plan

    def marked_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MarkedCall:
        """The call ``args``, ``kwargs`` as the gears read it: its leaves and key (``signature.call_key``), the names
        of its tensor arguments, its gear marks (``set_dim_gears`` on its tensors, or the config's ``dim_gears`` by
        name), and whether ``set_dim_gears`` marked it."""
        ic = self.config.inference_config
        names = signature.leaf_names(self.method, args, kwargs)
        leaves, key = signature.call_key(args, kwargs)
        marks = find_marks(leaves, names, ic.dim_gears, ic.pad_values)
        return MarkedCall(args, kwargs, leaves, key, names, marks, has_marks(leaves))

    def plan_key(self, marks: list[MarkedDim], key: tuple[Hashable, ...]) -> str:
        """The gear plan's key: everything its trace depends on."""
        ic = self.config.inference_config
        return gear_plan_key(method_name=self.name, method_digest=self.entries.method_digest, structure=repr(key[0]),
                             plan_format=PLAN_FORMAT, marks=[[m.leaf, m.dim, m.sizes, m.pad_value] for m in marks],
                             merge_policy=ic.dynamic_gears_merge_policy, module_state=module_state(self.module),
                             global_state=torch_state.global_state(), software=torch_versions.software_versions(),
                             process_groups=process_groups_factor(),
                             decompositions=key_decompositions.factor(self.entries.decompositions))

    def stored(self, call: MarkedCall) -> guard_sets.Choice:
        """The store's plan record for the call's marks whose value guards hold here (``record`` None: none stored)."""
        pkey = self.plan_key(call.marks, call.key)
        return guard_sets.choose(self._read, pkey, self.scope)

    def any_stored(self) -> bool:
        """Whether the store holds any gear plan of this method (``Entries.gear_plans_in_method``)."""
        return bool(self.store.entries.gear_plans_in_method(self.topology.folder, self.name))

    def load_or_build(self, call: MarkedCall, found: guard_sets.Choice | None = None) -> GearPlan:
        """The stored gear plan for the call's marks, else one built (``build``) and stored; either way checked
        against ``padding_check`` (padding_check.apply: may raise PaddingUnsafeError). ``found``: ``stored(call)``
        already looked up (a warm-up's, before its workers start): not read from the store again, its record's
        value guards checked again here (a record whose guards no longer hold is looked up anew)."""
        ic = self.config.inference_config
        check_marks(call.marks, ic.dynamic_gears_merge_policy)
        if found is None or (found.guards is not None and found.guards.mismatch(self.scope) is not None):
            found = self.stored(call)
        saved, pkey = found.record, found.key
        if saved is not None and not dependencies_changed(saved.get("dependencies", [])):
            self.guards = found.guards
            gear_plan = GearPlan.from_json(saved["plan"], ic.past_largest_gear)
        else:
            gear_plan = self.build(call, pkey)
        padding_check.apply(self.name, gear_plan, ic.padding_check)
        return gear_plan

    def build(self, call: MarkedCall, pkey: str) -> GearPlan:
        """Trace the method with the marked dims symbolic (at the largest gear), analyse its padding, and store the
        plan under ``pkey`` (unless its value guards read a local value, which no other process can check)."""
        ic = self.config.inference_config
        marks, leaves, key = call.marks, call.leaves, call.key
        counters.traces += 1
        largest = tuple(max(m.sizes) if m.sizes[-1] >= 2 else leaves[m.leaf].shape[m.dim] for m in marks)
        traced = [(m.leaf, m.dim) for m in marks if m.sizes[-1] >= 2]
        sample = GearPlan(marks, [[i] for i in range(len(marks))], "product", {}, "error").pad(
            narrowed(leaves, marks, largest), list(largest))
        trace = symbolic_shapes(self.method, self.module, key[0], sample, traced)
        refuse_views_of_padded(self.method, trace, {leaf for leaf, _ in traced})
        self.entries.communicates = communicates(trace.graph)      # warm-up compiles such graphs in this thread
        from ..gears import padding  # the analysis (and sympy) only where a gear plan is built, never on a warm load

        bounds: dict[str, int] = {}
        for m, sym in zip([m for m in marks if m.sizes[-1] >= 2], trace.symbols):
            bounds[sym] = max(bounds.get(sym, 0), m.sizes[-1])
        report = padding.analyse(trace, call.names, {m.leaf for m in marks},
                                 {m.leaf: m.pad_value for m in marks if m.pad_value is not None}, bounds,
                                 decompositions=self.entries.decompositions)
        it = iter(trace.symbols)
        symbols = [next(it) if m.sizes[-1] >= 2 else f"static:{m.leaf}:{m.dim}" for m in marks]
        gear_plan = build_plan(marks, ic.dynamic_gears_merge_policy, ic.past_largest_gear, symbols,
                               trace.output_dims, report)
        self.guards = trace.plan_guards
        if trace.plan_guards.local is None:
            self._write(pkey, {"format": FORMAT_VERSION, "pkey": pkey, "plan": gear_plan.to_json(),
                               "dependencies": trace.dependencies, "guards": trace.plan_guards.to_json()})
        return gear_plan

    def revalidate(self, reading: guard_sets.Reading, moved: bool = False) -> None:
        """Drop the plan when its trace's value guards no longer hold, or when ``moved`` (the process's rank folder
        or process groups changed since it was made: its trace may hold what ``dist.is_initialized()`` or
        ``dist.get_rank()`` said then); the next call looks for marks anew."""
        if moved or (self.guards is not None and self.guards.mismatch(self.scope, reading) is not None):
            self.plan, self.checked, self.guards = None, False, None

    # ------------------------------------------------------------------------------------------ on a call
    def verify_first_use(self, gear_plan: GearPlan, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                         targets: list[int]) -> None:
        """Before gear ``targets`` first serves a padded call in this process, test it against eager on this call
        (``verify``; only under ``padding_check="verify"``: ``gear_plan.verify_first``). Nothing for a call at the
        gear's own sizes, or a gear already verified."""
        if tuple(targets) in gear_plan.verified or all(leaves[d.leaf].shape[d.dim] == t
                                                       for d, t in zip(gear_plan.dims, targets)):
            return
        self.verify(gear_plan, key, leaves, targets)

    def verify(self, gear_plan: GearPlan, key: tuple[Hashable, ...], leaves: tuple[Any, ...],
               sizes: list[int]) -> None:
        """Test gear ``sizes`` against eager in float64 on ``leaves``, a call of ``key``'s structure at real sizes
        that pad up to it (``padding_check.verify``), under the plan's lock, unless the gear passed already in this
        process (``gear_plan.verified``, which a pass adds it to); raises ``PaddingUnsafeError`` if padding changes
        an output or a written tensor."""
        with self.lock:
            if tuple(sizes) not in gear_plan.verified:
                padding_check.verify(self.name, self.method, self.module, gear_plan, key[0], leaves, sizes)

    def past_largest(self, gear_plan: GearPlan, leaves: tuple[Any, ...], key: tuple[Hashable, ...]) -> Any:
        """A call past the largest gear: raise (``past_largest_gear="error"``), run it uncompiled (``"eager"``,
        warned once), or serve it from an entry of its own signature (``"compile"``). A call with an empty marked dim
        (``GearPlan.empty_call``: never padded) runs uncompiled under every policy: eager's result, or eager's error
        (``x.amax(0)`` of 0 rows)."""
        if gear_plan.empty_call(leaves):
            counters.eager_calls += 1
            args, kwargs = signature.unflatten(key[0], leaves)
            return self.method(*args, **kwargs)
        policy = self.config.inference_config.past_largest_gear
        if policy == "error":
            raise PastLargestGearError(f"{self.name}: {gear_plan.past_largest_message(leaves)}")
        if policy == "eager":
            counters.eager_calls += 1
            if not gear_plan._warned_eager:         # once per plan
                gear_plan._warned_eager = True
                warnings.warn(f"gearcache: {self.name}: {gear_plan.past_largest_message(leaves)}; running it "
                              f"uncompiled (warned once; counted in gearcache.counters.eager_calls)", stacklevel=3)
            args, kwargs = signature.unflatten(key[0], leaves)
            return self.method(*args, **kwargs)
        entry = self.entries.get_or_miss(leaves, key)
        if isinstance(entry, Entry) and entry.state_aliases:       # (call/state_alias.py)
            state_alias.refuse(self.name, self.method, entry.state_aliases, leaves, key)
        return entry(leaves)

    # ------------------------------------------------------------------------------------------ the store
    def _read(self, pkey: str) -> dict[str, Any] | None:
        return self.store.entries.read_gear_plan(self.topology.folder, self.name, pkey)

    def _write(self, pkey: str, record: dict[str, Any]) -> None:
        self.store.entries.write_gear_plan(self.topology.folder, self.name, pkey, record)

