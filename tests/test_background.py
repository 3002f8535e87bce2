"""gearcache/background.py: ``on_new_signature="background"`` serves a new signature eagerly while a worker process
compiles it, then compiled; an exiting process publishes its compiles, and the next one loads them compiling
nothing. Every call is compared with an eager twin: outputs and the buffer the method updates in place."""
from __future__ import annotations

import pytest
import torch

import gearcache
from gearcache import CompilerConfig, InferenceConfig, cache_compile, counters
from conftest import empty_caches_env, run_script


class Counter(torch.nn.Module):
    def __init__(self, store=None):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.register_buffer("total", torch.zeros(6))
        if store is not None:
            config = CompilerConfig(on_new_signature="background",
                                    inference_config=InferenceConfig(warmup_workers=1))
            self.cached = cache_compile(self.fwd, config=config, cache_dir=store)

    def fwd(self, x):
        self.total.add_(x.sum(0))
        return torch.tanh(self.lin(x)) * self.total


def test_a_new_signature_runs_eagerly_until_its_background_compile_is_loaded(tmp_path):
    torch.manual_seed(0)
    model, twin = Counter(tmp_path / "store"), Counter()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 6)
    before = {k: getattr(counters, k) for k in ("traces", "compiles", "eager_calls", "hits")}

    def call_both():
        with torch.inference_mode():
            out, want = model.cached(x), twin.fwd(x)
        assert torch.allclose(out, want, atol=1e-6)
        assert torch.allclose(model.total, twin.total, atol=1e-6)

    call_both()
    assert counters.traces == before["traces"] + 1
    assert counters.compiles == before["compiles"]          # the call returned before any compile was done
    assert counters.eager_calls == before["eager_calls"] + 1
    assert gearcache.wait_for_background_compiles() == 1
    assert counters.compiles == before["compiles"] + 1
    assert gearcache.background.in_flight() == 0
    hits = counters.hits
    for _ in range(3):
        call_both()
    assert counters.hits == hits + 3                        # compiled from now on
    assert counters.eager_calls == before["eager_calls"] + 1
    assert counters.traces == before["traces"] + 1


def test_a_worker_killed_mid_compile_leaves_the_compile_to_the_settling_call(tmp_path):
    """SIGKILL every worker while the entry compiles: the call was served eagerly, and settling it compiles it in
    this process instead; the workers are closed once nothing is in flight."""
    import os
    import signal

    torch.manual_seed(1)
    model, twin = Counter(tmp_path / "store"), Counter()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 6)
    compiles = counters.compiles
    with torch.inference_mode():
        torch.testing.assert_close(model.cached(x), twin.fwd(x))
        pids = gearcache.background.worker_pids()
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert gearcache.wait_for_background_compiles() == 1
        assert counters.compiles == compiles + 1            # compiled here, once
        assert gearcache.background.worker_pids() == []
        torch.testing.assert_close(model.cached(x), twin.fwd(x))
        torch.testing.assert_close(model.total, twin.total)


def test_an_exiting_process_publishes_its_background_compiles_and_the_next_loads_them(tmp_path):
    """Gears 4 and 8 of a method that writes a buffer: compiled in the background of a process that exits right
    after its calls; a fresh process then loads both entries with no trace, guard, compile or kernel build."""
    store = str(tmp_path / "store")
    cold = run_script("run_background.py", store, "cold", env=empty_caches_env(tmp_path / "cold"), timeout=600)
    assert cold["equal"]
    assert cold["counters"]["traces"] == 3                 # the gear plan's trace, then one capture per gear
    assert cold["counters"]["eager_calls"] >= 1
    warm = run_script("run_background.py", store, "warm", env=empty_caches_env(tmp_path / "warm"))
    assert warm["equal"]
    assert warm["counters"]["loads"] == 2
    assert warm["counters"]["traces"] == warm["counters"]["compiles"] == warm["counters"]["eager_calls"] == 0
    assert set(warm["hooks"].values()) == {0}, warm["hooks"]


def _check_background_generate(run: dict) -> None:
    for facts in (run, run["again"]):           # while compiling (eager stand-ins), then compiled
        assert facts["tokens_match_generate"] is True and facts["sampled_match"] is True
        assert facts["streamed_match"] is True and facts["cache_max_abs_diff"] <= 1e-4
    assert run["max_abs_diff"] <= 1e-4 and run["again_max_abs_diff"] <= 1e-4
    assert run["counters"]["eager_calls"] > 0                   # served before the compiles were loaded
    before, after = run["counters_after_second_cache"], run["again_counters"]
    assert after["traces"] == 2 and after["compiles"] == 2      # prompt gear 16 and the decode step, once each
    assert after["eager_calls"] == before["eager_calls"]        # the second run: compiled entries only
    assert after["hits"] > before["hits"]


def test_generate_runs_eagerly_while_its_entries_compile_then_compiled(tmp_path):
    """transformers' generate() (the corpus Llama: greedy and sampling, a streamer, left padding) under
    on_new_signature="background": equal to eager while the prompt gear and the decode step compile in a worker,
    then again once they are loaded (tokens, logits, the static cache's keys, values and positions)."""
    _check_background_generate(run_script("run_corpus_model.py", "llama", str(tmp_path / "store"), "--background",
                                          timeout=900))


def test_background_compiles_with_cuda_graphs_are_refused_where_configured(tmp_path):
    """Not verified on a GPU yet (gearcache/cuda_graphs.py serves a compiling gear uncaptured, then captures it):
    refused at cache_compile, naming both options and the fix, never served unverified."""
    config = CompilerConfig(on_new_signature="background", mode="reduce-overhead")
    with pytest.raises(gearcache.ConfigError, match="on_new_signature='background'.*mode='reduce-overhead'.*Fix"):
        cache_compile(Counter().fwd, config=config, cache_dir=tmp_path / "store")
