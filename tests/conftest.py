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


@pytest.fixture(scope="session")
def corpus_cold(tmp_path_factory):
    """``corpus_cold(name)``: (store, report) of corpus model ``name`` (benchmarks/corpus.py, tiny, CPU) run cold in a
    fresh process; each model is compiled once per session."""
    done: dict[str, tuple[Path, dict]] = {}

    def cold(name: str) -> tuple[Path, dict]:
        if name not in done:
            store = tmp_path_factory.mktemp(f"corpus_{name}")
            done[name] = store, run_script("run_corpus_model.py", name, str(store), timeout=900)
        return done[name]
    return cold


@pytest.fixture(scope="session")
def corpus_warm(corpus_cold, tmp_path_factory):
    """``corpus_warm(name)``: the report of corpus model ``name`` run again on its cold store, in a fresh process with
    compile hooks installed and empty Inductor and Triton caches; once per session."""
    done: dict[str, dict] = {}

    def warm(name: str) -> dict:
        if name not in done:
            store, _ = corpus_cold(name)
            caches = tmp_path_factory.mktemp(f"corpus_{name}_torch_caches")
            env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
            done[name] = run_script("run_corpus_model.py", name, str(store), "--hooks", env=env, timeout=600)
        return done[name]
    return warm


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (free loopback port, no persistence), stopped after."""
    from redis_server import start

    server = start()
    yield server
    server.stop()


@pytest.fixture()
def redis(redis_server):
    """The session's redis-server, emptied for this test (restarted if a test killed it)."""
    if redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis_server.client()
    client.config_set("maxmemory", 0)
    client.flushall()
    yield redis_server
    if redis_server.proc.poll() is not None:
        redis_server.start()


FLEET_KEY = "fleet-test-key"


def fleet_config(redis_url: str | None, **extra) -> str:
    """tests/scripts/fleet_node.py's config: signed with FLEET_KEY, 4 KiB chunks (an artifact spans many)."""
    return json.dumps({"signing_key": FLEET_KEY, "remote": redis_url, "remote_chunk_bytes": 4096, **extra})


@pytest.fixture(scope="session")
def seed(tmp_path_factory):
    """A local folder holding fleet_node.py's entry, compiled once (signed with FLEET_KEY) by a fresh process."""
    folder = tmp_path_factory.mktemp("fleet_seed")
    report = run_script("fleet_node.py", str(folder), fleet_config(None))
    assert report["compiles"] == 1 and report["equal"]
    return folder
