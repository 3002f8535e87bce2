"""gearcache/compiling/background.py: ``on_new_signature="background"`` serves a new signature eagerly while a worker
process compiles it, then compiled; an exiting process publishes its compiles, and the next one loads them compiling
nothing. Every call is compared with an eager twin: outputs and the buffer the method updates in place."""
from __future__ import annotations

import copy

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
    assert gearcache.compiling.background.in_flight() == 0
    hits = counters.hits
    for _ in range(3):
        call_both()
    assert counters.hits == hits + 3                        # compiled from now on
    assert counters.eager_calls == before["eager_calls"] + 1
    assert counters.traces == before["traces"] + 1


@pytest.mark.slow
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
        pids = gearcache.compiling.background.worker_pids()
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert gearcache.wait_for_background_compiles() == 1
        assert counters.compiles == compiles + 1            # compiled here, once
        assert gearcache.compiling.background.worker_pids() == []
        torch.testing.assert_close(model.cached(x), twin.fwd(x))
        torch.testing.assert_close(model.total, twin.total)


class Breaks(torch.nn.Module):
    def __init__(self, store):
        super().__init__()
        config = CompilerConfig(on_new_signature="background", inference_config=InferenceConfig(warmup_workers=1))
        self.cached = cache_compile(self.fwd, config=config, cache_dir=store)

    def fwd(self, x):
        return x + 1 if x.sum().item() > 0 else x      # data-dependent branch: a graph break


def test_a_miss_whose_capture_fails_raises_and_leaves_no_worker_running(tmp_path):
    """The workers start before the capture (their imports overlap it); a capture that fails (a graph break) is the
    caller's error, as without background compiles, and the workers close: nothing is in flight."""
    with pytest.raises(gearcache.GraphBreakError), torch.inference_mode():
        Breaks(tmp_path / "store").cached(torch.ones(3))
    assert gearcache.compiling.background.in_flight() == 0
    assert gearcache.compiling.background.worker_pids() == []


@pytest.mark.slow
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


@pytest.mark.slow
def test_generate_runs_eagerly_while_its_entries_compile_then_compiled(tmp_path):
    """transformers' generate() (the corpus Llama: greedy and sampling, a streamer, left padding) under
    on_new_signature="background": equal to eager while the prompt gear and the decode step compile in a worker,
    then again once they are loaded (tokens, logits, the static cache's keys, values and positions)."""
    _check_background_generate(run_script("run_corpus_model.py", "llama", str(tmp_path / "store"), "--background",
                                          timeout=900))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


def _graphed_counter(store, device: str) -> tuple[Counter, Counter]:
    """A Counter under mode="reduce-overhead" with gears 2 and 4 on x's rows, and its eager twin, on ``device``."""
    torch.manual_seed(2)
    model, twin = Counter(), Counter()
    config = CompilerConfig(on_new_signature="background", mode="reduce-overhead",
                            inference_config=InferenceConfig(warmup_workers=1, dim_gears={"x": {0: [2, 4]}}))
    model.cached = cache_compile(model.fwd, config=config, cache_dir=store)
    twin.load_state_dict(model.state_dict())
    return model.to(device), twin.to(device)


