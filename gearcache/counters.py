"""Process-wide event counters that tests and benchmarks assert on (after vLLM's compilation counter).

Usage::

    from gearcache.counters import counters
    with counters.expect(compiles=0, loads=1):
        model(x)

Counters only ever go up; ``expect`` compares the change across the ``with`` block, so tests do not interfere.
Nothing here is on the hot path except ``hits``, ``pads`` and the elements of geared calls, which are plain
integer increments.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from typing import Iterator

_ADD_LOCK = threading.Lock()


@dataclasses.dataclass
class Counters:
    traces: int = 0            # Dynamo captures of a cached method
    compiles: int = 0          # Inductor compiles gearcache started
    loads: int = 0             # artifacts loaded from disk into a process
    direct_loads: int = 0      # ... of which by gearcache's own loader (run plan: torch's compiler not imported)
    hits: int = 0              # calls served by an entry already in memory
    misses: int = 0            # calls whose signature had no entry in memory
    eager_calls: int = 0       # calls run uncompiled by policy (past the largest gear, or a cache fault)
    pads: int = 0              # calls that were padded up to a gear
    real_elements: int = 0     # elements of the geared inputs of served geared calls, as the caller passed them
    padded_elements: int = 0   # ... as the entries ran them (padded to the gear): padding waste = 1 - real/padded
    quarantined: int = 0       # artifacts moved aside after a failed digest or signature check
    evictions: int = 0         # entries evicted under config.max_size
    graph_captures: int = 0    # CUDA graphs captured (mode="reduce-overhead")
    remote_loads: int = 0      # artifacts fetched from the remote store into the local folder
    remote_pushes: int = 0     # artifacts pushed to the remote store
    remote_refused: int = 0    # remote entries/artifacts refused (unsigned, tampered, corrupted): never executed
    remote_errors: int = 0     # remote store faults (down, timeout, full): the local folder carried on alone
    remote_waits: int = 0      # times this process waited for another fleet process compiling an artifact
    graph_warmups: int = 0     # runs of an entry before its capture (one per captured graph, on a side stream)
    padding_verifications: int = 0     # gears checked against eager because padding may mix rows (padding_check)
    rank_fences: int = 0       # fences passed with the other ranks of a process group before warm-up's runs (ranks.py)
    digests: int = 0           # artifact files whose sha256 an artifact check computed (store/artifacts.py)
    stamped_checks: int = 0    # artifact checks passed by the artifact's stamp, no digest computed (store/stamps.py)
    lease_waits: int = 0       # lease locks found held by an evictor, waited for (store/leases.py)
    guard_parses: int = 0      # value-guard sets parsed from a manifest's JSON (an equal one held already is shared)
    guard_checks: int = 0      # value-guard sets checked guard by guard on live objects (keys/guard_sets.py)
    guard_watches: int = 0     # guard watches built over the value guards' paths (keys/guard_watch.py)
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    capture_seconds: float = 0.0

    def add(self, **amounts: float) -> None:
        """Add to the named counters under a lock: for the counters that threads of one process may bump at once (a
        warm-up's gears are looked up and loaded side by side: ``misses``, ``loads``, ``load_seconds``, ...); a plain
        ``+=`` there may lose an update."""
        with _ADD_LOCK:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> "Counters":
        return copy.copy(self)

    def delta(self, since: "Counters") -> dict[str, float]:
        return {f.name: getattr(self, f.name) - getattr(since, f.name) for f in dataclasses.fields(self)}

    @contextlib.contextmanager
    def expect(self, **expected: int) -> Iterator[None]:
        """Assert that each named counter grew by exactly the given amount inside the block."""
        unknown = set(expected) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"expect(): unknown counter(s) {sorted(unknown)}")
        before = self.snapshot()
        yield
        got = self.delta(before)
        wrong = {k: (v, got[k]) for k, v in expected.items() if got[k] != v}
        if wrong:
            detail = ", ".join(f"{k}: expected +{v}, got +{g}" for k, (v, g) in wrong.items())
            raise AssertionError(f"gearcache counters: {detail}")


counters = Counters()
