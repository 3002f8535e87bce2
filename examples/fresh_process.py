"""Run one start of an example in a fresh Python process, as a server restart would."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_fresh(cmd: list, label: str) -> dict:
    """Run ``cmd`` with empty Inductor and Triton caches of its own; return the JSON report on its last stdout line,
    with ``process_s`` (the whole process's wall time) added."""
    with tempfile.TemporaryDirectory(prefix="gearcache-example-torch-caches-") as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{label}: the child process failed with exit code {proc.returncode}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["process_s"] = elapsed
    return report


def cold_then_warm(run_child, args, name: str, title: str) -> tuple[dict, dict]:
    """Print ``title`` with the store, then run a cold start and a warm start (``run_child(args, label)`` each) on
    ``args.cache_dir``, or on a temporary store removed afterwards when it is None."""
    temp = None
    if args.cache_dir is None:
        temp = args.cache_dir = tempfile.mkdtemp(prefix=f"gearcache-{name}-")
    print(f"{title}, store: {args.cache_dir}")
    try:
        return run_child(args, "cold start"), run_child(args, "warm start")
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def counters_line(report: dict) -> str:
    c = report["counters"]
    return (f"  traced {c['traces']}, compiled {c['compiles']}, loaded {c['loads']} entries; "
            f"{c['pads']} calls padded up to a gear\n")


def start_summary(report: dict, *timings: str) -> dict:
    """One start's line of an example's JSON summary: the named timings and the compile/trace/load counts."""
    return {**{k: report[k] for k in timings}, **{k: report["counters"][k] for k in ("compiles", "traces", "loads")}}
