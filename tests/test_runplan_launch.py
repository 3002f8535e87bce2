"""Launch paths of run plans (gearcache/runplan/launch_static.py, launch_driver.py) and the launch records the writer
builds for them (kernel_records.py). These run on CPU: the CUDA launchers are replaced by recorders that keep what
a launch was given. tests/test_runplan_gpu.py runs both paths on real kernels on the GPU."""
import ctypes
import struct
import types

import pytest
import torch

from gearcache.runplan import kernel_records, launch_driver, launch_static
from gearcache.errors import NoPlan


def _spec(**extra):
    return {"cubin": "runplan/kernels/K.cubin", "function": "triton_poi_0", "shared": 0, "num_warps": 4,
            "arg_types": "OOiOO", "scratch_args": 2, "def_args": ["in_ptr0", "out_ptr0", "xnumel"],
            "call_args": ["in_ptr0", "out_ptr0", "xnumel"], "grid_prefix": [],
            "grid": ["-((xnumel) // -(512))", "1", "1"], **extra}


def test_static_launcher_computes_the_grid_and_passes_the_cubin_arguments(tmp_path, monkeypatch):
    launches = []
    monkeypatch.setattr(launch_static.torch_runplan, "load_cubin", lambda path, fn, shared, device: ("handle", path, fn,
                                                                                              device))
    monkeypatch.setattr(launch_static.torch_runplan, "cubin_launcher", lambda: lambda *a: launches.append(a))
    kernel = launch_static.StaticLaunch("triton_poi_0", _spec(), tmp_path, 1)
    kernel.run("a", "b", 1025, stream=7)
    handle = ("handle", str(tmp_path / "runplan/kernels/K.cubin"), "triton_poi_0", 1)
    assert launches == [(handle, 3, 1, 1, 4, 0, "OOiOO", ("a", "b", 1025, None, None), 7)]


def test_kernels_of_one_launch_record_share_its_compiled_code_and_launch_their_own_cubins(tmp_path, monkeypatch):
    """A method's gears load the same kernels: the launcher's source is compiled once per process, and each kernel
    still launches its own module's function (its own globals), with the grid of its own arguments."""
    launches = []
    monkeypatch.setattr(launch_static.torch_runplan, "load_cubin", lambda path, fn, shared, device: (path, device))
    monkeypatch.setattr(launch_static.torch_runplan, "cubin_launcher", lambda: lambda *a: launches.append(a))
    name = f"triton_poi_shared_{id(tmp_path)}"          # a name no other test compiled
    compiled = launch_static._launcher_code.cache_info().misses
    one = launch_static.StaticLaunch(name, _spec(), tmp_path / "gear1", 0)
    two = launch_static.StaticLaunch(name, _spec(), tmp_path / "gear2", 1)
    other = launch_static.StaticLaunch(name, _spec(num_warps=8), tmp_path / "gear2", 1)
    assert launch_static._launcher_code.cache_info().misses == compiled + 2, "one compile per distinct launcher"
    assert one.run.__code__ is two.run.__code__ and one.run is not two.run
    assert other.run.__code__ is not one.run.__code__
    one.run("a", "b", 513, stream=1)
    two.run("c", "d", 100, stream=2)
    assert [(a[0], a[1], a[4], a[-1]) for a in launches] == [
        ((str(tmp_path / "gear1/runplan/kernels/K.cubin"), 0), 2, 4, 1),
        ((str(tmp_path / "gear2/runplan/kernels/K.cubin"), 1), 1, 4, 2)]


def test_driver_launch_structures_have_cuda_h_layout():
    """``CUlaunchAttribute`` is 72 bytes (id, padding, a 64-byte union); ``CUlaunchConfig`` 56 with the stream at 32."""
    assert ctypes.sizeof(launch_driver._LaunchAttribute) == 72
    assert launch_driver._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(launch_driver._LaunchConfig) == 56
    assert launch_driver._LaunchConfig.hStream.offset == 32
    assert launch_driver._LaunchConfig.attrs.offset == 40 and launch_driver._LaunchConfig.numAttrs.offset == 48


def test_driver_packs_each_argument_type_as_the_kernel_reads_it():
    pack = launch_driver._PACK
    x = torch.zeros(4)
    assert pack["O"](x).value == x.data_ptr() and pack["O"](None).value == 0 and pack["O"](1234).value == 1234
    assert pack["i"](-3).value == -3 and pack["l"](2 ** 40).value == 2 ** 40 and pack["K"](2 ** 63).value == 2 ** 63
    assert pack["e"](1.0).value == 0x3C00                  # fp16 1.0
    assert pack["E"](1.0).value == 0x3F80                  # bf16 1.0
    assert pack["E"](-2.5).value == 0xC020
    assert abs(pack["f"](0.1).value - 0.1) < 1e-7 and pack["d"](0.1).value == 0.1


class _RecordingDriver:
    """Stands for libcuda on a machine without one: keeps what ``cuLaunchKernelEx`` was given."""

    def __init__(self, param_types):
        self.param_types, self.launches, self.attributes = param_types, [], []

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(launch_driver._LaunchConfig)).contents
        values = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(self.param_types)]
        attrs = [(config.attrs[i].id, ctypes.string_at(ctypes.addressof(config.attrs[i]) + 8, 12))
                 for i in range(config.numAttrs)]
        self.launches.append({"grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
                              "block": config.blockDimX, "shared": config.sharedMemBytes,
                              "stream": config.hStream, "function": function, "params": values, "attrs": attrs})
        return 0

    def cuFuncSetAttribute(self, function, attribute, value):
        self.attributes.append((function, attribute, value))
        return 0


