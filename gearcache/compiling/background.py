"""New signatures compiled in the background (``config.on_new_signature="background"``).

A miss the store cannot serve is captured in the calling thread (Dynamo needs the live call; nothing runs), its graph
is compiled in a worker process (gearcache/compiling/workers.py), and the call returns at once: it, and every later
call of that signature until the compile is done, runs the method eagerly through :class:`Compiling`, an eager
stand-in (``faults.EagerEntry``), so outputs and in-place updates are eager's by construction. Such calls count in
``counters.eager_calls``, not in ``hits``.

A background compile is a handle, :class:`Compiling`, that its owner (an ``entry_life.EntryLife``) keeps, polls
(``done``, ``wait``) and installs: the first call of the signature after the worker is done (or :func:`wait`)
settles it in the calling thread (``EntryLife.settle``): the artifact is published as any miss publishes it
(``EntryLife.publish``: the artifact lock, a private build folder which :meth:`Compiling.fill` fills with the worker's
folder and the run plan written from the captured example inputs, ``pipeline.finish_artifact``, digests, an atomic
rename), the entry manifest written, the entry loaded and put in the table (``EntryLife.finish`` and ``remember``),
and the handle closed (:meth:`Compiling.close`). This module never reaches into its owner: it only asks it to
settle what it holds (:class:`BackgroundOwner`). From then on the signature is served compiled, CUDA graphs
included: under ``mode="reduce-overhead"`` a compiling gear runs eagerly with no graph (gearcache/graphs/cuda_graphs.py:
a graph of the stand-in would replay one eager run), and its graph is captured on its first call once loaded.
Nothing compiled touches CUDA in this process outside the calling thread: the threads here only wait for the
workers' pipes.

Identical blocks compiled by region (gearcache/regions.py: one cached method per block, one entry key for them all)
compile one graph: a block that misses a signature whose entry key another method of the same store compiles in
the background already captures nothing: it is served eagerly by a :class:`Waiting` stand-in until that compile is
settled, then looks the stored entry up as any miss does (its own value guards checked: a block whose attributes
change the code captures and compiles its own then). Settling is the compiling method's; a waiter whose compile is
done but not settled settles it when that method's lock is free (:meth:`BackgroundOwner.try_settle`, never a wait
on another method's lock). A compile whose method is freed before settling it (its model dropped, or its regions
removed) is settled by no one: its waiters stop waiting and the first to miss again compiles the entry itself
(:func:`compiling_elsewhere` no longer names it; its scratch folder goes with the handle).

The artifact lock is taken only when settling: processes sharing a folder that miss the same new signature at once
may each compile it in a worker (the first to settle publishes it; the others find it published and load it: no
wrong or half-written artifact, only a compile spent twice). ``warmup()`` is the way to compile once per fleet.

A process exiting with compiles in flight waits for them and settles them (``atexit``), so the next process loads
them instead of starting over (a failed worker's compile then runs here without Inductor's thread pool, which takes no
new work at interpreter exit: ``inductor.serial_compiles``). A worker that fails leaves the compile to the settling
call (in this process, as the serial path compiles); a worker found dead is replaced for the next compile
(``WorkerPool.compile``). A graph that cannot travel to a worker (it calls collectives, or torch cannot pickle
it) is compiled at once in the calling thread, as ``on_new_signature="compile"`` does.

One pool of worker processes serves the whole process (``inference_config.warmup_workers`` of the first method
that needs it, else ``workers.default_workers``); it is started before the capture of a miss that finds it closed,
so its imports overlap the trace, and closed when the last compile in flight is settled (each worker holds an
interpreter, torch and on a GPU a CUDA context).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import pathlib
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Generic, Hashable, Iterator, Protocol, TypeVar

import torch

from .._torch import inductor as torch_inductor, state as torch_state
from ..call import signature
from ..errors import WorkerError
from .capture import Captured
from .faults import EagerEntry
from .pipeline import ArtifactPipeline
from .workers import WorkerPool, default_workers, job_for

log = logging.getLogger("gearcache.compiling.background")
MAX_WORKERS = 8         # compiles at once, at most (fewer where cores or memory are short: workers.default_workers)


class PendingCall(Protocol):
    """A captured call whose artifact is not published yet (``entry_life.Pending``): what a background compile needs
    of it."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ekey: str
    captured: Captured


