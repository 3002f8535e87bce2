"""The dispatch shortcut's per-call checks on tensors, in C where possible (gearcache/call/signature.py,
gearcache/call/entry.py, gearcache/keys/guard_watch.py).

Mechanism: gearcache's native module (gearcache/native/guards.cpp, compiled against torch's own headers, so its
private C++ API is checked by the compiler) where it is built for this torch, else Dynamo's C++ guards or the same
check in Python.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import native as gearcache_native


def tensor_match(tensors: tuple[torch.Tensor, ...]) -> Callable[..., bool] | None:
    """A predicate in C++, ``match(*others) -> bool`` for exactly ``len(tensors)`` arguments (another count raises
    TypeError): True when each has the same Python type, dispatch keys under the thread's dispatch state (device type,
    layout, inference mode), dtype, device index, ``requires_grad``, sizes and strides as the tensor at its place, and
    no argument is passed twice. Nothing else (no values, no storage offset or alignment). Holds no reference to
    ``tensors``. None where torch lacks it: the caller then keys every call in Python (gearcache/call/signature.py).

    Mechanism: gearcache's native ``TensorMatch`` (gearcache/native/guards.cpp) where it is built for this torch,
    else Dynamo's ``torch._C._dynamo.guards.TensorGuards`` (guards.cpp ``TensorCheck``) with every size and stride
    given, so no dimension is dynamic."""
    native = gearcache_native.guards()
    if native is not None:
        try:
            match: Callable[..., bool] = native.TensorMatch(tuple(tensors))    # native module: no stubs
            return match
        except (TypeError, RuntimeError):     # not all plain strided tensors (sparse, nested, symbolic): Dynamo's
            pass
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    tensor_guards = getattr(guards, "TensorGuards", None)
    if tensor_guards is None:
        return None
    try:
        check: Callable[..., bool] = tensor_guards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                                   dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
        return check
    except (TypeError, RuntimeError, SystemError):
        return None


def tensor_storage_match(tensors: tuple[torch.Tensor, ...],
                         forbidden: tuple[tuple[tuple[int, int], ...] | None, ...] | None,
                         distinct: bool) -> Callable[..., bool] | None:
    """:func:`tensor_match`'s predicate that also answers False for a call with two tensors over overlapping memory
    (``distinct``) or a tensor whose storage overlaps a byte range ``forbidden`` names for its place (one item per
    tensor: None, or ``(start, end)`` ranges as ``call.memory.storage_range`` gives them), in the same C++ call. None
    where gearcache's native module is not built (the caller then wraps :func:`tensor_match`'s predicate in Python:
    ~0.2-0.3 us more per call)."""
    native = gearcache_native.guards()
    if native is None:
        return None
    try:
        match: Callable[..., bool] = native.TensorMatch(tuple(tensors), forbidden=forbidden, distinct=distinct)
        return match
    except (TypeError, RuntimeError):     # not all plain strided tensors, or a module without these checks
        return None


def tensor_meta_match(tensors: tuple[torch.Tensor, ...]) -> tuple[Callable[[], bool], object | None]:
    """``(holds, capsule)``: ``holds() -> bool`` is True while every tensor of ``tensors`` (held) has the dtype, device,
    layout, sizes, strides and data address it has now; ``capsule`` (None without gearcache's native module) is
    the same check in C for gearcache.call._callpath's GuardWatch (``META_HOLDS``, called with ``holds``).

    Mechanism: gearcache's native ``MetaMatch`` (gearcache/native/guards.cpp) where it is built for this torch and
    every tensor is a plain strided one, else the same comparison in Python (microseconds per tensor: the first
    process, before the native module is built)."""
    native = gearcache_native.guards()
    if native is not None and hasattr(native, "MetaMatch"):
        try:
            return native.MetaMatch(tuple(tensors)), native.META_HOLDS
        except (TypeError, RuntimeError):     # not all plain strided tensors: Python's
            pass
    return _PyMetaMatch(tuple(tensors)), None


class _PyMetaMatch:
    """:func:`tensor_meta_match` in Python."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors
        self.metas = [_meta(t) for t in tensors]

    def __call__(self) -> bool:
        return all(_meta(t) == m for t, m in zip(self.tensors, self.metas))


def _meta(t: torch.Tensor) -> tuple[object, ...]:
    if t.layout != torch.strided:
        return (t.layout, t.dtype, t.device, t.data_ptr())
    return (t.dtype, t.device, t.shape, t.stride(), t.data_ptr())


_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


def _plain_tensors(args: tuple[torch.Tensor, ...]) -> bool:
    """:func:`plain_tensors_check`'s answer in Python."""
    return (len({*map(id, args)}) == len(args) and all(type(a) is torch.Tensor for a in args)
            and not any(a.dtype in _COMPLEX and (a.is_conj() or a.is_neg()) for a in args))


def plain_tensors_check() -> Callable[[tuple[torch.Tensor, ...]], bool]:
    """``plain(args) -> bool`` for a tuple of tensors: each an exact ``torch.Tensor`` (no subclass), none passed twice,
    none with its conjugate or negative bit: a call whose key is each tensor's shape, stride, dtype and device alone.
    gearcache's native check (one C++ loop) where it is built, else the same in Python (~0.5 us more per call)."""
    native = gearcache_native.guards()
    return getattr(native, "plain_tensors", None) or _plain_tensors


def native_data_ptr() -> object | None:
    """gearcache's native ``DATA_PTR`` capsule (``tensor.data_ptr()`` in C, for the C runner's alignment checks:
    gearcache/call/_callpath.c), or None where the native module is not loaded (the runner then calls
    ``data_ptr()``)."""
    native = gearcache_native.guards()
    return getattr(native, "DATA_PTR", None) if native is not None else None


def aliased_base(t: torch.Tensor) -> object:
    """What AOTAutograd compiles ``t`` over where it and another input on its storage are views one of which the graph
    writes (``merge_view_inputs``: a graph input of its own, its sizes checked by Inductor at every call): ``t``'s
    autograd base (``_base``) as its sizes, strides and storage offset, else its storage's bytes. A key factor of such
    calls (gearcache/call/signature.py ``_memory_mark``)."""
    base = t._base
    if base is None:
        return t.untyped_storage().nbytes()
    return tuple(base.shape), tuple(base.stride()), int(base.storage_offset())
