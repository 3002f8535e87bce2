"""Cold warm-up of a geared method: compile the gears the store lacks side by side (``CachedFunction.warmup``).

Which gears, in what order (:func:`rank_order`): on ``W`` ranks sharing a folder, rank ``r`` first takes the gears
whose index is ``r`` mod ``W``, then the others, so ranks compile different gears at once instead of queueing on the
same artifact lock; the artifact lock still decides who compiles what (never twice).

How (:func:`compile_missing`), with ``n = inference_config.warmup_workers`` (default :func:`default_workers`) > 1:

1. look every gear's entry up (a stored entry is loaded, as on a miss): the first in rank order alone in the calling
   thread, the others after it there, or side by side in up to :data:`LOAD_THREADS` threads when the second spent
   most of its time waiting (:func:`find_all`, :func:`lookup_threads`; this step alone for any ``n``: a warm
   start's loads);
2. if several are missing, start ``n`` worker processes (``gearcache/compiling/workers.py``) before the first capture:
   their start (importing torch and Inductor, starting Inductor's compile pool) overlaps step 3. When no gear plan is
   stored yet (a first warm-up), they are started even earlier, before the plan's trace (:func:`start_workers`,
   ``warmup.method._early_workers``), and closed unused if at most one gear turns out missing;
3. in the calling thread, for each missing gear: capture it with Dynamo (it needs the live module) and key its
   artifact, then hand it to a thread that publishes the artifact exactly as a miss does
   (``faults.publish_or_fallback``: artifact lock, private build folder, digests, atomic rename), its build step
   sending the graph to an idle worker. The worker compiles; the thread then loads the folder and writes the run
   plan from the real example inputs (``pipeline.finish_artifact``: one at a time, on their own lock, beside the
   captures; a fallback compile in this process takes both locks);
4. in the calling thread, in gear order: write each entry manifest and load the entry (``_complete_entry``); the
   workers are told to exit and reaped in the background.

Every phase is recorded in a :class:`~gearcache.timeline.Timeline` (``CachedFunction.warmup_timeline``).

A graph a worker cannot take (torch cannot pickle one of its calls; it calls collectives, and Inductor resolves
their process groups while compiling) or fails on is compiled in the calling
process instead, so the result is that of the serial path: the same keys, artifacts, entries and run plans.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import pathlib
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Hashable, Iterable, NamedTuple

import torch

from .._torch import inductor as torch_inductor, state as torch_state
from ..compiling import background
from ..ranks import phases as ranks
from ..gears.plan import GearCall, MarkedCall, MarkedDim
from ..keys import guard_sets
from ..timeline import Timeline
from ..errors import GearLoadError, WorkerError
from ..runplan.collectives import communicates
from .progress import Progress
from ..compiling.workers import WorkerPool, default_workers, job_for

if TYPE_CHECKING:
    from ..compiling.entry_life import EntryLife, Found, Pending

try:
    import resource
    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)     # Linux
except ImportError:                 # pragma: no cover - not on Windows
    _RUSAGE_THREAD = None

log = logging.getLogger("gearcache.warmup.driver")
LOAD_THREADS = 8        # at most this many look-up threads (find_all): the GIL gains nothing from more
WAITED = 0.5            # look-ups side by side when the first one's CPU time was below this share of its wall time


def load_threads() -> int:
    """The threads of a warm-up's look-ups when they run side by side (:func:`find_all`, :func:`lookup_threads`):
    the cores this process may use, shared by the ranks of its host (torchrun's ``LOCAL_WORLD_SIZE``), at most
    :data:`LOAD_THREADS`, at least 1. More threads than cores only trade the GIL back and forth (on 2 cores: 12
    gears' look-ups end ~20 % later with 8 threads than with 2). ``$GEARCACHE_LOAD_THREADS`` (a positive integer)
    sets it instead, up to :data:`LOAD_THREADS` (to compare; 1: one after another)."""
    fixed = _fixed_threads()
    if fixed is not None:
        return fixed
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                      # (not on Linux)
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(LOAD_THREADS, cores // local))

def _fixed_threads() -> int | None:
    """``$GEARCACHE_LOAD_THREADS`` (a positive integer, at most :data:`LOAD_THREADS`); None: unset or not one."""
    fixed = os.environ.get("GEARCACHE_LOAD_THREADS", "")
    return min(LOAD_THREADS, int(fixed)) if fixed.isdigit() and int(fixed) > 0 else None


def rank_order(n: int, world_size: int, rank: int) -> list[int]:
    """Gear indices ``0..n-1``, this rank's share (index ≡ rank mod world size) first, then the rest in order."""
    own = [i for i in range(n) if i % world_size == rank % world_size]
    return own + [i for i in range(n) if i % world_size != rank % world_size]


def start_workers(life: "EntryLife", call: MarkedCall, policy: str, workers: int | None,
                  timeline: Timeline) -> WorkerPool | None:
    """Start the worker processes of a warm-up of the example ``call`` before it knows which gears are missing
    (``warmup.method._early_workers``): as many as the gears its marks can form under the merge ``policy``, at most
    (:func:`most_gears`); None when that would be one worker (the serial path)."""
    inputs = _call_inputs(life, call.leaves)
    most = most_gears(call.marks, policy)
    n = min(workers or default_workers(most, inputs), most)
    if n <= 1:
        return None
    log.info("warmup %s: starting %d worker processes while the gear plan is traced", life.name, n)
    with timeline.span("all", "spawn workers"):
        return WorkerPool(n)


def most_gears(marks: list[MarkedDim], policy: str) -> int:
    """How many gears ``marks`` can form at most, before the trace finds which dims move together: the longest
    gear list under ``"zip"``, the product of all of them under ``"product"``."""
    counts = [len(m.sizes) for m in marks]
    return max(counts, default=0) if policy == "zip" else math.prod(counts)


def compile_missing(life: "EntryLife", gears: list[GearCall], workers: int | None, timeline: Timeline,
                    pool: WorkerPool | None = None) -> None:
    """Give ``life`` (a cached method's entry stages, entry_life.py) an entry for every gear call of ``gears`` (the
    example call at each gear: ``GearPlan.gear_calls``): stored entries are looked up and loaded side by side
    (:func:`find_all`), missing ones compiled in rank order, in worker processes when there are several (see the
    module docstring). ``workers``: the config's ``warmup_workers`` (None: :func:`default_workers`); ``timeline``:
    where each phase's span is recorded; ``pool``: workers already started (:func:`start_workers`), used if several
    gears are missing and closed in any case."""
    background.wait_for(life)       # gears compiling in the background: settled, not compiled a second time
    ranks.note(f"{life.name}: warm-up's compile phase ({len(gears)} gears: look-ups, captures, compiles)")
    order = rank_order(len(gears), life.topology.world_size, life.topology.global_rank)
    progress = Progress(life.name, len(gears), "ready")
    missing: list[tuple[GearCall, "Found"]] = []
    try:
        with life.lock:
            unloaded: list[GearCall] = []       # in rank order, those not in the table yet
            for i in order:
                gear = gears[i]
                if gear.key in life.table:
                    progress.step(gear.sizes, "already loaded", 0.0)
                else:
                    unloaded.append(gear)
            for gear, found, seconds in find_all(life, unloaded, timeline):
                if found.entry is not None:
                    progress.step(gear.sizes, "loaded", seconds)
                    life.remember(gear.key, found.entry)
                else:
                    missing.append((gear, found))
            if len(missing) > 1 and workers != 1 and not life.communicates:
                pool, used = None, pool
                _compile_in_workers(life, missing, workers, progress, timeline, used)
            else:
                for gear, found in missing:
                    t0 = time.perf_counter()
                    with timeline.span(f"gear {gear.sizes}", "compile serially"):
                        life.remember(gear.key, life.new_entry(gear.args, gear.kwargs, gear.leaves, found))
                    progress.step(gear.sizes, "compiled or published", time.perf_counter() - t0)
    finally:
        progress.close()
        if pool is not None:
            log.info("warmup %s: %d gears missing; the workers started early are not needed", life.name, len(missing))
            pool.close(wait=False)


def find_all(life: "EntryLife", gears: Iterable[GearCall],
             timeline: Timeline) -> list[tuple[GearCall, "Found", float]]:
    """``life.find`` of each gear call of ``gears`` (its stored entry looked up, its guards
    checked, its artifact verified and loaded; a miss: ``entry`` None): ``(gear, found, seconds)`` in ``gears``'
    order. The first runs alone in the calling thread (the store's first use and any lazy set-up happen once); the
    others follow it there, one after another, unless the second (the first that pays no first use) spent most of
    its time waiting (:func:`lookup_threads`; ``$GEARCACHE_LOAD_THREADS`` decides instead where set): then the rest
    run side by side in :func:`load_threads` threads as ``gears`` yields them, under the caller's CUDA
    device, grad and inference mode and global torch state (autocast, ...: an entry key's factor; a gear whose
    thread cannot take that state on is looked up in the calling thread instead). Nothing in a look-up
    talks to other ranks (the run plan's group check reads this process's own groups). The gears' value guards are
    checked in one pass (one ``guard_sets.Reading``: the method's lock is held throughout, as ``_revalidate`` checks
    every entry's guards in one). A failure raises
    ``GearLoadError`` naming the first failing gear in order, once every look-up already running has ended (those not
    started are cancelled)."""
    results: list[tuple[GearCall, "Found", float]] = []
    futures: list[tuple[GearCall, concurrent.futures.Future[tuple["Found", float] | None]]] = []
    threads: concurrent.futures.ThreadPoolExecutor | None = None
    caller = _CallerState(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch_state.global_state())
    reading = guard_sets.Reading()      # one pass under the method's lock: each live value read once for all gears
    n, t0 = 1, time.time()
    try:
        for gear in gears:
            if n > 1:
                if threads is None:
                    threads = concurrent.futures.ThreadPoolExecutor(n, "gearcache-load", _adopt_device,
                                                                    (_caller_device(),))
                futures.append((gear, threads.submit(torch_inductor.settings_context().run, _find_in_thread, life,
                                                     gear, timeline, reading, caller)))
                continue
            before = _thread_clock()
            results.append((gear, *_find(life, gear, timeline, reading)))
            if len(results) == 1:
                n, t0 = (load_threads() if _fixed_threads() is not None else 1), time.time()
            elif len(results) == 2 and _fixed_threads() is None:
                n = lookup_threads(*_spent_since(before))
        for gear, future in futures:
            found = future.result()
            results.append((gear, *(found if found is not None else _find(life, gear, timeline, reading))))
    except BaseException:
        for _, future in futures:
            future.cancel()
        raise
    finally:
        if threads is not None:
            threads.shutdown(wait=True)
        if len(results) > 1 or futures:
            how = "side by side" if threads is not None else "one by one"
            timeline.add("all", f"look up the other gears {how}", t0, time.time())
    return results


def lookup_threads(wall: float, cpu: float, blocks: int | None = None, preemptions: int = 0) -> int:
    """The threads of a warm-up's look-ups after its second, which took ``wall`` seconds, ``cpu`` of them on this
    thread's CPU, and left its CPU ``blocks`` times to wait (voluntary context switches) and ``preemptions`` times
    for other work (involuntary ones; None and 0 where not counted): ``$GEARCACHE_LOAD_THREADS`` where set
    (:func:`load_threads`); else :func:`load_threads` when that look-up mostly waited (``cpu`` below :data:`WAITED`
    of ``wall``, and blocked more often than it was preempted: a remote store's fetch, a lock held elsewhere, a cold
    disk), where threads overlap the waits; else 1, one after another in the calling thread (a look-up kept off its
    CPU by other processes would keep its threads off too). A look-up's own work is Python (manifest and guards, the
    wrapper's module code), which holds the GIL: side by side each took 10-15x longer than alone on 4 H100 ranks
    (0.20-0.29 s against 0.02 s, the step 0.26-0.29 s for 6 gears) and 2-3x on CPU, where the step never got
    shorter (docs/BENCHMARKS.md)."""
    waited = cpu < WAITED * wall and (blocks is None or blocks > preemptions)
    return load_threads() if _fixed_threads() is not None or waited else 1


class _Clock(NamedTuple):
    """A thread's clocks (:func:`_thread_clock`), or what it spent between two readings (:func:`_spent_since`)."""
    wall: float
    cpu: float
    blocks: int | None      # voluntary context switches (None: not counted per thread here)
    preemptions: int        # involuntary ones


def _thread_clock() -> _Clock:
    """This thread's wall and CPU clocks, and its context switches so far where the system counts them per thread."""
    if _RUSAGE_THREAD is None:
        return _Clock(time.perf_counter(), time.thread_time(), None, 0)
    usage = resource.getrusage(_RUSAGE_THREAD)
    return _Clock(time.perf_counter(), time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw)


def _spent_since(before: _Clock) -> _Clock:
    """What this thread spent since ``before`` (:func:`lookup_threads`' arguments)."""
    now = _thread_clock()
    blocks = None if now.blocks is None or before.blocks is None else now.blocks - before.blocks
    return _Clock(now.wall - before.wall, now.cpu - before.cpu, blocks, now.preemptions - before.preemptions)


class _CallerState(NamedTuple):
    """What a look-up thread takes on from the thread that called :func:`find_all` (a thread starts without it)."""
    grad: bool
    inference: bool
    state: dict[str, Any]       # torch_state.global_state(): autocast, default device, ...


def _find_in_thread(life: "EntryLife", gear: GearCall, timeline: Timeline, reading: guard_sets.Reading,
                    caller: _CallerState) -> tuple["Found", float] | None:
    """:func:`_find` in a look-up thread under the ``caller``'s grad and inference mode and global torch state (the
    entry key reads it: a gear looked up without the caller's autocast would be served the entry compiled without it),
    run in the caller's ``settings_context()`` (the key's Inductor settings: a thread sees none of those the caller set
    in code; the gears were keyed without them); None where this thread cannot take that state on
    (``global_state_applied``: e.g. a torch-function mode): the caller then looks the gear up itself."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(caller.grad))
        stack.enter_context(torch.inference_mode(caller.inference))
        try:
            stack.enter_context(torch_state.global_state_applied(caller.state))
        except ValueError:
            return None
        return _find(life, gear, timeline, reading)


def _find(life: "EntryLife", gear: GearCall, timeline: Timeline,
          reading: guard_sets.Reading) -> tuple["Found", float]:
    """One gear's ``life.find`` for :func:`find_all`; its errors raised as ``GearLoadError`` naming the gear."""
    t0 = time.perf_counter()
    try:
        with timeline.span(f"gear {gear.sizes}", "look up"):
            found = life.find(gear.leaves, gear.key, reading)
    except Exception as exc:
        raise GearLoadError(life.name, gear.sizes, exc) from exc
    return found, time.perf_counter() - t0


def _compile_in_workers(life: "EntryLife", missing: list[tuple[GearCall, "Found"]], workers: int | None,
                        progress: Progress,
                        timeline: Timeline, pool: WorkerPool | None) -> None:
    finish_lock = threading.Lock()      # first loads and run-plan checks: one at a time, beside the captures
    capture_lock = threading.Lock()     # captures, and compiles in this process (a worker's fallback)
    pending: list[tuple[tuple[Hashable, ...], concurrent.futures.Future[tuple[pathlib.Path | None, bool]], "Pending",
                        str]] = []
    if pool is None:
        n = min(workers or default_workers(len(missing), _call_inputs(life, missing[0][0].leaves)), len(missing))
        with timeline.span("all", "spawn workers"):
            pool = WorkerPool(n)        # before the first capture: the workers' imports overlap the captures
    n = min(pool.size, len(missing))
    log.info("warmup %s: compiling %d missing gears in %d worker processes", life.name, len(missing), n)
    threads = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="gearcache-warmup",
                                                    initializer=_adopt_device, initargs=(_caller_device(),))

    def done(future: concurrent.futures.Future[tuple[pathlib.Path | None, bool]], sizes: list[int], t0: float) -> None:
        if future.exception() is None:
            how = "compiled" if future.result()[1] else "published by another process"
            progress.step(sizes, how, time.perf_counter() - t0)

    try:
        for gear, found in missing:
            who = f"gear {gear.sizes}"
            with capture_lock, timeline.span(who, "capture"):
                p = life.capture(gear.args, gear.kwargs, gear.leaves, found)
                job = _job(life, p)
            build = _RemoteBuild(life, p, job, pool, (capture_lock, finish_lock), timeline, who)
            # the thread compiles in this process where the worker cannot: under the caller's Inductor settings
            future = threads.submit(torch_inductor.settings_context().run, life.publish, p, build)
            future.add_done_callback(functools.partial(done, sizes=gear.sizes, t0=p.t0))
            pending.append((gear.key, future, p, who))
        for gkey, future, p, who in pending:
            folder, built = future.result()
            with timeline.span(who, "complete entry"):
                life.remember(gkey, life.finish(p, folder, built))
    finally:
        with timeline.span("all", "close workers"):
            threads.shutdown(wait=True, cancel_futures=True)
            pool.close(wait=False)      # their exit (compile pools shutting down) overlaps the first runs


def _caller_device() -> int | None:
    """The calling thread's current CUDA device, if this process uses CUDA (None otherwise: CUDA is not started)."""
    initialized = torch.cuda.is_initialized()     # type: ignore[no-untyped-call]  # untyped in torch
    return torch.cuda.current_device() if initialized else None


def _adopt_device(device: int | None) -> None:
    """A warm-up thread's start: make the caller's CUDA device current here too (a new thread starts on cuda:0, so
    on rank r of a job a compile, its exactness check or a load would otherwise touch cuda:0: a second context
    there, and kernels loaded into it)."""
    if device is not None:
        torch.cuda.set_device(device)


def _call_inputs(life: "EntryLife", leaves: tuple[Any, ...]) -> list[Any]:
    """What a worker will hold copies of, known before any capture: the call's tensors and the module's weights."""
    module = life.module
    weights = list(module.parameters()) + list(module.buffers()) if isinstance(module, torch.nn.Module) else []
    return [x for x in leaves if isinstance(x, torch.Tensor)] + weights


def _job(life: "EntryLife", p: "Pending") -> dict[str, Any] | None:
    """The worker job for a captured gear, or None when its graph cannot travel (it is compiled in-process)."""
    if communicates(p.captured.graph):
        life.communicates = True            # the method's next warm-ups compile in the calling thread
    return job_for(life.graph_to_compile(p.captured), p.captured.example_inputs, life.compile_patches(),
                   f"{life.name}: entry {p.ekey}")


class _RemoteBuild:
    """The ``build`` step of ``faults.publish_or_fallback`` for one gear: compile in a worker into ``folder``, then
    load it and write its run plan here; on a worker failure, compile here as the serial path does."""

    def __init__(self, life: "EntryLife", p: "Pending", job: dict[str, Any] | None, pool: WorkerPool,
                 locks: tuple[threading.Lock, threading.Lock], timeline: Timeline, who: str):
        self.life, self.p, self.job, self.pool = life, p, job, pool
        self.capture_lock, self.finish_lock = locks
        self.timeline, self.who = timeline, who
        # grad and inference mode, autocast, ... are per thread: this runs in a pool thread, under the caller's state
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self.state = torch_state.global_state()

    def __call__(self, folder: pathlib.Path) -> None:
        if self.job is not None:
            try:
                reply = self._compile_remotely(self.job, folder)
            except WorkerError as exc:
                log.warning("warmup %s: a worker failed to compile entry %s; compiling it in this process:\n%s",
                            self.life.name, self.p.ekey, exc)
                shutil.rmtree(folder, ignore_errors=True)
            else:
                with self.finish_lock, self.timeline.span(self.who, "finish_artifact"), \
                        torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
                    self.life.finish_compiled_elsewhere(self.p.captured, folder, reply["seconds"])
                return
        with self.capture_lock, self.finish_lock, self.timeline.span(self.who, "compile in caller"), \
                torch_state.global_state_applied(self.state), torch.inference_mode(self.inference), \
                torch.set_grad_enabled(self.grad):
            self.life.compile(self.p.captured, folder)

    def _compile_remotely(self, job: dict[str, Any], folder: pathlib.Path) -> dict[str, Any]:
        """Compile in a worker; record the wait for it, its start (first job only) and its compile."""
        t0 = time.time()
        reply = self.pool.compile({**job, "folder": str(folder)})
        times, worker = reply["times"], f"worker {reply['worker']}"
        self.timeline.add_once(worker, "worker start+imports", times["started"], times["ready"])
        self.timeline.add(self.who, "wait for a worker", t0, max(t0, times["job_start"]))
        self.timeline.add(self.who, f"compile in {worker}", times["job_start"], times["job_end"])
        return reply
