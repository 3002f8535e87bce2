"""The threads of ``CudaGraphs.capture_all`` (gearcache/graphs/cuda_graphs.py): one per gear, its warm-up run beside
the other gears' and the next look-ups, then its record, one gear at a time (:class:`GearThreads`)."""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol

import torch

from .graphed_entry import GraphedEntry

if TYPE_CHECKING:
    from ..compiling.entry_life import Loaded


class GearRecorder(Protocol):
    """What the threads use of a method's ``CudaGraphs``: the timeline span of a phase, a gear's warm-up run, its
    record into the method's pool."""

    def phase(self, leaves: tuple, phase: str, synchronize: bool = True) -> ContextManager[None]: ...

    def warm_up(self, entry: Loaded, static_leaves: tuple, copies: list, side: torch.cuda.Stream) -> None: ...

    def record(self, entry: Loaded, static_leaves: tuple) -> tuple[torch.cuda.CUDAGraph, list]: ...


class GearThreads:
    """``CudaGraphs.capture_all``'s threads, one per gear (``start``ed as each gear's entry is found): its warm-up run
    (at most ``limit`` at once), then, once every gear's has ended (``finish``), its record, one gear at a time in the
    order they were started. A failure in any thread stops the records that follow and is raised in the caller."""

    def __init__(self, graphs: GearRecorder, n: int, limit: int):
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
                with self.slots, self.graphs.phase(static_leaves, "graph warm-up run"):
                    self.graphs.warm_up(graphed.entry, static_leaves, graphed.copies, torch.cuda.Stream())
            except BaseException as exc:                # raised in the caller
                self.errors[k] = exc
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.warmed.wait()                  # (broken: the caller stopped)
            self.turns[k].wait()
            if self.abort or self.errors[k] is not None:
                return
            try:
                with self.graphs.phase(static_leaves, "graph record"):
                    self.results[k] = self.graphs.record(graphed.entry, static_leaves)
            except BaseException as exc:
                self.errors[k] = exc
