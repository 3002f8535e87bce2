"""Padding that never changes state or results (gearcache/padding_check.py, on the analysis of padding.py): unsafe
writes refused, mixing verified (or refused), padded inputs written in place copied back; outputs and every mutated
tensor equal eager in the compiling process and in a warm one. The GPU test needs CUDA (GEARCACHE_TEST_DEVICE=cuda on
the device machine); on CPU it is skipped."""
import pytest
import torch

import gearcache
from conftest import Script
from gear_models import Center, KVStep, RunningSum, SeenRows
from gearcache import CompilerConfig, PaddingUnsafeError, counters, set_dim_gears

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


def _config(policy: str = "verify", **gears) -> CompilerConfig:
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = gears
    if policy != "verify":                      # (the default)
        cfg.inference_config.padding_check = policy
    return cfg


@pytest.fixture(scope="module")
def padding_runs(tmp_path_factory) -> tuple[dict, dict]:
    """Reports of tests/scripts/run_padding.py on one folder: a cold process (compiles), then a warm one with compile
    hooks (loads)."""
    cache = tmp_path_factory.mktemp("padding")
    cold = Script("run_padding.py", str(cache)).result()
    return cold, Script("run_padding.py", str(cache), "--hooks").result()


# ------------------------------------------------------------------------------------------- served exactly
def test_outputs_and_written_tensors_equal_eager_in_the_compiling_process(padding_runs):
    cold, _ = padding_runs
    for name in ("kv_step", "running_sum", "batch_softmax"):
        assert cold[name]["equal"], name
        assert cold[name]["counters"]["compiles"] == 1 and cold[name]["counters"]["pads"] == 6
    assert cold["kv_step"]["counters"]["padding_verifications"] == 0, "padding-safe: never verified"
    assert cold["running_sum"]["counters"]["padding_verifications"] == 1, "verified once (pad 0 is neutral)"
    assert cold["batch_softmax"]["counters"]["padding_verifications"] == 1, "verified once (pad -inf is neutral)"


def test_a_warm_process_equals_eager_and_compiles_nothing(padding_runs):
    _, warm = padding_runs
    for name in ("kv_step", "running_sum", "batch_softmax"):
        got = warm[name]["counters"]
        assert warm[name]["equal"], name
        assert got["loads"] == 1 and got["compiles"] == 0 and got["traces"] == 0, name
    assert warm["kv_step"]["counters"]["padding_verifications"] == 0
    assert warm["running_sum"]["counters"]["padding_verifications"] == 1, "once per gear per process"
    assert warm["hooks"]["dynamo_frames"] == 0 and warm["hooks"]["inductor_compiles"] == 0


@pytest.mark.parametrize("process", ["cold", "warm"])
def test_a_state_write_and_a_batch_mean_are_refused_in_both_processes(padding_runs, process):
    """The issue's two measured bugs, on a batch of 3 served by gear 4: ``self.seen[:B].copy_(x)`` (eager writes rows
    0-2; the padded call would also zero row 3) and ``h - h.mean(0)`` (the mean takes in a pad row). A warm process
    refuses them from the stored plan's padding report: no trace, no compile."""
    run = dict(zip(("cold", "warm"), padding_runs))[process]
    seen, center = run["seen_rows"], run["center"]
    assert seen["error"] is not None and "self.seen[: x.shape[0]].copy_(x)" in seen["error"]
    assert "into parameter or buffer seen" in seen["error"] and "Fix: " in seen["error"]
    assert seen["state_unchanged"], "refused before anything ran: the buffer keeps row 3"
    assert seen["counters"]["padding_verifications"] == 0 and seen["counters"]["compiles"] == 0
    assert center["error"] is not None and "padding changes output 0 at gear [4] (real sizes [3]" in center["error"]
    assert "h - h.mean(0)" in center["error"]
    assert center["counters"]["padding_verifications"] == 1 and center["counters"]["compiles"] == 0
    for case in (seen, center):
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


