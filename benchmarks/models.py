"""Model corpus benchmark: every corpus model (benchmarks/corpus.py) cold, warm and eager, each in a fresh process.

    python benchmarks/models.py [--device cpu|cuda] [--models llama,bert,...] [--dtype float32|bfloat16]
                                [--size tiny|small] [--json PATH] [--cold-jobs N]

For each model, three fresh processes with empty Inductor and Triton caches of their own:
  cold   gearcache on an empty store: traces, compiles, publishes every entry;
  warm   gearcache on the cold run's store: loads every entry;
  eager  the plain transformers model, no gearcache (it pays library initialisation, e.g. cuBLAS, too).
The workload is the one a server runs (corpus.py): causal LMs call generate() twice (enable(model); greedy, then
sampling); encoders run a batch of every gear, then one padded up. "first calls" is the time of the calls that
reach an entry for the first time, summed (each to the device synchronising): for a causal LM its first generate()
(prefill and decode entries), for an encoder the first call of each gear. Columns:
  entries      entries the warm process loaded;  run plans: how many of them loaded through a run plan
               (counters.direct_loads), i.e. without torch's compiler;
  warm/eager/cold first calls (s); max |diff| of the warm process's outputs against eager on the same inputs;
  tokens       causal LMs: the warm process's greedy tokens equal transformers' generate(cache_implementation=
               "static") (eager) token for token (required for "all ok" in float32 only: in bfloat16 random
               weights give near-tied logits, and the logits are compared by max |diff| on the same tokens).
Exit status 0 when every model's warm process compiled nothing and loaded every entry through a run plan.
Defaults: CPU, float32, tiny configs; on CUDA bfloat16 and small configs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402


def run(name: str, variant: str, store: str, opts, caches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(HERE, "_model_start.py"), name, variant, store, opts.device, opts.dtype,
           opts.size]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200], "stderr": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cold_start(name: str, opts, work: str) -> dict:
    return run(name, "gearcache", os.path.join(work, name, "store"), opts, os.path.join(work, name, "cold"))


def one_model(name: str, opts, work: str, cold: dict) -> dict:
    store = os.path.join(work, name, "store")
    fresh = lambda label: os.path.join(work, name, label)      # noqa: E731 - empty torch cache folders per process
    warm = run(name, "gearcache", store, opts, fresh("warm")) if "error" not in cold else cold
    eager = run(name, "eager", store, opts, fresh("eager"))
    return {"model": name, "kind": corpus.CORPUS[name].kind, "cold": cold, "warm": warm, "eager": eager}


def row(r: dict) -> str:
    cold, warm, eager = r["cold"], r["warm"], r["eager"]
    if "error" in warm:
        return f"{r['model']:16} FAILED: {warm['error']}"
    c = warm["counters"]
    tokens = {True: "equal", False: "DIFFER"}.get(warm.get("tokens_match_generate"), "-")
    return (f"{r['model']:16} {c['loads']:>7} {c['direct_loads']:>9} {warm['first_calls_s']:>10.3f} "
            f"{eager.get('first_calls_s', float('nan')):>10.3f} {cold['first_calls_s']:>10.2f} "
            f"{warm['max_abs_diff']:>10.2e} {tokens:>7}   (cold compiled {cold['counters']['compiles']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=",".join(corpus.CORPUS),
                    help=f"comma-separated, from: {', '.join(corpus.CORPUS)} (default: all)")
    ap.add_argument("--dtype", help="float32 or bfloat16 (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--size", choices=["tiny", "small", "gpu"],
                    help="model configs (default: tiny on cpu, small on cuda)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--cold-jobs", type=int, default=1,
                    help="cold starts of that many models at once, before the warm and eager starts (which always "
                         "run one at a time); cold first-call times are then not comparable")
    opts = ap.parse_args(argv)
    names = [n.strip() for n in opts.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in corpus.CORPUS]
    if unknown:
        ap.error(f"--models: unknown model(s) {unknown}; known: {', '.join(corpus.CORPUS)}")
    opts.dtype = opts.dtype or ("bfloat16" if opts.device == "cuda" else "float32")
    opts.size = opts.size or ("small" if opts.device == "cuda" else "tiny")
    work = tempfile.mkdtemp(prefix="gearcache-models-")
    results = []
    print(f"corpus, {opts.device}, {opts.dtype}, {opts.size} configs; each start a fresh process\n")
    print(f"{'model':16} {'entries':>7} {'run plans':>9} {'warm 1st':>10} {'eager 1st':>10} {'cold 1st':>10} "
          f"{'max|diff|':>10} {'tokens':>7}")
    try:
        colds = {}
        if opts.cold_jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(opts.cold_jobs) as pool:
                colds = dict(zip(names, pool.map(lambda n: cold_start(n, opts, work), names)))
        for name in names:
            r = one_model(name, opts, work, colds.get(name) or cold_start(name, opts, work))
            results.append(r)
            print(row(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    exact = opts.dtype == "float32"          # bf16 greedy tokens may part from eager's on near-tied logits
    ok = all("error" not in r["warm"] and r["warm"]["counters"]["compiles"] == 0
             and r["warm"]["counters"]["direct_loads"] == r["warm"]["counters"]["loads"] > 0
             and (r["warm"].get("tokens_match_generate", True) or not exact) for r in results)
    print("\nfirst calls in seconds; entries and run plans from the warm process; all ok (warm: nothing compiled, "
          f"every entry through a run plan{', tokens equal' if exact else ''}):", ok)
    if opts.json:
        import torch

        with open(opts.json, "w") as f:
            json.dump({"device": opts.device, "dtype": opts.dtype, "size": opts.size, "torch": torch.__version__,
                       "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
