"""CUDA graphs per gear (``CompilerConfig(mode="reduce-overhead")``).

Gears make shapes static, so every gear's entry can be captured once as a CUDA graph and replayed. Graphs are not
serialisable: each process captures its own, from the kernels it loaded (no compiler runs), at warm-up or on a gear's
first call; the capture time is counted (``counters.graph_captures``, ``counters.capture_seconds``) and logged.

Per graph, every tensor input that is not a weight gets a static buffer. A call copies (and pads) its inputs into the
buffers in one step per input (a fill of the pad value, then the copy of the real rows), replays, cuts the outputs back
to the call's sizes and returns copies of them (``inference_config.graph_outputs = "copy"``, the default), or views into
the graph's static outputs (``"view"``). Such views hold until the method's next call, whatever its gear: the gears'
graphs share one memory pool, so a gear captured after another may keep its static outputs in memory the other's graph
uses for its intermediates, and a replay of either can overwrite the other's outputs. ``"view-checked"`` catches misuse
of such views: each call hands out views through storages of their own, and the method's next call makes every earlier
one raise on any access (torch's CUDA-graph trees check their outputs the same way). In every mode an output that views
an input or a module tensor is returned as eager returns it, a view of the caller's tensor (``GraphedEntry.aliases``).

Inputs updated in place (a KV cache, ``mark_static_address``) and inputs the graph writes: graphed_entry.py. All graphs
of a method share one memory pool. Parameters and buffers (weights, a KV cache bound to the module) are read and written
at the addresses they had at capture: updates in place (``load_state_dict``, ``.copy_()``) need nothing; a parameter or
buffer replaced by another tensor is noticed (a watch over the module's ``_parameters`` and ``_buffers`` items,
``GraphedEntry.state_watch``) and the gear's graph is captured again at its next call. The warm-up run before a capture
writes what the graph writes (a KV cache, a position counter): every such tensor (the run plan's ``mutated_inputs``,
module state included) is saved before it and restored after, so each call updates the state once, as eager."""
from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Iterator, cast

import torch

from .._torch import cuda_graphs as torch_cuda_graphs
from ..call import signature
from ..snapshot import snapshot
from ..compiling import background
from ..compiling.background import Compiling, StandIn
from ..counters import counters
from ..errors import ConfigError, UnsupportedInputError
from .callbacks import EntryStages, UncapturedPath
from .gear_threads import GearThreads, collectives_possible
from .graphed_entry import (GraphedEntry, GraphShortcut, fill_buffers, graph_matcher, is_static_address,
                            mutated_leaves, refuse_split_memory, refuse_state_aliases, state_rules_of, state_watch_of,
                            target_shape, write_refused_message, written_copies, written_tensors)

Leaves = tuple[Any, ...]
"""A call's flattened arguments (``signature.call_key``'s leaves): the caller's tensors and Python values."""
CallKey = tuple[Hashable, ...]
"""A call's signature key (``signature.call_key``)."""
GraphKey = tuple[object, ...]
"""A CUDA graph's key among a method's graphs (:meth:`CudaGraphs._graph_key`)."""

if TYPE_CHECKING:
    from ..compiling.entry_life import Loaded
    from ..gears.plan import GearCall, GearPlan
    from ..timeline import Timeline


log = logging.getLogger("gearcache")
CAPTURE_THREADS = 8     # warm-up runs at once in CudaGraphs.capture_all (benchmarks/decode_step.py compares with 1)


_LIVE: "weakref.WeakSet[CudaGraphs]" = weakref.WeakSet()     # every method's graphs, for release_graphs()