def test_driver_launch_sets_clusters_pdl_and_passes_every_argument(tmp_path, monkeypatch):
    recorder = _RecordingDriver([ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint16])
    monkeypatch.setattr(launch_driver, "_driver", lambda: recorder)
    monkeypatch.setattr(launch_driver.torch_runplan, "load_cubin", lambda path, fn, shared, device: 0xF00D)
    spec = _spec(launcher="driver", arg_types="OOie", scratch_args=0, shared=1024, num_warps=8,
                 def_args=["in_ptr0", "out_ptr0", "xnumel", "scale"], call_args=["in_ptr0", "out_ptr0", "xnumel",
                                                                                 "scale"],
                 num_ctas=2, cluster_dims=[1, 1, 1], launch_pdl=True, launch_cooperative_grid=False,
                 global_scratch_size=0, profile_scratch_size=0)
    kernel = launch_driver.DriverLaunch("triton_poi_0", spec, tmp_path, 0)
    x = torch.zeros(4)
    kernel.run(x, None, 1025, 1.0, stream=99)
    (launch,) = recorder.launches
    assert launch["grid"] == (3 * 2, 1, 1)                 # Triton: grid x times num_ctas, a cluster of num_ctas
    assert launch["block"] == 256 and launch["shared"] == 1024 and launch["stream"] == 99
    assert launch["function"] == 0xF00D
    assert launch["params"] == [x.data_ptr(), 0, 1025, 0x3C00]
    assert launch["attrs"] == [
        (launch_driver._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, struct.pack("<i", 1).ljust(12, b"\0")),
        (launch_driver._ATTR_CLUSTER_DIMENSION, struct.pack("<III", 2, 1, 1)),
        (launch_driver._ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE, struct.pack("<i", 1).ljust(12, b"\0"))]
    kernel.run(x, None, 0, 1.0, stream=99)                  # an empty grid launches nothing
    assert len(recorder.launches) == 1


def test_driver_launch_passes_null_scratch_pointers_when_the_kernel_needs_no_scratch(tmp_path, monkeypatch):
    """Triton 3.3+ kernels take global and profile scratch pointers after their arguments, whether they use them
    or not."""
    recorder = _RecordingDriver([ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64])
    monkeypatch.setattr(launch_driver, "_driver", lambda: recorder)
    monkeypatch.setattr(launch_driver.torch_runplan, "load_cubin", lambda path, fn, shared, device: 0xF00D)
    spec = _spec(launcher="driver", num_ctas=1, cluster_dims=[1, 1, 1], launch_pdl=False,
                 launch_cooperative_grid=False, global_scratch_size=0, profile_scratch_size=0)
    x = torch.zeros(4)
    launch_driver.DriverLaunch("triton_poi_0", spec, tmp_path, 0).run(x, x, 600, stream=3)
    (launch,) = recorder.launches
    assert launch["params"] == [x.data_ptr(), x.data_ptr(), 600, 0, 0] and launch["grid"] == (2, 1, 1)
    assert launch["attrs"] == []


def test_driver_refuses_argument_types_it_cannot_pack(tmp_path):
    with pytest.raises(launch_driver.RunPlanUnavailable, match="argument types"):
        launch_driver.DriverLaunch("k", _spec(launcher="driver", arg_types="OOz"), tmp_path, 0)


def _src(signature, constants=None):
    fn = types.SimpleNamespace(arg_names=list(signature), __name__="k")
    return types.SimpleNamespace(signature=signature, constants=constants or {}, fn=fn)


def test_record_argument_types_skip_constexprs_and_name_16_bit_floats():
    src = _src({"in_ptr0": "*fp32", "out_ptr0": "*bf16", "xnumel": "i32", "scale": "fp16", "XBLOCK": "constexpr",
                "unused": "i64"}, constants={(5,): 1})
    codes, constexprs = kernel_records._arg_types("k", src, src.fn.arg_names)
    assert codes == "OOie" and constexprs == {4, 5}


def test_records_refuse_tma_descriptors_with_a_reason():
    src = _src({"desc": "tensordesc<bf16[64, 64]>", "n": "i32"})
    with pytest.raises(NoPlan, match="TMA"):
        kernel_records._arg_types("k", src, src.fn.arg_names)


def test_cubin_of_a_long_kernel_name_is_found_under_tritons_truncated_file_name():
    """Triton names a kernel's files after its first 150 characters; Inductor looks for the whole name (and falls
    back to Triton's launcher when it is longer): the writer finds it either way."""
    name = "triton_poi_fused_" + "_".join(["abs", "add", "cos", "exp", "mul", "neg", "sin", "tanh"] * 5)
    assert len(name) > kernel_records.TRITON_NAME_LIMIT
    cubins = {("h", name[:150] + ".cubin"): b"cubin"}
    assert kernel_records._cubin_from_bundle(cubins, "h", name) == b"cubin"
    assert kernel_records._cubin_from_bundle(cubins, "other", name) is None


def test_launcher_choice_takes_the_static_path_only_where_it_launches_exactly():
    base = {"num_ctas": 1, "cluster_dims": [1, 1, 1], "launch_pdl": False, "launch_cooperative_grid": False,
            "global_scratch_size": 0, "profile_scratch_size": 0}
    assert kernel_records.choose_launcher(base, "OOi") == "static"
    for change in [{"num_ctas": 2}, {"cluster_dims": [2, 1, 1]}, {"launch_pdl": True},
                   {"launch_cooperative_grid": True}, {"global_scratch_size": 64}, {"profile_scratch_size": 8}]:
        assert kernel_records.choose_launcher({**base, **change}, "OOi") == "driver", change
    assert kernel_records.choose_launcher(base, "OOE") == "driver"
