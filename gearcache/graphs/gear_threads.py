"""The threads of ``CudaGraphs.capture_all`` (gearcache/graphs/cuda_graphs.py): one per gear, its warm-up run beside
the other gears' and the next look-ups, then its record, one gear at a time (:class:`GearThreads`)."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import torch

from .._torch import distributed as torch_distributed
from ..runplan.collectives import stand_in_collectives
from .graphed_entry import GraphedEntry

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..compiling.entry_life import Loaded


class GearRecorder(Protocol):
    """What the threads use of a method's ``CudaGraphs``: the timeline span of a phase, a gear's warm-up run, its
    record into the method's pool."""

    def phase(self, leaves: tuple[Any, ...], phase: str, synchronize: bool = True) -> ContextManager[None]: ...

    def warm_up(self, entry: Loaded, static_leaves: tuple[Any, ...], copies: list[tuple[int, torch.Tensor, float]],
                side: torch.cuda.Stream) -> None: ...

    def record(self, entry: Loaded, static_leaves: tuple[Any, ...]) -> tuple[torch.cuda.CUDAGraph, list[Any]]: ...


class GearThreads:
    """``CudaGraphs.capture_all``'s threads, one per gear (``start``ed as each gear's entry is found): its warm-up run
    (at most ``limit`` at once), then, once every gear's has ended (``finish``), its record, one gear at a time in the
    order they were started. A failure in any thread stops the records that follow and is raised in the caller.

    ``shadow``: the warm-up runs answer collectives locally (``runplan.collectives.stand_in_collectives``, in the
    thread's own dispatch mode: no communication), and ``finish``'s ``in_turn`` runs the real one in each thread's
    turn, before its record (a process of a process group: collectives reach the group in the threads' order)."""

    def __init__(self, graphs: GearRecorder, n: int, limit: int, shadow: bool = False):
        self.graphs = graphs
        self.shadow = shadow
        self.in_turn: Callable[[int], None] | None = None
        self.slots = threading.Semaphore(max(1, limit))
        self.warmed = threading.Barrier(n + 1)                      # every gear's thread, and the caller
        self.gears: list[tuple[GraphedEntry, tuple[Any, ...]]] = []
        self.threads: list[threading.Thread] = []
        self.turns = [threading.Event() for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.results: list[tuple[torch.cuda.CUDAGraph, list[Any]] | None] = [None] * n
        self.abort = False
        # thread-local state a new thread does not inherit: the device, grad and inference mode
        self.modes = (torch.cuda.current_device(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    def start(self, graphed: GraphedEntry, static_leaves: tuple[Any, ...]) -> None:
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

    def finish(self, between: Callable[[], None],
               in_turn: Callable[[int], None] | None = None) -> list[tuple[torch.cuda.CUDAGraph, list[Any]]]:
        """Wait for every warm-up run, call ``between`` (unless one failed), then let each thread record in turn
        (after ``in_turn(k)``, in thread ``k``, where given). Returns each gear's (graph, static outputs)."""
        self.in_turn = in_turn
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

    def _warm_up(self, graphed: GraphedEntry, static_leaves: tuple[Any, ...]) -> None:
        """The gear's warm-up run. ``shadow``: with collectives stood in, and a failure only logged (an operator
        without a stand-in, say): the real warm-up run in the thread's turn runs the same graph on the group and
        raises what is real."""
        if not self.shadow:
            with self.graphs.phase(static_leaves, "graph warm-up run"):
                self.graphs.warm_up(graphed.entry, static_leaves, graphed.copies,
                                    torch.cuda.Stream())   # type: ignore[no-untyped-call]  # untyped in torch
            return
        try:
            with self.graphs.phase(static_leaves, "graph warm-up run, collectives stood in"), stand_in_collectives():
                self.graphs.warm_up(graphed.entry, static_leaves, graphed.copies,
                                    torch.cuda.Stream())   # type: ignore[no-untyped-call]  # untyped in torch
        except Exception as exc:                    # the real run in turn raises what is real
            log.debug("gearcache: a warm-up run with collectives stood in failed (%s); the real one follows", exc)

    def _gear(self, k: int) -> None:
        graphed, static_leaves = self.gears[k]
        device, grad, inference = self.modes
        with contextlib.ExitStack() as modes:
            try:
                modes.enter_context(torch.cuda.device(device))
                modes.enter_context(torch.inference_mode(inference))
                modes.enter_context(torch.set_grad_enabled(grad))
                with self.slots:
                    self._warm_up(graphed, static_leaves)
            except BaseException as exc:                # raised in the caller
                self.errors[k] = exc
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.warmed.wait()                  # (broken: the caller stopped)
            self.turns[k].wait()
            if self.abort or self.errors[k] is not None:
                return
            try:
                if self.in_turn is not None:
                    self.in_turn(k)
                with self.graphs.phase(static_leaves, "graph record"):
                    self.results[k] = self.graphs.record(graphed.entry, static_leaves)
            except BaseException as exc:
                self.errors[k] = exc


def collectives_possible() -> bool:
    """Whether this process belongs to a process group (its graphs may hold collectives, which must reach each group
    in one order on every rank, and are not issued from several threads at once: even a group of one is kept to
    one thread)."""
    return bool(torch_distributed.process_groups())
