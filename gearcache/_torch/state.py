"""The thread's global torch state: what of it changes the compiled code (:func:`global_state`, a cache key factor),
a cheap check that it has not changed (:func:`state_guard`), reproducing it in another thread or process
(:func:`global_state_applied`), autocast switches for running compiled code, and the random generators kept
across a compile (:func:`generators_kept`).

Consumers: gearcache/call/ (signature.py, entry.py, cached_function.py), gearcache/compiling/ (background.py,
pipeline.py, workers.py, entry_life.py, torch_compile_backend.py), gearcache/warmup/driver.py,
gearcache/runplan/runner.py.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterable, Iterator

import torch

from .. import native as gearcache_native


def global_state(devices: Iterable[str] = ()) -> dict[str, Any]:
    """The thread's torch settings, other than grad and inference mode (the signature holds those), that change what a
    capture traces or what Inductor generates for it, as JSON-able values (a cache key factor; equal dicts mean the
    same compiled code):

    - ``autocast``: ``{device type: dtype}`` for each device type whose autocast is on (the traced graph casts);
    - ``default_dtype``, ``deterministic`` (algorithms on, warn only), ``torch_function`` (enabled, all disabled);
    - ``matmul``: TF32 and reduced-precision reductions of cuBLAS, cuDNN's TF32, the float32 matmul precision;
    - ``sdp``: the scaled-dot-product attention backends enabled (Dynamo picks one at trace time);
    - ``default_device``: ``torch.set_default_device``'s (factory calls in the method are traced on it);
    - ``torch_function_modes``: the classes of the active ``TorchFunctionMode`` stack (Dynamo traces a mode into the
      graph: ``TORCH_FUNCTION_MODE_STACK``), ``functorch``: the active functorch transforms (vmap, grad, ...:
      ``FUNCTORCH_STACK_MATCH``), ``forward_ad_level``: forward-mode AD's level (``DUAL_LEVEL``);
    - ``cpu_threads``, only where a CPU is among ``devices`` (a key's devices): Inductor writes the thread count into
      its C++ kernels.

    The set follows Dynamo's global-state guard (``GlobalStateGuard``), the thread count only for CPU code, plus
    ``matmul``'s cuDNN/precision parts and ``sdp``, which Dynamo does not guard. Public APIs only; ~10 us: call it on
    a miss, not per call (see :func:`state_guard`)."""
    autocast = {}
    for device_type in _AUTOCAST_DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device_type):
                autocast[device_type] = str(torch.get_autocast_dtype(device_type))
        except (RuntimeError, ValueError):      # a device type this build does not know
            continue
    matmul = torch.backends.cuda.matmul
    state: dict[str, Any] = {
        "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled() if autocast else None,
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "torch_function": [torch._C._is_torch_function_enabled(),
                           bool(getattr(torch._C, "_is_torch_function_all_disabled", lambda: False)())],
        "matmul": {"cuda_tf32": matmul.allow_tf32,
                   "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
                   "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
                   "cudnn_tf32": torch.backends.cudnn.allow_tf32,
                   "float32_precision": torch.get_float32_matmul_precision()},
        "sdp": _sdp_backends(),
        "default_device": default_device(),
        "torch_function_modes": _torch_function_modes(),
        "functorch": _functorch_layers(),
        "forward_ad_level": _forward_ad_level(),
    }
    if any(str(d).startswith("cpu") for d in devices):
        state["cpu_threads"] = torch.get_num_threads()
    return state


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "privateuseone")


def _sdp_backends() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {name: bool(getattr(cuda, f"{name}_sdp_enabled", lambda: None)())
            for name in ("flash", "mem_efficient", "math", "cudnn")}


def _torch_function_modes() -> list[str]:
    """The classes of the thread's ``TorchFunctionMode`` stack, innermost last."""
    modes = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [f"{type(m).__module__}.{type(m).__qualname__}" for m in modes]


def _functorch_layers() -> list[object]:
    """The active functorch transforms (each interpreter's state: transform, level, options), outermost first."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return []
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return [json.loads(json.dumps(ci.get_state(), default=str)) for ci in retrieve_all_functorch_interpreters()]


def _forward_ad_level() -> int:
    """Forward-mode AD's current dual level (-1: none)."""
    import torch.autograd.forward_ad as forward_ad
    return int(forward_ad._current_level)


def default_device() -> str | None:
    """The device ``torch.set_default_device`` set for this thread (None: torch's own default). Dynamo guards it
    (``DEFAULT_DEVICE``): factory calls in a captured method are traced on it."""
    from torch.utils import _device

    device = _device.CURRENT_DEVICE
    return None if device is None else str(device)


def state_guard() -> Callable[[], bool] | None:
    """``same() -> bool`` in C++: True while the calling thread's grad mode, autocast, default dtype, deterministic
    algorithms, cuBLAS TF32/reduced-precision flags, torch-function state, the depth of its TorchFunctionMode stack
    and thread count are what they were when this was called (~0.2-0.5 us). With gearcache's native module it also
    sees inference mode, the thread's dispatch keys and the SDPA backends; neither sees cuDNN's TF32 flag nor the
    float32 matmul precision beyond what it does to cuBLAS TF32 (torch.compile does not either). None where torch
    lacks both (callers then compute
    :func:`global_state` each time).

    Mechanism: gearcache's native ``StateSnapshot`` (gearcache/native/guards.cpp) where it is built for this torch,
    else Dynamo's ``torch._C._dynamo.guards.GlobalStateGuard`` (guards.cpp); a snapshot taken at construction."""
    native = gearcache_native.guards()
    if native is not None:
        snapshot: Callable[[], bool] = native.StateSnapshot()     # native module: no stubs
        return snapshot
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    guard_type = getattr(guards, "GlobalStateGuard", None)
    if guard_type is None:
        return None
    try:
        check: Callable[[], bool] = guard_type().check
    except (TypeError, RuntimeError):
        return None
    depth, now = function_mode_depth(), function_mode_depth

    def same() -> bool:         # Dynamo's guard does not see the TorchFunctionMode stack (the native snapshot does)
        return check() and now() == depth
    return same


def state_guard_covers_inference_mode(same: Callable[[], bool]) -> bool:
    """True when ``same`` (from :func:`state_guard`) also says False once inference mode differs from its snapshot's
    (gearcache's native snapshot does; Dynamo's does not)."""
    native = gearcache_native.guards()
    return native is not None and isinstance(same, native.StateSnapshot)


@contextlib.contextmanager
def global_state_applied(state: dict[str, Any]) -> Iterator[None]:
    """Within the block, this thread's global torch state is ``state`` (a :func:`global_state` of another thread or
    process: a compile worker compiles under the caller's autocast, TF32 flags, ...); the previous state is restored
    after. ValueError (nothing changed) when the state cannot be reproduced here, e.g. another torch-function state:
    the caller then compiles in its own thread."""
    before = global_state()
    with contextlib.ExitStack() as stack:
        try:
            stack.callback(_set_settings, before)
            _set_settings(state)
            for device_type, dtype in state["autocast"].items():
                stack.enter_context(torch.autocast(device_type, dtype=_dtype(dtype),
                                                   cache_enabled=state["autocast_cache"]))
            now = global_state()
            if now != state:
                differ = sorted(k for k in state if now.get(k) != state.get(k))
                raise ValueError(f"the global torch state cannot be reproduced here (differs in {differ})")
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"global_state_applied: {exc}") from exc
        yield


