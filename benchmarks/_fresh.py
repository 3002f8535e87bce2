"""A benchmark's child run in a fresh process with empty Inductor and Triton caches of its own."""
import json
import os
import shutil
import subprocess
import tempfile


def run_child(cmd: list[str], prefix: str, extra_env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` with ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` in a new temporary folder (removed after)
    and ``extra_env``; return the JSON object on its last stdout line. Exits with the command and its stderr's tail
    when it fails."""
    caches = tempfile.mkdtemp(prefix=prefix)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton"), **(extra_env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
