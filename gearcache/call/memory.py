"""Which tensors share memory: by the bytes of their storages, and by storage object where torch's compilers care.

Dynamo and AOTAutograd treat two graph inputs as aliases only when they sit on one storage *object* (one
``StorageImpl``); they compile tensors on distinct storage objects as apart, whatever their bytes. Distinct storage
objects can cover overlapping bytes: ``torch.from_numpy`` of two views of one NumPy array, ``torch.frombuffer`` of
one buffer twice, DLPack imports. A graph that writes one such input while reading another then runs in its compiled
order, not eager's. So gearcache tells sharing apart in two ways:

- by storage object: tensors on one storage object are views of one base, which torch compiles correctly; a call key
  marks them (``memory_groups``: the first leaf on the object, the storage offset);
- by bytes: a *cluster* of tensors whose storages' byte ranges overlap, on more than one storage object, is marked
  too (its first leaf), so such a call gets an entry of its own, which is refused wherever its graph writes one of
  the cluster's leaves (``state_alias.rules``); entries that write an argument are served by the shortcut only to
  calls whose tensors' storages are pairwise apart in memory (``ranges_apart``, and the native ``TensorMatch``).

Storage objects are told by identity: torch keeps one Python object per ``StorageImpl`` while it lives, so
``a.untyped_storage() is a[1:].untyped_storage()`` (``tests/test_memory.py`` checks it on every torch it runs with;
were it not so, leaves on one object would be taken for a cluster: refused where written, never served wrong).
"""
from __future__ import annotations

import bisect
from typing import Any, NamedTuple

import torch

_Tensor = torch.Tensor


class Forbidden(NamedTuple):
    """The memory a call leaf must not overlap (module tensors'): their storages' byte ranges ``[start, end)``,
    sorted by start, ``reach[i]`` the largest end among the first ``i + 1`` (storages may overlap: ``from_numpy``
    views of one array), ``names[i]`` what each is. Told by memory, not by storage object: a tensor on another
    storage over the same bytes (``torch.from_numpy(array[1:3])`` beside a buffer ``from_numpy(array[:4])``)
    overlaps too."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    reach: tuple[int, ...]
    names: tuple[str, ...]

    def owner(self, start: int, end: int) -> str | None:
        """The name of a range that ``[start, end)`` overlaps (None for most calls: one bisection)."""
        i = bisect.bisect_left(self.starts, end) - 1
        if end <= start or i < 0 or self.reach[i] <= start:
            return None
        while self.ends[i] <= start:
            i -= 1
        return self.names[i]


def forbidden_ranges(ranges: dict[tuple[int, int], str]) -> Forbidden:
    """:class:`Forbidden` over ``{(start, end): name}`` (empty ranges left out)."""
    items = sorted((r, name) for r, name in ranges.items() if r[1] > r[0])
    reach, top = [], 0
    for (_, end), _ in items:
        top = max(top, end)
        reach.append(top)
    return Forbidden(tuple(r[0] for r, _ in items), tuple(r[1] for r, _ in items), tuple(reach),
                     tuple(name for _, name in items))


def everywhere(name: str) -> Forbidden:
    """A :class:`Forbidden` that every tensor with memory overlaps (a leaf whose every call is refused). Its end is
    the largest 64-bit address: the native ``TensorMatch`` reads ranges as unsigned 64-bit ints (``1 << 64`` read as
    0 there, an empty range, forbade nothing)."""
    return forbidden_ranges({(1, (1 << 64) - 1): name})


def storage_address(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (meta and other storage-less tensors: by object, never shared)."""
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -id(t)
    return address if address else -id(t)          # empty storages share no memory


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first byte, past the last byte)`` of ``t``'s storage; ``(0, 0)`` for one without memory."""
    try:
        storage = t.untyped_storage()
        start = storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    return (start, start + storage.nbytes()) if start else (0, 0)


def ranges_apart(tensors: tuple[Any, ...]) -> bool:
    """Whether no two of ``tensors``' storages overlap in memory (one storage object twice overlaps itself); items that
    are no tensor are skipped."""
    spans = sorted(r for t in tensors if isinstance(t, _Tensor) and (r := storage_range(t))[1] > r[0])
    reach = 0
    for start, end in spans:
        if start < reach:
            return False
        reach = max(reach, end)
    return True