def test_a_reduction_over_the_batch_is_refused_on_its_first_padded_call(tmp_path):
    m = Center(tmp_path, _config(x={0: [4]}))
    with torch.no_grad(), counters.expect(compiles=0, padding_verifications=1), \
            pytest.raises(PaddingUnsafeError) as info:
        m.cached(torch.randn(3, 4))
    text = str(info.value)
    assert "padding changes output 0 at gear [4] (real sizes [3]" in text
    assert "aten.mean.dim at gear_models.py:" in text and "h - h.mean(0)" in text
    assert "pad_value" in text and "-inf before a softmax" in text


def test_warmup_verifies_before_compiling_also_on_random_rows(tmp_path):
    """Gear 4 is checked at real size 2 (gear 1 is never padded). On warmup()'s example of zeros real and pad rows
    are alike, so the mean does not change; the second run, on random rows, shows it."""
    m = Center(tmp_path, _config(x={0: [1, 4]}))
    with torch.no_grad(), counters.expect(compiles=0, padding_verifications=1), \
            pytest.raises(PaddingUnsafeError, match=r"at gear \[4\] \(real sizes \[2\], random rows"):
        m.cached.warmup(torch.zeros(4, 4))


def test_refuse_policy_refuses_mixing_when_the_plan_is_built(tmp_path):
    m = Center(tmp_path, _config("refuse", x={0: [4]}))
    with torch.no_grad(), counters.expect(compiles=0, padding_verifications=0), \
            pytest.raises(PaddingUnsafeError, match=r"padding may change results: aten\.mean\.dim .*'refuse'"):
        m.cached(torch.randn(3, 4))


def test_a_state_update_with_a_pad_value_that_is_not_neutral_is_refused(tmp_path):
    m = RunningSum(tmp_path, _config())
    x = set_dim_gears(torch.randn(3, 4), {0: [4]}, pad_value=1.0)
    with torch.no_grad(), counters.expect(compiles=0), pytest.raises(PaddingUnsafeError) as info:
        m.cached(x)
    assert "padding changes output 0" in str(info.value) and "reaches parameter or buffer total" in str(info.value)
    assert torch.equal(m.total, torch.zeros(4)), "verification restored the buffer"


def test_off_serves_without_checking(tmp_path):
    m = Center(tmp_path, _config("off", x={0: [4]}))
    x = torch.randn(3, 4)
    with torch.no_grad(), counters.expect(compiles=1, padding_verifications=0):
        out = m.cached(x)
    assert not torch.allclose(out, m.fwd(x), atol=1e-4), "off: the user asserted padding is exact (it is not)"


# ------------------------------------------------------------------------------------------------- lockstep
def test_dims_that_meet_must_have_equal_real_sizes(tmp_path):
    m = KVStep(tmp_path, _config(x={0: [4]}, kv={0: [4]}))
    with torch.no_grad(), counters.expect(compiles=0), pytest.raises(gearcache.ConfigError, match="must be equal"):
        m.cached_setitem(torch.randn(1, 1, 4), torch.zeros(3, 6, 4), torch.tensor([0]))


# ----------------------------------------------------------------------------------------------------- GPU
@needs_cuda
def test_cuda_graphs_refuse_a_padded_input_written_in_place(tmp_path):
    cfg = _config(x={0: [4]}, kv={0: [4]})
    cfg.mode = "reduce-overhead"
    m = KVStep(tmp_path, cfg).cuda()
    with torch.inference_mode(), pytest.raises(gearcache.UnsupportedInputError, match="has gears and the method "
                                                                                    "writes it in place"):
        m.cached(torch.randn(3, 1, 4, device="cuda"), torch.zeros(3, 6, 4, device="cuda"),
                 torch.tensor([0], device="cuda"))


@needs_cuda
def test_cuda_graphs_verify_mixing_before_a_padded_replay(tmp_path):
    cfg = _config(x={0: [4]})
    cfg.mode = "reduce-overhead"
    m = Center(tmp_path, cfg).cuda()
    with torch.inference_mode(), counters.expect(padding_verifications=1, graph_captures=0), \
            pytest.raises(PaddingUnsafeError, match="padding changes output 0"):
        m.cached(torch.randn(3, 4, device="cuda"))
