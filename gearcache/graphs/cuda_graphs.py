"""CUDA graphs per gear (``CompilerConfig(mode="reduce-overhead")``).

Gears make shapes static, so every gear's entry can be captured once as a CUDA graph and replayed. Graphs are not
serialisable: each process captures its own, from the kernels it loaded (no compiler runs), at warm-up or on a gear's
first call; the capture time is counted (``counters.graph_captures``, ``counters.capture_seconds``) and logged.

Per graph, every tensor input that is not a weight gets a static buffer. A call copies (and pads) its inputs into the
buffers in one step per input (a fill of the pad value, then the copy of the real rows), replays, cuts the outputs
back to the call's sizes and returns copies of them (``inference_config.graph_outputs = "copy"``, the default), or
views into the graph's static outputs (``"view"``). Such views hold until the method's next call, whatever its gear:
the gears' graphs share one memory pool, so a gear captured after another may keep its static outputs in memory the
other's graph uses for its intermediates, and a replay of either can overwrite the other's outputs. ``"view-checked"``
catches misuse of such views: each call hands out views through storages of their own, and the method's next call
makes every earlier one raise on any access (torch's CUDA-graph trees check their outputs the same way).

Inputs updated in place (a KV cache) are best marked with :func:`mark_static_address`: the graph then reads and
writes the caller's tensor itself, and a call passing another tensor is an error. An unmarked input that the graph
writes to (its run plan's ``mutated_inputs``; a padded one included) is written in its static buffer, and copied back
into the caller's tensor after each replay (its real rows, for a padded one), as ``mode="default"`` copies a padded
input's rows back after a run (``GearPlan.copy_back``). An entry without a run plan does not say what it writes: a
write into a copied input found at its capture is refused.
All graphs of a method share one memory pool. Parameters and buffers (weights, a KV cache bound to the module) are
read and written at the addresses they had at capture: updates in place (``load_state_dict``, ``.copy_()``) need
nothing; a parameter or buffer replaced by another tensor is noticed (a watch over the module's ``_parameters`` and
``_buffers`` items, ``GraphedEntry.state_watch``) and the gear's graph is captured again at its next call.
The warm-up run before a capture writes what the graph writes (a KV cache, a position counter): every such tensor
(the run plan's ``mutated_inputs``, module state included) is saved before it and restored after, so each call
updates the state once, as eager.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from typing import Any, Callable, cast

import torch

from .._torch import cuda_graphs as torch_cuda_graphs, distributed as torch_distributed
from ..keys import guard_watch
from ..call import signature
from ..compiling.snapshot import snapshot
from ..compiling import background
from ..compiling.background import Compiling
from ..counters import counters
from ..call.entry import Entry
from ..errors import ConfigError, UnsupportedInputError

log = logging.getLogger("gearcache")
STATIC_ADDRESS_ATTR = "_gearcache_static_address"
CAPTURE_THREADS = 8     # warm-up runs at once in CudaGraphs.capture_all (benchmarks/decode_step.py compares with 1)


def mark_static_address(tensor: torch.Tensor) -> torch.Tensor:
    """Declare that ``tensor`` is passed (the same storage) on every call, e.g. a KV cache updated in place."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"mark_static_address: tensor={type(tensor).__qualname__} is not a torch.Tensor")
    setattr(tensor, STATIC_ADDRESS_ATTR, True)
    return tensor


def on_cuda(leaves: tuple) -> bool:
    """Whether a call has a CUDA tensor among its inputs (calls with none run without graphs, same entries)."""
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)


