"""The differential tester from the command line (the device's long mode, or a longer CPU run).

    python3 -m tests.difftest --cases 300                          # CPU, as CI's slice does (seed 0)
    python3 -m tests.difftest --cases 100 --device cuda --graphs   # GPU: also mode="reduce-overhead" with every
                                                                   # graph_outputs and capture_graphs choice
    python3 -m tests.difftest --seed 7 --cases 600 --max-compiles 80 --work /tmp/dt

Prints the counts and coverage, the refusals by reason, every failure with its reproducer (a standalone script: run
it with python3), and exits 1 if a case neither equalled eager nor raised a gearcache error, if an entry was loaded
stale, or (on CUDA) if a case refused there equals eager when run again on the CPU (its "CPU twin": the same program,
gears and calls with mode="default"): a refusal must hold on every device.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from .session import run_difftest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.difftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="run seed (each case's seed derives from it)")
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--graphs", action="store_true", help="on CUDA, also draw mode='reduce-overhead'")
    parser.add_argument("--programs", type=int, default=9,
                        help="distinct generated module classes (plus the 3 of draw.PAD_PROGRAMS)")
    parser.add_argument("--max-compiles", type=int, default=48, help="entry identities the draw may create")
    parser.add_argument("--max-plans", type=int, default=30, help="gear plans the draw may create")
    parser.add_argument("--no-warm", action="store_true", help="skip the fresh-process runs")
    parser.add_argument("--shrink", type=int, default=3, help="failures to shrink into reproducers")
    parser.add_argument("--shrink-seconds", type=float, default=300.0, help="time limit per shrunk failure")
    parser.add_argument("--work", type=Path, help="work folder (default: a new temporary folder, kept)")
    parser.add_argument("--json", type=Path, help="also write the report (counts, coverage, failures) here")
    args = parser.parse_args(argv)
    if args.graphs and args.device != "cuda":
        parser.error("--graphs needs --device cuda")
    work = args.work or Path(tempfile.mkdtemp(prefix="difftest-"))
    report = run_difftest(args.seed, args.cases, work, device=args.device, graphs=args.graphs,
                          n_programs=args.programs, max_compiles=args.max_compiles, max_plans=args.max_plans,
                          warm=not args.no_warm, shrink=args.shrink, shrink_seconds=args.shrink_seconds)
    print(report.summary())
    print(f"work folder: {work}")
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.failures or report.stale or report.gpu_only_refusals else 0


if __name__ == "__main__":
    sys.exit(main())