def element_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first byte, past the last byte)`` of ``t``'s elements by address (``(0, 0)`` for none): every element lies
    inside, so tensors whose spans are apart share no element (views ``kv.unbind(0)`` of one tensor)."""
    if not t.numel():
        return 0, 0
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * t.element_size()


def copies_split(leaves: tuple[Any, ...], copied: tuple[Any, ...], shared: list[int]) -> bool:
    """Whether copying splits memory a call shares: a leaf of ``shared`` (leaf indices, ``signature.shares_memory``)
    that ``copied`` replaces (a padded copy: ``copied[i] is not leaves[i]``) whose elements' span overlaps another
    shared leaf's (the same tensor twice overlaps itself). False where the copies cover memory no other leaf reaches:
    each copy is written, read and copied back apart, as eager's writes to its elements are. Cost: a span per shared
    leaf, for calls sharing memory only."""
    spans = {i: element_span(leaves[i]) for i in shared if isinstance(leaves[i], _Tensor)}
    for i in shared:
        if copied[i] is leaves[i] or i not in spans:
            continue
        start, end = spans[i]
        if any(j != i and start < other[1] and other[0] < end for j, other in spans.items()):
            return True
    return False


def elements_may_overlap(sizes: Any, strides: Any) -> bool:
    """Whether two elements of a tensor of these ``sizes`` and ``strides`` may sit at one address: False where each
    dim, taken by stride, steps past all that the smaller ones reach (contiguous, channels-last, slices, transposes),
    True for a stride 0 over more than one element (``expand``) and for interleaved strides (``as_strided`` windows,
    ``(3, 2)`` over strides ``(1, 1)``); a few layouts whose elements are apart after all are taken to overlap too."""
    if any(size == 0 for size in sizes):
        return False
    reach = 0
    for stride, size in sorted((abs(st), sz) for sz, st in zip(sizes, strides) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


Span = tuple[int, int, int, torch.UntypedStorage]
"""``(start, end, leaf index, storage object)`` of a tensor leaf with memory."""


def memory_groups(leaves: Any) -> dict[int, tuple[int, int | None]]:
    """``{leaf index: (first leaf on its storage object, first leaf of its cluster or None)}`` for the tensor leaves
    (distinct objects: a tensor passed twice is the key's ``("same", i)``) whose storage's bytes overlap another
    leaf's; the cluster's first leaf only where the cluster (leaves joined by overlapping bytes) spans more than one
    storage object. ``{}`` when no two overlap (the common case). Cost: a storage object per tensor leaf and a sort
    (~0.6 us per tensor on CPU), as calls with at least two tensors take the key's path."""
    if len(leaves) < 2:
        return {}
    spans: list[Span] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            try:
                storage = leaf.untyped_storage()
                start = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if start:
                spans.append((start, start + storage.nbytes(), i, storage))
    spans.sort()                        # by start (then end, then leaf index: never by storage)
    groups: dict[int, tuple[int, int | None]] = {}
    begin, reach = 0, 0
    for k, span in enumerate(spans):
        if span[0] >= reach:
            if k - begin > 1:
                _mark(spans[begin:k], leaves, groups)
            begin = k
        reach = max(reach, span[1])
    if len(spans) - begin > 1:
        _mark(spans[begin:], leaves, groups)
    return groups


def _mark(cluster: list[Span], leaves: Any, groups: dict[int, tuple[int, int | None]]) -> None:
    """Enter a cluster of overlapping spans into ``groups`` (see :func:`memory_groups`), a tensor object met before
    left out (nothing where that leaves one)."""
    cluster.sort(key=lambda span: span[2])
    first: dict[int, int] = {}
    objects: set[int] = set()
    kept = []
    for span in cluster:
        if id(leaves[span[2]]) not in objects and span[1] > span[0]:
            objects.add(id(leaves[span[2]]))
            first.setdefault(id(span[3]), span[2])
            kept.append(span)
    if len(kept) < 2:
        return
    head = kept[0][2] if len(first) > 1 else None
    for _, _, i, storage in kept:
        groups[i] = (first[id(storage)], head)


def shared_memory(tensors: list[Any]) -> list[tuple[int, int, int, bool, int]]:
    """``(i, j, offset, same, first_offset)`` for each tensor ``tensors[i]`` whose storage is that of an earlier
    ``tensors[j]`` (``offset``, ``first_offset``: their storage offsets, which with their sizes and strides say where
    they overlap; ``same``: the very same tensor object); items that are no tensor, meta, sparse or empty are skipped
    (their places still count). The module tensors' sharing an entry was compiled with (``Entry.sharing_changed``,
    ``entry_life.shared_memory_rows``)."""
    first: dict[tuple[torch.device, int], tuple[int, torch.Tensor]] = {}
    pairs: list[tuple[int, int, int, bool, int]] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, _Tensor) or t.is_meta or t.layout != torch.strided or not t.numel():
            continue
        where = (t.device, t.data_ptr() - int(t.storage_offset()) * t.element_size())    # its storage's address
        if where in first:
            j, other = first[where]
            pairs.append((i, j, int(t.storage_offset()), t is other, int(other.storage_offset())))
        else:
            first[where] = (i, t)
    return pairs
