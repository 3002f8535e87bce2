"""Decode-step benchmark on the GPU: eager, torch.compile, torch.compile reduce-overhead, gearcache, gearcache with
CUDA graphs, side by side in one process.

    python benchmarks/decode_step.py [--cache-dir DIR] [--sdpa no-cudnn]

Reference decoder (hidden 1024, 8 layers, bf16), decode step at B = 1, 8, 32: per step = the median over 10 repeats of
(CUDA-event time of 20 back-to-back steps) / 20. The four CUDA-graph rows (torch.compile reduce-overhead and
gearcache's three) are measured in 5 alternating rounds of 4 repeats each, median of the 20: they differ by ~1 %,
and a drift of the host over the run then hits each alike. gearcache with CUDA graphs runs once per
``graph_outputs``: copies (the default), views, and view-checked (the contract of reduce-overhead's outputs:
overwritten by the next run, an error if read after it). gearcache serves every batch through gears 1, 2, 4, ..., 64
(zip over x's and the KV cache's batch dims). Then, for gearcache with CUDA graphs: capture time and GPU memory of the
7 gears' graphs, a batch sweep 1..64 (compiles after warm-up, padding waste), and a warm start in a fresh process
(every gear loaded from the folder with empty Inductor/Triton caches, and captured).

``--sdpa no-cudnn`` turns cuDNN's attention off for every path (``torch.backends.cuda.enable_cudnn_sdp(False)`` at
the start of each process: the decoder's masked attention then runs mem-efficient attention). cuDNN builds an
execution plan per new shape (~40 ms each on an H200, and threads do not overlap them:
``benchmarks/sdpa_new_shapes.py``), which every new gear's first run pays; the other backends have no such step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import step_us  # noqa: E402
GEARS = [1, 2, 4, 8, 16, 32, 64]
BATCHES = (1, 8, 32)
ROUNDS = 5          # alternating rounds over the CUDA-graph paths


def make_cached(ref, mode: str, cache_dir: str, outputs: str = "copy", capture: str = "warmup",
                gears: list[int] = GEARS):
    """The reference decoder on the GPU, its decode step cached by gearcache with ``gears`` over the batch."""
    from gearcache import CompilerConfig, cache_compile

    config = CompilerConfig(mode=mode)
    config.inference_config.capture_graphs = capture
    config.inference_config.dim_gears = {"x": {0: gears}, "kv": {2: gears}}
    config.inference_config.graph_outputs = outputs

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir)

    import torch

    torch.manual_seed(0)
    return CachedGPT().to("cuda", torch.bfloat16).eval()


def apply_sdpa(choice: str) -> None:
    """The attention backends of this process (see the module docstring)."""
    if choice == "no-cudnn":
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)


def warm_child(cache_dir: str, capture: str, threads: int | None = None) -> None:
    """A fresh process: load every gear and capture its graph (``capture="warmup"``), or load every gear and capture
    only B=1's on its first call (``"first_call"``); print the times and counters as JSON."""
    import torch

    import reference_decoder as ref
    from gearcache import counters
    from gearcache.graphs import cuda_graphs

    if threads:
        cuda_graphs.CAPTURE_THREADS = threads
    model = make_cached(ref, "reduce-overhead", cache_dir, capture=capture)
    x, kv, pos = ref.inputs(64, "cuda", torch.bfloat16)
    one = ref.inputs(1, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.cached_decode.warmup(x, kv, pos)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.cached_decode(*one)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
    print(model.cached_decode.warmup_timeline.summary(), file=sys.stderr)      # where the warm start goes
    print(json.dumps({"warm_all_gears_s": dt, "first_call_b1_s": first, "counters": dict(vars(counters)),
                      "reserved_mib": torch.cuda.memory_reserved() / 2**20,
                      "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
                      "compiler_imported": "torch._inductor" in sys.modules or "torch._dynamo" in sys.modules}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--child", choices=("warmup", "first_call"), help=argparse.SUPPRESS)
    ap.add_argument("--capture-threads", type=int, default=None,
                    help="with --child warmup: gears warmed up at once before their capture (default: "
                         "gearcache.graphs.cuda_graphs.CAPTURE_THREADS)")
    ap.add_argument("--sdpa", choices=("default", "no-cudnn"), default="default",
                    help="no-cudnn: cuDNN attention off in every path (see the module docstring)")
    opts = ap.parse_args()
    apply_sdpa(opts.sdpa)
    cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="gearcache-decode-")
    if opts.child:
        return warm_child(cache_dir, opts.child, opts.capture_threads)
    import torch

    import reference_decoder as ref
    from gearcache import counters

    dtype = torch.bfloat16
    inputs = {b: ref.inputs(b, "cuda", dtype) for b in BATCHES}
    rows = {}
    with torch.inference_mode():
        model = ref.make("cuda", dtype)
        rows["eager"] = {b: step_us(model.decode, inputs[b]) for b in BATCHES}
        torch._dynamo.reset()
        fn = torch.compile(model.decode, fullgraph=True, dynamic=False)
        rows["torch.compile"] = {b: step_us(fn, inputs[b]) for b in BATCHES}
        torch._dynamo.reset()
        plain = make_cached(ref, "default", cache_dir)
        t0 = time.perf_counter()
        plain.cached_decode.warmup(*ref.inputs(64, "cuda", dtype))
        warmup_s = time.perf_counter() - t0
        rows["gearcache"] = {b: step_us(plain.cached_decode, inputs[b]) for b in BATCHES}
        graphed = make_cached(ref, "reduce-overhead", cache_dir)
        torch.cuda.synchronize()
        warm_inputs = ref.inputs(64, "cuda", dtype)
        mem0 = torch.cuda.memory_reserved()
        c0, cap0 = counters.compiles, counters.capture_seconds
        t0 = time.perf_counter()
        graphed.cached_decode.warmup(*warm_inputs)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0
        capture_only = counters.capture_seconds - cap0
        graph_mem = torch.cuda.memory_reserved() - mem0
        views = make_cached(ref, "reduce-overhead", cache_dir, outputs="view")
        views.cached_decode.warmup(*ref.inputs(64, "cuda", dtype))
        checked = make_cached(ref, "reduce-overhead", cache_dir, outputs="view-checked")
        checked.cached_decode.warmup(*ref.inputs(64, "cuda", dtype))
        torch._dynamo.reset()
        reduce_overhead = torch.compile(model.decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
        for b in BATCHES:                                      # compile and record each batch size
            for _ in range(3):
                reduce_overhead(*inputs[b])
        # The graphed paths differ by ~1 %: measured in alternating rounds, so drift over the run hits each alike.
        graphed_paths = {"torch.compile reduce-overhead": reduce_overhead,
                         "gearcache + CUDA graphs": graphed.cached_decode,
                         "gearcache + CUDA graphs, views": views.cached_decode,
                         "gearcache + CUDA graphs, view-checked": checked.cached_decode}
        samples = {name: {b: [] for b in BATCHES} for name in graphed_paths}
        for _ in range(ROUNDS):
            for name, fn in graphed_paths.items():
                for b in BATCHES:
                    samples[name][b].append(step_us(fn, inputs[b], repeats=4))
        for name in graphed_paths:
            rows[name] = {b: statistics.median(samples[name][b]) for b in BATCHES}
        order = ["eager", "torch.compile", "torch.compile reduce-overhead", "gearcache", *list(graphed_paths)[1:]]
        rows = {name: rows[name] for name in order}
        del views, checked
        # sweep
        before = counters.compiles + counters.traces
        total, padded, real = 0.0, 0, 0
        for b in range(1, 65):
            x, kv, pos = ref.inputs(b, "cuda", dtype)
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits, new_kv = graphed.cached_decode(x, kv, pos)
            torch.cuda.synchronize()
            total += time.perf_counter() - t
            ref_logits, _ = model.decode(x, kv, pos)
            assert logits.shape == ref_logits.shape and new_kv.shape[2] == b
            assert torch.allclose(logits.float(), ref_logits.float(), atol=0.15, rtol=0.05), f"B={b} differs"
            real += b
            padded += next(g for g in GEARS if g >= b)
        sweep_compiles = counters.compiles + counters.traces - before
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    empty = tempfile.mkdtemp()
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(empty, "i"), TRITON_CACHE_DIR=os.path.join(empty, "t"),
               PYTHONPYCACHEPREFIX=os.path.join(tempfile.gettempdir(), "gearcache-pyc"))
    children = {}
    for capture in ("warmup", "first_call"):
        out = subprocess.run([sys.executable, __file__, "--child", capture, "--cache-dir", cache_dir,
                              "--sdpa", opts.sdpa],
                             capture_output=True, text=True, env=env, check=True)
        children[capture] = json.loads(out.stdout.strip().splitlines()[-1])
    warm, lazy = children["warmup"], children["first_call"]

    print(f"decode step, reference decoder bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"attention backends: {opts.sdpa}")
    print(f"{'path':40}" + "".join(f"{'B=' + str(b):>11}" for b in BATCHES) + "   (us per step, median)")
    for name, r in rows.items():
        print(f"{name:40}" + "".join(f"{r[b]:>11.0f}" for b in BATCHES))
    g, t, ro = rows["gearcache + CUDA graphs"], rows["torch.compile"], rows["torch.compile reduce-overhead"]
    v, vc = rows["gearcache + CUDA graphs, views"], rows["gearcache + CUDA graphs, view-checked"]
    print(f"\nB=1: gearcache + CUDA graphs is {t[1] / g[1]:.2f}x torch.compile, {ro[1] / g[1]:.2f}x its "
          f"reduce-overhead (views: {t[1] / v[1]:.2f}x and {ro[1] / v[1]:.2f}x; view-checked, reduce-overhead's own "
          f"output contract: "
          f"{ro[1] / vc[1]:.2f}x)")
    print("step time over reduce-overhead's, B=1 / 8 / 32 (below 1: faster): "
          + "; ".join(f"{name.replace('gearcache + CUDA graphs', 'graphs')} "
                      + " / ".join(f"{r[b] / ro[b]:.3f}" for b in BATCHES)
                      for name, r in (("copies", g), ("views", v), ("view-checked", vc))))
    print(f"gearcache warm-up of {len(GEARS)} gears (compile or load): {warmup_s:.1f} s; "
          f"then loading + capturing the {len(GEARS)} graphs: {capture_s:.2f} s "
          f"(capture alone {capture_only:.2f} s, compiles {counters.compiles - c0}), "
          f"GPU memory reserved by them {graph_mem / 2**20:.0f} MiB")
    print(f"batch sweep 1..64 with CUDA graphs: {sweep_compiles} compiles after warm-up, {total:.3f} s of calls, "
          f"padding waste {padded / real:.2f}x; every output equal to eager (bf16 tolerance)")
    print(f"warm start, fresh process, empty Inductor/Triton caches: every gear loaded and captured in "
          f"{warm['warm_all_gears_s']:.2f} s (loads {warm['counters']['loads']}, of which through run plans "
          f"{warm['counters']['direct_loads']}; compiles {warm['counters']['compiles']}, traces "
          f"{warm['counters']['traces']}, captures {warm['counters']['graph_captures']}, capture alone "
          f"{warm['counters']['capture_seconds']:.2f} s, warm-up runs {warm['counters']['graph_warmups']}, "
          f"loading alone "
          f"{warm['counters']['load_seconds']:.2f} s; torch's compiler imported: {warm['compiler_imported']}); then "
          f"the first call at B=1 {warm['first_call_b1_s'] * 1e3:.1f} ms")
    print(f"the same with capture_graphs='first_call': every gear loaded in {lazy['warm_all_gears_s']:.2f} s "
          f"(captures {lazy['counters']['graph_captures'] - 1} at warm-up); the first call at B=1, which captures its "
          f"gear, {lazy['first_call_b1_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