def _call_both(model: Counter, twin: Counter, x: torch.Tensor) -> None:
    with torch.inference_mode():
        out, want = model.cached(x), twin.fwd(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(model.total, twin.total)


@pytest.mark.slow
def test_background_compiles_with_cuda_graphs_on_cpu_inputs_run_like_eager(tmp_path):
    """mode="reduce-overhead" with on_new_signature="background" on CPU inputs (no graphs there): eager while the
    gear compiles, then the compiled gear, equal to eager throughout (outputs and the buffer written in place)."""
    model, twin = _graphed_counter(tmp_path / "store", "cpu")
    eager_calls, captures = counters.eager_calls, counters.graph_captures
    x = torch.randn(3, 6)
    _call_both(model, twin, x)
    assert counters.eager_calls == eager_calls + 1
    assert gearcache.wait_for_background_compiles() == 1
    hits = counters.hits
    _call_both(model, twin, x)
    _call_both(model, twin, x.flip(0) * 3)          # other rows, gear 4 again: the same entry, compiled
    assert counters.hits == hits + 2
    assert counters.eager_calls == eager_calls + 1
    assert counters.graph_captures == captures


@needs_cuda
def test_cuda_graphs_serve_a_compiling_gear_uncaptured_then_capture_it(tmp_path):
    """On the GPU: a gear whose entry compiles in the background is served by the eager stand-in without a graph
    (a graph of the stand-in would replay one eager run); once loaded, its graph is captured once and replayed.
    Every call equals an eager twin, outputs and the buffer the method writes in place."""
    model, twin = _graphed_counter(tmp_path / "store", "cuda")
    eager_calls, captures = counters.eager_calls, counters.graph_captures
    x = torch.randn(3, 6, device="cuda")
    _call_both(model, twin, x)                      # gear 4: compiling, eager, nothing captured
    assert counters.eager_calls == eager_calls + 1
    assert counters.graph_captures == captures
    assert gearcache.wait_for_background_compiles() == 1
    _call_both(model, twin, x)                      # loaded: captured now
    assert counters.graph_captures == captures + 1
    hits = counters.hits
    for _ in range(3):
        _call_both(model, twin, x)                  # replayed
    assert counters.hits == hits + 3 and counters.graph_captures == captures + 1
    eager_calls = counters.eager_calls
    _call_both(model, twin, x[:2])                  # gear 2: compiling, eager
    assert counters.eager_calls == eager_calls + 1
    assert gearcache.wait_for_background_compiles() == 1
    for _ in range(2):
        _call_both(model, twin, x[:1])
    assert counters.graph_captures == captures + 2
    assert counters.eager_calls == eager_calls + 1


@needs_cuda
def test_generate_under_cuda_graphs_runs_eagerly_while_compiling_then_replays_graphs(tmp_path):
    """generate() of the corpus Llama on the GPU with mode="reduce-overhead" and on_new_signature="background":
    equal to eager while its entries compile (no graph captured), then replaying CUDA graphs once they are loaded;
    a warm fresh process then loads them, compiling nothing, and replays graphs equal to eager."""
    from conftest import Script

    store = str(tmp_path / "store")
    cold = run_script("run_corpus_model.py", "llama", store, "--background", "--cuda-graphs", timeout=900)
    _check_background_generate(cold)
    assert cold["counters_after_second_cache"]["graph_captures"] == 0     # compiling: served uncaptured
    assert cold["again_counters"]["graph_captures"] >= 2                  # prompt gear and decode step
    warm = Script("run_corpus_model.py", "llama", store, "--cuda-graphs", "--hooks",
                  env=empty_caches_env(tmp_path / "caches")).result(timeout=600)
    assert warm["tokens_match_generate"] is True and warm["sampled_match"] is True
    assert warm["max_abs_diff"] <= 1e-4 and warm["cache_max_abs_diff"] <= 1e-4
    assert warm["counters"]["compiles"] == 0 and warm["hooks"]["dynamo_frames"] == 0
    assert warm["counters"]["graph_captures"] >= 2
    assert warm["tokens"] == cold["tokens"]


def test_a_background_compile_is_a_handle_its_owner_keeps_polls_and_closes(tmp_path):
    """background.Compiling is what the owner (an EntryLife) keeps: ``done``/``wait`` poll the worker, ``reply`` is
    None when it failed (the settling build compiles in-process), ``close`` removes its scratch folder and ends its
    count in ``in_flight``; the module holds it weakly and reaches its owner only through ``settle_all``."""
    import concurrent.futures
    import types

    from gearcache.compiling import background
    from gearcache.errors import WorkerError

    class Owner:
        def __init__(self):
            self.deadlines = []

        def settle_all(self, deadline=None):
            self.deadlines.append(deadline)
            return 0

    owner, scratch = Owner(), tmp_path / "scratch"
    scratch.mkdir()
    pending = types.SimpleNamespace(args=(torch.ones(2),), kwargs={}, ekey="e" * 40, captured=None)
    future: concurrent.futures.Future = concurrent.futures.Future()
    before = background.in_flight()
    handle = background.Compiling(torch.relu, "m", pending, None, future, scratch, owner)
    background._WORKERS.handles.add(handle)
    assert background.in_flight() == before + 1
    assert not handle.done() and not handle.wait(0.01)
    assert background.wait(timeout=0) == 0 and owner.deadlines and owner.deadlines[-1] is not None
    future.set_exception(WorkerError("the worker died", pid=1))
    assert handle.done() and handle.wait(0) and handle.reply() is None
    assert handle.manifest == {"method": "m", "ekey": "e" * 40, "eager": True, "compiling": True}
    handle.close()
    assert not scratch.exists() and background.in_flight() == before


class Layer(torch.nn.Module):
    """A repeated block that writes a buffer of its own in place; ``flip`` (a Python attribute) changes its code."""

    def __init__(self, flip=False):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.register_buffer("seen", torch.zeros(6))
        self.flip = flip

    def forward(self, x):
        self.seen.add_(x.sum(0))
        y = torch.tanh(self.lin(x))
        return -y if self.flip else y


def _stack(flips, store=None):
    torch.manual_seed(2)
    model = torch.nn.Sequential(*(Layer(f) for f in flips))
    twin = copy.deepcopy(model)
    regions = None
    if store is not None:
        config = CompilerConfig(on_new_signature="background", inference_config=InferenceConfig(warmup_workers=1))
        regions = gearcache.compile_blocks(model, cache_dir=store, config=config)
    return model, twin, regions


def _same(model, twin, x):
    with torch.inference_mode():
        out, want = model(x), twin(x)
    torch.testing.assert_close(out, want)
    for mine, theirs in zip(model, twin):
        torch.testing.assert_close(mine.seen, theirs.seen)


@pytest.mark.slow
def test_identical_blocks_capture_and_compile_one_background_entry(tmp_path):
    """Three identical blocks by region (one entry key) under background compiles: the first block's miss captures
    and compiles; the others capture nothing and run eagerly until it is settled, then load the stored entry. Equal
    to eager (outputs, each block's buffer written in place) at every call; 1 trace, 1 compile in all."""
    model, twin, _ = _stack([False] * 3, tmp_path / "store")
    x = torch.randn(4, 6)
    compiles = counters.compiles
    with counters.expect(traces=1, compiles=0, eager_calls=3):
        _same(model, twin, x)
    with counters.expect(traces=0):
        _same(model, twin, x)            # still compiling (eager), or settled by block 0 and loaded by the others
    assert gearcache.wait_for_background_compiles() <= 1
    assert gearcache.compiling.background.in_flight() == 0
    with counters.expect(traces=0, compiles=0, eager_calls=0):
        _same(model, twin, x)
        _same(model, twin, x)
    assert counters.compiles == compiles + 1


@pytest.mark.slow
def test_a_block_whose_attributes_change_its_code_waits_then_compiles_its_own(tmp_path):
    """Blocks 0-1 plain, block 2 with ``flip`` (same entry key, other value guards): block 2 waits for block 0's
    compile, then finds its guards fail and compiles its own; equal to eager throughout, 2 traces in all."""
    model, twin, _ = _stack([False, False, True], tmp_path / "store")
    x = torch.randn(4, 6)
    traces = counters.traces
    for _ in range(3):
        _same(model, twin, x)
        gearcache.wait_for_background_compiles()
    _same(model, twin, x)
    assert counters.traces == traces + 2
    assert gearcache.compiling.background.in_flight() == 0
    with counters.expect(traces=0, compiles=0, eager_calls=0):
        _same(model, twin, x)


@pytest.mark.slow
def test_a_waiter_whose_owner_is_freed_compiles_its_own(tmp_path):
    """Two models of identical blocks sharing one store: model B's blocks wait for model A's block 0 compile, then A's
    regions are removed and A is freed mid-compile (no one can settle that compile now). B's blocks must not run
    eagerly forever: B's first block captures and compiles the entry itself, the others wait for it, then all load it.
    Equal to eager throughout (outputs and every block's buffer); the workers close once nothing is in flight."""
    import gc

    store = tmp_path / "store"
    a, _, regions_a = _stack([False] * 3, store)
    b, twin, _ = _stack([False] * 3, store)
    x = torch.randn(4, 6)
    with torch.inference_mode():
        a(x)                                    # A's block 0 compiles; its blocks 1-2 wait for it
    with counters.expect(traces=0, eager_calls=3):
        _same(b, twin, x)                       # B's blocks wait for A's compile too
    regions_a.remove()
    del a, regions_a
    gc.collect()
    with counters.expect(traces=1, eager_calls=3):
        _same(b, twin, x)                       # the orphaned compile is not waited for: B's block 0 captures its own
    assert gearcache.wait_for_background_compiles() == 1
    with counters.expect(traces=0, compiles=0, eager_calls=0):
        _same(b, twin, x)
    assert gearcache.compiling.background.in_flight() == 0
    assert gearcache.compiling.background.worker_pids() == []


@pytest.mark.slow
def test_threads_capturing_identical_blocks_at_once_run_like_eager(tmp_path):
    """Two models of identical blocks (two stores), each served by a thread of its own, both called at once with a
    new signature: their first blocks capture the same code object at the same time (Dynamo's cache entries on it
    are per code object, not per thread). Every call must equal eager (outputs and every block's buffer), with no
    error and no crash; the compiles then settle and serve both."""
    import threading

    pairs = [_stack([False] * 3, tmp_path / f"store{i}")[:2] for i in range(2)]
    barrier, errors = threading.Barrier(2), []

    def serve(model, twin):
        try:
            for rows in (3, 5):
                x = torch.randn(rows, 6)
                barrier.wait(timeout=60)
                _same(model, twin, x)
        except BaseException as exc:            # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=serve, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert gearcache.wait_for_background_compiles() == 4
    for model, twin in pairs:
        with counters.expect(traces=0, eager_calls=0):
            _same(model, twin, torch.randn(5, 6))


@pytest.mark.slow
def test_a_wait_in_another_thread_does_not_hold_up_the_calls_it_waits_for(tmp_path):
    """``wait_for_background_compiles()`` in a thread of its own while identical blocks compile: the serving thread's
    calls are still served eagerly at once (not held until the compile is done, as a wait holding the compiling
    method's lock would), equal to eager; the wait then settles the one compile and the blocks load it."""
    import threading
    import time

    model, twin, _ = _stack([False] * 3, tmp_path / "store")
    x = torch.randn(4, 6)
    with counters.expect(traces=1, eager_calls=3):
        _same(model, twin, x)
    settled = []
    waiter = threading.Thread(target=lambda: settled.append(gearcache.wait_for_background_compiles()))
    waiter.start()
    time.sleep(0.5)                             # the waiter is waiting for the worker now
    with counters.expect(traces=0, eager_calls=3):
        _same(model, twin, x)                   # served eagerly at once, while the worker still compiles
    assert gearcache.compiling.background.in_flight() == 1
    waiter.join(timeout=300)
    assert settled == [1]
    with counters.expect(traces=0, compiles=0, eager_calls=0):
        _same(model, twin, x)


@pytest.mark.slow
def test_a_stand_in_never_gets_the_shortcut_of_its_settled_signature(tmp_path):
    """Two threads calling one compiling signature: thread A's miss returns the eager stand-in, then thread B settles
    the compile and its next call sets the signature's shortcut (its matcher is now known), then A sets the shortcut
    for its own call. That interleaving, replayed here in one thread (A's ``_shortcut_to`` after B's call): the
    shortcut must not carry the stand-in, or every later call of the signature runs eagerly while counted as a hit."""
    from gearcache.call import signature

    torch.manual_seed(4)
    model, twin = Counter(tmp_path / "store"), Counter()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 6)
    _call_both(model, twin, x)                      # compiling: thread A's call gets the stand-in
    with torch.inference_mode():
        leaves, key = signature.call_key((x,), {})
    stand_in = model.cached.life.compiling[key]
    assert gearcache.wait_for_background_compiles() == 1
    _call_both(model, twin, x)                      # thread B: loaded, the shortcut set (its matcher known)
    model.cached._shortcut_to(key, leaves, stand_in)    # thread A, after its miss returned the stand-in
    with counters.expect(eager_calls=0, hits=2):
        _call_both(model, twin, x)
        _call_both(model, twin, x)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_for_the_next_background_compile(tmp_path):
    """SIGKILL the worker while one signature compiles, then call a new signature while that compile is still in
    flight (the pool stays open): the new compile must run in a fresh worker, not fail at once on the dead one and
    fall to an in-process compile in a serving call. Every call equals eager; both entries are then loaded."""
    import os
    import signal

    from gearcache.call import signature

    torch.manual_seed(5)
    model, twin = Counter(tmp_path / "store"), Counter()
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(3, 6), torch.randn(5, 6)
    _call_both(model, twin, x)
    for pid in gearcache.compiling.background.worker_pids():
        os.kill(pid, signal.SIGKILL)
    _call_both(model, twin, y)                      # a new signature: compiled in the background too
    with torch.inference_mode():
        key = signature.call_key((y,), {})[1]
    handle = model.cached.life.compiling[key]
    assert handle.wait(300) and handle.reply() is not None, "compiled by a worker"
    assert gearcache.wait_for_background_compiles() == 2
    with counters.expect(eager_calls=0, traces=0):
        for z in (x, y):
            _call_both(model, twin, z)


@pytest.mark.slow
def test_an_exiting_process_whose_worker_was_killed_still_publishes_its_compiles(tmp_path):
    """The worker SIGKILLed right before the process exits with gears 4 and 8 compiling: the exit compiles them in
    this process (at interpreter exit, where Inductor's thread pool takes no new work), so a fresh process loads both
    entries, compiling nothing; equal to eager in both."""
    store = str(tmp_path / "store")
    cold = run_script("run_background.py", store, "kill", env=empty_caches_env(tmp_path / "cold"), timeout=600)
    assert cold["equal"]
    warm = run_script("run_background.py", store, "warm", env=empty_caches_env(tmp_path / "warm"))
    assert warm["equal"]
    assert warm["counters"]["loads"] == 2
    assert warm["counters"]["traces"] == warm["counters"]["compiles"] == warm["counters"]["eager_calls"] == 0
