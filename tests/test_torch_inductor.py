"""gearcache/_torch/inductor.py: Inductor's kernel-compile pool started by a compile on CUDA (the GPU test runs on
the device machine: ``GEARCACHE_TEST_DEVICE=cuda python -m pytest tests/test_torch_inductor.py``)."""
import pytest
import torch

from conftest import run_script

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device)")


@needs_cuda
def test_a_cold_compile_on_cuda_starts_inductors_compile_pool_before_its_first_kernel(tmp_path, empty_torch_caches):
    report = run_script("run_compile_pool.py", str(tmp_path / "cache"), env=empty_torch_caches)
    assert report["compiles"] == 1 and report["kernels"] >= 1, report
    assert report["max_diff"] < 1e-4, report
    if report["compile_threads"] <= 1:
        pytest.fail(f"this host gives Inductor one compile thread: the pool is never used ({report})")
    assert report["pool_before_first_kernel"], report
