"""Artifacts free of the device index, on real GPUs: compiled on cuda:0 in one process, the same artifact loads and
runs on cuda:1 in another, with nothing compiled. Needs two GPUs: on the device machine run
``python -m pytest tests/test_device_index_gpu.py``. CPU coverage: tests/test_runplan_device_binding.py (the
wrapper rewrite, the loader's binding) and tests/test_ranks.py (ranks sharing one artifact)."""
import pytest
import torch

from conftest import run_script

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (run on the device)")


@needs_two_gpus
def test_artifact_compiled_on_gpu0_runs_on_gpu1_without_compiling(tmp_path, empty_torch_caches):
    cache = str(tmp_path / "cache")
    cold = run_script("run_device_index.py", cache, "0", "0", env=empty_torch_caches)
    assert cold["counters"]["compiles"] == 1 and cold["max_diff"] < 1e-5, cold
    (akey, plan), = cold["plans"].items()
    assert plan["supported"] and plan["device_free"] and plan["device_index"] == 0, plan
    other = run_script("run_device_index.py", cache, "1", "1", env=empty_torch_caches)
    assert other["out_device"] == "cuda:1" and other["current_device"] == 0, "the output is made on the live GPU"
    assert other["max_diff"] < 1e-5 and other["max_diff_again"] < 1e-5
    assert other["counters"]["compiles"] == 0 and other["counters"]["direct_loads"] == 1, other["counters"]
    assert other["hooks"]["inductor_compiles"] == 0 and other["hooks"]["triton_compiles"] == 0, other["hooks"]
    assert list(other["plans"]) == [akey], "one artifact for both GPUs"
    warm = run_script("run_device_index.py", cache, "1", "1", env=empty_torch_caches)
    assert warm["counters"]["traces"] == 0 and warm["counters"]["compiles"] == 0 and warm["max_diff"] < 1e-5


@needs_two_gpus
def test_artifact_bound_to_gpu0_is_compiled_again_for_gpu1(tmp_path, empty_torch_caches):
    """An artifact without a run plan would run on cuda:0 through torch's loader: cuda:1 gets its own."""
    cache = str(tmp_path / "cache")
    cold = run_script("run_device_index.py", cache, "0", "0", "--bound", env=empty_torch_caches)
    (plan0,) = cold["plans"].values()
    assert not plan0["supported"] and not plan0["device_free"] and plan0["device_index"] == 0, plan0
    other = run_script("run_device_index.py", cache, "1", "1", "--bound", env=empty_torch_caches)
    assert other["counters"]["compiles"] == 1 and other["out_device"] == "cuda:1" and other["max_diff"] < 1e-5
    assert sorted(p["device_index"] for p in other["plans"].values()) == [0, 1], other["plans"]
