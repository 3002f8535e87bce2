"""Run one start of an example in a fresh Python process, as a server restart would."""
import json
import os
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
