"""Shared fixtures. Compiling on CPU costs seconds per graph, so compiled artifacts are built once per session."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


def run_script(script: str, *args: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Run ``tests/scripts/<script>`` in a fresh Python process; return the JSON report on its last stdout line."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, str(TESTS / "scripts" / script), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_lm_cache(tmp_path_factory) -> tuple[Path, dict]:
    """A cache folder holding TinyLM's prefill and decode entries, compiled by a separate (cold) process."""
    cache = tmp_path_factory.mktemp("tiny_lm_cache")
    report = run_script("run_tiny_lm.py", str(cache))
    return cache, report


@pytest.fixture(scope="session")
def gears_cache(tmp_path_factory) -> tuple[Path, dict]:
    """A cache folder holding PairMLP's three gears, warmed up serially by a separate (cold) process
    (tests/scripts/run_gears.py)."""
    cache = tmp_path_factory.mktemp("gears_cache")
    return cache, run_script("run_gears.py", str(cache), "--workers", "1")


@pytest.fixture()
def empty_torch_caches(tmp_path) -> dict:
    """Environment pointing Inductor's and Triton's caches at empty folders."""
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    inductor.mkdir()
    triton.mkdir()
    return {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(triton)}
