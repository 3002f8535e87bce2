"""Where the host's time of one ``generate()`` decode step goes: gearcache's share against transformers' own loop.

    from step_breakdown import Phases
    phases = Phases.install(lm)           # after enable(lm) (or on an eager model), before the warm-up
    phases.refresh()                      # after the warm-up: the loaded entries' runs are timed too
    long, short = phases.timed(lambda: generate(64 new tokens)), phases.timed(lambda: generate(1 new token))
    Phases.split(long, short, 63)         # {phase: microseconds per decode step}

Each phase is the host time (``time.perf_counter_ns``; a CPU-time clock can be given) spent in one function,
exclusive of the timed functions it calls (nested timers), per decode step: the difference between two timed runs
63 decode steps apart, divided by 63 (the prefill cancels out). Phases:

  prepare        ``model.prepare_inputs_for_generation`` (transformers', with gearcache's wrapper around it)
  bind           ``ServedLM.bind`` (gearcache: finding the backing the cache is bound to)
  forward        ``model.forward`` outside the phases below (gearcache: reading transformers' arguments, padding
                 ids / mask / positions to the gear, the cache's host counters, the output object); eager: the
                 whole forward (the model's own work)
  dispatch       the cached step outside the compiled run (gearcache: the dispatcher, signature, graph look-up, copies
                 into the graph's static inputs, output copies)
  step           the compiled run: the entry's ``run`` without graphs, ``CUDAGraph.replay`` with them (on a GPU the
                 host time of queuing the kernels / the replay, not the GPU's time)
  rest           the decode step's time in none of the phases above: transformers' generate loop (logits processors,
                 stopping criteria and their host sync on a GPU, ``_update_model_kwargs_for_generation``, the
                 concatenation of the ids) and ``nn.Module.__call__``

The timers cost ~1 us per timed call (in the phases' totals; the untimed per-token time is measured apart).
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable


class Phases:
    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock          # perf_counter_ns; thread_time_ns on a shared CPU host (one torch thread)
        self.ns: collections.Counter[str] = collections.Counter()
        self._stack: list[list[int]] = []      # per open timer: [child ns]
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self._stack.append([0])
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = self.clock() - t0
                children = self._stack.pop()[0]
                self.ns[name] += spent - children
                if self._stack:
                    self._stack[-1][0] += spent
        return timed

    @classmethod
    def install(cls, lm: Any, clock: Callable[[], int] = time.perf_counter_ns) -> "Phases":
        """Timers on ``lm`` (enabled by gearcache or not): its instance attributes and the graph replay."""
        phases = cls(clock)
        served = getattr(lm, "_gearcache", None)
        object.__setattr__(lm, "prepare_inputs_for_generation",
                           phases.wrap("prepare", lm.prepare_inputs_for_generation))
        object.__setattr__(lm, "forward", phases.wrap("forward", lm.forward))
        if served is None:
            return phases
        served.bind = phases.wrap("bind", served.bind)
        served.cached_step = phases.wrap("dispatch", served.cached_step)
        phases._time_entries(served.cached_step.__wrapped__)
        return phases

    def _time_entries(self, cached: Any) -> None:
        """Time the compiled run: graph replays, and each loaded entry's ``run`` (:meth:`refresh` after a warm-up)."""
        if getattr(cached, "graphs", None) is not None:
            from gearcache.graphs import graphed_entry

            cls = graphed_entry.GraphedEntry
            if not hasattr(cls.replay, "__wrapped__"):
                cls.replay = self.wrap("step", cls.replay)
        self._cached = cached
        self._timed: set[int] = set()
        self.refresh()

    def refresh(self) -> None:
        """Time the ``run`` of the entries loaded since :meth:`install` (call it after the warm-up)."""
        for entry in list(getattr(getattr(self, "_cached", None), "_table", {}).values()):
            if id(entry) in self._timed or not hasattr(entry, "run"):
                continue
            try:
                entry.run = self.wrap("step", entry.run)
            except AttributeError:
                continue
            self._timed.add(id(entry))

    def timed(self, fn: Callable[[], Any]) -> collections.Counter[str]:
        """Run ``fn()`` with the timers on; the nanoseconds of each phase in it, and of all of it (``total``)."""
        self.ns = collections.Counter()
        self.on = True
        t0 = self.clock()
        try:
            fn()
        finally:
            self.on = False
            self.ns["total"] += self.clock() - t0
        return self.ns

    @staticmethod
    def split(long: collections.Counter[str], short: collections.Counter[str], steps: int) -> dict[str, float]:
        """Microseconds per decode step of each phase: (``long`` - ``short``) / ``steps`` (the timed phases of two
        runs ``steps`` decode steps apart, or of ``steps`` steps and nothing), ``rest`` the step's time in none of
        them; with the shares ``gearcache_us`` (bind, forward, dispatch), ``step_us`` and ``transformers_us``
        (prepare, rest). On an eager model ``forward`` is the model's forward (no gearcache share)."""
        out = {name: (long[name] - short[name]) / steps / 1e3 for name in sorted(set(long) | set(short))}
        total = out.pop("total")
        out["rest"] = total - sum(out.values())
        eager = "dispatch" not in out
        out["gearcache_us"] = 0.0 if eager else sum(out.get(k, 0.0) for k in ("bind", "forward", "dispatch"))
        out["step_us"] = out["forward"] if eager else out.get("step", 0.0)
        out["transformers_us"] = out.get("prepare", 0.0) + out["rest"]
        out["total_us"] = total
        return {k: round(v, 1) for k, v in out.items()}
