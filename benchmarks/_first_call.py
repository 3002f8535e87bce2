"""One fresh process of the warm-start benchmark: build the reference decoder, time its first decode call.

usage: _first_call.py VARIANT WORKDIR DEVICE
VARIANT: compile | megacache-save | megacache-load | aot-save | aot-load | aot-load-unguarded | gearcache
Prints one JSON line: first_call_s (first call incl. any load, to the device synchronising), call_p50_us (the
median wall time of one call, the device synchronised around the timed calls only), and for gearcache the
per-call timings of the loaded entry against the torch-loaded compiled callable it wraps. ``aot-save`` compiles
with torch's ``aot_compile`` and saves it (``save_compiled_function``); ``aot-load`` loads that file
(``torch.compiler.load_compiled_function``) and calls it with its guards checked, ``aot-load-unguarded`` with
``disable_guard_check()``.
"""
import time

T_PROCESS = time.perf_counter()
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
variant, workdir, device = sys.argv[1], sys.argv[2], sys.argv[3]
import torch

import reference_decoder as ref
from _timing import p50_us

dtype = torch.bfloat16 if device == "cuda" else torch.float32


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


report = {"variant": variant}


def _p50(call, n: int) -> float:
    return p50_us(call, n, sync)


if variant == "gearcache":
    from gearcache import cache_compile, counters

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, cache_dir=os.path.join(workdir, "gearcache"))

    torch.manual_seed(0)
    model = CachedGPT().to(device, dtype).eval()
    fn = model.cached_decode
else:
    model = ref.make(device, dtype)
    if variant == "megacache-load":
        with open(os.path.join(workdir, "megacache.bin"), "rb") as f:
            blob = f.read()
    fn = None
x, kv, pos = ref.inputs(1, device, dtype)
sync()
profile = None
if os.environ.get("GEARCACHE_BENCH_PROFILE") and variant == "gearcache":
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
with torch.inference_mode():
    t0 = time.perf_counter()
    report["setup_s"] = t0 - T_PROCESS
    if variant == "megacache-load":
        torch.compiler.load_cache_artifacts(blob)
    if variant.startswith("aot-load"):
        with open(os.path.join(workdir, "aot_compiled.bin"), "rb") as f:
            aot = torch.compiler.load_compiled_function(f)
        if variant == "aot-load-unguarded":
            aot.disable_guard_check()
        fn = lambda *a, _aot=aot: _aot(model, *a)          # noqa: E731 - compiled from a bound method: self first
    if variant == "aot-save":
        torch._dynamo.config.enable_aot_compile = True      # off by default on torch 2.11
        aot = torch.compile(model.decode, fullgraph=True).aot_compile(((x, kv, pos), {}))
        fn = lambda *a, _aot=aot: _aot(model, *a)          # noqa: E731 - compiled from a bound method: self first
    if fn is None:
        fn = torch.compile(model.decode, fullgraph=True)
    out = fn(x, kv, pos)
    sync()
    report["first_call_s"] = time.perf_counter() - t0
    report["process_to_first_output_s"] = time.perf_counter() - T_PROCESS
    report["compiler_imported"] = "torch._inductor" in sys.modules
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    eager = model.decode(x, kv, pos)
    report["max_abs_diff_vs_eager"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, eager))
    report["call_p50_us"] = _p50(lambda: fn(x, kv, pos), int(os.environ.get("GEARCACHE_BENCH_CALLS", "10000")))
    if variant == "aot-save":
        aot.save_compiled_function(os.path.join(workdir, "aot_compiled.bin"))
    if variant == "megacache-save":
        artifacts = torch.compiler.save_cache_artifacts()
        with open(os.path.join(workdir, "megacache.bin"), "wb") as f:
            f.write(artifacts[0])
    if variant == "gearcache":
        report["counters"] = {k: v for k, v in vars(counters).items()}
        from gearcache.call.signature import call_key

        entry = next(iter(fn._table.values()))
        args = entry.gather(call_key((x, kv, pos), {})[0])
        direct = entry.compiled
        n = int(os.environ.get("GEARCACHE_BENCH_CALLS", "10000"))
        t_entry, t_direct = [], []
        for _ in range(200):
            fn(x, kv, pos), direct(*args)
        sync()
        for _ in range(n):
            t = time.perf_counter_ns()
            fn(x, kv, pos)
            t_entry.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            direct(*args)
            t_direct.append(time.perf_counter_ns() - t)
        sync()
        report["entry_call_p50_us"] = statistics.median(t_entry) / 1e3
        report["direct_call_p50_us"] = statistics.median(t_direct) / 1e3
        wrapper = getattr(direct, "wrapper_call", None)     # Inductor's generated call(list), under a run plan
        if wrapper is not None:
            # interleaved, and the median of the per-pair differences: host jitter of a ~1 ms loop cancels out
            pairs = []
            for i in range(n + 200):
                t = time.perf_counter_ns()
                fn(x, kv, pos)
                t1 = time.perf_counter_ns()
                wrapper(list(args))
                t2 = time.perf_counter_ns()
                if i >= 200:
                    pairs.append((t1 - t, t2 - t1))
            sync()
            report["wrapper_call_p50_us"] = statistics.median(w for _, w in pairs) / 1e3
            report["entry_call_vs_wrapper_p50_us"] = statistics.median(e - w for e, w in pairs) / 1e3
            # The run plan's own per-call work, isolated: the same per-call function around a call() that does nothing.
            from gearcache.runplan import PlanRunner

            plan = json.loads((fn.store.layout.artifact(entry.manifest["akey"]) / "runplan" / "plan.json").read_text())
            null_run = PlanRunner(lambda a: a, plan)
            null_run.set_stable_inputs([j for j, (kind, _) in enumerate(entry.manifest["inputs"]) if kind == "state"])
            report["run_plan_own_p50_us"] = _p50(lambda: null_run(*args), n) - _p50(lambda: list(args), n)
            from gearcache._torch import inductor as torch_inductor

            torch_loaded = torch_inductor.load_folder(fn.store.layout.artifact(entry.manifest["akey"]) / "inductor")
            torch_loaded(*args)
            report["torch_loaded_call_p50_us"] = _p50(lambda: torch_loaded(*args), n)
        # gearcache's own work per call, without the compiled graph: key + lookup + gather + build.
        leaves = (x, kv, pos)
        outs = direct(*args)
        t_glue = []
        for _ in range(n):
            t = time.perf_counter_ns()
            lv, key = call_key(leaves, {})
            e = fn._table.get(key)
            e.build(outs, lv) if e.gather(lv) else None
            t_glue.append(time.perf_counter_ns() - t)
        report["dispatch_glue_p50_us"] = statistics.median(t_glue) / 1e3
        # Device time per step: CUDA events around 100 steps.
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                fn(x, kv, pos)
            end.record()
            sync()
            report["step_us"] = start.elapsed_time(end) * 1e3 / 100
print(json.dumps(report))
