"""Warm-up of one cached method (``CachedFunction.warmup``): every gear's entry compiled or loaded, then run once.

The stages, each a public stage of the method's parts (``CachedMethod``: its ``gear_life``, a
:class:`~gearcache.compiling.gear_plan_life.GearPlanLife`; its ``life``, an
:class:`~gearcache.compiling.entry_life.EntryLife`; its ``graphs``, the CUDA graphs of ``mode="reduce-overhead"``):

1. the example call as the gears read it, derived once (``GearPlanLife.marked_call``: a ``MarkedCall``, its leaves,
   signature key and marks, whether ``set_dim_gears`` marked it), and its gear plan (``CachedMethod.gear_plan``);
   when no plan is stored for its marks yet, worker processes start first, as many as the gears the marks can form
   at most (:func:`_early_workers`), so that their start overlaps the plan's
   trace; a method without marks is called once and done;
2. every gear tested against eager where ``padding_check="verify"`` asks (eager runs only, before anything is
   compiled: :func:`_verify_gears`, the cases ``padding_check.cases``, each test ``GearPlanLife.verify``);
3. the example at every gear (``GearPlan.gear_calls``: its leaves, key and arguments there), once for the stages
   below; every gear's stored entry looked up and loaded side by side, the gears the store lacks compiled, side by
   side (driver.py ``compile_missing``);
4. what the runs below may write in place saved, to be restored after them (:func:`_kept_by`: ``snapshot.kept``);
   the fence: every rank of the process groups the gears' graphs name waits for the others (:func:`_fence`, over
   ``ranks.fence``; under CUDA graphs' capture, inside ``capture_all``, before that);
5. each gear run once on the example padded to it (``CachedMethod.call_geared``, or the CUDA graphs' capture:
   ``CudaGraphs.capture_all``), largest first under CUDA graphs (:func:`capture_order`).

Every phase is recorded in the :class:`~gearcache.timeline.Timeline` the caller passes.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Protocol

import torch

from ..call import signature
from ..call.entry import Entry
from ..compiling.entry_life import Loaded
from ..snapshot import kept
from ..config import CompilerConfig
from ..gears.plan import GearCall, GearPlan, MarkedCall
from ..gears import padding_check
from ..keys import guard_sets
from ..graphs import cuda_graphs, graphed_entry
from ..ranks import phases as ranks
from . import driver
from ..timeline import Timeline

if TYPE_CHECKING:
    from ..compiling.entry_life import EntryLife
    from ..compiling.workers import WorkerPool
    from ..compiling.gear_plan_life import GearPlanLife

log = logging.getLogger("gearcache.warmup.method")


class CachedMethod(Protocol):
    """What a warm-up drives: a ``CachedFunction``'s public stages."""
    name: str
    config: CompilerConfig
    life: EntryLife
    gear_life: GearPlanLife
    graphs: cuda_graphs.CudaGraphs | None

    @property
    def module(self) -> torch.nn.Module: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def gear_plan(self, call: MarkedCall, again: bool = False,
                  found: guard_sets.Choice | None = None) -> GearPlan | None: ...

    def call_geared(self, gear_plan: GearPlan, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                    served: bool = False) -> Any: ...


def warm_up(cached: CachedMethod, args: tuple[Any, ...], kwargs: dict[str, Any], timeline: Timeline) -> int:
    """Compile or load the entry of every gear of ``cached`` from the example call ``args``, ``kwargs``, then run each
    once (see the module docstring); returns the number of gears (1 for a method without marks)."""
    early = None                            # worker processes started before the gear plan's trace
    ic = cached.config.inference_config
    lazy = ic.capture_graphs == "first_call"    # CUDA graphs captured at each gear's first call, not here
    try:
        with timeline.span("all", "signature and gears"):
            call = cached.gear_life.marked_call(args, kwargs)
            found = None                    # the store's plan record, when looked up for the early workers
            if not cached.gear_life.checked:
                early, found = _early_workers(cached, call, timeline)
            gear_plan: GearPlan | None = cached.gear_plan(call, found=found)
            if gear_plan is None and call.tagged:    # an earlier call had no marks, these do
                gear_plan = cached.gear_plan(call, again=True)
        if gear_plan is not None:
            # eager runs only, before anything is compiled
            _verify_gears(cached, gear_plan, call, timeline)
            gears = gear_plan.gear_calls(call)
            capture_now = cached.graphs is not None and not lazy and signature.on_cuda(call.leaves)
            pool, early = early, None       # compile_missing owns (and closes) it from here
            driver.compile_missing(cached.life, gears, ic.warmup_workers, timeline, pool)
    finally:
        if early is not None:
            early.close(wait=False)
    if gear_plan is not None:
        return _run_gears(cached, gear_plan, gears, call.leaves, timeline, lazy, capture_now)
    with kept([*call.leaves, *cached.module.buffers()]):     # no marks: one call
        cached(*args, **kwargs)
    return 1


