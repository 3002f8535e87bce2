"""What Inductor's generated wrapper imports from ``torch._inductor`` and ``triton``, served without importing them.

A run needs only trivial helpers from those packages (kernel sources, the one place ``triton`` is used, are never
compiled). The wrapper is executed with a copy of the builtins whose ``__import__`` hands out these stand-ins and
refuses anything else from ``torch._inductor`` or ``triton``, so a wrapper needing more cannot load this way and the
caller falls back to torch's loader. Nothing in torch is patched.
"""
from __future__ import annotations

import builtins
import contextlib
import types
from typing import Any, Iterator

import torch

from .._torch import runplan as torch_runplan
from .format import ALIGN_BYTES


def _run_intermediate_hooks(name: str, value: Any) -> None:
    """Debug hooks (``torch._inductor.hooks``) are not run for entries loaded by gearcache."""


@contextlib.contextmanager
def _maybe_profile(should_profile: bool, *args: Any, **kwargs: Any) -> Iterator[torch.profiler.profile | None]:
    if should_profile:
        with torch.profiler.profile(*args, **kwargs) as prof:
            yield prof
    else:
        yield None


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


def _no_op(*_: Any) -> None:
    """Bandwidth-profiling bookkeeping (``start_graph``/``end_graph``) is not done for entries loaded by gearcache."""


def _assert_tensor_metadata(tensor: torch.Tensor | None, expected_size: tuple[int, ...],
                            expected_stride: tuple[int, ...],
                            expected_dtype: torch.dtype, op_name: str | None = None) -> None:
    """``torch._inductor.runtime.runtime_utils.assert_tensor_metadata`` (wrappers of torch 2.15 check an extern
    kernel's output with it): the dtype here, sizes and strides by the C check the wrapper's ``assert_size_stride``
    is (that module itself imports ``torch._dynamo``)."""
    if tensor is None:
        return
    if tensor.dtype != expected_dtype:
        raise RuntimeError(f"expected dtype {expected_dtype} but got {tensor.dtype}"
                           + (f"\nError in op: {op_name}" if op_name else ""))
    torch_runplan.assert_size_stride(tensor, expected_size, expected_stride, op_name)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def stand_ins(kernels: Any, extern: types.SimpleNamespace) -> dict[str, types.ModuleType]:
    """The modules the wrapper may import, by name. ``kernels`` stands for ``AsyncCompile()``, ``extern`` for
    ``select_algorithm.extern_kernels``."""
    language = _module("triton.language")
    return {
        "torch._inductor.hooks": _module("torch._inductor.hooks", run_intermediate_hooks=_run_intermediate_hooks),
        "torch._inductor.utils": _module("torch._inductor.utils", maybe_profile=_maybe_profile),
        "torch._inductor.codegen.memory_planning": _module("torch._inductor.codegen.memory_planning", _align=_align),
        "torch._inductor.async_compile": _module("torch._inductor.async_compile", AsyncCompile=lambda: kernels),
        "torch._inductor.select_algorithm": _module("torch._inductor.select_algorithm", extern_kernels=extern),
        "torch._inductor.runtime.triton_heuristics": _module("torch._inductor.runtime.triton_heuristics",
                                                             start_graph=_no_op, end_graph=_no_op),
        "torch._inductor.runtime.runtime_utils": _module("torch._inductor.runtime.runtime_utils",
                                                         assert_tensor_metadata=_assert_tensor_metadata),
        # The wrapper imports triton for the kernel sources it passes to async_compile, which are never compiled.
        "triton": _module("triton", language=language),
        "triton.language": language,
    }


def builtins_with(served: dict[str, types.ModuleType]) -> dict[str, Any]:
    """A copy of the builtins whose ``__import__`` serves ``served`` and refuses anything else from
    ``torch._inductor`` or ``triton``."""
    real_import = builtins.__import__

    def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (name == "triton" or name.startswith(("triton.", "torch._inductor"))):
            if fromlist and name in served:
                return served[name]
            if not fromlist and name.split(".")[0] == "triton":
                return served["triton"]
            raise ImportError(f"the wrapper imports {name} {list(fromlist or [])}, which gearcache's loader does not "
                              f"provide")
        return real_import(name, globals, locals, fromlist, level)

    table = dict(builtins.__dict__)
    table["__import__"] = _import
    return table
