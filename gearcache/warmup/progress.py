"""Warm-up progress for people watching a terminal, and for logs.

On a terminal (the stream's ``isatty()``): a bar, tqdm's when tqdm is installed (``pip install gearcache[progress]``;
transformers brings it too), else a one-line bar of gearcache's own redrawn in place::

    gearcache warmup decode: [##########..........] 4/7 gears ready, 12.3 s (gear [8]: compiled in 11.9 s)

Elsewhere (a log file, a pipe, a batch job): no bar, one ``log.info`` line per gear on the ``gearcache.warmup.driver``
logger: ``warmup decode: gear [8] compiled in 11.90 s (4/7)``.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, TextIO

log = logging.getLogger("gearcache.warmup.driver")
BAR_WIDTH = 20


def find_tqdm() -> Any:
    """tqdm's bar class if tqdm is installed, else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """Progress of ``total`` gears of the method ``name`` becoming ``what`` ("ready"); :meth:`step` once per gear
    (from any thread), :meth:`close` at the end. ``tqdm_class``: the bar to draw on a terminal (default
    :func:`find_tqdm`; None: gearcache's own)."""

    def __init__(self, name: str, total: int, what: str, stream: TextIO | None = None,
                 tqdm_class: Any = find_tqdm):
        self.name, self.total, self.what, self.done = name, total, what, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.last = ""
        self.closed = False
        self._lock = threading.Lock()
        bar_class = tqdm_class() if tqdm_class is find_tqdm else tqdm_class
        self.bar = None
        if self.tty and bar_class is not None:
            self.bar = bar_class(total=total, desc=f"gearcache warmup {name}", unit="gear", file=self.stream,
                                 leave=True, dynamic_ncols=True)

    def step(self, gear: list[int], how: str, seconds: float) -> None:
        """Gear ``gear`` is done (``how``: "loaded", "compiled", ...) after ``seconds``."""
        with self._lock:
            self.done += 1
            self.last = f"gear {gear}: {how} in {seconds:.1f} s"
            if self.bar is not None:
                self.bar.set_postfix_str(self.last, refresh=False)
                self.bar.update(1)
            elif self.tty:
                print("\r" + self.line(), end="", file=self.stream, flush=True)
            else:
                log.info("warmup %s: gear %s %s in %.2f s (%d/%d)", self.name, gear, how, seconds, self.done,
                         self.total)

    def line(self) -> str:
        """gearcache's own bar, as drawn on a terminal without tqdm."""
        filled = round(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
        elapsed = time.monotonic() - self.started
        return (f"gearcache warmup {self.name}: [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} "
                f"gears {self.what}, {elapsed:.1f} s ({self.last})")

    def close(self) -> None:
        """End the bar's line (once; a later call does nothing)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            elif self.tty and self.done:
                print(file=self.stream, flush=True)
