"""Timing helper shared by the benchmarks."""
import statistics
import threading
import time
from typing import Callable, Iterable


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


def step_us(fn, inputs, device: str = "cuda", repeats: int = 10) -> float:
    """One decode step in µs: the median over ``repeats`` repeats of (20 back-to-back ``fn(*inputs)``) / 20, after 5
    warm-up calls; CUDA-event time on a GPU, wall time otherwise."""
    import torch

    for _ in range(5):
        fn(*inputs)
    if not device.startswith("cuda"):
        per = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(20):
                fn(*inputs)
            per.append((time.perf_counter() - t) * 1e6 / 20)
        return statistics.median(per)
    torch.cuda.synchronize()
    per_step = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        per_step.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(per_step)


def wall_s(fn: Callable[[object], object], items: Iterable, mode: str) -> float:
    """Seconds of wall time to run ``fn(item)`` for every item: one after another (``mode="serial"``) or each in a
    thread of its own, all started at once (``"threads"``)."""
    t0 = time.perf_counter()
    if mode == "serial":
        for item in items:
            fn(item)
    else:
        threads = [threading.Thread(target=fn, args=(item,)) for item in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return time.perf_counter() - t0
