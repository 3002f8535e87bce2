"""transformers ``generate()`` served by gearcache (``enable(model)``) against eager and torch.compile, per model.

    python3 benchmarks/generate.py [--device cpu|cuda] [--size tiny|small|gpu] [--models llama,gemma3,...]
                                   [--dtype float32|bfloat16] [--graphs] [--background] [--regions]
                                   [--layers N] [--sweep-only] [--json PATH]

Every start is a fresh process with empty Inductor and Triton caches of its own. Per model (benchmarks/corpus.py
configs, batch 1, static cache):
  sweep        a prompt-length sweep: 6 generate() calls with distinct prompt lengths <= 64 and 64 decode steps in
               all; its total wall time in a cold process, for gearcache (empty store: compiles its gears) and for
               torch.compile (transformers' own: generate() compiles the decode step of a static cache; prefill eager);
               with --background also gearcache with on_new_signature="background" (a store of its own: the sweep
               runs eagerly while its entries compile in a worker), the time until every entry is compiled and
               the sweep twice more once they are (with --graphs also under mode="reduce-overhead");
  first        the first generate() of a warm gearcache process (the sweep's store) and of an eager process;
  per_token_ms (generate(64 new tokens) - generate(1 new token)) / 63, after a warm-up: eager, torch.compile,
               gearcache, and with --graphs gearcache with mode="reduce-overhead" (CUDA graphs per gear, the same
               store's entries);
  step_loop_ms a bare greedy decode loop's per-token time through the served forward (gearcache variants);
  regions      with --regions, gearcache with ``enable(model, regions="blocks")`` too (a store of its own: one entry
               per distinct decoder layer and gear), cold and warm, beside the whole-step gearcache; with --regions
               --background also regions under on_new_signature="background" (the sweep eager while one entry per
               distinct layer and gear compiles in the workers, side by side: gearcache-regions-background);
  --layers N   the models built with N decoder layers (cold time against the layer count); --sweep-only: the cold
               sweeps and first generate() only (no warm, eager or per-token runs).
  step_phases_us  with --breakdown: where a decode step's host time goes, per step, through generate() and through
               the bare loop (benchmarks/step_breakdown.py): gearcache's share (bind, forward, dispatch), the
               compiled step or graph replay, transformers' share (prepare, rest). Its timers wrap the model's
               methods, and per_token_ms and step_loop_ms are then measured with them in place: compare those only
               with runs made the same way.
  --per-token-only  no sweep: eager, gearcache and with --graphs gearcache with graphs: per token and the step loop
               (and the breakdown with --breakdown) only; a short device run.
  max_reserved_mib  torch.cuda.max_memory_reserved() of each process (CUDA).
Prints one JSON object (and writes it to --json).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEP = [(5, 11), (11, 11), (19, 11), (29, 11), (41, 10), (60, 10)]     # (prompt length, new tokens): 64 steps


def child(name: str, variant: str, store: str, device: str, dtype: str, size: str) -> dict:
    """One process: build the model, run the variant, return its timings."""
    sys.path.insert(0, HERE)
    import torch

    import corpus

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    layers = int(os.environ.get("GEARCACHE_BENCH_LAYERS", "0"))
    if layers:
        dims = corpus._lm_dims
        corpus._lm_dims = lambda size: {**dims(size), "layers": layers}
    torch.manual_seed(0)
    lm = corpus.CORPUS[name].build(size).to(device, getattr(torch, dtype)).eval()
    lm.generation_config.eos_token_id = None
    options = dict(cache_implementation="static", pad_token_id=0, do_sample=False, disable_compile=True)
    if variant.startswith("gearcache"):
        from gearcache import CompilerConfig
        from gearcache.integrations.transformers import enable

        config = {"gearcache-graphs": CompilerConfig(mode="reduce-overhead"),
                  "gearcache-background": CompilerConfig(on_new_signature="background"),
                  "gearcache-background-graphs": CompilerConfig(on_new_signature="background",
                                                                mode="reduce-overhead"),
                  "gearcache-regions-background": CompilerConfig(on_new_signature="background")}.get(variant)
        try:
            regions = "blocks" if variant.startswith("gearcache-regions") else "whole"
            enable(lm, cache_dir=store, config=config, regions=regions)
        except Exception as exc:                       # noqa: BLE001 - reported, e.g. graphs refused for now
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    elif variant == "torch.compile":
        from transformers import CompileConfig

        compile_config = CompileConfig()
        compile_config._compile_all_devices = True     # transformers compiles on CUDA only unless told
        options.update(disable_compile=False, compile_config=compile_config)
    gen = torch.Generator().manual_seed(1)

    def generate(length: int, new: int) -> float:
        ids = torch.randint(1, lm.config.vocab_size, (1, length), generator=gen).to(device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **options)
        sync()
        return time.perf_counter() - t0

    profile_path = os.environ.get("GEARCACHE_BENCH_PROFILE")     # cProfile of the first generate(), for its cost
    if os.environ.get("GEARCACHE_BENCH_PER_TOKEN_ONLY"):
        return per_token(lm, generate, variant, device, sync, {})
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        out = {"first_generate_s": profiler.runcall(generate, *SWEEP[0])}
        profiler.dump_stats(profile_path)
    else:
        out = {"first_generate_s": generate(*SWEEP[0])}
    out["sweep_s"] = out["first_generate_s"] + sum(generate(*call) for call in SWEEP[1:])
    if "background" in variant:    # the sweep was served; now wait until every entry is compiled
        from gearcache import wait_for_background_compiles

        from gearcache import counters as served

        out["counters_served"] = {k: getattr(served, k) for k in ("traces", "compiles", "eager_calls")}
        t0 = time.perf_counter()
        out["settled"] = wait_for_background_compiles()
        out["all_compiled_s"] = out["sweep_s"] + time.perf_counter() - t0
        # the same sweep twice more, compiled (graphs: the first of them captures each gear's graph)
        out["again_sweep_s"] = [sum(generate(*call) for call in SWEEP) for _ in range(2)]
    if variant.startswith("gearcache"):
        from gearcache import counters

        counters_after_sweep = {k: getattr(counters, k) for k in ("traces", "compiles", "loads", "graph_captures",
                                                                  "load_seconds", "compile_seconds")}
    if os.environ.get("GEARCACHE_BENCH_SWEEP_ONLY"):  # the sweep and first generate() only (a short device run)
        if variant.startswith("gearcache"):
            out["counters_after_sweep"] = counters_after_sweep
        return out
    if variant.startswith("gearcache"):
        out["counters_after_sweep"] = counters_after_sweep
    return per_token(lm, generate, variant, device, sync, out)


def per_token(lm, generate, variant: str, device: str, sync, out: dict) -> dict:
    """per_token_ms, step_loop_ms (gearcache variants) and with --breakdown step_phases_us, into ``out``."""
    import torch

    breakdown = os.environ.get("GEARCACHE_BENCH_BREAKDOWN")
    phases = None
    if breakdown:
        from step_breakdown import Phases

        phases = Phases.install(lm)
    generate(16, 64), generate(16, 1)                  # warm-up of the timed shapes
    long = min(generate(16, 64) for _ in range(3))
    short = min(generate(16, 1) for _ in range(3))
    out["per_token_ms"] = (long - short) / 63 * 1e3
    if variant.startswith("gearcache") or breakdown:
        out["step_loop_ms"] = step_loop(lm, device, sync)
    if phases is not None:
        phases.refresh()
        timed_long = phases.timed(lambda: generate(16, 64))
        timed_short = phases.timed(lambda: generate(16, 1))
        loop_ns = collections.Counter()
        step_loop(lm, device, sync, rounds=1, timed=lambda run: loop_ns.update(phases.timed(run)))
        out["step_phases_us"] = {"generate": Phases.split(timed_long, timed_short, 63),
                                 "step_loop": Phases.split(loop_ns, collections.Counter(), 64)}
    if device == "cuda":
        out["max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def step_loop(lm, device: str, sync, rounds: int = 3, timed=None) -> float:
    """Per-token time of a bare greedy decode loop (the model's forward on a StaticCache, argmax, next), the floor
    that generate()'s own per-token time is compared with (best of ``rounds``); ``timed(run)`` runs the 64 decode
    steps (``run()``) under the breakdown's timers."""
    import torch
    from transformers import StaticCache

    from gearcache.integrations import hf_compat

    kw = hf_compat.cache_keyword(lm)
    best = float("inf")
    for _ in range(rounds):
        cache = StaticCache(config=lm.config, max_cache_len=256)
        ids = torch.ones(1, 16, dtype=torch.long, device=device)
        with torch.inference_mode():
            first = lm(input_ids=ids, **{kw: cache}).logits[:, -1:].argmax(-1)

            def run(tok=first, cache=cache):
                for _ in range(64):
                    tok = lm(input_ids=tok, **{kw: cache}).logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            (timed or (lambda f: f()))(run)
            sync()
        best = min(best, (time.perf_counter() - t0) / 64 * 1e3)
    return best


def entry_compile_times(store: str) -> list[dict]:
    """Each entry of ``store`` (``gearcache ls --json``): its method, signature and compile seconds (for regions: one
    entry per distinct block and gear)."""
    done = subprocess.run([sys.executable, "-m", "gearcache.cli", "ls", "--cache-dir", store, "--json"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return [{"error": done.stderr[-300:]}]
    rows = json.loads(done.stdout)
    rows = rows.get("entries", rows) if isinstance(rows, dict) else rows
    return [{k: r.get(k) for k in ("method", "signature", "compile_seconds")} for r in rows]


def start(name: str, variant: str, store: str, opts, work: str) -> dict:
    caches = tempfile.mkdtemp(dir=work)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
           "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, variant, store, opts.device, opts.dtype,
           opts.size]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def per_token_runs(name: str, store: str, opts, work: str) -> dict:
    """--per-token-only: eager, gearcache (its entries compiled by its warm-up) and with --graphs gearcache with CUDA
    graphs on the same entries; per token, the bare step loop and the per-step breakdown of each."""
    variants = ["eager", "gearcache"] + (["gearcache-graphs"] if opts.graphs else [])
    runs = {v: start(name, v, store, opts, work) for v in variants}
    pick = lambda key: {v: runs[v].get(key, runs[v].get("error")) for v in variants}   # noqa: E731
    out = {"per_token_ms": pick("per_token_ms"), "step_loop_ms": pick("step_loop_ms"),
           "step_phases_us": pick("step_phases_us")}
    out["generate_over_step_loop"] = {v: round(runs[v]["per_token_ms"] / runs[v]["step_loop_ms"], 3)
                                      for v in variants if "per_token_ms" in runs[v] and runs[v].get("step_loop_ms")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", choices=["tiny", "small", "gpu"])
    ap.add_argument("--models", default="llama,mistral_sliding,gemma3")
    ap.add_argument("--dtype")
    ap.add_argument("--graphs", action="store_true", help="also gearcache with mode='reduce-overhead'")
    ap.add_argument("--background", action="store_true",
                    help="also a cold sweep with on_new_signature='background' (eager while compiling)")
    ap.add_argument("--regions", action="store_true", help="also gearcache with regions='blocks'")
    ap.add_argument("--layers", type=int, help="build the models with this many decoder layers")
    ap.add_argument("--sweep-only", action="store_true", help="cold sweeps and first generate() only")
    ap.add_argument("--cold-variants", help="the whole-step cold runs to make, of gearcache,torch.compile,"
                                            "gearcache-background (default all; e.g. torch.compile with --regions "
                                            "--sweep-only: the layer count's growth without the whole step's long "
                                            "compiles)")
    ap.add_argument("--breakdown", action="store_true", help="where a decode step's host time goes (step_phases_us)")
    ap.add_argument("--per-token-only", action="store_true",
                    help="per token, the step loop and the breakdown only (no sweeps, no cold/warm starts)")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    wanted = (lambda v: True) if not opts.cold_variants else (lambda v: v in opts.cold_variants.split(","))
    if opts.child:
        print(json.dumps(child(*opts.child)))
        return 0
    if opts.layers:
        os.environ["GEARCACHE_BENCH_LAYERS"] = str(opts.layers)
    if opts.sweep_only:
        os.environ["GEARCACHE_BENCH_SWEEP_ONLY"] = "1"
    if opts.breakdown:          # timers wrapped around the model's methods: the per-token figures then include them
        os.environ["GEARCACHE_BENCH_BREAKDOWN"] = "1"
    if opts.per_token_only:
        os.environ["GEARCACHE_BENCH_PER_TOKEN_ONLY"] = "1"
    opts.size = opts.size or ("gpu" if opts.device == "cuda" else "tiny")
    opts.dtype = opts.dtype or ("bfloat16" if opts.device == "cuda" else "float32")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gearcache-generate-") as work:
        for name in [n.strip() for n in opts.models.split(",") if n.strip()]:
            store = os.path.join(work, name)
            if opts.per_token_only:
                results[name] = per_token_runs(name, store, opts, work)
                continue
            runs = {v: start(name, v, store, opts, work) for v in ("gearcache", "torch.compile")   # cold
                    if wanted(v)}
            if opts.regions:        # cold too: a store of its own
                runs["gearcache-regions"] = start(name, "gearcache-regions", store + "-regions", opts, work)
                runs["gearcache-regions"]["entries"] = entry_compile_times(store + "-regions")
            if opts.background and wanted("gearcache-background"):     # cold too: a store of its own
                runs["gearcache-background"] = start(name, "gearcache-background", store + "-background", opts, work)
            if opts.background:
                if opts.regions:
                    runs["gearcache-regions-background"] = start(name, "gearcache-regions-background",
                                                                 store + "-regions-background", opts, work)
                if opts.graphs:
                    runs["gearcache-background-graphs"] = start(name, "gearcache-background-graphs",
                                                                store + "-background-graphs", opts, work)
            if not opts.sweep_only:
                runs["gearcache-warm"] = start(name, "gearcache", store, opts, work)
                runs["eager"] = start(name, "eager", store, opts, work)
                if opts.regions:
                    runs["gearcache-regions-warm"] = start(name, "gearcache-regions", store + "-regions", opts, work)
            if opts.graphs:
                runs["gearcache-graphs"] = start(name, "gearcache-graphs", store, opts, work)   # same entries
            get = lambda v, k, runs=runs: runs.get(v, {}).get(k, runs.get(v, {}).get("error"))   # noqa: E731
            results[name] = {
                "cold_sweep_s": {"gearcache": get("gearcache", "sweep_s"),
                                 "torch.compile": get("torch.compile", "sweep_s"),
                                 **({"gearcache-regions": get("gearcache-regions", "sweep_s")} if opts.regions else {}),
                                 **({"gearcache-background": get("gearcache-background", "sweep_s"),
                                     "gearcache-background_all_compiled": get("gearcache-background",
                                                                              "all_compiled_s")}
                                    if opts.background else {}),
                                 **({"gearcache-regions-background": get("gearcache-regions-background", "sweep_s"),
                                     "gearcache-regions-background_all_compiled": get(
                                         "gearcache-regions-background", "all_compiled_s")}
                                    if opts.background and opts.regions else {}),
                                 **({"gearcache-background-graphs": get("gearcache-background-graphs", "sweep_s"),
                                     "gearcache-background-graphs_all_compiled": get("gearcache-background-graphs",
                                                                                     "all_compiled_s")}
                                    if opts.background and opts.graphs else {})},
                "again_sweep_s": {v: runs[v]["again_sweep_s"] for v in runs if "again_sweep_s" in runs[v]},
                "regions_entries": runs.get("gearcache-regions", {}).get("entries"),
                "cold_counters": {v: runs[v].get("counters_after_sweep") for v in runs
                                  if v in ("gearcache", "gearcache-regions", "gearcache-background",
                                           "gearcache-background-graphs", "gearcache-regions-background")},
                "first_generate_s": {"gearcache_warm": get("gearcache-warm", "first_generate_s"),
                                     "eager": get("eager", "first_generate_s"),
                                     **({"gearcache_regions_warm": get("gearcache-regions-warm", "first_generate_s"),
                                         "cold": {v: get(v, "first_generate_s") for v in
                                                  ("gearcache", "gearcache-regions", "torch.compile")}}
                                        if opts.regions else {})},
                "per_token_ms": {v: get(v, "per_token_ms") for v in runs
                                 if v not in ("gearcache", "gearcache-regions")},
                "step_loop_ms": {v: runs[v]["step_loop_ms"] for v in ("gearcache-warm", "gearcache-graphs",
                                                                      "gearcache-regions-warm")
                                 if "step_loop_ms" in runs.get(v, {})},
                "max_reserved_mib": {v: runs[v]["max_reserved_mib"] for v in runs if "max_reserved_mib" in runs[v]},
            }
    import torch

    report = {"device": opts.device, "size": opts.size, "dtype": opts.dtype, "torch": torch.__version__,
              "layers": opts.layers or "default",
              "sweep": SWEEP, "results": results}
    print(json.dumps(report, indent=1))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