PendingT = TypeVar("PendingT", bound=PendingCall)


class BackgroundOwner(Protocol):
    """What holds background compiles (an ``entry_life.EntryLife``): :func:`wait` asks it to settle them."""

    def settle_all(self, deadline: float | None = None) -> int:
        """Wait for its compiles (until ``deadline``, a ``time.monotonic()``) and settle them; how many were."""
        ...

    def try_settle(self, handle: "Compiling[Any]") -> bool:
        """Settle ``handle`` (one of its compiles, done) now if its lock is free; whether it is settled."""
        ...


class StandIn(EagerEntry):
    """An eager stand-in while a background compile runs (:class:`Compiling`, :class:`Waiting`): the method run
    uncompiled (``EagerEntry``), without ``EagerEntry``'s warning (nothing failed: this is the design until
    compiled). CUDA graphs capture nothing of a stand-in (a graph of it would replay one eager run)."""

    __slots__ = ()

    def _stand_in(self, method: Callable[..., Any], name: str, ekey: str, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
        self.method = method
        self.structure = signature.call_key(args, kwargs)[1][0]
        self.manifest = {"method": name, "ekey": ekey, "eager": True, "compiling": True}
        self.hits = self.real_elements = self.padded_elements = 0
        self.out_structure = None


class Compiling(StandIn, Generic[PendingT]):
    """The handle of one background compile, which serves its signature eagerly meanwhile (see the module
    docstring): the ``pending`` capture, the ``graph`` the worker compiles, the worker's ``future`` and its build
    folder ``scratch``, the ``owner`` (held weakly) and the calling thread's grad mode, inference mode, global
    state and Inductor settings, which the settling compile runs under. The owner keeps it, polls it (:meth:`done`,
    :meth:`wait`), fills the published build folder with it (:meth:`fill`) and then closes it (:meth:`close`)."""

    __slots__ = ("pending", "graph", "future", "scratch", "owner", "grad", "inference", "state", "settings",
                 "shared_as", "closed")

    def __init__(self, method: Callable[..., Any], name: str, pending: PendingT, graph: torch.fx.GraphModule,
                 future: concurrent.futures.Future[dict[str, Any]], scratch: pathlib.Path, owner: BackgroundOwner,
                 shared_as: Hashable | None = None):
        self._stand_in(method, name, pending.ekey, pending.args, pending.kwargs)
        self.pending, self.graph, self.future, self.scratch = pending, graph, future, scratch
        self.shared_as, self.closed = shared_as, False
        self.owner: Callable[[], BackgroundOwner | None] = weakref.ref(owner)
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self.state = torch_state.global_state()
        self.settings = torch_inductor.settings_context()      # the Inductor settings its key names

    def done(self) -> bool:
        """Whether the worker is done (compiled, or failed: :meth:`reply` tells)."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until done) for the worker; whether it is done."""
        try:
            self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        except WorkerError:
            pass                                # done, failed: the settling ``fill`` compiles it in this process
        return True

    def reply(self) -> dict[str, Any] | None:
        """The done worker's reply (``{"seconds": ...}``); None when it failed (logged: ``fill`` compiles it here)."""
        try:
            return self.future.result()
        except WorkerError as exc:
            log.warning("%s: a worker failed to compile entry %s; compiling it in this process:\n%s",
                        self.manifest["method"], self.pending.ekey, exc)
            return None

    def fill(self, pipeline: ArtifactPipeline, reply: dict[str, Any] | None, work: pathlib.Path) -> None:
        """Fill the build folder ``work``: the worker's folder and its run plan, or (``reply`` None: the worker
        failed) a compile here; under the launching thread's grad mode, inference mode and global state, and a
        compile here under its Inductor settings as they were at the launch (those its key names: the settling
        thread may be another, or have left a ``config.patch`` since)."""
        example_inputs = self.pending.captured.example_inputs
        with torch_state.global_state_applied(self.state), torch.inference_mode(self.inference), \
                torch.set_grad_enabled(self.grad):
            if reply is None:
                torch_inductor.run_under_settings(self.settings, pipeline.compile, self.graph, example_inputs, work)
                return
            shutil.copytree(self.scratch / "inductor", work, symlinks=True)
            pipeline.finish_compiled_elsewhere(example_inputs, work, reply["seconds"])

    def close(self) -> None:
        """The compile is settled (or given up): remove its scratch folder, and close the workers if idle."""
        self.closed = True
        shutil.rmtree(self.scratch, ignore_errors=True)
        _WORKERS.handles.discard(self)
        with _WORKERS.lock:
            if self.shared_as is not None and _WORKERS.shared.get(self.shared_as) is self:
                del _WORKERS.shared[self.shared_as]
        _WORKERS.close_if_idle()

    def settled(self) -> bool:
        """Whether the compile is settled (its entry published by its owner, or given up); a done compile whose owner
        is not busy is settled here first (:meth:`BackgroundOwner.try_settle`)."""
        if not self.closed and self.done() and (owner := self.owner()) is not None:
            owner.try_settle(self)
        return self.closed or self.owner() is None


class Waiting(StandIn):
    """The stand-in of a signature whose entry another method of the same store compiles in the background (an
    identical block's: see the module docstring): eager until that compile is :meth:`Compiling.settled`."""

    __slots__ = ("compiling",)

    def __init__(self, method: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 compiling: Compiling[Any]):
        self._stand_in(method, name, compiling.pending.ekey, args, kwargs)
        self.compiling = compiling

    def over(self) -> bool:
        """Whether the compile waited for is settled: the signature is then looked up in the store again."""
        return self.compiling.settled()


def compiling_elsewhere(shared_as: Hashable) -> Compiling[Any] | None:
    """The background compile in flight of the entry ``shared_as`` names (the store's folder, the topology's folder,
    the entry key: ``EntryLife.shared_as``), started by any method of this process; None when there is none, or its
    owner was freed before settling it (no one settles it then: a waiter must not wait for it forever)."""
    with _WORKERS.lock:
        handle = _WORKERS.shared.get(shared_as)
        if handle is not None and handle.owner() is None:
            del _WORKERS.shared[shared_as]      # its owner was freed: nothing settles it, the caller compiles its own
            return None
        return handle


class Launcher:
    """Starts background compiles on the open worker pool (:func:`starting`)."""

    def __init__(self, pool: WorkerPool, threads: concurrent.futures.ThreadPoolExecutor):
        self.pool, self.threads = pool, threads

    def launch(self, owner: BackgroundOwner, method: Callable[..., Any], name: str, pending: PendingT,
               graph: torch.fx.GraphModule, patches: dict[str, Any],
               shared_as: Hashable | None = None) -> Compiling[PendingT] | None:
        """Compile ``graph`` (the capture ``pending``'s, decompositions applied) under Inductor's ``patches`` in a
        worker: the :class:`Compiling` handle, for ``owner`` to keep; None when the graph cannot travel to a worker
        (the caller compiles it in this process). ``shared_as``: the name under which other methods find it in flight
        (:func:`compiling_elsewhere`)."""
        torch_inductor.import_torch_loader()           # settling may happen at exit, when Inductor can no longer import
        job = job_for(graph, pending.captured.example_inputs, patches, f"{name}: entry {pending.ekey}")
        if job is None:
            return None
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="gearcache-background-"))
        future = self.threads.submit(self.pool.compile, {**job, "folder": str(scratch / "inductor")})
        handle = Compiling(method, name, pending, graph, future, scratch, owner, shared_as)
        # a handle dropped unsettled (its owner freed) removes its folder; not at exit, where ``_at_exit`` settles
        weakref.finalize(handle, shutil.rmtree, scratch, True).atexit = False
        _WORKERS.handles.add(handle)
        if shared_as is not None:
            with _WORKERS.lock:
                _WORKERS.shared.setdefault(shared_as, handle)
        return handle


