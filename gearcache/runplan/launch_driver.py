"""Triton kernels that torch's static launcher cannot take, launched through the CUDA driver's ``cuLaunchKernelEx``.

torch's static launcher (launch_static.py) covers the common case in one C++ call. It refuses kernels that need
launch attributes or memory it does not provide: thread-block clusters (``num_ctas > 1``), global or profile scratch
memory, programmatic dependent launch (PDL) and cooperative grids. This launcher does what Triton's own generated
launcher does for them (``third_party/nvidia/backend/driver.py``), with ``ctypes`` and the driver library:

- grid ``(grid_0 * num_ctas, grid_1, grid_2)`` with a cluster of ``(num_ctas, 1, 1)`` and the spread scheduling
  policy, or the kernel's ``cluster_dims`` where Triton recorded them (the grid multiplied by them);
- ``32 * num_warps`` threads a block, ``shared`` bytes of dynamic shared memory;
- scratch memory of ``size * blocks * num_ctas`` bytes, aligned, taken from torch's caching allocator on the current
  stream (kept until the launch is queued; stream order makes its reuse safe), passed after the kernel's arguments.

The kernel's module is loaded by torch's static launcher (``_load_kernel``, which also raises the dynamic shared
memory limit). Packing the arguments in Python costs a few microseconds a launch more than the static path; only the
kernels that need it take this path. The plan writer's exactness check runs every such kernel before a plan is kept.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
import struct
from typing import Any, Callable

import torch

from .._torch import runplan as torch_runplan
from ..errors import RunPlanUnavailable
from .launch_static import compile_launcher, launcher_source

# cuda.h: CUlaunchAttributeID, CUclusterSchedulingPolicy, CUfunction_attribute
_ATTR_COOPERATIVE = 2
_ATTR_CLUSTER_DIMENSION = 4
_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CLUSTER_SCHEDULING_POLICY_SPREAD = 1
_FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: a 4-byte id, padding to 8, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RunPlanUnavailable(f"the CUDA driver library cannot be opened: {exc}") from None
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"gearcache: {what} failed with {(name.value or b'?').decode()} ({result})")


def _pointer(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    pointer: int = value.data_ptr()
    return pointer


def _fp16_bits(value: float) -> int:
    bits: int = struct.unpack("<H", struct.pack("<e", value))[0]
    return bits


def _bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF


# One converter per argument-type character: a Python value -> a ctypes value the kernel reads.
_PACK: dict[str, Callable[[Any], Any]] = {
    "O": lambda v: ctypes.c_uint64(_pointer(v)),
    "i": ctypes.c_int32, "l": ctypes.c_int64, "I": ctypes.c_uint32, "K": ctypes.c_uint64,
    "b": ctypes.c_int8, "h": ctypes.c_int16, "B": ctypes.c_uint8, "H": ctypes.c_uint16,
    "f": ctypes.c_float, "d": ctypes.c_double,
    "e": lambda v: ctypes.c_uint16(_fp16_bits(v)), "E": lambda v: ctypes.c_uint16(_bf16_bits(v)),
}


def _attribute(attr_id: int, value: bytes) -> _LaunchAttribute:
    attr = _LaunchAttribute()
    attr.id = attr_id
    # Byte for byte: assigning bytes to a c_char array would stop at the first NUL.
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, value, len(value))
    return attr


class DriverLaunch:
    """Stands for Inductor's ``CachingAutotuner`` after autotuning, for a kernel launched through the driver."""
    __slots__ = ("run", "_function", "_attrs", "_launch")

    def __init__(self, name: str, spec: dict[str, Any], folder: pathlib.Path, device_index: int):
        types = spec["arg_types"]
        unknown = sorted(set(types) - set(_PACK))
        if unknown:
            raise RunPlanUnavailable(f"{name}: argument types {unknown} the driver launcher does not pack")
        self._function = torch_runplan.load_cubin(str(folder / spec["cubin"]), spec["function"], spec["shared"],
                                           device_index)
        cluster = [int(c) for c in spec.get("cluster_dims") or (1, 1, 1)]
        num_ctas = int(spec.get("num_ctas", 1))
        if num_ctas > 1 and cluster == [1, 1, 1]:
            cluster = [num_ctas, 1, 1]
        attrs = []
        if spec.get("launch_pdl"):
            attrs.append(_attribute(_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, struct.pack("<i", 1)))
        if spec.get("launch_cooperative_grid"):
            attrs.append(_attribute(_ATTR_COOPERATIVE, struct.pack("<i", 1)))
        if cluster != [1, 1, 1]:
            attrs.append(_attribute(_ATTR_CLUSTER_DIMENSION, struct.pack("<III", *cluster)))
            attrs.append(_attribute(_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                    struct.pack("<i", _CLUSTER_SCHEDULING_POLICY_SPREAD)))
            if cluster[0] * cluster[1] * cluster[2] > 8:
                _check(_driver().cuFuncSetAttribute(self._function, _FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                                    1), f"{name}: allowing a non-portable cluster size")
        self._attrs = (_LaunchAttribute * max(1, len(attrs)))(*attrs)
        self._launch = _make_launch(name, spec, self._function, self._attrs, len(attrs), cluster, device_index)
        n_scratch = int(spec.get("scratch_args", 0))
        args = ", ".join([*spec["call_args"], *["None"] * n_scratch])     # scratch: allocated by launch()
        self.run = compile_launcher(name, launcher_source(spec, f"launch(grid_0, grid_1, grid_2, stream, {args})"),
                                    {"launch": self._launch})


def _make_launch(name: str, spec: dict[str, Any], function: int, attrs: Any, num_attrs: int, cluster: list[int],
                 device_index: int) -> Callable[..., None]:
    """``launch(grid_0, grid_1, grid_2, stream, *args, *scratch placeholders)``: packs the arguments, allocates the
    scratch memory and calls ``cuLaunchKernelEx``."""
    pack = [_PACK[t] for t in spec["arg_types"]]
    n_args = len(pack)
    scratch = [(int(spec.get(f"{kind}_scratch_size", 0)), int(spec.get(f"{kind}_scratch_align", 1) or 1))
               for kind in ("global", "profile")][:int(spec.get("scratch_args", 0))]
    threads, shared = 32 * int(spec["num_warps"]), int(spec["shared"])
    device = torch.device("cuda", device_index)
    driver = _driver()
    ParamArray = ctypes.c_void_p * (n_args + len(scratch))

    def launch(grid_0: int, grid_1: int, grid_2: int, stream: int, *args: Any) -> None:
        grid = (grid_0 * cluster[0], grid_1 * cluster[1], grid_2 * cluster[2])
        if grid[0] * grid[1] * grid[2] == 0:
            return
        values = [p(v) for p, v in zip(pack, args[:n_args])]
        keep = []                       # scratch tensors, alive until the launch is queued
        for size, align in scratch:
            if size > 0:
                nbytes = size * grid[0] * grid[1] * grid[2]
                buffer = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
                keep.append(buffer)
                values.append(ctypes.c_uint64((buffer.data_ptr() + align - 1) // align * align))
            else:
                values.append(ctypes.c_uint64(0))
        params = ParamArray(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        config = _LaunchConfig(grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, attrs, num_attrs)
        _check(driver.cuLaunchKernelEx(ctypes.byref(config), function, params, None), f"launching {name}")

    return launch