def _is_static_address(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and getattr(leaf, STATIC_ADDRESS_ATTR, False)


class GraphedEntry:
    """One entry (one gear) captured as a CUDA graph, with its static input buffers."""

    def __init__(self, entry: Any, graph: torch.cuda.CUDAGraph, outs: list, copies: list, static_ptrs: list):
        self.entry, self.graph, self.outs = entry, graph, outs
        self.copies = copies                  # [(leaf index, static buffer, pad value)]
        self.static_ptrs = static_ptrs        # [(leaf index, data_ptr)] of static-address inputs
        self.written: list[tuple[int, torch.Tensor]] = []   # [(leaf index, static buffer)] the graph writes
        self.state_watch: Any = None          # valid() while every parameter and buffer the graph reads is the same
        #                                       tensor as at its capture (``_state_watch``)

    def state_replaced(self) -> bool:
        """Whether a parameter or buffer the graph reads was replaced by another tensor since its capture (a new KV
        cache bound to the module, ``module.weight = Parameter(...)``): its replays would read and write the old
        one's memory, so the graph must be captured again."""
        return self.state_watch is not None and not self.state_watch.valid()

    def fill(self, leaves: tuple) -> None:
        """Copy (and pad) the call's inputs into the static buffers; check the static-address inputs."""
        _fill(self, leaves)
        for i, ptr in self.static_ptrs:
            if leaves[i].data_ptr() != ptr:
                raise UnsupportedInputError(
                    f"input {i} was marked with mark_static_address, but this call passes another tensor (storage "
                    f"{leaves[i].data_ptr():#x}, captured {ptr:#x}). Pass the same tensor on every call, or call "
                    f".graphs.reset() on the cached method after replacing it")

    def replay(self) -> list:
        """Run the graph on what ``fill`` left in the buffers; returns its static outputs."""
        self.graph.replay()
        return self.outs

    def copy_back(self, leaves: tuple) -> None:
        """Copy what the replay wrote into copied inputs back into the caller's tensors (their real rows)."""
        for i, buf in self.written:
            dst = leaves[i]
            dst.copy_(buf if buf.shape == dst.shape else buf[tuple(slice(0, n) for n in dst.shape)])


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
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return dropped


class CudaGraphs:
    """The CUDA graphs of one cached method, keyed by gear and input metadata."""

    def __init__(self, cached: Any, life: Any):
        _LIVE.add(self)
        self.cached = cached        # the CachedFunction: its call path without graphs, its gear checks, name, config
        self.life = life            # its entries' stages (entry_life.EntryLife): a gear's entry, found or compiled
        # torch.cuda.graph_pool_handle(), shared by every gear
        self.pool: torch_cuda_graphs.GraphPoolHandle | None = None
        self.graphs: dict[tuple, GraphedEntry] = {}
        self._side: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self.timeline: Any = None       # set by warmup(): captures then record their phases in its Timeline
        self.handed_out: list[torch.Tensor] = []        # "view-checked": the views the last call returned

    def __del__(self) -> None:
        # The views "view-checked" handed out do not keep the pool's memory: make them raise rather than read it
        # once it is gone (at interpreter exit torch may be half torn down: nothing to protect then).
        with contextlib.suppress(Exception):
            self._retire_views()

    def reset(self) -> None:
        """Drop every captured graph (they are captured again on their next call)."""
        self._retire_views()
        self.graphs.clear()
        self.pool = None

    def drop_unless(self, entry_ids: set[int]) -> None:
        """Drop the graphs whose entry is not among ``entry_ids`` (the method dropped it: its value guards no longer
        hold); the others stay."""
        stale = [g for g, graphed in self.graphs.items() if id(graphed.entry) not in entry_ids]
        if stale:
            self._retire_views()
            for gkey in stale:
                del self.graphs[gkey]
            if not self.graphs:
                # torch keeps a pool whose graphs are all gone while its memory is in use (outputs handed out), and
                # refuses a capture into it: the next capture starts a pool of its own
                self.pool = None

    def call(self, gear_plan: Any, leaves: tuple, key: tuple, served: bool = False) -> Any:
        """Run the call on its gear's graph (captured on first use). ``served``: a caller's call, not a warm-up's
        (its padding is counted: ``GearPlan.record_padding``)."""
        if (signature.shares_memory(key) if gear_plan is not None else signature.shares_storage(key)) and \
                on_cuda(leaves):
            raise UnsupportedInputError(signature.shared_memory_message(
                self.cached.name, key, "a CUDA graph copies each input into a static buffer of its own"))
        targets = gear_plan.targets(leaves) if gear_plan is not None else None
        if gear_plan is not None and targets is None:
            return self.cached.past_largest(gear_plan, leaves, key)
        if gear_plan is not None and gear_plan.verify_first:
            self.cached.verify_first_use(gear_plan, leaves, key, targets)       # padding_check.py
        gkey = self._graph_key(gear_plan, leaves, key, targets)
        graphed = self.graphs.get(gkey)
        if graphed is None:
            if not on_cuda(leaves):
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
            captured = self._capture(gear_plan, leaves, key, targets)
            if captured is None:    # its entry was dropped and compiles in the background: eager until loaded
                del self.graphs[gkey]
                return self.cached.call_uncaptured(gear_plan, leaves, key, served)
            graphed = self.graphs[gkey] = captured
        else:
            counters.hits += 1
        graphed.fill(leaves)        # first: the inputs may be views the last call handed out (a decode loop's KV cache)
        outs = graphed.replay()
        graphed.copy_back(leaves)   # (before the views are retired: a written input may be one of them)
        self._retire_views()
        if gear_plan is not None:
            outs = gear_plan.cut(graphed.entry, outs, leaves)
            if served:
                gear_plan.record_padding(graphed.entry, leaves, targets)
        mode = self.cached.config.inference_config.graph_outputs
        if mode == "copy":
            outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
        elif mode == "view-checked":
            outs = self._checked_views(outs)
        return graphed.entry.build(outs, leaves)

    def _checked_views(self, outs: list) -> list:
        """``"view-checked"``: views of ``outs`` through storages of their own, retired by the method's next call."""
        views = [torch_cuda_graphs.storage_alias(o) if isinstance(o, torch.Tensor) else o for o in outs]
        self.handed_out = [v for v in views if isinstance(v, torch.Tensor)]
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
    def _graph_key(gear_plan: Any, leaves: tuple, key: tuple, targets: list[int] | None) -> tuple:
        shapes: dict[int, list[int]] = {}
        if targets is not None:         # a gear plan's call (targets is None exactly when gear_plan is)
            for d, t in zip(gear_plan.dims, targets):
                shapes.setdefault(d.leaf, list(leaves[d.leaf].shape))[d.dim] = t
        parts: list[tuple] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                shape = tuple(shapes[i]) if i in shapes else tuple(leaf.shape)
                static = leaf.stride() if _is_static_address(leaf) else None
                parts.append((shape, static, leaf.dtype, leaf.device))
            else:
                parts.append((type(leaf), leaf))
        return (key[0], key[1], *parts)

    def prepare(self, gear_plan: Any, leaves: tuple, key: tuple) -> Entry:
        """Find (load, or compile) the entry of this call's gear without capturing it (lazy capture's warm-up)."""
        if (signature.shares_memory(key) if gear_plan is not None else signature.shares_storage(key)) and \
                on_cuda(leaves):
            raise UnsupportedInputError(signature.shared_memory_message(
                self.cached.name, key, "a CUDA graph copies each input into a static buffer of its own"))
        targets = gear_plan.targets(leaves) if gear_plan is not None else None
        static_leaves = gear_plan.pad(leaves, targets) if targets is not None else leaves
        skey = signature.rekey(key, static_leaves)
        return self.life.get_or_miss(static_leaves, skey, count=False)

    def _capture(self, gear_plan: Any, leaves: tuple, key: tuple, targets: list[int] | None,
                 wait: bool = False) -> GraphedEntry | None:
        """Build the gear's static buffers, find (or compile/load) its entry, warm it up, capture it. None (nothing
        captured, nothing run) while the entry compiles in the background: a graph of the eager stand-in would
        replay one eager run, not the method. ``wait``: wait for such a compile instead (a warm-up's captures: never
        None then).

        Only the warm-up and the capture are counted in ``counters.capture_seconds`` (a load is in ``load_seconds``).
        """
        graphed, static_leaves = self._prepare(gear_plan, leaves, key, targets, wait)
        if isinstance(graphed.entry, Compiling):
            return None
        return self._capture_prepared(graphed, leaves, static_leaves)

    def _capture_prepared(self, graphed: GraphedEntry, leaves: tuple, static_leaves: tuple) -> GraphedEntry:
        """Warm up and record a gear ``_prepare`` made ready (its entry found): the run phase of a capture."""
        t0 = time.perf_counter()
        with self._phase(static_leaves, "graph warm-up run"):
            # The warm-up run writes to static-address inputs and to state (a KV cache, a position counter): undo it,
            # so this call updates them once.
            saved = snapshot(written_tensors(graphed.entry, static_leaves))
            counters.graph_warmups += 1
            self._warm_up(graphed.entry, static_leaves, graphed.copies, self._streams()[0])
            for view, before in saved:
                view.copy_(before)
            _fill(graphed, leaves)
        with self._phase(static_leaves, "graph record"):
            graphed.graph, graphed.outs = self._record(graphed.entry, static_leaves)
        graphed.state_watch = _state_watch(graphed.entry)
        self._captured(graphed, time.perf_counter() - t0)
        return graphed

    def _prepare(self, gear_plan: Any, leaves: tuple, key: tuple, targets: list[int] | None,
                 wait: bool = False) -> tuple[GraphedEntry, tuple]:
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
            if _is_static_address(leaf):
                if i in pad_of:
                    raise ConfigError(f"input {i} is marked with mark_static_address and has gears; a static-address "
                                      f"input cannot be padded")
                static_ptrs.append((i, leaf.data_ptr()))
                continue
            buf = leaf.new_empty(leaf.shape if targets is None else
                                 [t for t in _target_shape(gear_plan, leaves, targets, i)])
            static[i] = buf
            pad = pad_of.get(i)
            copies.append((i, buf, 0 if pad is None else pad))
        static_leaves = tuple(static)
        graphed = GraphedEntry(None, cast(torch.cuda.CUDAGraph, None), [], copies, static_ptrs)   # recorded later
        _fill(graphed, leaves)      # a compile runs the graph on these buffers: they must hold this call's data
        skey = signature.rekey(key, static_leaves)
        graphed.entry = self.life.get_or_miss(static_leaves, skey, count=False)
        if wait and isinstance(graphed.entry, Compiling):      # compiling in the background: wait, then load it
            background.wait_for(self.life)
            graphed.entry = self.life.get_or_miss(static_leaves, skey, count=False)
        graphed.written = _written_copies(graphed.entry, copies)
        return graphed, static_leaves

    def _captured(self, graphed: GraphedEntry, seconds: float) -> None:
        counters.graph_captures += 1
        counters.capture_seconds += seconds
        log.info("%s: captured a CUDA graph for %s in %.3f s", self.cached.name,
                 [tuple(b.shape) for _, b, _ in graphed.copies], seconds)

    def capture_all(self, gear_plan: Any, calls: list[tuple[tuple, tuple]], threads: int | None = None,
                    before_runs: Callable[[list], None] | None = None) -> int:
        """Capture the graph of every call in ``calls`` (``(leaves, key)`` of a call at each gear, in the order the
        graphs are recorded: ``capture_order``) that has none yet; returns how many were captured.

        Their entries are found (loaded, or compiled) here, one after another (``warmup()`` leaves stored gears to be
        loaded here: ``compile_missing(defer_loads=True)``); as soon as a gear's entry is here, a
        thread of its own runs the gear's warm-up run (at most ``threads`` at once), beside the next look-ups. cuDNN
        keeps the attention plan it builds for a new shape (~45 ms a gear on an H200) per thread, so each gear is
        recorded by the thread that warmed it up: one gear at a time in ``calls``' order, into the shared pool, after
        every warm-up has ended (while a graph is recorded no other thread uses the device). In a process that
        belongs to a process group (collectives may be in the graphs) every gear is warmed up and recorded in the
        calling thread, one after another in ``calls``' order, so each rank's collectives reach the group in the same
        order, and only once every gear's entry is found (the compile phase: loads, or compiles, in no rank's order)
        and ``before_runs(entries)`` (ranks.py's fence: every rank of the group is there) returned. The static-address
        inputs (a KV cache) the warm-up runs write to are restored before the records. Then the allocator's cache is
        emptied once: the blocks the warm-up runs used stay reserved otherwise (graph pools keep theirs)."""
        todo = self._uncaptured(gear_plan, calls)
        if not todo:
            return 0
        if _collectives_possible():
            return self._capture_in_order(gear_plan, todo, before_runs)
        self._streams()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gear_threads, prepared = _GearThreads(self, len(todo), threads or CAPTURE_THREADS), []
        written: list[torch.Tensor] = []
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for gkey, leaves, key, targets in todo:
                with self._phase(leaves, "look up", synchronize=False):
                    graphed, static_leaves = self._prepare(gear_plan, leaves, key, targets, wait=True)
                prepared.append((gkey, leaves, graphed))
                fresh = [t for t in written_tensors(graphed.entry, static_leaves) if all(t is not w for w in written)]
                saved += snapshot(fresh)   # (what the gears started before write is in ``written``: not again)
                written += fresh
                gear_threads.start(graphed, static_leaves)
        except BaseException:
            gear_threads.stop()
            raise

        def between() -> None:              # every warm-up has ended; no record has begun
            for view, before in saved:
                view.copy_(before)
            for _, leaves, graphed in prepared:
                _fill(graphed, leaves)

        recorded = gear_threads.finish(between)
        seconds = (time.perf_counter() - t0) / len(todo)
        for (gkey, _, graphed), (graph, outs) in zip(prepared, recorded):
            graphed.graph, graphed.outs = graph, outs
            graphed.state_watch = _state_watch(graphed.entry)
            self.graphs[gkey] = graphed
            counters.graph_warmups += 1
            self._captured(graphed, seconds)
        torch.cuda.empty_cache()
        return len(todo)

    def _capture_in_order(self, gear_plan: Any, todo: list[tuple[tuple, tuple, tuple, Any]],
                          before_runs: Callable[[list], None] | None) -> int:
        """``capture_all`` in a process of a process group. Collectives in warm-up runs of several threads would
        reach the group in a different order on each rank (a hang): every gear's entry first (no collective runs
        while ranks compile or wait for each other's artifacts), then ``before_runs`` (the fence), then one gear at
        a time in ``todo``'s order, the same on every rank."""
        prepared = [(gkey, leaves, *self._prepare(gear_plan, leaves, key, targets, wait=True))
                    for gkey, leaves, key, targets in todo]
        if before_runs is not None:
            before_runs([graphed.entry for _, _, graphed, _ in prepared])
        for gkey, leaves, graphed, static_leaves in prepared:
            self.graphs[gkey] = self._capture_prepared(graphed, leaves, static_leaves)
        torch.cuda.empty_cache()
        return len(todo)

    def _uncaptured(self, gear_plan: Any, calls: list[tuple[tuple, tuple]]) -> list[tuple[tuple, tuple, tuple, Any]]:
        """``(graph key, leaves, key, targets)`` of each call in ``calls`` whose gear has no graph yet, once each."""
        todo: list[tuple[tuple, tuple, tuple, list[int] | None]] = []
        for leaves, key in calls:
            targets = gear_plan.targets(leaves) if gear_plan is not None else None
            gkey = self._graph_key(gear_plan, leaves, key, targets)
            if gkey not in self.graphs and all(gkey != g for g, *_ in todo):
                todo.append((gkey, leaves, key, targets))
        return todo

    def _phase(self, leaves: tuple, phase: str, synchronize: bool = True) -> Any:
        """A span of the running warm-up's timeline (with ``synchronize``, the device synchronised at its end, so the
        span holds the GPU work it queued), or nothing outside a warm-up."""
        if self.timeline is None:
            return contextlib.nullcontext()
        who = "gear " + str([tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)][:1])
        return self.timeline.span(who, phase, synchronize=torch.cuda.synchronize if synchronize else None)

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The side stream of warm-up runs and the capture stream, made once per method (not once per gear)."""
        if self._side is None or self._capture_stream is None:     # (made together)
            self._side, self._capture_stream = torch.cuda.Stream(), torch.cuda.Stream()
        return self._side, self._capture_stream

    def _record(self, entry: Any, static_leaves: tuple) -> tuple[torch.cuda.CUDAGraph, list]:
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

    def _warm_up(self, entry: Any, static_leaves: tuple, copies: list, side: torch.cuda.Stream) -> None:
        """Run the entry once on the stream ``side`` before its capture (as CUDA graph capture requires: lazy
        initialisation, cuBLAS workspaces and first kernel loads must not happen while capturing). An entry without a
        run plan does not say which inputs it writes: for it, this run also refuses writes to copied inputs."""
        known = _mutated_leaves(entry) is not None
        before = [] if known else [buf.clone() for _, buf, _ in copies]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            entry.compiled(*entry.gather(static_leaves))
        torch.cuda.current_stream().wait_stream(side)
        for (i, buf, _), old in zip(copies, before):
            if not torch.equal(buf, old):
                raise UnsupportedInputError(_write_message(i))


class _GearThreads:
    """``CudaGraphs.capture_all``'s threads, one per gear (``start``ed as each gear's entry is found): its warm-up run
    (at most ``limit`` at once), then, once every gear's has ended (``finish``), its record, one gear at a time in the
    order they were started. A failure in any thread stops the records that follow and is raised in the caller."""

    def __init__(self, graphs: CudaGraphs, n: int, limit: int):
        self.graphs = graphs
        self.slots = threading.Semaphore(max(1, limit))
        self.warmed = threading.Barrier(n + 1)                      # every gear's thread, and the caller
        self.gears: list[tuple[GraphedEntry, tuple]] = []
        self.threads: list[threading.Thread] = []
        self.turns = [threading.Event() for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.results: list[tuple[torch.cuda.CUDAGraph, list] | None] = [None] * n
        self.abort = False
        # thread-local state a new thread does not inherit: the device, grad and inference mode
        self.modes = (torch.cuda.current_device(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    def start(self, graphed: GraphedEntry, static_leaves: tuple) -> None:
        k = len(self.threads)
        self.gears.append((graphed, static_leaves))
        thread = threading.Thread(target=self._gear, args=(k,), name=f"gearcache-capture-{k}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """The caller failed before every gear was started: end the started threads without recording."""
        self.abort = True
        self.warmed.abort()
        for k, thread in enumerate(self.threads):
            self.turns[k].set()
            thread.join()

    def finish(self, between: Callable[[], None]) -> list[tuple[torch.cuda.CUDAGraph, list]]:
        """Wait for every warm-up run, call ``between`` (unless one failed), then let each thread record in turn.
        Returns each gear's (graph, static outputs)."""
        self.warmed.wait()
        try:
            if not any(self.errors):
                torch.cuda.synchronize()
                between()
                torch.cuda.synchronize()
        finally:
            for k, thread in enumerate(self.threads):
                self.abort = self.abort or any(e is not None for e in self.errors)
                self.turns[k].set()
                thread.join()
        for exc in self.errors:
            if exc is not None:
                raise exc
        return self.results         # type: ignore[return-value]  # no None left: each gear recorded, or raised above

    def _gear(self, k: int) -> None:
        graphed, static_leaves = self.gears[k]
        device, grad, inference = self.modes
        with contextlib.ExitStack() as modes:
            try:
                modes.enter_context(torch.cuda.device(device))
                modes.enter_context(torch.inference_mode(inference))
                modes.enter_context(torch.set_grad_enabled(grad))
                with self.slots, self.graphs._phase(static_leaves, "graph warm-up run"):
                    self.graphs._warm_up(graphed.entry, static_leaves, graphed.copies, torch.cuda.Stream())
            except BaseException as exc:                # raised in the caller
                self.errors[k] = exc
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.warmed.wait()                  # (broken: the caller stopped)
            self.turns[k].wait()
            if self.abort or self.errors[k] is not None:
                return
            try:
                with self.graphs._phase(static_leaves, "graph record"):
                    self.results[k] = self.graphs._record(graphed.entry, static_leaves)
            except BaseException as exc:
                self.errors[k] = exc


