"""Pipeline-parallel decoder benchmark on 4 GPUs: 2 pipeline stages x TP 2, cold start, warm start of all 4 ranks.

    python benchmarks/pp_decoder.py                          # both phases; prints the targets and a JSON summary last
    python benchmarks/pp_decoder.py --device cpu --toy --gears 1,2,4 --prompt-len 4 --new-tokens 3   # CPU smoke run

The model and one start are examples/pp_decoder.py's: the reference decoder (hidden 1024, 16 heads, 8 layers, bf16)
cut into 2 stages of 4 layers, each sharded over a TP group of 2, activations sent between stages, each stage's
``prefill`` and ``decode`` cached under its ``pp_rank`` in one shared folder, batch gears 1..64,
``mode="reduce-overhead"`` on GPU. Each phase is a fresh ``torchrun`` job with empty Inductor and Triton caches:

- cold: every gear of both methods of each stage compiled (each stage's graphs once for its two TP ranks) and
  captured, then ``--new-tokens`` tokens generated through the pipeline;
- warm: per rank, from a barrier, the stage's first decode call at B=1 and every gear of both methods loaded and
  captured (the warm start), then the same generation;
- eager start: the floor under the warm start, a third fresh job in which the same calls are made by each stage's
  eager methods (the first uses of cuBLAS, the attention and every kernel that any process pays).

Targets (issue #38): warm start (every gear loaded and captured) <= 0.3 s on every rank, the tokens equal to the
unsplit eager model's (also reported: equal to the split eager model's, which differs from the unsplit one only by
the order of bf16 sums), 0 compiles in the warm job. ``--out-dir`` keeps the summary and, for a rank still running
after ``--stack-dump-s`` seconds (a hang), its threads' stacks, and ``warm-timelines.txt`` each warm rank's warm-up
timelines (gearcache/timeline.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "pp_decoder.py")
TARGET_WARM_START_S = 0.3


def _example():
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    spec = importlib.util.spec_from_file_location("pp_decoder", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pp_decoder"] = module          # the cached methods' names: pp_decoder.Stage.*, as in the example
    spec.loader.exec_module(module)
    return module


def child(argv: list[str]) -> None:
    """One start under torchrun: the example's, with this rank's stacks dumped if it hangs."""
    import faulthandler

    ex = _example()
    stacks = os.environ.get("GEARCACHE_BENCH_STACKS")
    if stacks:
        f = open(os.path.join(stacks, f"stacks-rank{os.environ.get('RANK', 0)}.txt"), "w")
        faulthandler.dump_traceback_later(float(os.environ.get("GEARCACHE_BENCH_STACK_S", "240")), repeat=True,
                                          file=f)
    out = ex.one_start(ex.parse_args(argv))
    faulthandler.cancel_dump_traceback_later()
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(out), flush=True)


def run_phase(ex, args, label: str, out_dir: str, stack_s: float, extra: tuple[str, ...] = ()) -> dict:
    from fresh_process import run_fresh

    stacks = os.path.join(out_dir, label.replace(" ", "-"))
    os.makedirs(stacks, exist_ok=True)
    os.environ.update(GEARCACHE_BENCH_STACKS=stacks, GEARCACHE_BENCH_STACK_S=str(stack_s))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--child", *ex.child_flags(args), *extra]
    report = run_fresh(cmd, label)
    for name in os.listdir(stacks):          # an empty file: that rank never hung
        if os.path.getsize(os.path.join(stacks, name)) == 0:
            os.remove(os.path.join(stacks, name))
    return report


def summarize(args, cold: dict, warm: dict, eager: dict) -> dict:
    w = warm["ranks"]
    floor = {x["rank"]: x for x in eager["ranks"]}
    per_rank = [{"rank": x["rank"], "pp": x["pp"], "tp": x["tp"], "warm_first_call_s": x["first_call_s"],
                 "warm_start_s": x["all_gears_s"], "eager_first_call_s": floor[x["rank"]]["eager_first_call_s"],
                 "eager_start_s": floor[x["rank"]]["eager_all_gears_s"], "tokens_equal_eager": x["tokens_equal_eager"],
                 "tokens_equal_split_eager": x["tokens_equal_split_eager"], "warm_compiles": x["counters"]["compiles"],
                 "cold_compiles": c["counters"]["compiles"]} for x, c in zip(w, cold["ranks"])]
    summary = {"benchmark": "pp_decoder", "nproc": args.nproc, "pp": args.pp, "device": w[0]["device"],
               "gears": args.gears, "toy": args.toy, "cold_process_s": cold["process_s"],
               "warm_process_s": warm["process_s"], "per_rank": per_rank,
               "cold_compiles": sum(x["cold_compiles"] for x in per_rank), "tokens": w[0]["tokens"]}
    summary["targets"] = {
        "warm start <= 0.3 s on every rank": all(x["warm_start_s"] <= TARGET_WARM_START_S for x in per_rank),
        "tokens equal the unsplit eager model (cold and warm, every rank)":
            all(x["tokens_equal_eager"] for r in (cold, warm) for x in r["ranks"]),
        "tokens equal the split eager model (cold and warm, every rank)":
            all(x["tokens_equal_split_eager"] for r in (cold, warm) for x in r["ranks"]),
        "0 compiles in the warm job": all(x["warm_compiles"] == 0 for x in per_rank),
    }
    return summary


def main() -> None:
    if "--child" in sys.argv[1:]:
        child(sys.argv[1:])
        return
    ex = _example()
    argv = list(sys.argv[1:])
    out_dir, stack_s = None, 240.0
    if "--out-dir" in argv:
        i = argv.index("--out-dir")
        out_dir = argv[i + 1]
        del argv[i:i + 2]
    if "--stack-dump-s" in argv:
        i = argv.index("--stack-dump-s")
        stack_s = float(argv[i + 1])
        del argv[i:i + 2]
    args = ex.parse_args(argv)
    temp = [] if args.cache_dir else [tempfile.mkdtemp(prefix="gearcache-pp-bench-")]
    args.cache_dir = args.cache_dir or temp[0]
    out = out_dir or tempfile.mkdtemp(prefix="gearcache-pp-bench-out-")
    try:
        cold = run_phase(ex, args, "cold start", out, stack_s)
        warm = run_phase(ex, args, "warm start", out, stack_s)
        eager = run_phase(ex, args, "eager start", out, stack_s, ("--eager-start",))
    finally:
        for folder in temp:
            shutil.rmtree(folder, ignore_errors=True)
    s = summarize(args, cold, warm, eager)
    for row in s["per_rank"]:
        print(f"  rank {row['rank']} (pp {row['pp']}, tp {row['tp']}): warm first call {row['warm_first_call_s']:.3f}"
              f" s, warm start {row['warm_start_s']:.3f} s (eager's same calls in a fresh job: first "
              f"{row['eager_first_call_s']:.3f} s, all {row['eager_start_s']:.3f} s), cold compiles "
              f"{row['cold_compiles']}, tokens equal eager "
              f"{row['tokens_equal_eager']} (split eager {row['tokens_equal_split_eager']})")
    for name, ok in s["targets"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f)
    with open(os.path.join(out, "warm-timelines.txt"), "w") as f:     # each rank's warm-ups, phase by phase
        for x in warm["ranks"]:
            for name, text in x["timelines"].items():
                f.write(f"== rank {x['rank']} (pp {x['pp']}, tp {x['tp']}): {name} (first call {x['first_call_s']:.3f}"
                        f" s, decode's gears by {x['decode_all_gears_s']:.3f} s)\n{text}\n")
    print(json.dumps(s))


if __name__ == "__main__":
    main()
