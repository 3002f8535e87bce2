"""What gearcache's own loader and writer of run plans (gearcache/runplan/) need of torch's private API.

The run-time half (:func:`assert_size_stride`, :data:`CPP_KERNEL_ENV`, :func:`cpp_kernel_env_value`,
:func:`load_cubin`, :func:`cubin_launcher`, :func:`grad_mode_setter`, :func:`operator_ref`) touches ``torch._C`` only,
never the compiler: a warm process imports nothing from ``torch._inductor`` or triton. The writer's half
(:func:`load_cache_entry`, the Triton helpers) runs in a compiling process only and imports torch's compiler lazily,
inside each function.
"""
from __future__ import annotations

import pathlib
import pickle
from typing import Any, Callable

import torch

# the environment variable Inductor's C++ kernel libraries read their tensor data-pointer offset from at import
CPP_KERNEL_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def assert_size_stride(tensor: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...],
                       op_name: str | None = None) -> None:
    """The C check Inductor's wrappers run on a kernel's output (``torch._C._dynamo.guards.assert_size_stride``,
    which ``torch._inductor.runtime.runtime_utils.assert_tensor_metadata`` calls in 2.15): AssertionError naming the
    differing size or stride."""
    torch._C._dynamo.guards.assert_size_stride(tensor, size, stride, op_name)


def cpp_kernel_env_value() -> str:
    """What Inductor's C++ kernel libraries read from ``CPP_KERNEL_ENV`` when imported (their tensor data-pointer
    offset; ``CppPythonBindingsCodeCache._load_library_inner`` sets it the same way)."""
    guards = torch._C._dynamo.guards
    return str(guards._torchinductor_pyobject_tensor_data_ptr)  # type: ignore[attr-defined]  # missing in torch's stubs


def load_cubin(path: str, function: str, shared: int, device: int) -> int:
    """Load a kernel from a cubin with torch's static CUDA launcher; returns the function handle. torch 2.11 returns
    ``(function, n_regs, n_spills)``, 2.13 ``(module, function, n_regs, n_spills)``. Loaded under a guard of
    ``device``: a thread whose current device is another (a warm-up thread of rank 1 is on cuda:0) would otherwise
    get a handle of the wrong context ("invalid resource handle" at launch, seen on 2 H200s)."""
    with torch.cuda.device(device):     # the module is loaded into the current context: make it the device's
        return torch._C._StaticCudaLauncher._load_kernel(path, function, shared, device)[-3]


def cubin_launcher() -> Callable[..., None]:
    """``launch(function, grid_x, grid_y, grid_z, num_warps, shared, arg_types, args, stream)``."""
    return torch._C._StaticCudaLauncher._launch_kernel


def grad_mode_setter() -> Callable[[bool], None]:
    """``torch._C._set_grad_enabled``: sets grad mode with no Python frame (``torch.set_grad_enabled`` is a context
    manager class), for the run plan's per-call function."""
    return torch._C._set_grad_enabled


def operator_ref(target: Any) -> tuple[str, str] | None:
    """``("namespace::op", overload name)`` of an operator (``OpOverload``; an ``OpOverloadPacket`` gets the overload
    name ``""``), None for anything else (a Python function)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, ""
    return None


# The writer's half (a compiling process only): torch's compiler is imported inside each function.
def load_cache_entry(path: pathlib.Path) -> Any:
    """Unpickle one of torch's cache entries in a saved artifact (AOTAutograd's ``aotautograd/*/*`` or the FX graph
    entry ``fxgraph/*/*/*``), after importing the modules defining the classes they pickle."""
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401 - the AOTAutograd entry's classes
    import torch._inductor.output_code  # noqa: F401 - the FX graph entry's classes

    with open(path, "rb") as f:
        return pickle.load(f)


def triton_bundle(fx_entry: Any) -> Any:
    """The FX graph entry's Triton bundle (the cubins of every config compiled), or None."""
    return getattr(fx_entry, "_triton_bundle", None)


def triton_autotuners(namespace: dict[str, Any]) -> dict[str, Any]:
    """The Triton kernels (Inductor's ``CachingAutotuner`` objects) among a loaded wrapper module's globals."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return {n: k for n, k in namespace.items() if isinstance(k, CachingAutotuner)}


def kernel_grid(inductor_meta: Any, config: Any) -> tuple[list[str], list[str]]:
    """A Triton kernel's launch grid as Inductor computes it at run time (``GridExpr.from_meta``): the lines that
    precede it (``prefix``) and its x, y, z expressions. ``inductor_meta``: torch's kernel metadata, a dict in 2.13
    and the ``InductorMeta`` TypedDict in 2.14 (so typed ``Any`` here)."""
    from torch._inductor.runtime.triton_heuristics import GridExpr

    grid = GridExpr.from_meta(inductor_meta, config)
    return list(grid.prefix), [str(grid.x_grid), str(grid.y_grid), str(grid.z_grid)]


def kernel_arg_lists(compile_result: Any, arg_names: list[str], constexprs: Any) -> tuple[list[str], list[str], Any]:
    """Inductor's argument lists for launching a compiled Triton kernel (``TritonCompileResult._get_arg_lists``):
    the call arguments, the definition's arguments and (an ordered set) the names passed as None."""
    lists: tuple[list[str], list[str], Any] = compile_result._get_arg_lists(arg_names, constexprs)
    return lists


def triton_constexprs(jit_function: Any) -> list[int]:
    """The indices of a Triton ``JITFunction``'s constexpr parameters (``triton_helpers.get_constexprs``)."""
    from torch._inductor.runtime.triton_helpers import get_constexprs

    return get_constexprs(jit_function)