@contextlib.contextmanager
def starting(tensors: list[torch.Tensor], workers: int | None) -> Iterator[Launcher]:
    """The worker pool (started if closed: ``workers`` processes, else :func:`workers.default_workers` for the call's
    and the module's ``tensors``), open for the block, which captures the miss and :meth:`Launcher.launch`es it:
    the workers' imports overlap the trace. The pool closes after the block if nothing was launched."""
    pool, threads = _WORKERS.start(workers or default_workers(MAX_WORKERS, tensors))
    try:
        yield Launcher(pool, threads)
    finally:
        _WORKERS.started()                      # in flight now, or nothing is: the pool closes if idle


class _Workers:
    """The process's worker pool and the threads that wait on it (started on first use, closed at exit)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: WorkerPool | None = None
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.handles: "weakref.WeakSet[Compiling[Any]]" = weakref.WeakSet()    # in flight (their owners hold them)
        # in flight by the entry they compile, for identical blocks' misses (compiling_elsewhere); held weakly
        self.shared: "weakref.WeakValueDictionary[Hashable, Compiling[Any]]" = weakref.WeakValueDictionary()
        self.starting = 0       # misses between ``start`` and ``started`` (capturing: not in flight yet)
        self.exit_registered = False

    def start(self, size: int) -> tuple[WorkerPool, concurrent.futures.ThreadPoolExecutor]:
        """The pool (started if closed) for a miss about to capture; the pool stays open until its ``started``."""
        with self.lock:
            self.starting += 1
            if self.pool is None or self.threads is None:
                log.info("starting %d worker process(es) for background compiles", size)
                self.pool = WorkerPool(size)
                self.threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="gearcache-background")
                if not self.exit_registered:
                    atexit.register(_at_exit)
                    self.exit_registered = True
            return self.pool, self.threads

    def started(self) -> None:
        """A miss's ``start`` ended: its compile is in flight, or it failed or compiled in this process."""
        with self.lock:
            self.starting -= 1
        self.close_if_idle()

    def close_if_idle(self) -> None:
        """Close the workers once no compile is in flight and no miss is starting one: each holds an interpreter,
        torch and (on a GPU) a CUDA context; the next background miss starts them again, beside its trace."""
        with self.lock:
            if self.pool is None or self.starting or in_flight():
                return
            log.info("no background compile in flight: closing the %d worker process(es)", self.pool.size)
            self.pool.close(wait=False)
            if self.threads is not None:
                self.threads.shutdown(wait=False)
            self.pool = self.threads = None