def _set_settings(state: dict[str, Any]) -> None:
    """Set the non-autocast parts of a :func:`global_state` that differ from this thread's (only those: setting a
    value equal to the current one can still change torch's state, e.g. the float32 matmul precision also sets the
    ``fp32_precision`` fields, which Inductor's cache keys read; the precision goes first: it sets the TF32 flag)."""
    now = global_state()
    if state["default_dtype"] != now["default_dtype"]:
        torch.set_default_dtype(_dtype(state["default_dtype"]))
    if state["deterministic"] != now["deterministic"]:
        torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    matmul, now_matmul = state["matmul"], now["matmul"]
    if matmul["float32_precision"] != now_matmul["float32_precision"]:
        torch.set_float32_matmul_precision(matmul["float32_precision"])
        now_matmul = global_state()["matmul"]
    cuda = torch.backends.cuda.matmul
    for key, attr in (("cuda_tf32", "allow_tf32"), ("fp16_reduced", "allow_fp16_reduced_precision_reduction"),
                      ("bf16_reduced", "allow_bf16_reduced_precision_reduction")):
        if matmul[key] != now_matmul[key]:
            setattr(cuda, attr, matmul[key])
    if matmul["cudnn_tf32"] != now_matmul["cudnn_tf32"]:
        torch.backends.cudnn.allow_tf32 = matmul["cudnn_tf32"]
    for name, enabled in state["sdp"].items():
        if enabled != now["sdp"].get(name):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


dispatch_mode_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many user ``TorchDispatchMode``s are active in this thread (C++, ~50 ns; torch's infrastructure modes, fake
tensors and functionalization, are kept apart and not counted): a compiled entry runs its kernels without them."""


function_mode_depth: Callable[[], int] = torch._C._len_torch_function_stack
"""How many ``TorchFunctionMode``s are active in this thread (C++, ~50 ns), torch's own ``DeviceContext``
(``with torch.device(...)``) included."""


def user_function_modes() -> list[str]:
    """The classes of this thread's active ``TorchFunctionMode``s other than torch's ``DeviceContext`` (``with
    torch.device(...)``: the default device, which the key holds), innermost last. Dynamo traces such a mode into the
    graph, and an entry does not follow its state (a mode's attributes, another mode of the same depth): a cached
    method refuses calls under one (``CachedFunction._refuse_modes``)."""
    from torch.utils._device import DeviceContext

    modes = [torch._C._get_function_stack_at(i) for i in range(function_mode_depth())]
    return [f"{type(m).__module__}.{type(m).__qualname__}" for m in modes if not isinstance(m, DeviceContext)]


def dispatch_modes() -> list[str]:
    """The classes of this thread's active user ``TorchDispatchMode``s, innermost last (for a refusal's message)."""
    return [f"{type(m).__module__}.{type(m).__qualname__}"
            for m in (torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack()))]


any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
"""True when autocast is on for any device type in this thread (C++; what AOTAutograd reads at load)."""


disable_autocast: Callable[[], contextlib.AbstractContextManager[None]] = torch._C._DisableAutocast
"""Autocast off for every device type within the block: compiled code runs so, as its casts are already in the graph
(AOTAutograd's runtime wrapper does the same: ``disable_amp``)."""



@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """The CPU generator's state, and that of every GPU's generator where CUDA is initialized, as they were on entry
    (``torch.random.fork_rng``): compiling runs the graph (the run plan's check) and may draw Inductor's seeds, which
    must not move the numbers the caller's later draws get. A copy of each state in and out (a compile's cost, never a
    call's)."""
    initialized = torch.cuda.is_initialized()       # type: ignore[no-untyped-call]  # torch leaves it untyped
    devices = list(range(torch.cuda.device_count())) if initialized else []
    with torch.random.fork_rng(devices=devices):
        yield
