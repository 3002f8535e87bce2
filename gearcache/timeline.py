"""A warm-up's timeline: named phases per gear with wall-clock start and end, for finding where warm-up time goes.

``CachedFunction.warmup`` leaves the last one at ``CachedFunction.warmup_timeline``; ``benchmarks/warmup.py`` prints
its :meth:`Timeline.summary`. Times are ``time.time()`` seconds (worker processes report theirs on the same host
clock), shown relative to the timeline's start. Recording is thread-safe.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator


class Timeline:
    """Spans ``(who, phase, start, end)``: ``who`` a gear (``"gear [8]"``), a worker (``"worker 1"``) or ``"all"``."""

    def __init__(self) -> None:
        self.start = time.time()
        self.spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    def add(self, who: str, phase: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append((who, phase, start, end))

    def add_once(self, who: str, phase: str, start: float, end: float) -> None:
        """:meth:`add`, unless ``who`` already has a ``phase`` span (a worker's start, reported with every job)."""
        with self._lock:
            if not any(s[:2] == (who, phase) for s in self.spans):
                self.spans.append((who, phase, start, end))

    @contextlib.contextmanager
    def span(self, who: str, phase: str, synchronize: Callable[[], None] | None = None) -> Iterator[None]:
        """Record the time the ``with`` block takes; ``synchronize`` (``torch.cuda.synchronize``) is called at its
        end first, so that the span also holds the device work the block queued."""
        t0 = time.time()
        try:
            yield
        finally:
            if synchronize is not None:
                synchronize()
            self.add(who, phase, t0, time.time())

    def totals(self) -> dict[str, tuple[int, float, float, float]]:
        """Per phase: ``(count, summed seconds, first start, last end)``, the two ends relative to :attr:`start`."""
        out: dict[str, tuple[int, float, float, float]] = {}
        for _, phase, a, b in self.spans:
            n, s, first, last = out.get(phase, (0, 0.0, float("inf"), 0.0))
            out[phase] = (n + 1, s + b - a, min(first, a - self.start), max(last, b - self.start))
        return out

    def summary(self) -> str:
        """Every span in start order (``+start..+end  seconds  who  phase``), then per-phase totals; the busy span of
        a phase (first start to last end) against its summed seconds shows how much of it ran side by side."""
        lines = [f"{'start':>7} {'end':>7} {'secs':>6}  who          phase"]
        for who, phase, a, b in sorted(self.spans, key=lambda s: (s[2], s[3])):
            lines.append(f"{a - self.start:>7.2f} {b - self.start:>7.2f} {b - a:>6.2f}  {who:<12} {phase}")
        lines.append(f"{'phase':<22} {'n':>3} {'sum s':>7} {'first':>7} {'last':>7}")
        for phase, (n, s, first, last) in sorted(self.totals().items(), key=lambda kv: kv[1][2]):
            lines.append(f"{phase:<22} {n:>3} {s:>7.2f} {first:>7.2f} {last:>7.2f}")
        return "\n".join(lines)
