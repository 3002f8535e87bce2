"""Parallel warm-up (gearcache/warmup/driver.py, gearcache/compiling/workers.py): rank order, worker-compiled gears
equal the serial path's, load in a fresh process with nothing compiled, and two ranks sharing a folder split the
gears; a graph whose inputs share memory is compiled in the calling process (a worker would compile them apart), in a
warm-up and in a background compile."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TESTS, run_script
import gearcache
from gearcache import CompilerConfig, InferenceConfig, cache_compile, counters
from gearcache.gears.plan import GearCall, MarkedDim
from gearcache.warmup.driver import default_workers, most_gears, rank_order
from gearcache.warmup.method import capture_order
from gearcache.compiling.workers import build_input, input_spec, job_for


def test_rank_order_starts_with_the_ranks_share():
    assert rank_order(7, 1, 0) == list(range(7))
    assert rank_order(7, 2, 0) == [0, 2, 4, 6, 1, 3, 5]
    assert rank_order(7, 2, 1) == [1, 3, 5, 0, 2, 4, 6]
    assert rank_order(2, 4, 3) == [0, 1]                       # more ranks than gears: every gear is "the rest"
    for world in (1, 2, 3, 8):
        firsts = [rank_order(7, world, r)[0] for r in range(min(world, 7))]
        assert len(set(firsts)) == len(firsts), "ranks start on different gears"


def test_early_workers_are_sized_by_the_most_gears_the_marks_can_form():
    marks = [MarkedDim(0, 0, [1, 2, 4], "x"), MarkedDim(1, 0, [8, 16], "ids")]
    assert most_gears(marks, "zip") == 3                       # dims that move together: the longest gear list
    assert most_gears(marks, "product") == 6                   # independent dims: every combination


def test_capture_order_is_largest_gear_first():
    def order(*combinations):
        gears = [GearCall(list(sizes), (), (), (), {}) for sizes in combinations]
        return [gear.sizes for gear in capture_order(gears)]
    assert order([1], [2], [4], [8]) == [[8], [4], [2], [1]]
    assert order([1, 8], [2, 2], [8, 1], [4, 4]) == [[4, 4], [8, 1], [1, 8], [2, 2]]


def test_workers_option_and_default_caps():
    with pytest.raises(ValueError, match="warmup_workers"):
        CompilerConfig().inference_config.warmup_workers = 0
    assert default_workers(5, [torch.zeros(3)]) == max(1, min(5, os.cpu_count() // 2))   # memory allows that here
    assert default_workers(1, []) == 1


def test_worker_inputs_keep_the_metadata():
    base = torch.randn(6, 5)
    view = base[1:, 1:4]                                       # storage offset and strides of a view
    param = torch.nn.Parameter(torch.randn(3, 2))
    with torch.inference_mode():
        inf = torch.randn(2)
        inf_param = torch.nn.Parameter(torch.randn(4))        # a model built under inference mode
    for x in (view, param, inf, inf_param, base.t()):
        y = build_input(input_spec(x))
        assert (y.shape, y.stride(), y.storage_offset(), y.dtype, y.device) == \
               (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device)
        assert (type(y), y.requires_grad, y.is_inference()) == (type(x), x.requires_grad, x.is_inference())
    assert build_input(input_spec(3)) == 3


def test_inputs_sharing_memory_do_not_travel_to_a_worker():
    """A worker rebuilds each input on a base of its own: views of one tensor would be compiled apart there."""
    gm = torch.fx.symbolic_trace(lambda x, y: x + y)
    t = torch.arange(8.)
    assert job_for(gm, [t[0:4], t[2:6]], {}, "f") is None
    assert job_for(gm, [t[0:4], t[4:8]], {}, "f") is None          # one storage: the graph's aliasing is AOT's call
    assert job_for(gm, [t[0:4], t[2:6].clone()], {}, "f") is not None


def test_a_graph_compiled_under_a_custom_inductor_pass_does_not_travel_to_a_worker():
    """A custom pass (``torch._inductor.config.post_grad_custom_post_pass``) is left out of the settings a worker
    gets (torch's portable config snapshot ignores it): the worker compiled without it, under the key that names it.
    Such a graph is compiled in the calling process."""
    import torch._inductor.config as inductor_config

    from models import MulToAdd

    gm = torch.fx.symbolic_trace(lambda x, y: x * y)
    inputs = [torch.ones(4), torch.ones(4)]
    assert job_for(gm, inputs, {}, "f") is not None
    with inductor_config.patch(post_grad_custom_post_pass=MulToAdd()):
        assert job_for(gm, inputs, {}, "f") is None


@pytest.mark.slow
def test_a_warm_up_in_workers_keeps_module_tensors_that_are_views_of_one_tensor(tmp_path):
    """tests/scripts/run_warmup_views.py: ``c.mul_(2); return d.sum() + x``, ``c`` and ``d`` views of one tensor,
    warmed up with 2 workers, gave [60] where eager gives [82] (the workers compiled them apart), and so did a fresh
    process loading those entries. Such gears are compiled in the calling process now: equal to eager, warm too."""
    cold = run_script("run_warmup_views.py", str(tmp_path), "warmup", "2")
    assert cold["equal"] == [True] * 3 and cold["gears"] == 2 and cold["compiles"] == 2, cold
    warm = run_script("run_warmup_views.py", str(tmp_path), "calls")
    assert warm["equal"] == [True] * 3 and warm["compiles"] == 0 and warm["loads"] == 2, warm


class _RoundedViews(torch.nn.Module):
    """A bfloat16 chain over two buffers that are views of one tensor (its gears are compiled in the calling process,
    in the warm-up's threads): equal to eager only with Inductor's ``emulate_precision_casts``."""

    def __init__(self, cache_dir, gears=(2, 4)):
        super().__init__()
        torch.manual_seed(0)
        base = torch.randn(2, 64).to(torch.bfloat16)
        self.register_buffer("y", base[0])
        self.register_buffer("z", base[1])
        config = CompilerConfig(inference_config=InferenceConfig(dim_gears={"x": {0: list(gears)}}))
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return ((x * self.y + self.z) * self.y - x) * self.z


@pytest.mark.slow
def test_a_warm_up_compiling_in_its_threads_compiles_under_the_callers_inductor_settings(tmp_path):
    """torch (2.13) keeps an Inductor setting set in code in a ContextVar, which a new thread does not see: with
    ``emulate_precision_casts`` set, the gears a warm-up compiled in its threads (inputs sharing memory) were
    compiled without it, under the key that names it: 0.03125 off eager, where a compile in the caller is exact (and
    a fresh process with the setting loaded them). The threads run under the caller's settings now."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=True), torch.inference_mode():
        m = _RoundedViews(tmp_path)
        assert m.cached.warmup(torch.zeros(4, 64, dtype=torch.bfloat16)) == 2
        for rows in (4, 3, 2):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            torch.testing.assert_close(m.cached(x), m.fwd(x), rtol=0, atol=0)


@pytest.mark.slow
def test_a_warm_up_looking_up_in_threads_keys_gears_under_the_callers_inductor_settings(tmp_path, monkeypatch):
    """The look-up threads of a warm-up (``find_all``) computed the gears' entry keys without the caller's Inductor
    settings (a ContextVar a new thread does not see): those gears were stored under the key of a process without
    ``emulate_precision_casts`` (which then loaded code compiled with it), or loaded such a process's entries. Every
    gear's entry now names the setting, and each equals eager."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("GEARCACHE_LOAD_THREADS", "2")       # the second gear's look-up on, in threads
    with inductor_config.patch(emulate_precision_casts=True), torch.inference_mode():
        m = _RoundedViews(tmp_path, gears=(1, 2, 4))
        assert m.cached.warmup(torch.zeros(4, 64, dtype=torch.bfloat16)) == 3
        for rows in (4, 2, 1):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            torch.testing.assert_close(m.cached(x), m.fwd(x), rtol=0, atol=0)
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "entries").rglob("*.json")]
    configs = [m["factors"]["values"]["config"] for m in manifests if "ekey" in m]
    assert len(configs) == 3
    assert all(c.get("compiler_settings") == {"inductor": {"emulate_precision_casts": "True"}} for c in configs)


class ScaleAdd(torch.nn.Module):
    """Compiles new signatures in the background (gearcache/compiling/background.py), in one worker."""

    def __init__(self, store=None):
        super().__init__()
        if store is not None:
            config = CompilerConfig(on_new_signature="background",
                                    inference_config=InferenceConfig(warmup_workers=1))
            self.cached = cache_compile(self.fwd, config=config, cache_dir=store)

    def fwd(self, x, y):
        y.mul_(2)
        return x + y


def test_arguments_that_are_views_of_one_tensor_are_not_compiled_apart_in_a_worker(tmp_path):
    """x, y = b[:2], b[1:3]: the worker rebuilt each input on a base of its own and compiled them apart; once loaded,
    the entry returned [5, 8] where eager returns [5, 10]. Such a graph is compiled in the calling thread now (no
    eager call), and a second instance loading its entry equals eager too."""
    model, twin = ScaleAdd(tmp_path / "store"), ScaleAdd()
    eager_before = counters.eager_calls
    with torch.no_grad():
        for m in (model, model, ScaleAdd(tmp_path / "store")):
            for _ in range(2):
                b, eager_b = torch.arange(1., 5.), torch.arange(1., 5.)
                assert torch.equal(m.cached(b[:2], b[1:3]), twin.fwd(eager_b[:2], eager_b[1:3]))
                assert torch.equal(b, eager_b)
            gearcache.wait_for_background_compiles()
    assert counters.eager_calls == eager_before


def _summary(root: Path) -> tuple[dict, dict]:
    """Entry manifests (less their times) and, per artifact, its files and its run plan. Names that vary between any
    two compiles are masked: torch's cache entries (kept by key folder), and the wrapper source written on load
    (named by its content, which carries an "AOT ID" comment counting the compiles of the compiling process)."""
    entries = {}
    for p in sorted((root / "entries").rglob("*.json")):
        m = json.loads(p.read_text())
        if "ekey" in m:
            entries[p.relative_to(root).as_posix()] = {k: v for k, v in m.items()
                                                       if k not in ("created", "compile_seconds")}
    artifacts = {}
    for a in sorted((root / "artifacts").iterdir()):
        files = set()
        for f in a.rglob("*"):
            parts = f.relative_to(a).parts
            if f.is_file():
                keyed = len(parts) > 2 and parts[1] in ("aotautograd", "fxgraph")
                wrapper = len(parts) == 3 and parts[0] == "inductor" and parts[2].endswith(".py")
                files.add("/".join(parts[:-1]) + "/<entry>" if keyed else "inductor/<wrapper>.py" if wrapper
                          else "/".join(parts))
        artifacts[a.name] = (sorted(files), json.loads((a / "runplan" / "plan.json").read_text()))
    return entries, artifacts


@pytest.mark.slow
def test_workers_give_the_serial_entries_and_a_fresh_process_compiles_nothing(gears_cache, tmp_path,
                                                                             empty_torch_caches):
    serial_cache, serial = gears_cache
    cache = tmp_path / "cache"
    cold = run_script("run_gears.py", str(cache), "--workers", "2")
    assert cold["equal"] and cold["gears"] == 3 and cold["compiles_after_warmup"] == 0
    assert cold["counters"]["compiles"] == 3 and cold["counters"]["traces"] == 4
    spawn, trace = cold["phases"]["spawn workers"], cold["phases"]["signature and gears"]
    assert spawn[1] <= trace[1], "no gear plan stored: the workers start before the plan's trace ends"
    entries, artifacts = _summary(cache)
    serial_entries, serial_artifacts = _summary(serial_cache)
    assert len(entries) == 3 and entries == serial_entries, "same entry keys and manifests"
    assert artifacts == serial_artifacts, "same artifact keys, torch cache keys, files and run plans"
    assert all(plan["supported"] for _, plan in artifacts.values())
    warm = run_script("run_gears.py", str(cache), "--hooks", env=empty_torch_caches)
    assert warm["equal"] and warm["counters"]["loads"] == 3
    assert warm["counters"]["compiles"] == 0 and warm["counters"]["traces"] == 0
    assert warm["hooks"]["dynamo_frames"] == 0 and warm["hooks"]["inductor_compiles"] == 0
    assert warm["hooks"]["cpp_builds"] == 0 and warm["hooks"]["triton_compiles"] == 0


@pytest.mark.slow
def test_two_ranks_sharing_a_folder_split_the_gears(tmp_path):
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    procs = [subprocess.Popen([sys.executable, str(TESTS / "scripts" / "run_rank_warmup.py"), str(cache),
                               str(barrier)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["gears"] == 2 for r in reports)
    assert reports[0]["compiled"] == [2] and reports[1]["compiled"] == [4], "each rank compiled its own gear"
    assert sum(r["counters"]["compiles"] for r in reports) == 2, "each gear compiled once across ranks"
    assert all(r["counters"]["compiles"] == len(r["compiled"]) for r in reports)


class _Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def fwd(self, x):
        return torch.tanh(self.lin(x))


def test_a_worker_compiles_under_the_callers_autocast_and_flags(tmp_path):
    # Dynamo's graph has no casts: AOTAutograd adds them when it traces under autocast. A worker process does not
    # share the caller's (per-thread) autocast or flags, so its job carries them (``global_state``).
    from gearcache._torch import inductor as torch_inductor, state as torch_state
    from gearcache import cache_compile
    from gearcache.call import signature
    from gearcache.compiling import workers
    from gearcache.warmup.driver import _job

    m = _Lin().eval()
    cf = cache_compile(m.fwd, cache_dir=tmp_path / "cache")
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        leaves, key = signature.call_key((x,), {})
        found = cf.life.find(leaves, key)
        pending = cf.life.capture((x,), {}, leaves, found)
        job = _job(cf.life, pending)
        want = m.fwd(x)
    assert job is not None and job["global_state"]["autocast"] == {"cpu": "torch.bfloat16"}
    before = torch_state.global_state()
    with torch.no_grad():                                      # this thread has no autocast, as a worker
        reply = workers._run_job({**job, "folder": str(tmp_path / "artifact")})
    assert reply["ok"] and torch_state.global_state() == before, "the caller's state is applied for the job only"
    out = torch_inductor.load_folder(tmp_path / "artifact")(*pending.captured.example_inputs)
    assert want.dtype == out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], want)


def test_global_state_applied_reproduces_a_state_in_another_thread_and_restores_it():
    import threading

    from gearcache._torch import state as torch_state

    base = torch_state.global_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            wanted = torch_state.global_state()
        finally:
            torch.use_deterministic_algorithms(False)
    wanted["sdp"]["cudnn"] = not wanted["sdp"]["cudnn"]
    seen = {}

    def other():
        with torch_state.global_state_applied(wanted):
            seen["inside"] = torch_state.global_state()
        seen["after"] = torch_state.global_state()
        bad = {**wanted, "torch_function": [False, True]}      # not reproducible by setting flags
        try:
            with torch_state.global_state_applied(bad):
                seen["bad"] = "entered"
        except ValueError as exc:
            seen["bad"] = str(exc)
        seen["after_bad"] = torch_state.global_state()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["inside"] == wanted and seen["after"] == base == seen["after_bad"] == torch_state.global_state()
    assert "torch_function" in seen["bad"]
    # An equal state sets nothing: setting the matmul precision would also set the fp32_precision fields Inductor's
    # cache keys read (a worker's artifacts then differed from the caller's)
    fields = lambda: [getattr(torch.backends.cuda.matmul, "fp32_precision", None),     # noqa: E731
                      getattr(torch.backends, "fp32_precision", None)]
    before = fields()
    with torch_state.global_state_applied(base):
        assert fields() == before


class _Advancing(torch.nn.Module):
    """Advances a position counter and writes a row of a cache at every call (state a warm-up must not change)."""

    def __init__(self, cache_dir, gears):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))
        self.register_buffer("cache", torch.zeros(8, 4))
        config = gearcache.CompilerConfig()
        config.inference_config.dim_gears = gears
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        self.cache.index_copy_(0, self.pos, self.lin(x[:1]))
        self.pos.add_(1)
        return self.lin(x) + self.pos


@pytest.mark.parametrize("gears,warm", [          # the fast tier keeps one: gears, state written on the first call
    pytest.param({}, True, marks=pytest.mark.slow, id="no gears-warmup"),
    pytest.param({}, False, marks=pytest.mark.slow, id="no gears-first call"),
    pytest.param({"x": {0: [1, 2]}}, True, marks=pytest.mark.slow, id="gears-warmup"),
    pytest.param({"x": {0: [1, 2]}}, False, id="gears-first call")])
def test_warmup_leaves_the_state_its_runs_write_as_it_was(tmp_path, gears, warm):
    """warmup() runs the method on its example (once per gear): the counter and cache those runs advance are restored,
    so the calls after it equal eager's from the same state. Without warmup(), the first call traces the gear plan
    (a run of the graph on copies of the inputs): it advances the state once, as eager."""
    torch.manual_seed(0)
    m = _Advancing(tmp_path, gears)
    twin = _Advancing(tmp_path / "twin", {})
    twin.load_state_dict(m.state_dict())
    with torch.no_grad():
        if warm:
            m.cached.warmup(torch.ones(2, 4))
            assert int(m.pos) == 0 and not m.cache.any(), "warm-up runs left their writes"
        for n in (1, 2, 2):
            x = torch.randn(n, 4)
            torch.testing.assert_close(m.cached(x), twin.fwd(x))
        torch.testing.assert_close(m.cache, twin.cache)
        assert int(m.pos) == int(twin.pos) == 3


def test_each_gears_warm_up_run_sees_the_examples_state(tmp_path):
    """warmup() runs the example once per gear, each from the state the example was given: a decode step that writes
    its cache row at ``pos`` and advances ``pos`` is valid at the last row, and its second gear's run must not see
    the position the first advanced (it wrote past the cache: Inductor's bounds check raised). Restored after."""
    torch.manual_seed(0)
    m = _Advancing(tmp_path, {"x": {0: [1, 2]}})
    twin = _Advancing(tmp_path / "twin", {})
    twin.load_state_dict(m.state_dict())
    with torch.no_grad():
        m.pos.fill_(7)
        twin.pos.fill_(7)
        assert m.cached.warmup(torch.ones(2, 4)) == 2
        assert int(m.pos) == 7 and not m.cache.any(), "warm-up runs left their writes"
        x = torch.randn(1, 4)
        torch.testing.assert_close(m.cached(x), twin.fwd(x))
        torch.testing.assert_close(m.cache, twin.cache)
