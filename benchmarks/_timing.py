"""Timing helper shared by the benchmarks."""
import statistics
import time
from typing import Callable


def p50_us(call: Callable[[], object], n: int, sync: Callable[[], None], warmup: int = 200) -> float:
    """Median wall time of ``call()`` in µs over ``n`` calls, after ``warmup`` calls; ``sync`` waits for the device
    before and after the timed calls."""
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t)
    sync()
    return statistics.median(times) / 1e3