def _collectives_possible() -> bool:
    """Whether this process belongs to a process group (its graphs may hold collectives, which must reach each group
    in one order on every rank, and are not issued from several threads at once: even a group of one is kept to
    one thread)."""
    return bool(torch_distributed.process_groups())


def capture_order(combinations: list[list[int]]) -> list[list[int]]:
    """The order ``warmup`` captures gears in: largest first (by padded elements, then sizes), so the graphs of the
    smaller gears reuse blocks the larger ones freed into the shared pool instead of growing it."""
    return sorted(combinations, key=lambda sizes: (math.prod(sizes), sizes), reverse=True)


def _mutated_leaves(entry: Any) -> list[int] | None:
    """Call leaves that the entry's graph writes in place, from its run plan (``mutated_inputs``); None when the
    entry was loaded without a plan (then only a run can tell)."""
    mutated = _plan_mutated(entry)
    if mutated is None:
        return None
    inputs = entry.manifest["inputs"]
    return [int(inputs[j][1]) for j in mutated if inputs[j][0] == "leaf"]


def _plan_mutated(entry: Any) -> list[int] | None:
    """The graph inputs the entry writes in place, as its run plan says (an unsupported plan too, where its writer
    could read them: ``runplan.loader.TorchLoaded``); None when unknown."""
    run_plan = getattr(entry.compiled, "plan", None)
    mutated = run_plan.get("mutated_inputs") if isinstance(run_plan, dict) else None
    return [int(j) for j in mutated] if isinstance(mutated, list) else None


