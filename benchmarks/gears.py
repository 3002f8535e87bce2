"""Gears benchmark: dispatch overhead and a batch sweep, side by side in one run.

    python benchmarks/gears.py [--device cuda|cpu] [--cache-dir DIR]

1. Dispatch overhead, p50 over 10,000 calls of the reference decoder's decode at a gear size (no padding) and at a
   size that pads: the geared call (resolve + pad + lookup + compiled graph + cut) against the torch-loaded compiled
   callable called directly with prebuilt inputs; and gearcache's glue alone (the compiled graph replaced by a
   function returning its outputs).
2. Batch sweep B = 1..64 with gears 1, 2, 4, ..., 64 (zip over x's and the KV cache's batch dims): compiles after
   warm-up (target 0), total time, padding waste (padded rows / real rows); beside it torch.compile with
   dynamic=False (fails at the 9th shape: recompile limit 8) and with its default automatic dynamic shapes.
On CUDA: the reference decoder (hidden 1024, 8 layers, bf16); on CPU a small one (hidden 256, 2 layers, fp32).
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import p50_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--cache-dir", default=None, help="gearcache folder (default: a new temporary one)")
    ap.add_argument("--calls", type=int, default=10000)
    opts = ap.parse_args()
    import torch

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.update({"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000", "A_TMAX": "64"})
    import reference_decoder as ref
    from gearcache import CompilerConfig, cache_compile, counters
    from gearcache.call.signature import call_key

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gear_sizes = [1, 2, 4, 8, 16, 32, 64]
    config = CompilerConfig()
    config.inference_config.dim_gears = {"x": {0: gear_sizes}, "kv": {2: gear_sizes}}
    cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="gearcache-gears-")

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir)

    torch.manual_seed(0)
    model = CachedGPT().to(device, dtype).eval()
    fn = model.cached_decode
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gears benchmark, {device}, torch {torch.__version__}, {device_name}")
    with torch.inference_mode():
        t0 = time.perf_counter()
        n_gears = fn.warmup(*ref.inputs(64, device, dtype))
        sync()
        print(f"warm-up: {n_gears} gears in {time.perf_counter() - t0:.1f} s "
              f"(compiled {counters.compiles}, loaded {counters.loads})")

        # ---------------------------------------------------------------------------------------- overhead
        def p50(f, n):
            return p50_us(f, n, sync, warmup=2)

        print(f"\ndispatch overhead, p50 over {opts.calls} calls (us)")
        print(f"{'batch':>6} {'geared call':>12} {'direct':>8} {'difference':>11} {'glue alone':>11}")
        for batch in (8, 5):
            x, kv, pos = ref.inputs(batch, device, dtype)
            fn(x, kv, pos)
            gear_plan = fn.gear_life.plan
            padded = gear_plan.pad((x, kv, pos), gear_plan.targets((x, kv, pos)))
            entry = fn._table[call_key(padded, {})[1]]
            args = entry.gather(padded)
            direct = entry.compiled
            geared = p50(lambda x=x, kv=kv, pos=pos: fn(x, kv, pos), opts.calls)
            plain = p50(lambda direct=direct, args=args: direct(*args), opts.calls)
            outs = direct(*args)
            real_compiled, entry.compiled = entry.compiled, (lambda *a, outs=outs: outs)
            glue = p50(lambda x=x, kv=kv, pos=pos: fn(x, kv, pos), opts.calls)
            entry.compiled = real_compiled
            label = f"{batch}" + (" (pads to 8)" if batch == 5 else "")
            print(f"{label:>6} {geared:>12.1f} {plain:>8.1f} {geared - plain:>11.1f} {glue:>11.2f}")

        # ------------------------------------------------------------------------------------------- sweep
        compiles_before = counters.compiles + counters.traces
        padded_rows = real_rows = 0
        sweep_s = 0.0
        for batch in range(1, 65):
            x, kv, pos = ref.inputs(batch, device, dtype)
            sync()
            t0 = time.perf_counter()
            logits, new_kv = fn(x, kv, pos)
            sync()
            sweep_s += time.perf_counter() - t0
            assert logits.shape[0] == batch and new_kv.shape[2] == batch
            real_rows += batch
            padded_rows += next(g for g in gear_sizes if g >= batch)
        print("\nbatch sweep 1..64")
        print(f"{'path':44} {'compiles':>9} {'total':>9}  note")
        sweep_compiles = counters.compiles + counters.traces - compiles_before
        print(f"{'gearcache (gears 1..64, after warm-up)':44} {sweep_compiles:>9} "
              f"{sweep_s:>8.2f}s  (calls only) padding waste {padded_rows / real_rows:.2f}x "
              f"({padded_rows} padded / {real_rows} real rows)")
        for dynamic in (False, None):
            _sweep_torch_compile(ref, dynamic, device, dtype, sync)


def _sweep_torch_compile(ref, dynamic, device, dtype, sync) -> None:
    import torch
    import torch._dynamo.utils as du

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ref.GPT().to(device, dtype).eval()
    compiled = torch.compile(model.decode, fullgraph=True, dynamic=dynamic)
    before = du.counters["stats"]["unique_graphs"]
    total = 0.0
    note = "ok"
    try:
        for batch in range(1, 65):
            inputs = ref.inputs(batch, device, dtype)
            sync()
            t0 = time.perf_counter()
            compiled(*inputs)
            sync()
            total += time.perf_counter() - t0
    except Exception as exc:           # the recompile limit
        note = f"failed at B={batch}: {type(exc).__name__}"
    graphs = du.counters["stats"]["unique_graphs"] - before
    print(f"{'torch.compile(dynamic=' + str(dynamic) + ')':44} {graphs:>9} {total:>8.2f}s  {note} (calls only)")


if __name__ == "__main__":
    main()
