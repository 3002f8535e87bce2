"""Padding that never changes state or results (gearcache/gears/padding_check.py, on the analysis of padding.py): what
the analysis cannot prove exact is refused before anything compiles or runs, what it proves is served with the pad
values it chose, padded inputs written in place are copied back; outputs and every mutated tensor equal eager in the
compiling process and in a warm one. ``padding_check="verify"`` tests the analysis against eager in float64. The GPU
tests need CUDA (GEARCACHE_TEST_DEVICE=cuda on the device machine); on CPU they are skipped."""
import math

import pytest
import torch

import gearcache
from conftest import Script, ahead
from gear_models import BatchMin, BatchSoftmax, Center, KVStep, RunningSum, SeenRows
from gearcache import CompilerConfig, ConfigError, PaddingUnsafeError, counters, set_dim_gears
from gearcache.gears import padding_check
from gearcache.call import signature

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


def _config(policy: str = "refuse", **gears) -> CompilerConfig:
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = gears
    if policy != "refuse":                      # (the default)
        cfg.inference_config.padding_check = policy
    return cfg


@ahead("padding_runs")
def _padding_runs(tmp_path_factory, need) -> tuple[dict, dict]:
    cache = tmp_path_factory.mktemp("padding")
    cold = Script("run_padding.py", str(cache)).result()
    return cold, Script("run_padding.py", str(cache), "--hooks").result()


@pytest.fixture(scope="module")
def padding_runs(ahead_jobs) -> tuple[dict, dict]:
    """Reports of tests/scripts/run_padding.py on one folder: a cold process (compiles), then a warm one with compile
    hooks (loads)."""
    return ahead_jobs.value("padding_runs")


SERVED = ("kv_step", "running_sum", "batch_softmax", "batch_min")


# ------------------------------------------------------------------------------------------- served exactly
def test_outputs_and_written_tensors_equal_eager_in_the_compiling_process(padding_runs):
    cold, _ = padding_runs
    for name in SERVED:
        assert cold[name]["equal"], name
        assert cold[name]["counters"]["pads"] == 6, name
        assert cold[name]["counters"]["padding_verifications"] == 0, f"{name}: proved, never sampled"
    assert all(cold[name]["counters"]["compiles"] == 1 for name in SERVED)


def test_a_min_over_the_batch_is_padded_with_the_largest_value_and_stays_exact_when_data_would_show_the_pad(
        padding_runs):
    """The issue's wrong answers: ``x.amin(0)`` was verified on a mixed-sign first call and then returned the pad 0
    for an all-positive one (eager 0.5); ``ids.min(0)`` returned [0, 0] (eager [2, 5]). Now the analysis pads x
    with +inf and ids with int64's largest value, so every call, in either process, equals eager."""
    for run in padding_runs:
        case = run["batch_min"]
        assert case["equal"]
        assert case["pad_values"] == {"x": math.inf, "ids": torch.iinfo(torch.int64).max}


def test_a_warm_process_equals_eager_and_compiles_nothing(padding_runs):
    _, warm = padding_runs
    for name in SERVED:
        got = warm[name]["counters"]
        assert warm[name]["equal"], name
        assert got["loads"] == 1 and got["compiles"] == 0 and got["traces"] == 0, name
        assert got["padding_verifications"] == 0, name
    assert warm["batch_min"]["pad_values"] == padding_runs[0]["batch_min"]["pad_values"], "from the stored plan"
    assert warm["hooks"]["dynamo_frames"] == 0 and warm["hooks"]["inductor_compiles"] == 0


