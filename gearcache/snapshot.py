"""Saving tensors' bytes and putting them back: what a run that must leave no trace (a CUDA graph's warm-up run,
``warmup()``'s runs on examples, the gear plan's trace) wrote in place is restored from it."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


def snapshot(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(view, copy)`` pairs to restore ``tensors`` later with ``view.copy_(copy)``: per storage, one byte view of the
    smallest range that holds every one of ``tensors`` in it (gears' views of one KV cache share a storage)."""
    ranges: dict[int, tuple[int | torch.SymInt, int | torch.SymInt, torch.UntypedStorage]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size
        storage = t.untyped_storage()
        a, b, _ = ranges.get(storage.data_ptr(), (lo, hi, storage))
        ranges[storage.data_ptr()] = (min(a, lo), max(b, hi), storage)
    views = [torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, lo, (hi - lo,), (1,))
             for lo, hi, storage in ranges.values()]
    return [(view, view.clone()) for view in views]


@contextlib.contextmanager
def kept(tensors: list[Any]) -> Iterator[Callable[[], None]]:
    """Restore ``tensors`` (those of them that are tensors) after the block, however it ends. The block is given the
    restore itself, for runs that must each see the state as it was before the first (warm-up's gears)."""
    saved = snapshot([t for t in tensors if isinstance(t, torch.Tensor)])

    def restore() -> None:
        for view, before in saved:
            view.copy_(before)
    try:
        yield restore
    finally:
        restore()