def _run_gears(cached: CachedMethod, gear_plan: GearPlan, gears: list[GearCall], leaves: tuple[Any, ...],
               timeline: Timeline, lazy: bool, capture_now: bool) -> int:
    """Run every gear once on the example padded to it (``gears``; under CUDA graphs: capture it now, largest first,
    or only load it: lazy capture), after the fence; returns the number of gears."""
    graphs = cached.graphs
    call: Callable[..., Any] = cached.call_geared
    if graphs is not None:
        gears = capture_order(gears)
        call = graphs.prepare if lazy else graphs.call
    with graphs.timed(timeline) if graphs is not None else contextlib.nullcontext():
        combos = [gear.sizes for gear in gears]
        fence = functools.partial(_fence, cached, combos, timeline=timeline)
        table = cached.life.table
        if capture_now:
            assert graphs is not None       # capture_now: graphs are captured (reduce-overhead)
            with timeline.span("all", "capture every gear"):    # entries, warm-up runs at once, records
                graphs.capture_all(gear_plan, gears, before_runs=fence)
        with _kept_by(table, gears, [*leaves, *cached.module.buffers()]) as restore:
            if not capture_now and not lazy:
                fence([table.get(gear.key) for gear in gears])
            for gear in gears:
                with timeline.span(f"gear {gear.sizes}", "first run"):
                    call(gear_plan, gear.leaves, gear.key)
                restore()       # each gear's run sees the example's state (a position a decode step advances)
    return len(gears)


def _verify_gears(cached: CachedMethod, gear_plan: GearPlan, call: MarkedCall, timeline: Timeline) -> None:
    """Test every gear against eager before anything is compiled, where ``padding_check="verify"`` asks for it: the
    example ``call`` narrowed to the smallest real sizes that pad up to each gear not verified yet
    (``padding_check.cases``), each test timed in ``timeline`` (``GearPlanLife.verify``)."""
    if gear_plan.verify_first:
        for sizes, real_leaves in padding_check.cases(gear_plan, call.leaves):
            with timeline.span(f"gear {sizes}", "verify padding"):
                cached.gear_life.verify(gear_plan, call.key, real_leaves, sizes)


def capture_order(gears: list[GearCall]) -> list[GearCall]:
    """The order a warm-up captures gears in: largest first (by padded elements, then sizes), so the graphs of the
    smaller gears reuse blocks the larger ones freed into the shared pool instead of growing it."""
    return sorted(gears, key=lambda gear: (math.prod(gear.sizes), gear.sizes), reverse=True)


def _early_workers(cached: CachedMethod, call: MarkedCall,
                   timeline: Timeline) -> tuple[WorkerPool | None, guard_sets.Choice | None]:
    """Worker processes started before the gear plan is traced, when no plan is stored for these marks yet: such
    a warm-up has gears to compile, and the workers' start (importing torch and Inductor: ~10 s each on the H200
    host) then overlaps the trace (~7 s there) instead of following it. None when the plan is stored, nothing is
    marked, or warm-up is serial. Beside them, the store's plan record where it was looked up (``GearPlanLife.stored``,
    handed to ``gear_plan``: a plan's JSON, as large as an entry's, read once), else None."""
    ic = cached.config.inference_config
    if not call.marks or ic.warmup_workers == 1:
        return None, None
    found = cached.gear_life.stored(call)
    if found.record is not None:
        return None, found
    return driver.start_workers(cached.life, call, ic.dynamic_gears_merge_policy, ic.warmup_workers, timeline), found


def _fence(cached: CachedMethod, combos: list[list[int]], entries: list[Loaded | None], timeline: Timeline) -> None:
    """Between the compile phase and the runs: wait until every rank of the process groups the gears' graphs name is
    here with the same gears in the same order (ranks.fence; nothing without collectives, or when an entry does not
    say which groups it uses)."""
    groups: dict[str, dict[str, Any]] = {}
    for entry in entries:
        named = _groups(entry) if entry is not None else None
        if named is None:
            log.debug("%s: an entry does not say which process groups it uses; no fence before its runs",
                      cached.name)
            return
        groups.update(named)
    if groups:
        with timeline.span("all", "wait for the other ranks"):
            ranks.fence(ranks.group_ranks(groups.values()), f"{cached.name} warm-up runs",
                        f"gears {combos}", cached.config.rank_timeout_s)


def _groups(entry: Loaded) -> dict[str, dict[str, Any]] | None:
    """The process groups an entry's collectives run on (``{name: {"ranks", "backend"}}``; ``{}``: none): its run
    plan's ``groups``, else its manifest's (written at compile); None when unknown (an eager stand-in, which runs the
    method as written, or an entry stored without either): the fence then cannot tell which ranks it talks to."""
    if not isinstance(entry, Entry):
        return None
    plan = getattr(entry.compiled, "plan", None)
    if isinstance(plan, dict) and "groups" in plan:
        plan_groups: dict[str, dict[str, Any]] = plan["groups"]
        return plan_groups
    groups = entry.manifest.get("groups")
    return groups if isinstance(groups, dict) else None


def _kept_by(table: dict[tuple[Hashable, ...], Loaded], gears: list[GearCall],
             unknown: list[torch.Tensor]) -> ContextManager[Callable[[], None]]:
    """What the gears' first runs may write in place (their entries' ``mutated_inputs``; ``unknown`` where a gear's
    entry is not in ``table`` yet: it is found by its first run), kept: restored after each of them and at the end
    (``snapshot.kept``, which gives the block its restore)."""
    written: list[torch.Tensor] = []
    for gear in gears:
        entry = table.get(gear.key)
        written += unknown if entry is None else graphed_entry.written_tensors(entry, gear.leaves)
    return kept(written)
