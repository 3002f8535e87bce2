"""Run plans on real GPU kernels: kernels whose names Triton truncates, every kernel through the driver launcher, and
a thread-block-cluster kernel. They need CUDA: on the device machine run
``GEARCACHE_TEST_DEVICE=cuda python -m pytest tests/test_runplan_gpu.py``; tests/test_runplan_launch.py covers the
same launchers on CPU with a recording driver."""
import pytest
import torch

from conftest import run_script
from gearcache.runplan import kernel_records

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device)")


def _kernels(report):
    return {name: k for plan in report["plans"] for name, k in plan["kernels"].items()}


@needs_cuda
def test_kernels_with_long_names_load_through_their_plans(tmp_path, empty_torch_caches):
    cold = run_script("run_long_names.py", str(tmp_path / "cache"), env=empty_torch_caches)
    assert cold["max_diff"] < 1e-4 and cold["max_diff_again"] < 1e-4
    assert all(p["supported"] for p in cold["plans"]), cold["plans"]
    lengths = [k["name_length"] for k in _kernels(cold).values()]
    assert max(lengths) > kernel_records.TRITON_NAME_LIMIT, lengths     # the case this test is for
    warm = run_script("run_long_names.py", str(tmp_path / "cache"), "--hooks", env=empty_torch_caches)
    assert warm["counters"]["direct_loads"] == warm["counters"]["loads"] >= 1
    assert warm["hooks"]["inductor_compiles"] == 0 and warm["hooks"]["triton_compiles"] == 0
    assert warm["max_diff"] < 1e-4 and warm["max_diff_again"] < 1e-4


@needs_cuda
def test_driver_launcher_runs_real_inductor_kernels(tmp_path, empty_torch_caches):
    cold = run_script("run_long_names.py", str(tmp_path / "cache"), "--force-driver", env=empty_torch_caches)
    kernels = _kernels(cold)
    assert kernels and all(k["launcher"] == "driver" for k in kernels.values()), kernels
    warm = run_script("run_long_names.py", str(tmp_path / "cache"), env=empty_torch_caches)
    assert warm["counters"]["direct_loads"] == warm["counters"]["loads"] >= 1
    assert warm["compiler_modules"] == []
    assert warm["max_diff"] < 1e-4 and warm["max_diff_again"] < 1e-4


@needs_cuda
def test_driver_launcher_runs_a_cluster_kernel_as_triton_does(tmp_path):
    """A Triton kernel compiled with ``num_ctas=2`` (a cluster of two blocks on Hopper) launched from its record."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need compute capability 9.0")
    import triton
    import triton.language as tl

    from gearcache.runplan import launch_driver

    @triton.jit
    def scale_add(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 3.0 + 1.0, mask=mask)

    x = torch.randn(5000, device="cuda")
    want = torch.full_like(x, float("nan"))
    compiled = scale_add[(triton.cdiv(5000, 256),)](x, want, 5000, BLOCK=256, num_ctas=2)
    md = compiled.metadata
    assert getattr(md, "num_ctas", 1) == 2
    (tmp_path / "k.cubin").write_bytes(compiled.asm["cubin"])
    spec = {"cubin": "k.cubin", "function": md.name, "shared": md.shared, "num_warps": md.num_warps,
            "arg_types": "OOi" + "O" * 2, "scratch_args": 2, "def_args": ["x_ptr", "out_ptr", "n"],
            "call_args": ["x_ptr", "out_ptr", "n"], "grid_prefix": [], "grid": ["-((n) // -(256))", "1", "1"],
            "launcher": "driver", "num_ctas": 2, "cluster_dims": [1, 1, 1], "launch_pdl": False,
            "launch_cooperative_grid": False,
            "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0), "global_scratch_align": 1,
            "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0), "profile_scratch_align": 1}
    kernel = launch_driver.DriverLaunch("scale_add", spec, tmp_path, torch.cuda.current_device())
    got = torch.full_like(x, float("nan"))
    kernel.run(x, got, 5000, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.allclose(got, x * 3 + 1, atol=1e-5)      # Triton fuses the multiply-add (FMA rounding)