def written_tensors(entry: Any, static_leaves: tuple) -> list[torch.Tensor]:
    """The tensors a run of ``entry`` on ``static_leaves`` may write in place: its run plan's ``mutated_inputs``
    (call leaves and module state alike: a KV cache, a position counter); without a run plan, every static-address leaf
    and every buffer it reads (a run alone could tell; these are what a method may legitimately update). For an
    eager stand-in (``faults.EagerEntry``), which runs the method as written: every tensor leaf."""
    if not isinstance(entry, Entry):
        return [x for x in static_leaves if isinstance(x, torch.Tensor)]
    inputs = entry.gather(static_leaves)
    mutated = _plan_mutated(entry)
    if mutated is not None:
        return [inputs[j] for j in mutated if isinstance(inputs[j], torch.Tensor)]
    kinds = entry.manifest["inputs"]
    return [x for (kind, ref), x in zip(kinds, inputs) if isinstance(x, torch.Tensor) and (
        (kind == "leaf" and _is_static_address(x)) or (kind == "state" and not isinstance(x, torch.nn.Parameter)))]


def _state_watch(entry: Any) -> Any:
    """A watch over the ``_parameters`` / ``_buffers`` items the entry's graph reads (``GraphedEntry.state_watch``):
    the graph holds their addresses, so replacing one of them must lead to a new capture. None when it reads none."""
    if not isinstance(entry, Entry):
        return None
    items = [(d, name, d[name]) for d, name in entry.state_refs()]
    return guard_watch.GuardWatch(items, [], [], guard_watch.ABSENT) if items else None


