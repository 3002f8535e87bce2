"""Warm first call of the reference decoder, the tree in .old/ against this one, in one run (fresh processes).

    python3 scripts/warm_old_new.py [cuda|cpu] [rounds]

Each tree fills its own gearcache folder once (cold), then warm processes alternate old, new, old, new ... each with
EMPTY Inductor/Triton caches (benchmarks/_first_call.py's "gearcache" variant). The last round of each tree runs
under cProfile (GEARCACHE_BENCH_PROFILE=1); its table is written to $OUT/profile-<tree>.txt.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_call(tree: str, work: str, device: str, caches: str, profile: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"PYTHONPYCACHEPREFIX": os.path.join(work, "pycache"), "GEARCACHE_BENCH_CALLS": "200",
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
                "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
                "PYTHONPATH": tree + os.pathsep + env.get("PYTHONPATH", "")})
    if device != "cuda":
        env.update({"A_D": "256", "A_H": "4", "A_L": "2", "A_V": "1000"})
    if profile:
        env["GEARCACHE_BENCH_PROFILE"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "_first_call.py"), "gearcache", work,
                           device], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if profile:
        with open(os.path.join(os.environ.get("OUT", "."), f"profile-{os.path.basename(tree)}.txt"), "w") as f:
            f.write(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    trees = {"old": os.path.join(ROOT, ".old"), "new": ROOT}
    works = {name: tempfile.mkdtemp(prefix=f"warm-{name}-") for name in trees}
    for name, tree in trees.items():
        r = first_call(tree, works[name], device, os.path.join(works[name], "cold"))
        print(name, "cold first call", round(r["first_call_s"], 3), "s", flush=True)
    times: dict = {name: [] for name in trees}
    for i in range(rounds):
        for name, tree in trees.items():
            r = first_call(tree, works[name], device, os.path.join(works[name], f"warm{i}"), profile=i == rounds - 1)
            times[name].append(r["first_call_s"])
            print(name, "warm", i, round(r["first_call_s"], 4), "s; to 1st output",
                  round(r["process_to_first_output_s"], 2), "s; max |d|", r["max_abs_diff_vs_eager"], flush=True)
    for name, ts in times.items():
        plain = ts[:-1] or ts
        print(f"{name}: warm first call median {statistics.median(plain):.4f} s over {len(plain)} (profiled run "
              f"{ts[-1]:.4f} s)")


if __name__ == "__main__":
    main()
