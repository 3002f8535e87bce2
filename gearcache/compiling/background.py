"""New signatures compiled in the background (``config.on_new_signature="background"``).

A miss the store cannot serve is captured in the calling thread (Dynamo needs the live call; nothing runs), its graph
is compiled in a worker process (gearcache/compiling/workers.py), and the call returns at once: it, and every later
call of
that signature until the compile is done, runs the method eagerly through :class:`Compiling`, an eager stand-in
(``faults.EagerEntry``), so outputs and in-place updates are eager's by construction. Such calls count in
``counters.eager_calls``, not in ``hits``.

The first call of the signature after the worker is done (or :func:`wait`) settles it in the calling thread: the
artifact is published as any miss publishes it (``EntryLife.publish``: the artifact lock, a private build folder
into which the worker's folder is copied, the run plan written from the captured example inputs:
``compiler.finish_artifact``, digests, an atomic rename), the entry manifest written, the entry loaded and put in
the table (``EntryLife.finish`` and ``remember``). From then on the signature is served compiled, CUDA graphs
included: under ``mode="reduce-overhead"`` a compiling gear runs eagerly with no graph
(gearcache/graphs/cuda_graphs.py: a
graph of the stand-in would replay one eager run), and its graph is captured on its first call once loaded.
Nothing compiled touches CUDA in this process outside the calling thread: the threads here only wait for the
workers' pipes.

The artifact lock is taken only when settling: processes sharing a folder that miss the same new signature at once
may each compile it in a worker (the first to settle publishes it; the others find it published and load it: no
wrong or half-written artifact, only a compile spent twice). ``warmup()`` is the way to compile once per fleet.

A process exiting with compiles in flight waits for them and settles them (``atexit``), so the next process loads
them instead of starting over. A worker that fails leaves the compile to the settling call (in this process,
as the serial path compiles). A graph that cannot travel to a worker (it calls collectives, or torch cannot pickle
it) is compiled at once in the calling thread, as ``on_new_signature="compile"`` does.

One pool of worker processes serves the whole process (``inference_config.warmup_workers`` of the first method
that needs it, else ``workers.default_workers``); it is started before the capture of a miss that finds it closed,
so its imports overlap the trace, and closed when the last compile in flight is settled (each worker holds an
interpreter, torch and on a GPU a CUDA context).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import logging
import pathlib
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

import torch

from .._torch import inductor as torch_inductor, state as torch_state
from ..call import signature
from ..errors import WorkerError
from .faults import EagerEntry
from .workers import WorkerPool, default_workers, job_for

log = logging.getLogger("gearcache.compiling.background")
MAX_WORKERS = 8         # compiles at once, at most (fewer where cores or memory are short: workers.default_workers)


class Compiling(EagerEntry):
    """Serves one signature eagerly while its entry compiles in a worker (see the module docstring): the
    ``pending`` capture (``entry_life.Pending``), the worker's ``future`` and its build folder ``scratch``, and the
    calling thread's grad mode, inference mode and global state, which the settling compile runs under."""

    __slots__ = ("pending", "future", "scratch", "grad", "inference", "state")

    def __init__(self, method: Any, name: str, pending: Any, future: concurrent.futures.Future,
                 scratch: pathlib.Path):
        # not EagerEntry.__init__: nothing failed, so nothing is warned; the stand-in is the design until compiled
        self.method = method
        self.structure = signature.call_key(pending.args, pending.kwargs)[1][0]
        self.manifest = {"method": name, "ekey": pending.ekey, "eager": True,
                         "compiling": True}
        self.hits = self.real_elements = self.padded_elements = 0
        self.out_structure = None
        self.pending, self.future, self.scratch = pending, future, scratch
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self.state = torch_state.global_state()