def release_graphs() -> int:
    """Drop every CUDA graph this process captured (each method's ``graphs.reset()``; the next call of a gear
    captures it again) and wait for the device; returns how many were dropped. Call it before
    ``torch.distributed.destroy_process_group()``: a live graph that captured NCCL collectives keeps its
    communicator's resources, and NCCL's teardown then waits for them (pytorch/pytorch#115388)."""
    dropped = 0
    for graphs in list(_LIVE):
        dropped += len(graphs.graphs)
        graphs.reset()
    if torch.cuda.is_initialized():     # type: ignore[no-untyped-call]  # torch leaves it untyped
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return dropped


class CudaGraphs:
    """The CUDA graphs of one cached method, keyed by gear and input metadata.

    ``targets`` (a call's gear sizes) is None exactly when ``gear_plan`` is: where one is known not None, so is the
    other (what the ``type: ignore``s below stand for)."""

    def __init__(self, cached: UncapturedPath, life: EntryStages):
        _LIVE.add(self)
        self.cached = cached        # the CachedFunction: its call path without graphs, its gear checks, name, config
        self.life = life            # its entries' stages (entry_life.EntryLife): a gear's entry, found or compiled
        # torch.cuda.graph_pool_handle(), shared by every gear
        self.pool: torch_cuda_graphs.GraphPoolHandle | None = None
        self.graphs: dict[GraphKey, GraphedEntry] = {}
        self._side: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self.timeline: Timeline | None = None      # a warm-up's (``timed``): captures record their phases in it
        self.handed_out: list[torch.Tensor] = []        # "view-checked": the views the last call returned
        self.replayed: GraphedEntry | None = None       # the graph the last call replayed (None: it ran none)

    def __del__(self) -> None:
        # The views "view-checked" handed out do not keep the pool's memory: make them raise rather than read it
        # once it is gone (at interpreter exit torch may be half torn down: nothing to protect then).
        with contextlib.suppress(Exception):
            self._retire_views()

    @contextlib.contextmanager
    def timed(self, timeline: Timeline) -> Iterator[None]:
        """Record the phases of the captures made in the block (look-up, warm-up run, record) in ``timeline``."""
        self.timeline = timeline
        try:
            yield
        finally:
            self.timeline = None

    def reset(self) -> None:
        """Drop every captured graph (they are captured again on their next call)."""
        self._retire_views()
        self.replayed = None
        for graphed in self.graphs.values():
            graphed.retire()
        self.graphs.clear()
        self.pool = None

    def drop_unless(self, entry_ids: set[int]) -> None:
        """Drop the graphs whose entry is not among ``entry_ids`` (the method dropped it: its value guards no longer
        hold); the others stay."""
        stale = [g for g, graphed in self.graphs.items() if id(graphed.entry) not in entry_ids]
        if stale:
            self._retire_views()
            self.replayed = None
            for gkey in stale:
                self.graphs.pop(gkey).retire()
            if not self.graphs:
                # torch keeps a pool whose graphs are all gone while its memory is in use (outputs handed out), and
                # refuses a capture into it: the next capture starts a pool of its own
                self.pool = None

    def call(self, gear_plan: GearPlan | None, leaves: Leaves, key: CallKey, served: bool = False) -> Any:
        """Run the call on its gear's graph (captured on first use). ``served``: a caller's call, not a warm-up's
        (its padding is counted: ``GearPlan.record_padding``). ``self.replayed``: the graph it replayed, or None."""
        self.replayed = None
        refuse_split_memory(self.cached, gear_plan is not None, leaves, key)
        targets = gear_plan.targets(leaves) if gear_plan is not None else None
        if gear_plan is not None and targets is None:
            return self.cached.gear_life.past_largest(gear_plan, leaves, key)
        if gear_plan is not None and gear_plan.verify_first:
            self.cached.gear_life.verify_first_use(gear_plan, leaves, key, targets)  # type: ignore[arg-type]  # padding_check.py
        gkey = self._graph_key(gear_plan, leaves, key, targets)
        graphed = self.graphs.get(gkey)
        if graphed is None:
            if not signature.on_cuda(leaves):
                return self.cached.call_uncaptured(gear_plan, leaves, key, served)  # CPU inputs: no graphs
            captured = self._capture(gear_plan, leaves, key, targets)
            if captured is None:    # its entry compiles in the background (background.py): eager until loaded
                return self.cached.call_uncaptured(gear_plan, leaves, key, served)
            graphed = self.graphs[gkey] = captured
        elif graphed.state_replaced():
            log.info("%s: a parameter or buffer of the graph %s was replaced since its capture; capturing it again",
                     self.cached.name, [tuple(b.shape) for _, b, _ in graphed.copies])
            self._retire_views()
            # captured before the old graph is released: torch refuses a capture into a pool none of whose graphs
            # is alive while its memory is in use
            graphed.retired = True
            captured = self._capture(gear_plan, leaves, key, targets)
            graphed.retire()
            if captured is None:    # its entry was dropped and compiles in the background: eager until loaded
                del self.graphs[gkey]
                return self.cached.call_uncaptured(gear_plan, leaves, key, served)
            graphed = self.graphs[gkey] = captured
        else:
            counters.hits += 1
        refuse_state_aliases(self.cached, graphed.entry, leaves, key)
        graphed.refuse_overlapping_written(leaves)
        self.replayed = graphed
        return self._replay(graphed, gear_plan, leaves, targets, served)

    def _replay(self, graphed: GraphedEntry, gear_plan: GearPlan | None, leaves: Leaves, targets: list[int] | None,
                served: bool) -> Any:
        """Replay ``graphed`` on the call's inputs; the method's result."""
        graphed.fill(leaves)        # first: the inputs may be views the last call handed out (a decode loop's KV cache)
        outs = graphed.replay()
        graphed.copy_back(leaves)   # (before the views are retired: a written input may be one of them)
        self._retire_views()
        outs = graphed.over_callers(outs, leaves) if graphed.aliases else outs
        if gear_plan is not None:
            outs = gear_plan.cut(graphed.entry, outs, leaves)
            if served:
                gear_plan.record_padding(graphed.entry, leaves, targets)  # type: ignore[arg-type]
        mode = self.cached.config.inference_config.graph_outputs
        if mode == "copy":
            outs = torch_cuda_graphs.fresh_copies(outs, graphed.aliases)
        elif mode == "view-checked":
            outs = self._checked_views(outs, graphed.aliases)
        return graphed.entry.build(outs, leaves)

    def shortcut(self, leaves: Leaves, key: CallKey, distinct_storages: bool) -> tuple[Any, GraphShortcut] | None:
        """``(matcher, served)`` for the dispatcher's shortcut (``_set_shortcut``): the next calls like this one
        (``key``; no gear plan) replay the graph this call replayed (``self.replayed``) without the full path's keys
        and look-ups; None when it replayed none or the key has no matcher."""
        graphed = self.replayed
        if graphed is None:
            return None
        try:
            return graphed.shortcuts[key]
        except KeyError:
            pass
        matcher = signature.matcher(leaves, key, distinct_storages, state_rules=state_rules_of(graphed.entry))
        made = None
        if matcher is not None:
            run = lambda args: self._replay(graphed, None, args, None, False)     # noqa: E731
            made = signature.Matcher(graph_matcher(matcher.check, graphed), *matcher[1:]), GraphShortcut(run)
        graphed.shortcuts[key] = made
        return made

    def _checked_views(self, outs: list[Any], kept: dict[int, int | None]) -> list[Any]:
        """``"view-checked"``: views of ``outs`` (but ``kept``'s) through storages of their own, retired next call."""
        views = [torch_cuda_graphs.storage_alias(o) if isinstance(o, torch.Tensor) and k not in kept else o
                 for k, o in enumerate(outs)]
        self.handed_out = [v for k, v in enumerate(views) if isinstance(v, torch.Tensor) and k not in kept]
        return views

    def _retire_views(self) -> None:
        """Make the views the last call handed out raise on any access: before any graph of the method replays (the
        gears share one pool, so any replay may overwrite them; after the call's inputs are copied into the static
        buffers, since they may be such views), and before ``reset`` drops the graphs."""
        if not self.handed_out:
            return
        message = (f"gearcache: this output of {self.cached.name} is a view into a CUDA graph's static output, "
                   f"overwritten by a later call of the same method, whatever its gear "
                   f"(graph_outputs='view-checked'). Fix: .clone() it before calling again, or use "
                   f"graph_outputs='copy'")
        for old in self.handed_out:
            torch_cuda_graphs.forbid_storage_access(old, message)
        self.handed_out = []

    @staticmethod
    def _graph_key(gear_plan: GearPlan | None, leaves: Leaves, key: CallKey, targets: list[int] | None) -> GraphKey:
        shapes: dict[int, list[int]] = {}
        if targets is not None:         # a gear plan's call (targets is None exactly when gear_plan is)
            for d, t in zip(gear_plan.dims, targets):  # type: ignore[union-attr]
                shapes.setdefault(d.leaf, list(leaves[d.leaf].shape))[d.dim] = t
        parts: list[tuple[object, ...]] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                shape = tuple(shapes[i]) if i in shapes else tuple(leaf.shape)
                static = leaf.stride() if is_static_address(leaf) else None
                parts.append((shape, static, leaf.dtype, leaf.device))
            else:
                parts.append((type(leaf), leaf))
        return (key[0], key[1], *parts)

    def prepare(self, gear_plan: GearPlan | None, leaves: Leaves, key: CallKey) -> Loaded:
        """Find (load, or compile) the entry of this call's gear without capturing it (lazy capture's warm-up)."""
        refuse_split_memory(self.cached, gear_plan is not None, leaves, key)
        targets = gear_plan.targets(leaves) if gear_plan is not None else None
        static_leaves = gear_plan.pad(leaves, targets) if targets is not None else leaves  # type: ignore[union-attr]
        skey = signature.rekey(key, static_leaves)
        return self.life.get_or_miss(static_leaves, skey, count=False)

    def _capture(self, gear_plan: GearPlan | None, leaves: Leaves, key: CallKey, targets: list[int] | None,
                 wait: bool = False) -> GraphedEntry | None:
        """Build the gear's static buffers, find (or compile/load) its entry, warm it up, capture it. None (nothing
        captured, nothing run) while the entry compiles in the background: a graph of the eager stand-in would
        replay one eager run, not the method. ``wait``: wait for such a compile instead (a warm-up's captures: never
        None then).

        Only the warm-up and the capture are counted in ``counters.capture_seconds`` (a load is in ``load_seconds``).
        """
        graphed, static_leaves = self._prepare(gear_plan, leaves, key, targets, wait)
        if isinstance(graphed.entry, StandIn):
            return None
        return self._capture_prepared(graphed, leaves, static_leaves)

    def _capture_prepared(self, graphed: GraphedEntry, leaves: Leaves, static_leaves: Leaves) -> GraphedEntry:
        """Warm up and record a gear ``_prepare`` made ready (its entry found): the run phase of a capture."""
        t0 = time.perf_counter()
        counters.graph_warmups += 1
        self._warm_up_undone(graphed, leaves, static_leaves)
        with self.phase(static_leaves, "graph record"):
            graphed.recorded(*self.record(graphed.entry, static_leaves), static_leaves)
        graphed.state_watch = state_watch_of(graphed.entry)
        self._captured(graphed, time.perf_counter() - t0)
        return graphed

    def _prepare(self, gear_plan: GearPlan | None, leaves: Leaves, key: CallKey, targets: list[int] | None,
                 wait: bool = False) -> tuple[GraphedEntry, Leaves]:
        """The gear's static buffers (filled with this call's inputs) and its entry (found, loaded or compiled), as a
        ``GraphedEntry`` not captured yet; and the static leaves a capture runs on."""
        pad_of = {d.leaf: d.pad_value for d in gear_plan.dims} if gear_plan is not None else {}
        static = list(leaves)
        copies, static_ptrs = [], []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.device.type != "cuda":
                raise UnsupportedInputError(
                    f"mode='reduce-overhead' captures CUDA graphs; input {i} is on {leaf.device}")
            if is_static_address(leaf):
                if i in pad_of:
                    raise ConfigError(f"input {i} is marked with mark_static_address and has gears; a static-address "
                                      f"input cannot be padded")
                static_ptrs.append((i, leaf.data_ptr()))
                continue
            buf = leaf.new_empty(leaf.shape if targets is None else
                                 [t for t in target_shape(gear_plan, leaves, targets, i)])  # type: ignore[arg-type]
            static[i] = buf
            pad = pad_of.get(i)
            copies.append((i, buf, 0 if pad is None else pad))
        static_leaves = tuple(static)
        graphed = GraphedEntry(cast("Loaded", None), cast(torch.cuda.CUDAGraph, None), [], copies,  # recorded later
                               static_ptrs)
        fill_buffers(graphed, leaves)      # a compile runs the graph on these buffers: they must hold this call's data
        skey = signature.rekey(key, static_leaves)
        graphed.entry = self.life.get_or_miss(static_leaves, skey, count=False)
        while wait and isinstance(graphed.entry, StandIn):     # compiling in the background: wait, then load it
            if isinstance(graphed.entry, Compiling):            # (a waiter's look-up after the wait may start a
                background.wait_for(self.life)                  # compile of its own: waited for in turn)
            else:                                               # an identical block's compile: wait for every one
                background.wait()
            graphed.entry = self.life.get_or_miss(static_leaves, skey, count=False)
        refuse_state_aliases(self.cached, graphed.entry, leaves, key)    # before a warm-up run or a capture runs it
        graphed.written = written_copies(graphed.entry, copies)
        return graphed, static_leaves

    def _captured(self, graphed: GraphedEntry, seconds: float) -> None:
        counters.graph_captures += 1
        counters.capture_seconds += seconds
        log.info("%s: captured a CUDA graph for %s in %.3f s", self.cached.name,
                 [tuple(b.shape) for _, b, _ in graphed.copies], seconds)

    def capture_all(self, gear_plan: GearPlan | None, calls: list[GearCall], threads: int | None = None,
                    before_runs: Callable[[list[Loaded]], None] | None = None) -> int:
        """Capture the graph of every call in ``calls`` (the call at each gear of ``gear_plan``, in the order the
        graphs are recorded: a warm-up's, largest first) that has none yet; returns how many were captured.

        Their entries are found here, one after another (under ``warmup()`` they are in the method's table already:
        ``compile_missing`` looked up and loaded every gear side by side; else each is loaded, or compiled, here); as
        soon as a gear's entry is here, a thread of its own runs the gear's warm-up run (at most ``threads`` at once),
        beside the next look-ups. cuDNN
        keeps the attention plan it builds for a new shape (~45 ms a gear on an H200) per thread, so each gear is
        recorded by the thread that warmed it up: one gear at a time in ``calls``' order, into the shared pool, after
        every warm-up has ended (while a graph is recorded no other thread uses the device). The static-address
        inputs (a KV cache) the warm-up runs write to are restored before the records. Then the allocator's cache is
        emptied once: the blocks the warm-up runs used stay reserved otherwise (graph pools keep theirs).

        In a process that belongs to a process group (collectives may be in the graphs) the parallel warm-up runs
        answer collectives locally (``runplan.collectives.stand_in_collectives``: no communication, as the run plan's
        check at compile time ran them), so they do every per-shape first use (cuDNN plans, cuBLAS heuristics, lazy
        kernel loads) side by side; then, once every gear's entry is found (the compile phase: loads, or compiles, in
        no rank's order) and ``before_runs(entries)`` (ranks.py's fence: every rank of the group is there) returned,
        each gear's thread in turn, in ``calls``' order, runs the real warm-up run (its collectives reach the group in
        the same order on every rank, one thread at a time) and records."""
        todo = self._uncaptured(gear_plan, calls)
        if not todo:
            return 0
        in_order = collectives_possible()
        self._streams()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gear_threads = GearThreads(self, len(todo), threads or CAPTURE_THREADS, shadow=in_order)
        prepared, saved = self._start_gears(gear_plan, todo, gear_threads)
        if in_order and before_runs is not None:
            try:
                before_runs([graphed.entry for _, _, graphed, _ in prepared])
            except BaseException:
                gear_threads.stop()
                raise

        between, real_warm_up = self._turns(prepared, saved)
        recorded = gear_threads.finish(between, real_warm_up if in_order else None)
        seconds = (time.perf_counter() - t0) / len(todo)
        for (gkey, _, graphed, static_leaves), (graph, outs) in zip(prepared, recorded):
            counters.graph_warmups += 1
            self._captured(graphed, seconds)
            graphed.state_watch = state_watch_of(graphed.entry)
            graphed.recorded(graph, outs, static_leaves)
            self.graphs[gkey] = graphed
        torch.cuda.empty_cache()
        return len(todo)

    def _start_gears(self, gear_plan: GearPlan | None, todo: list[tuple[GraphKey, Leaves, CallKey, list[int] | None]],
                     gear_threads: GearThreads) -> tuple[list[tuple[GraphKey, Leaves, GraphedEntry, Leaves]],
                                                         list[tuple[torch.Tensor, torch.Tensor]]]:
        """Find each gear's entry and start its thread's warm-up run: ``(graph key, leaves, graphed, static
        leaves)`` per gear, and the saved copies of what the warm-up runs write (restored before the records)."""
        prepared: list[tuple[GraphKey, Leaves, GraphedEntry, Leaves]] = []
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        written: list[torch.Tensor] = []        # the tensors themselves (``saved`` holds byte views of copies)
        try:
            for gkey, leaves, key, targets in todo:
                with self.phase(leaves, "look up", synchronize=False):
                    graphed, static_leaves = self._prepare(gear_plan, leaves, key, targets, wait=True)
                prepared.append((gkey, leaves, graphed, static_leaves))
                # what the gears started before write is in ``written``: saved once, before any of them ran
                fresh = [t for t in written_tensors(graphed.entry, static_leaves) if all(t is not w for w in written)]
                saved += snapshot(fresh)
                written += fresh
                gear_threads.start(graphed, static_leaves)
        except BaseException:
            gear_threads.stop()
            raise
        return prepared, saved

    def _turns(self, prepared: list[tuple[GraphKey, Leaves, GraphedEntry, Leaves]],
               saved: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Callable[[], None], Callable[[int], None]]:
        """``capture_all``'s steps after the parallel warm-up runs (``GearThreads.finish``): ``between`` (no record
        begun yet: what the runs wrote restored from ``saved``, every gear's buffers filled again), ``real_warm_up(k)``
        (in gear k's thread, alone on the device: its real warm-up run, the same restore, its buffers filled again)."""
        def restore() -> None:
            for view, before in saved:
                view.copy_(before)

        def between() -> None:
            restore()
            for _, leaves, graphed, _ in prepared:
                fill_buffers(graphed, leaves)

        def real_warm_up(k: int) -> None:
            _, leaves, graphed, static_leaves = prepared[k]
            with self.phase(static_leaves, "graph warm-up run"):
                self.warm_up(graphed.entry, static_leaves, graphed.copies, self._streams()[0])
                restore()
                fill_buffers(graphed, leaves)
        return between, real_warm_up

    def _warm_up_undone(self, graphed: GraphedEntry, leaves: Leaves, static_leaves: Leaves) -> None:
        """Run the gear's warm-up run, then undo what it wrote to static-address inputs and to state (a KV cache, a
        position counter), so that the call being served updates them once, and fill its static buffers again."""
        with self.phase(static_leaves, "graph warm-up run"):
            saved = snapshot(written_tensors(graphed.entry, static_leaves))
            self.warm_up(graphed.entry, static_leaves, graphed.copies, self._streams()[0])
            for view, before in saved:
                view.copy_(before)
            fill_buffers(graphed, leaves)

    def _uncaptured(self, gear_plan: GearPlan | None,
                    calls: list[GearCall]) -> list[tuple[GraphKey, Leaves, CallKey, list[int] | None]]:
        """``(graph key, leaves, key, targets)`` of each call in ``calls`` whose gear has no graph yet, once each (a
        call at a gear is padded to that gear: its targets are the gear's sizes)."""
        todo: list[tuple[GraphKey, Leaves, CallKey, list[int] | None]] = []
        for sizes, leaves, key, *_ in calls:
            targets = sizes if gear_plan is not None else None
            gkey = self._graph_key(gear_plan, leaves, key, targets)
            if gkey not in self.graphs and all(gkey != g for g, *_ in todo):
                todo.append((gkey, leaves, key, targets))
        return todo

    def phase(self, leaves: Leaves, phase: str, synchronize: bool = True) -> ContextManager[None]:
        """A span of the running warm-up's timeline (with ``synchronize``, the device synchronised at its end, so the
        span holds the GPU work it queued), or nothing outside a warm-up."""
        if self.timeline is None:
            return contextlib.nullcontext()
        who = "gear " + str([tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)][:1])
        return self.timeline.span(who, phase, synchronize=torch.cuda.synchronize if synchronize else None)

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The side stream of warm-up runs and the capture stream, made once per method (not once per gear)."""
        if self._side is None or self._capture_stream is None:     # (made together)
            self._side, self._capture_stream = (torch.cuda.Stream(),    # type: ignore[no-untyped-call]  # untyped in torch
                                                 torch.cuda.Stream())    # type: ignore[no-untyped-call]
        return self._side, self._capture_stream

    def record(self, entry: Loaded, static_leaves: Leaves) -> tuple[torch.cuda.CUDAGraph, list[Any]]:
        """Capture one run of ``entry`` into the method's shared memory pool.

        ``torch.cuda.graph`` would also empty the allocator's cache before every capture (so the next gear's buffers
        are allocated from the driver again) and, where ``force_cudagraph_gc`` is set, run the garbage collector:
        capturing gears one after another needs neither. What it does that matters is done here: the device is idle
        before capture begins, and the capture runs on a stream of its own."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()     # every gear of the method allocates from this one pool
        _, stream = self._streams()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # "thread_local", as torch's CUDA-graph trees capture: other threads (NCCL's watchdog, which queries events of
        # the collectives a TP graph captures) may keep calling CUDA while this thread captures.
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outs = entry.compiled(*entry.gather(static_leaves))
            finally:
                graph.capture_end()
        return graph, list(outs)

    def warm_up(self, entry: Loaded, static_leaves: Leaves, copies: list[tuple[int, torch.Tensor, float]],
                side: torch.cuda.Stream) -> None:
        """Run the entry once on the stream ``side`` before its capture (as CUDA graph capture requires: lazy
        initialisation, cuBLAS workspaces and first kernel loads must not happen while capturing). An entry without a
        run plan does not say which inputs it writes: for it, this run also refuses writes to copied inputs."""
        known = mutated_leaves(entry) is not None
        before = [] if known else [buf.clone() for _, buf, _ in copies]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            entry.compiled(*entry.gather(static_leaves))
        torch.cuda.current_stream().wait_stream(side)
        for (i, buf, _), old in zip(copies, before):
            if not torch.equal(buf, old):
                raise UnsupportedInputError(write_refused_message(i))

