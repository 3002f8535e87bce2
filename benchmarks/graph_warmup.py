"""Where a gear's first call goes under CUDA graphs in a warm process (the warm-up run before its capture).

    python benchmarks/decode_step.py --cache-dir DIR     # once, to fill DIR (or any warm-up of the same model)
    python benchmarks/graph_warmup.py DIR MODE           # MODE: serial | threads | main_then | profile

A fresh process loads the reference decoder's 7 decode gears from ``DIR`` with lazy capture
(``capture_graphs="first_call"``), then times each gear's first call (which runs the gear once, then captures it)
and its second call, largest gear first. Before that, ``threads`` runs every gear once through a second cached
method without graphs in 4 other threads, ``main_then`` does the same in this thread: if a gear's first call is
slow because of state a library keeps per thread (cuDNN's execution plans are), only ``main_then`` makes it fast.
``profile`` prints ``torch.profiler``'s CPU table for the first call of gear 2 (after gear 64 paid the libraries'
one-time initialisation). Prints one JSON line. Results: docs/BENCHMARKS.md, "Decode step and CUDA graphs".
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from os.path import abspath, dirname

sys.path.insert(0, dirname(abspath(__file__)))
import torch  # noqa: E402

import reference_decoder as ref  # noqa: E402
from decode_step import GEARS, make_cached  # noqa: E402


def main() -> None:
    folder, mode = sys.argv[1], sys.argv[2]
    order = sorted(GEARS, reverse=True)
    inputs = {b: ref.inputs(b, "cuda", torch.bfloat16) for b in GEARS}
    torch.cuda.synchronize()
    out: dict = {"mode": mode}
    with torch.inference_mode():
        if mode in ("threads", "main_then"):
            out["plain_runs_s"] = run_without_graphs(folder, inputs, order, threads=4 if mode == "threads" else 0)
        graphed = make_cached(ref, "reduce-overhead", folder, capture="first_call")
        t0 = time.perf_counter()
        graphed.cached_decode.warmup(*inputs[64])          # loads every gear, captures none
        torch.cuda.synchronize()
        out["load_all_s"] = time.perf_counter() - t0

        def call(b: int) -> float:
            t = time.perf_counter()
            graphed.cached_decode(*inputs[b])
            torch.cuda.synchronize()
            return time.perf_counter() - t

        if mode == "profile":
            from torch.profiler import ProfilerActivity, profile

            out["first_64_s"] = call(64)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out["first_2_s"] = call(2)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        else:
            out["first_s"] = {b: call(b) for b in order}
            out["second_s"] = {b: call(b) for b in order}
            out["first_total_s"] = sum(out["first_s"].values())
    print(json.dumps(out))


def run_without_graphs(folder: str, inputs: dict, order: list[int], threads: int) -> float:
    """Run every gear once through a cached method without CUDA graphs (same folder: loads, no compile), in
    ``threads`` other threads (each on a stream of its own), or in this thread when 0; returns the seconds."""
    plain = make_cached(ref, "default", folder)

    def run(b: int) -> None:
        with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream()):
            plain.cached_decode(*inputs[b])
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    if threads:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, order))
    else:
        for b in order:
            run(b)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
