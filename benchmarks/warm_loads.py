"""Warm start of one geared method: where its gears' look-ups and loads go (issue #38).

    python benchmarks/warm_loads.py [--device cpu|cuda] [--gears 1,2,...,12] [--runs 3] [--cache-dir DIR]

The reference decoder's ``decode`` (on CPU a small one: hidden 256, 2 layers, fp32) with batch gears ``--gears``
(``x`` dim 0 and ``kv`` dim 2, one gear plan). A first fresh process fills the store (skipped when ``--cache-dir``
already holds the method's entries); then ``--runs`` fresh processes, each with empty Inductor and Triton caches,
time ``warmup()`` alone from the warm store (model built and torch imported before the clock starts) and report
its timeline (gearcache/timeline.py): per phase its count, summed seconds and busy span (first start to last end),
and the counters (0 compiles, every gear loaded). Prints each run, the median warm-up and a JSON line last.
``GEARCACHE_BENCH_PROFILE=FILE``: each warm process also writes cProfile's stats of ``warmup()`` to FILE.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _fresh import run_child

HERE = os.path.dirname(os.path.abspath(__file__))


def child(device: str, gears: list[int], cache_dir: str) -> None:
    """One warm-up in this process; prints a JSON line."""
    sys.path.insert(0, HERE)
    import torch

    if device == "cpu":
        os.environ.update({"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000", "A_TMAX": "64"})
    import reference_decoder as ref
    from gearcache import CompilerConfig, cache_compile, counters

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = CompilerConfig(mode="reduce-overhead" if device == "cuda" else "default")
    config.inference_config.dim_gears = {"x": {0: gears}, "kv": {2: gears}}

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir)

    torch.manual_seed(0)
    model = CachedGPT().to(device, dtype).eval()
    with torch.inference_mode():
        inputs = ref.inputs(max(gears), device, dtype)
        before = counters.snapshot()
        profile = _profiler()
        t0 = time.perf_counter()
        n = model.cached_decode.warmup(*inputs)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.environ["GEARCACHE_BENCH_PROFILE"])
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        x, kv, pos = ref.inputs(3, device, dtype)
        got, want = model.cached_decode(x, kv, pos), model.decode(x, kv, pos)
        equal = all(torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(got, want))
    timeline = model.cached_decode.warmup_timeline
    print(json.dumps({"gears": n, "seconds": seconds, "equal": equal, "counters": counters.delta(before),
                      "phases": {k: list(v) for k, v in timeline.totals().items()},
                      "timeline": timeline.summary()}))


def _profiler():
    """cProfile running, when ``GEARCACHE_BENCH_PROFILE`` names a file for its stats (else None)."""
    if not os.environ.get("GEARCACHE_BENCH_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def run(device: str, gears: list[int], cache_dir: str) -> dict:
    """One warm-up in a fresh process, with empty Inductor and Triton caches of its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", device, "--cache-dir", cache_dir,
           "--gears", ",".join(map(str, gears))]
    return run_child(cmd, "gearcache-warm-loads-caches-",
                     {"PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gears", default=",".join(str(g) for g in range(1, 13)))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache-dir", default=None, help="the store (kept; filled first when it holds no entries)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    gears = [int(g) for g in opts.gears.split(",")]
    if opts.child:
        child(opts.device, gears, opts.cache_dir)
        return
    cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="gearcache-warm-loads-")
    if not os.path.isdir(os.path.join(cache_dir, "entries")):
        cold = run(opts.device, gears, cache_dir)
        print(f"cold fill: {cold['gears']} gears, {cold['counters']['compiles']} compiles, {cold['seconds']:.1f} s")
    warm = [run(opts.device, gears, cache_dir) for _ in range(opts.runs)]
    for i, r in enumerate(warm):
        c = r["counters"]
        lines = [f"run {i}: warm-up {r['seconds']:.3f} s, {r['gears']} gears, compiles {c['compiles']}, loads "
                 f"{c['loads']} ({c['direct_loads']} by run plan), equal to eager {r['equal']}"]
        for phase, (n, total, first, last) in r["phases"].items():
            lines.append(f"    {phase:<34} n {n:>3}  sum {total:6.3f} s  busy {first:6.3f}..{last:6.3f} s")
        print("\n".join(lines))
    median = statistics.median(r["seconds"] for r in warm)
    print(f"median warm-up over {len(warm)} fresh processes: {median:.3f} s")
    print(json.dumps({"benchmark": "warm_loads", "device": opts.device, "gears": gears, "median_s": median,
                      "runs": [{k: r[k] for k in ("seconds", "counters", "phases", "equal")} for r in warm]}))


if __name__ == "__main__":
    main()
