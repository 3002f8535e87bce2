"""Cold warm-up benchmark: the reference decoder's decode gears compiled one after another vs in worker processes.

    python benchmarks/warmup.py [--device cuda|cpu] [--workers N] [--gears 1,2,4,8,16,32,64]

Each measurement is a fresh process with a new, empty cache folder and empty Inductor and Triton caches, timing
``warmup()`` alone (model built, torch imported before the clock starts):

1. one gear: ``warmup()`` with only the largest gear (one capture + one compile);
2. serial: every gear, ``inference_config.warmup_workers = 1`` (what warm-up did before parallel warm-up);
3. parallel: every gear, ``warmup_workers = N`` (default: ``gearcache.warmup.driver.default_workers``).

Then the timelines of the one-gear and parallel runs (``CachedFunction.warmup_timeline``): per gear its capture,
wait for a worker, compile in worker k, finish_artifact (first load + run-plan check), complete entry, first run;
per worker its start and imports; then per phase its count, summed seconds and first start / last end.

Target (issue #14): parallel <= 1.5x one gear on the H200 for the 7 decode gears. On CUDA: the reference decoder
(hidden 1024, 8 layers, bf16); on CPU a small one (hidden 256, 2 layers, fp32).
"""
import argparse
import json
import os
import sys
import tempfile
import time

from _fresh import run_child

HERE = os.path.dirname(os.path.abspath(__file__))


def child(device: str, gears: list[int], workers: int | None) -> None:
    """One cold warm-up in this process; prints a JSON line."""
    sys.path.insert(0, HERE)
    import torch

    if device == "cpu":
        os.environ.update({"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000", "A_TMAX": "64"})
    import reference_decoder as ref
    from gearcache import CompilerConfig, cache_compile, counters

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = CompilerConfig()
    config.inference_config.dim_gears = {"x": {0: gears}, "kv": {2: gears}}
    config.inference_config.warmup_workers = workers
    cache_dir = tempfile.mkdtemp(prefix="gearcache-warmup-bench-")

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir)

    torch.manual_seed(0)
    model = CachedGPT().to(device, dtype).eval()
    with torch.inference_mode():
        inputs = ref.inputs(max(gears), device, dtype)
        t0 = time.perf_counter()
        n = model.cached_decode.warmup(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    print(json.dumps({"gears": n, "seconds": seconds, "compiles": counters.compiles,
                      "compile_seconds": counters.compile_seconds,
                      "timeline": model.cached_decode.warmup_timeline.summary()}))


def run(device: str, gears: list[int], workers: int | None) -> dict:
    """One cold warm-up in a fresh process, with empty Inductor and Triton caches of its own (shared caches would
    let a later run reuse the kernels an earlier one compiled; its workers inherit them)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", device,
           "--gears", ",".join(map(str, gears))]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    return run_child(cmd, "gearcache-warmup-bench-caches-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--workers", type=int, default=None, help="parallel run's workers (default: gearcache's)")
    ap.add_argument("--gears", default="1,2,4,8,16,32,64")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    gears = [int(g) for g in opts.gears.split(",")]
    import torch

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if opts.child:
        child(device, gears, opts.workers)
        return
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"cold warm-up benchmark, {device}, torch {torch.__version__}, {name}, gears {gears}")
    one = run(device, gears[-1:], 1)
    serial = run(device, gears, 1)
    parallel = run(device, gears, opts.workers)
    print(f"{'run':>10} {'gears':>6} {'seconds':>8} {'x one gear':>11}")
    for label, r in [("one gear", one), ("serial", serial), ("parallel", parallel)]:
        print(f"{label:>10} {r['gears']:>6} {r['seconds']:>8.1f} {r['seconds'] / one['seconds']:>11.2f}")
    print(f"parallel speed-up over serial: {serial['seconds'] / parallel['seconds']:.2f}x "
          f"(target on the H200: parallel <= 1.5x one gear)")
    for label, r in [("one gear", one), ("parallel", parallel)]:
        print(f"\ntimeline, {label} (seconds from warmup() start; gearcache/timeline.py):\n{r['timeline']}")


if __name__ == "__main__":
    main()