_WORKERS = _Workers()


def wait(timeout: float | None = None) -> int:
    """Wait for every background compile of this process and settle it in the calling thread (publish, load,
    remember: see the module docstring); returns how many entries were settled. ``timeout`` (seconds, in all): the
    compiles not done by then stay in flight (their calls still run eagerly)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    owners = dict.fromkeys(owner for handle in list(_WORKERS.handles) if (owner := handle.owner()) is not None)
    return sum(wait_for(owner, deadline) for owner in owners)


def wait_for(owner: BackgroundOwner, deadline: float | None = None) -> int:
    """:func:`wait` for the compiles of one owner (an ``entry_life.EntryLife``; ``deadline``: a
    ``time.monotonic()``)."""
    return owner.settle_all(deadline)


def in_flight() -> int:
    """How many background compiles of this process are not settled yet."""
    return len(_WORKERS.handles)

def worker_pids() -> list[int]:
    """The pids of the background worker processes running now (none while no compile is in flight)."""
    pool = _WORKERS.pool
    return pool.pids if pool is not None else []


def _at_exit() -> None:
    """Settle what is in flight (the next process loads it instead of compiling again), then close the workers."""
    try:
        if in_flight():
            log.info("waiting for %d background compile(s) before exit", in_flight())
            with torch_inductor.serial_compiles():      # a failed worker's compile runs here, where no pool can
                wait()
    except Exception:                                       # noqa: BLE001 - at exit: logged, never raised
        log.exception("background compiles could not be settled at exit")
    finally:
        _WORKERS.close_if_idle()
