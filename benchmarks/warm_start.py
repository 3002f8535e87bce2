"""Warm-start benchmark: first-call time of a fresh process, side by side in one run.

    python benchmarks/warm_start.py [--device cuda|cpu] [--out FILE]

Paths, each in its own fresh process. "first call" is timed from just before the first call to the device
synchronising; "setup" (imports, CUDA init, building the model and moving it to the device) is reported beside it,
and "start to 1st output" is the whole process up to the first result.
  1. torch.compile, cold: empty Inductor and Triton caches;
  2. torch.compile, warm: the Inductor and Triton cache folders of run 1 kept;
  3. Mega-Cache: save_cache_artifacts() after a cold compile, load_cache_artifacts() into empty cache folders;
  4. gearcache, cold: an empty gearcache folder (traces, compiles, publishes);
  5. gearcache, warm: the folder of run 4, with EMPTY Inductor and Triton cache folders.
On CUDA the model is the reference decoder (hidden 1024, 8 layers, bf16, decode B=1); on CPU a small one
(hidden 256, 2 layers, fp32). A throwaway process first fills Python's bytecode cache so no path pays for it.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(variant: str, workdir: str, device: str, caches: str, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(env_extra)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(workdir, "pycache")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_first_call.py"), variant, workdir, device],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--repeat-warm", type=int, default=0, metavar="N",
                    help="N more gearcache warm processes (fresh, empty torch caches): their first calls and the "
                         "median of all warm first calls (a noisy host moves one process by tens of ms)")
    opts = ap.parse_args()
    small = {} if opts.device == "cuda" else {"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000"}
    work = tempfile.mkdtemp(prefix="gearcache-bench-")
    fresh = lambda name: os.path.join(work, name)          # noqa: E731 - a new, empty cache root
    rows = []
    run("compile", work, opts.device, fresh("throwaway"), small)          # fills the bytecode cache only
    rows.append(("torch.compile, cold (empty caches)", run("compile", work, opts.device, fresh("c1"), small)))
    rows.append(("torch.compile, Inductor+Triton caches kept", run("compile", work, opts.device, fresh("c1"), small)))
    run("megacache-save", work, opts.device, fresh("c2"), small)
    rows.append(("torch.compile + Mega-Cache, empty caches",
                 run("megacache-load", work, opts.device, fresh("c3"), small)))
    rows.append(("gearcache, cold (empty folder)",
                 run("gearcache", work, opts.device, fresh("c4"), {**small, "GEARCACHE_BENCH_CALLS": "10"})))
    warm = run("gearcache", work, opts.device, fresh("c5"), small)
    rows.append(("gearcache, warm (empty Inductor/Triton caches)", warm))
    again = [run("gearcache", work, opts.device, fresh(f"c6-{i}"), {**small, "GEARCACHE_BENCH_CALLS": "10"})
             for i in range(opts.repeat_warm)]
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nwarm start, {opts.device}: each path in a fresh process")
    print(f"{'path':48} {'first call':>11} {'setup':>8} {'start to 1st output':>20}")
    for name, r in rows:
        print(f"{name:48} {r['first_call_s']:>9.3f} s {r['setup_s']:>6.2f} s "
              f"{r['process_to_first_output_s']:>18.2f} s")
    best_torch = min(r["first_call_s"] for name, r in rows[1:3])
    print(f"\ngearcache warm vs torch's best warm path: {best_torch / warm['first_call_s']:.1f}x faster")
    if again:
        firsts = [warm["first_call_s"]] + [r["first_call_s"] for r in again]
        print(f"gearcache warm first calls of {len(firsts)} fresh processes: "
              f"{', '.join(f'{x:.3f}' for x in firsts)} s; median {statistics.median(firsts):.3f} s "
              f"({best_torch / statistics.median(firsts):.1f}x torch's best warm path)")
        rows.append(("gearcache, warm, repeated", {"first_calls_s": firsts, "median_s": statistics.median(firsts)}))
    print(f"gearcache warm counters: {warm['counters']}")
    print(f"gearcache warm process imported torch's compiler before its first output: "
          f"{warm['compiler_imported']}")
    n = os.environ.get('GEARCACHE_BENCH_CALLS', 10000)
    print(f"per call p50 over {n} calls: loaded entry {warm['entry_call_p50_us']:.1f} us, its compiled callable "
          f"directly {warm['direct_call_p50_us']:.1f} us, "
          f"overhead {warm['entry_call_p50_us'] - warm['direct_call_p50_us']:.1f} us")
    if "wrapper_call_p50_us" in warm:
        print(f"per call p50 over {n} calls: Inductor's generated call() directly "
              f"{warm['wrapper_call_p50_us']:.1f} us, "
              f"loaded entry above it (median of paired differences) {warm['entry_call_vs_wrapper_p50_us']:.1f} us; "
              f"the same artifact loaded by torch's loader {warm['torch_loaded_call_p50_us']:.1f} us")
    print(f"gearcache dispatch glue alone (signature key, table lookup, gather inputs, build result), p50: "
          f"{warm['dispatch_glue_p50_us']:.2f} us")
    if "run_plan_own_p50_us" in warm:
        print(f"run plan's own per-call work (alignment and grad checks around call()), p50: "
              f"{warm['run_plan_own_p50_us']:.2f} us; overhead above Inductor's call(): "
              f"{warm['dispatch_glue_p50_us'] + warm['run_plan_own_p50_us']:.2f} us")
    if "step_us" in warm:
        print(f"decode step (CUDA events, mean of 100): {warm['step_us']:.0f} us")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
