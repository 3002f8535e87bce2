"""gearcache beside torch's own precompile (``aot_compile``): the same module, a warm start in a fresh process and
the time of one call, side by side in one run.

    python benchmarks/precompile.py [--device cuda|cpu] [--calls N] [--out FILE]

Each path runs in a fresh process (benchmarks/_first_call.py) with EMPTY Inductor and Triton cache folders of its
own, so nothing but the path's own artifact carries over:
  1. torch ``aot_compile``: ``torch.compile(model.decode, fullgraph=True).aot_compile(...)`` then
     ``save_compiled_function`` (the cold process, not compared);
  2. torch ``aot_compile``, warm: ``torch.compiler.load_compiled_function`` and the first call, guards checked;
  3. the same with ``disable_guard_check()`` (torch's fastest call, with no check at all);
  4. gearcache, cold: an empty gearcache folder (not compared);
  5. gearcache, warm: the folder of 4.
"first call" runs from just before the load to the device synchronising after the first output; "per call" is the
median wall time of one call over ``--calls`` calls (the device synchronised around the timed calls only). Every
path's first output is compared with eager in its process. On CUDA the model is the reference decoder (hidden
1024, 8 layers, bf16, decode B=1); on CPU a small one (hidden 256, 2 layers, fp32).
"""
import argparse
import json
import os
import shutil
import tempfile

from warm_start import _has_cuda, run

ROWS = [("torch aot_compile, cold (compile + save)", "aot-save", "a1"),
        ("torch aot_compile, warm (load, guards on)", "aot-load", "a2"),
        ("torch aot_compile, warm (guards off)", "aot-load-unguarded", "a3"),
        ("gearcache, cold (empty folder)", "gearcache", "g1"),
        ("gearcache, warm (empty Inductor/Triton caches)", "gearcache", "g2")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    ap.add_argument("--calls", type=int, default=2000, help="calls timed per path (default 2000)")
    ap.add_argument("--out", help="also write the results as JSON here")
    opts = ap.parse_args()
    env = {"GEARCACHE_BENCH_CALLS": str(opts.calls)}
    if opts.device != "cuda":
        env.update({"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000"})
    work = tempfile.mkdtemp(prefix="gearcache-precompile-")
    run("compile", work, opts.device, os.path.join(work, "throwaway"), env)      # fills the bytecode cache only
    results = {}
    for name, variant, caches in ROWS:
        results[name] = run(variant, work, opts.device, os.path.join(work, caches), env)
    shutil.rmtree(work, ignore_errors=True)
    _print(opts.device, results)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)


def _print(device: str, results: dict) -> None:
    print(f"\nprecompiled warm start beside torch's aot_compile, {device}: each path a fresh process, empty caches")
    print(f"{'path':48} {'first call':>11} {'start to 1st output':>20} {'per call':>10} {'max |d| vs eager':>17} "
          f"{'compiler imported':>18}")
    for name, r in results.items():
        print(f"{name:48} {r['first_call_s']:>9.3f} s {r['process_to_first_output_s']:>18.2f} s "
              f"{r['call_p50_us']:>7.1f} us {r['max_abs_diff_vs_eager']:>17.2e} {str(r['compiler_imported']):>18}")
    aot, fast, gc = (results[ROWS[i][0]] for i in (1, 2, 4))
    print(f"\nwarm first call: gearcache {gc['first_call_s']:.3f} s vs aot_compile {aot['first_call_s']:.3f} s "
          f"({aot['first_call_s'] / gc['first_call_s']:.1f}x); per call: gearcache {gc['call_p50_us']:.1f} us vs "
          f"aot_compile {aot['call_p50_us']:.1f} us with guards, {fast['call_p50_us']:.1f} us without")


if __name__ == "__main__":
    main()
