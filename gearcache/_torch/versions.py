"""Version probes: which torch this is, and what compiled code depends on about the software and the device.

Consumers: the cache key (gearcache/cached_function.py, gearcache/compiling/entry_life.py and
torch_compile_backend.py: the ``software`` and ``devices`` key factors) and ``gearcache check``
(gearcache/cli/checks.py).
Public torch APIs, except ``torch.cpu._is_<extension>_supported`` (:func:`device_capability`'s CPU extensions).
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys
from typing import cast

import torch

TORCH_VERSION = cast(tuple[int, int], tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]))
"""``(major, minor)`` of the running torch (supported: 2.11 to 2.15, README "Supported torch versions")."""


TORCH_VERSION = cast(tuple[int, int], tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]))


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def software_versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "triton": _dist_version("triton"),
            "cuda": str(torch.version.cuda), "platform": platform.machine()}


@functools.cache
def device_capability(device: str) -> str:
    """What the compiled code depends on about a device: the GPU's name and compute capability, or the CPU's ISA."""
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return f"cuda:sm_{major}{minor}:{torch.cuda.get_device_name(idx)}"
    if dev.type == "cpu":
        extras = "+".join(name for name in CPU_ISA_EXTRAS if _cpu_supports(name))
        return f"cpu:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}" + (f"+{extras}" if extras else "")
    return dev.type


# Instruction-set extensions beyond ATen's CPU capability for which Inductor adds compiler flags when the CPU has them
# (-mavx512bf16, -mavx512vnni, -mamx-tile, -mamx-fp16: torch._inductor.cpu_vec_isa): kernels built with them may not
# run on a CPU of the same capability that lacks them, so they are part of the device's key factor.
CPU_ISA_EXTRAS = ("avx512_bf16", "vnni", "amx_tile", "amx_fp16")


def _cpu_supports(extension: str) -> bool:
    """``torch.cpu._is_<extension>_supported()`` (reads the CPU's flags; False where torch has no such check)."""
    check = getattr(torch.cpu, f"_is_{extension}_supported", None)
    return bool(check()) if check is not None else False