class _Workers:
    """The process's worker pool and the threads that wait on it (started on first use, closed at exit)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: WorkerPool | None = None
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.lives: "weakref.WeakSet[Any]" = weakref.WeakSet()     # EntryLife objects with compiles in flight
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


def start(life: Any, key: tuple, args: tuple, kwargs: dict, leaves: tuple, found: Any) -> Any:
    """A miss of ``life`` (an ``entry_life.EntryLife``, under its lock) the store cannot serve: capture it here and
    compile it in a worker; returns the :class:`Compiling` stand-in (kept in ``life.compiling[key]``, not in the
    table), or the entry itself when the graph must be compiled in this process."""
    weights = [*life.module.parameters(), *life.module.buffers()]
    size = life.config.inference_config.warmup_workers or default_workers(
        MAX_WORKERS, [x for x in leaves if isinstance(x, torch.Tensor)] + weights)
    pool, threads = _WORKERS.start(size)         # before the capture: the workers' imports overlap the trace
    try:
        pending = life.capture(args, kwargs, leaves, found)
        torch_inductor.import_torch_loader()           # settling may happen at exit, when Inductor can no longer import
        job = job_for(life.graph_to_compile(pending.captured), pending.captured.example_inputs,
                      life.compile_patches(), f"{life.name}: entry {pending.ekey}")
        if job is None:
            folder, built = life.publish(pending)
            return life.finish(pending, folder, built)
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="gearcache-background-"))
        future = threads.submit(pool.compile, {**job, "folder": str(scratch / "inductor")})
        stand_in = Compiling(life.method, life.name, pending, future, scratch)
        life.compiling[key] = stand_in
        _WORKERS.lives.add(life)
    finally:
        _WORKERS.started()                      # in flight now, or nothing is: the pool closes if idle
    log.info("%s: entry %s compiles in the background; its calls run eagerly until it is loaded", life.name,
             pending.ekey)
    return stand_in


def settle(life: Any, key: tuple, stand_in: Compiling, wait: bool = False) -> Any:
    """The entry of ``key`` if its compile is done (or, with ``wait``, once it is): published, loaded and
    remembered here (see the module docstring); else ``stand_in``. Called under ``life.lock``."""
    if not (wait or stand_in.future.done()):
        return stand_in
    try:
        reply: dict[str, Any] | None = stand_in.future.result()
    except WorkerError as exc:
        log.warning("%s: a worker failed to compile entry %s; compiling it in this process:\n%s", life.name,
                    stand_in.pending.ekey, exc)
        reply = None
    try:
        folder, built = life.publish(stand_in.pending, lambda work: _build(life, stand_in, reply, work))
        entry = life.finish(stand_in.pending, folder, built)
    finally:
        shutil.rmtree(stand_in.scratch, ignore_errors=True)
        del life.compiling[key]
        _WORKERS.close_if_idle()
    life.remember(key, entry)
    return entry


def _build(life: Any, stand_in: Compiling, reply: dict[str, Any] | None, work: pathlib.Path) -> None:
    """Fill the build folder ``work``: the worker's folder and its run plan, or (the worker failed) a compile here."""
    with torch_state.global_state_applied(stand_in.state), torch.inference_mode(stand_in.inference), \
            torch.set_grad_enabled(stand_in.grad):
        if reply is None:
            life.compile(stand_in.pending.captured, work)
            return
        shutil.copytree(stand_in.scratch / "inductor", work, symlinks=True)
        life.finish_compiled_elsewhere(stand_in.pending.captured, work, reply["seconds"])


def wait(timeout: float | None = None) -> int:
    """Wait for every background compile of this process and settle it in the calling thread (publish, load,
    remember: see the module docstring); returns how many entries were settled. ``timeout`` (seconds, in all): the
    compiles not done by then stay in flight (their calls still run eagerly)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return sum(wait_for(life, deadline) for life in list(_WORKERS.lives))


def wait_for(life: Any, deadline: float | None = None) -> int:
    """:func:`wait` for the compiles of one ``entry_life.EntryLife`` (``deadline``: a ``time.monotonic()``)."""
    settled = 0
    with life.lock:
        for key, stand_in in list(life.compiling.items()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                stand_in.future.result(left)
            except concurrent.futures.TimeoutError:
                continue
            except WorkerError:
                pass                            # settle compiles it here
            settle(life, key, stand_in, wait=True)
            settled += 1
    return settled


def in_flight() -> int:
    """How many background compiles of this process are not settled yet."""
    return sum(len(life.compiling) for life in list(_WORKERS.lives))


def worker_pids() -> list[int]:
    """The pids of the background worker processes running now (none while no compile is in flight)."""
    pool = _WORKERS.pool
    return pool.pids if pool is not None else []


def _at_exit() -> None:
    """Settle what is in flight (the next process loads it instead of compiling again), then close the workers."""
    try:
        if in_flight():
            log.info("waiting for %d background compile(s) before exit", in_flight())
            wait()
    except Exception:                                       # noqa: BLE001 - at exit: logged, never raised
        log.exception("background compiles could not be settled at exit")
    finally:
        _WORKERS.close_if_idle()
