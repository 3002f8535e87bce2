"""What a decode step with CUDA graphs runs on the GPU: torch.compile reduce-overhead against gearcache's graphs with
each ``graph_outputs`` (copy, view, view-checked), kernel by kernel, in one process.

    python benchmarks/graph_step_kernels.py [CACHE_DIR]

Reference decoder (hidden 1024, 8 layers, bf16), decode B=1; gearcache serves it through gears 1 and 2 (two
compiles on an empty folder). Per path: the step time (``_timing.step_us``, 5 alternating rounds, median), the host
time to enqueue one call (50 calls, no synchronisation between them), and a ``torch.profiler`` trace of 20 steps:
GPU time per step summed over kernels and copies, their count, the 12 largest. Then, per gearcache path, each kernel
or copy whose time per step differs from reduce-overhead's by more than 0.3 µs, or whose count differs: what makes
the rows differ.
"""
import collections
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import step_us  # noqa: E402
from decode_step import make_cached  # noqa: E402

GEARS = [1, 2]
ROUNDS = 5
PROFILED_STEPS = 20


def enqueue_us(fn, inputs, n: int = 50) -> float:
    """Host µs per call to enqueue ``n`` calls back to back (the GPU runs behind)."""
    import torch

    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*inputs)
    per_call = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return per_call


def gpu_work(fn, inputs) -> dict[str, list[float]]:
    """{kernel or copy name: [count per step, µs per step]} over ``PROFILED_STEPS`` steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            fn(*inputs)
        torch.cuda.synchronize()
    work: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            work[event.name][0] += 1 / PROFILED_STEPS
            work[event.name][1] += event.device_time_total / PROFILED_STEPS
    return dict(work)


def main() -> None:
    import torch

    import reference_decoder as ref

    cache_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="gearcache-kernels-")
    inputs = ref.inputs(1, "cuda", torch.bfloat16)
    paths = {}
    with torch.inference_mode():
        model = ref.make("cuda", torch.bfloat16)
        paths["reduce-overhead"] = torch.compile(model.decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
        for outputs in ("copy", "view", "view-checked"):
            cached = make_cached(ref, "reduce-overhead", cache_dir, outputs=outputs, gears=GEARS)
            cached.cached_decode.warmup(*ref.inputs(GEARS[-1], "cuda", torch.bfloat16))
            paths["gearcache, " + outputs] = cached.cached_decode
        for fn in paths.values():
            fn(*inputs)
        steps = collections.defaultdict(list)
        for _ in range(ROUNDS):
            for name, fn in paths.items():
                steps[name].append(step_us(fn, inputs, repeats=4))
        work = {}
        print(f"decode B=1, reference decoder bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
        for name, fn in paths.items():
            work[name] = gpu_work(fn, inputs)
            total = sum(us for _, us in work[name].values())
            count = sum(n for n, _ in work[name].values())
            print(f"\n{name}: step {statistics.median(steps[name]):.1f} µs; host enqueue {enqueue_us(fn, inputs):.1f} "
                  f"µs/call; GPU kernels and copies {total:.1f} µs/step, {count:.0f} per step")
            for kernel, (n, us) in sorted(work[name].items(), key=lambda kv: -kv[1][1])[:12]:
                print(f"    {us:7.2f} µs  {n:4.0f}x  {kernel[:90]}")
    base = work["reduce-overhead"]
    for name in list(paths)[1:]:
        print(f"\n{name} against reduce-overhead, per step:")
        for kernel in sorted(set(base) | set(work[name])):
            n0, us0 = base.get(kernel, (0, 0.0))
            n1, us1 = work[name].get(kernel, (0, 0.0))
            if abs(us1 - us0) > 0.3 or round(n1 - n0, 1) != 0:
                print(f"    {us1 - us0:+7.2f} µs  {n1 - n0:+5.1f} launches  {kernel[:90]}")


if __name__ == "__main__":
    main()
