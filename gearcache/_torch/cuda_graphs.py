"""What gearcache's CUDA graphs (gearcache/graphs/cuda_graphs.py) need of torch's private API: the memory pool
handle's type, and outputs whose storage can be made unreadable after a replay, as torch's CUDA-graph trees do.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    GraphPoolHandle = torch.cuda._POOL_HANDLE      # what torch.cuda.graph_pool_handle() returns (for annotations)


def storage_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s memory through a non-owning storage of its own (so that storage can be made
    unreadable without touching ``tensor``'s), as torch's CUDA-graph trees build their outputs."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return tensor.new_empty(0).set_(alias, tensor.storage_offset(), tensor.size(), tensor.stride())


def forbid_storage_access(tensor: torch.Tensor, message: str) -> None:
    """Make any later access to ``tensor``'s storage raise ``message`` (CUDA builds of torch; elsewhere a no-op)."""
    forbid = getattr(torch._C, "_set_storage_access_error_msg", None)
    if forbid is not None:
        forbid(tensor, message)


def fresh_copies(values: list[Any], kept: Collection[int] = ()) -> list[Any]:
    """``values`` with each tensor (but those at the places ``kept``) replaced by a copy in memory of its own (as
    ``clone()``: same dtype, device and, where dense, strides), the copies made by one ``torch._foreach_copy_`` (one
    kernel launch per dtype for dense CUDA tensors instead of one per tensor: a graph replay's outputs are copied on
    every call); other values as they are."""
    if kept:
        copied = fresh_copies([None if k in kept else v for k, v in enumerate(values)])
        return [values[k] if k in kept else c for k, c in enumerate(copied)]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) < 2:
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
    copies = iter([torch.empty_like(t) for t in tensors])
    out = [next(copies) if isinstance(v, torch.Tensor) else v for v in values]
    torch._foreach_copy_([o for o in out if isinstance(o, torch.Tensor)], tensors)
    return out