@pytest.mark.parametrize("process", ["cold", "warm"])
def test_a_state_write_and_a_batch_mean_are_refused_in_both_processes(padding_runs, process):
    """``self.seen[:B].copy_(x)`` (eager writes rows 0-2; the padded call would also zero row 3) and ``h -
    h.mean(0)`` (the mean takes in a pad row, whatever its value), on a batch of 3 served by gear 4. Both are refused
    when the gear plan is built (cold) or loaded (warm: from the stored report, no trace), before anything runs."""
    run = dict(zip(("cold", "warm"), padding_runs))[process]
    seen, center = run["seen_rows"], run["center"]
    assert seen["error"] is not None and "self.seen[: x.shape[0]].copy_(x)" in seen["error"]
    assert "into parameter or buffer seen" in seen["error"] and "Fix: " in seen["error"]
    assert seen["state_unchanged"], "refused before anything ran: the buffer keeps row 3"
    assert center["error"] is not None and "aten.mean.dim at gear_models.py:" in center["error"]
    assert "h - h.mean(0)" in center["error"] and "a mean divides by the padded count" in center["error"]
    for case in (seen, center):
        assert case["counters"]["padding_verifications"] == 0 and case["counters"]["compiles"] == 0
        assert case["counters"]["traces"] == (1 if process == "cold" else 0)
        assert case["counters"]["loads"] == 0


# --------------------------------------------------------------------------------------------------- refused
def test_a_write_through_a_padded_extent_into_a_buffer_is_refused_before_anything_runs(tmp_path):
    m = SeenRows(tmp_path, _config(x={0: [4]}))
    before = m.seen.clone()
    with torch.no_grad(), counters.expect(compiles=0), pytest.raises(PaddingUnsafeError) as info:
        m.cached(torch.randn(3, 4))
    text = str(info.value)
    assert "aten.copy_.default at gear_models.py:" in text and "self.seen[: x.shape[0]].copy_(x)" in text
    assert "into parameter or buffer seen" in text and "Fix: do that write outside the cached method" in text
    assert torch.equal(m.seen, before), "the plan's trace wrote nothing"
    with torch.no_grad(), pytest.raises(PaddingUnsafeError, match="buffer seen"):
        SeenRows(tmp_path, _config(x={0: [4]})).cached.warmup(torch.zeros(4, 4))     # a stored plan: refused too


@pytest.mark.parametrize("policy", ["refuse", "verify"])
def test_a_mean_over_the_batch_is_refused_when_the_plan_is_built(tmp_path, policy):
    m = Center(tmp_path, _config(policy, x={0: [4]}))
    with torch.no_grad(), counters.expect(compiles=0, padding_verifications=0), \
            pytest.raises(PaddingUnsafeError) as info:
        m.cached(torch.randn(3, 4))
    text = str(info.value)
    assert "padding a call up to its gear may change its results: aten.mean.dim at gear_models.py:" in text
    assert "h - h.mean(0)" in text and "(mean: a mean divides by the padded count); it reaches output 0" in text
    assert "(pad values: x=0)" in text and "Fix: make that op exact under padding" in text


def test_a_pad_value_the_user_gave_that_is_not_neutral_is_refused_with_what_it_needs(tmp_path):
    m = RunningSum(tmp_path, _config())
    x = set_dim_gears(torch.randn(3, 4), {0: [4]}, pad_value=1.0)
    with torch.no_grad(), counters.expect(compiles=0), pytest.raises(PaddingUnsafeError) as info:
        m.cached(x)
    text = str(info.value)
    assert "aten.sum.dim_IntList" in text and "self.total.add_(x.sum(0))" in text
    assert "exact only if its padded rows hold 0, but they hold 1" in text and "(pad values: x=1)" in text
    assert torch.equal(m.total, torch.zeros(4)), "nothing ran"


def test_a_pad_value_the_dtype_cannot_hold_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"set_dim_gears\(pad_value\)=-inf: a torch.int64 tensor cannot hold -inf"):
        set_dim_gears(torch.zeros(3, dtype=torch.long), {0: [4]}, pad_value=float("-inf"))
    m = BatchMin(tmp_path, _config(x={0: [4]}, ids={0: [4]}))
    m.cached.config.inference_config.pad_values = {"ids": 0.5}
    with torch.no_grad(), pytest.raises(ConfigError, match=r"pad_values\['ids'\]=0.5: a torch.int64 tensor cannot"):
        m.cached(torch.randn(3, 2), torch.zeros(3, 2, dtype=torch.long))