def _written_copies(entry: Any, copies: list) -> list[tuple[int, torch.Tensor]]:
    """``(leaf index, static buffer)`` of each copied (not static-address) input the entry's run plan says it writes:
    copied back after each replay (``GraphedEntry.copy_back``). Without a run plan: none (a write found at the
    capture's warm-up run is refused there)."""
    mutated = set(_mutated_leaves(entry) or ())
    return [(i, buf) for i, buf, _ in copies if i in mutated]


def _write_message(i: int) -> str:
    return (f"the method writes to its input {i} in place, and its entry has no run plan saying so; under CUDA graphs "
            f"such an input must keep its storage. Fix: gearcache.mark_static_address(tensor) on it (and pass the "
            f"same tensor on every call)")


def _target_shape(gear_plan: Any, leaves: tuple, targets: list[int], i: int) -> list[int]:
    shape = list(leaves[i].shape)
    for d, t in zip(gear_plan.dims, targets):
        if d.leaf == i:
            shape[d.dim] = t
    return shape


def _fill(graphed: GraphedEntry, leaves: tuple) -> None:
    """Copy (and pad) the call's inputs into the static buffers without replaying."""
    for i, buf, pad in graphed.copies:
        src = leaves[i]
        if src.shape == buf.shape:
            buf.copy_(src)
        else:
            buf.fill_(pad)
            buf[tuple(slice(0, s) for s in src.shape)].copy_(src)