def test_off_serves_without_checking(tmp_path):
    m = Center(tmp_path, _config("off", x={0: [4]}))
    x = torch.randn(3, 4)
    with torch.no_grad(), counters.expect(compiles=1, padding_verifications=0):
        out = m.cached(x)
    assert not torch.allclose(out, m.fwd(x), atol=1e-4), "off: the user asserted padding is exact (it is not)"


# ---------------------------------------------------------------------------------------- the opt-in test
def test_verify_tests_each_proved_gear_against_eager_in_float64_and_catches_a_false_proof(tmp_path):
    """``padding_check="verify"`` runs a proved gear against eager (padded and not, float64 copies of the module and
    inputs) before its first padded call. The test can fail: with the plan's pad value for the softmax changed from
    -inf to 0 (an analysis that proved something false), it raises and says so."""
    m = BatchSoftmax(tmp_path, _config("verify", x={0: [2, 4]}))
    x = torch.randn(3, 5)
    with torch.no_grad(), counters.expect(padding_verifications=1, compiles=1):
        torch.testing.assert_close(m.cached(x), m.fwd(x))
    plan = m.cached.gear_life.plan
    assert [d.pad_value for d in plan.dims] == [-math.inf] and plan.verified == {(4,)}
    plan.dims[0].pad_value = 0.0
    leaves, key = signature.call_key((x,), {})
    with torch.no_grad(), pytest.raises(PaddingUnsafeError) as info:
        padding_check.verify(m.cached.name, m.fwd, m, plan, key[0], leaves, [4])
    text = str(info.value)
    assert "the padding analysis proved gear [4] exact (pad values: x=0), but padding changes output 0" in text
    assert "in float64 (real sizes [3]" in text and "bug of gearcache's padding analysis" in text


# ------------------------------------------------------------------------------------------------- lockstep
def test_dims_that_meet_must_have_equal_real_sizes(tmp_path):
    m = KVStep(tmp_path, _config(x={0: [4]}, kv={0: [4]}))
    with torch.no_grad(), counters.expect(compiles=0), pytest.raises(gearcache.ConfigError, match="must be equal"):
        m.cached_setitem(torch.randn(1, 1, 4), torch.zeros(3, 6, 4), torch.tensor([0]))


# ----------------------------------------------------------------------------------------------------- GPU
@needs_cuda
def test_cuda_graphs_copy_a_padded_input_written_in_place_back_after_the_replay(tmp_path):
    """Under CUDA graphs a padded input is copied into the graph's static buffer; the graph's write into it is
    copied back into the caller's tensor (its real rows) after each replay, as mode="default" does after a run."""
    cfg = _config(x={0: [4]}, kv={0: [4]})
    cfg.mode = "reduce-overhead"
    m = KVStep(tmp_path, cfg).cuda()
    twin = KVStep(tmp_path).cuda()
    twin.load_state_dict(m.state_dict())
    with torch.inference_mode():
        for step in range(3):
            x, kv = torch.randn(3, 1, 4, device="cuda"), torch.randn(3, 6, 4, device="cuda")
            kv_e, pos = kv.clone(), torch.tensor([step], device="cuda")
            torch.testing.assert_close(m.cached(x, kv, pos), twin.fwd(x, kv_e, pos))
            torch.testing.assert_close(kv, kv_e)
    assert counters.graph_captures >= 1


@needs_cuda
def test_cuda_graphs_refuse_a_batch_mean_before_any_capture(tmp_path):
    cfg = _config(x={0: [4]})
    cfg.mode = "reduce-overhead"
    m = Center(tmp_path, cfg).cuda()
    with torch.inference_mode(), counters.expect(padding_verifications=0, graph_captures=0), \
            pytest.raises(PaddingUnsafeError, match="a mean divides by the padded count"):
        m.cached(torch.randn(3, 4, device="cuda"))
