"""Reading a guard watch's rows in Python: :class:`PyGuardWatch` (the watch where the C extension is not built) and
:func:`holds` (one checked row, as the C ``GuardWatch`` in ``gearcache/call/_callpath.c`` reads it), and the plain
data a property's value is compared by (``attr_eq`` rows). The rows themselves are built by
:mod:`gearcache.keys.guard_watch` (``Hops``)."""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

from .fingerprints import cell_contents
from .guard_paths import MISSING_OBJECT


PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


def plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data compared by value: a scalar of ``PLAIN_SCALARS``, or a list or tuple of at
    most 256 of them (nested at most 3 deep), each of exactly those types."""
    if type(value) in PLAIN_SCALARS:
        return True
    if type(value) in (list, tuple) and depth < 3 and len(value) <= 256:
        return all(plain(v, depth + 1) for v in value)
    return False


def plain_copy(value: Any) -> Any:
    """A copy of plain data (its lists copied, so an in-place change of the read value is not the expected one's)."""
    if type(value) is list:
        return [plain_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(plain_copy(v) for v in value)
    return value


def plain_equal(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are equal plain data of the same types (as the C watch's ``plain_equal``); floats by value and
    sign (``-0.0`` is not ``0.0`` to ``copysign``), a NaN equal to a NaN."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(plain_equal(x, y) for x, y in zip(a, b))
    if type(a) is float:
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    return bool(a == b)


class Watch(Protocol):
    """A ``GuardWatch``, C or Python (``PyGuardWatch``), as its holders use it."""

    def valid(self) -> bool:
        """True while nothing it watches changed."""
        ...


class PyGuardWatch:
    """The watch in Python (no C extension): every hop re-read at every call. ``valid()`` True while none changed."""

    def __init__(self, dicts: list[tuple[dict[Any, Any], Any, Any]], types_: list[type],
                 checked: list[tuple[str, Any, Any, Any]], absent: Any,
                 meta: Callable[[], bool] | None = None, meta_holds: object = None):
        self._reads = [("item", d, k, e) for d, k, e in dicts if k is not None] + list(checked)
        self._whole = [(d, dict(d)) for d, k, _ in dicts if k is None]
        self._types = [(t, dict(t.__dict__)) for t in types_]
        self._absent = absent
        self._meta = meta

    def valid(self) -> bool:
        if not all(_holds(op, parent, key, expected, self._absent) for op, parent, key, expected in self._reads):
            return False
        for d, copy in self._whole:
            if d.keys() != copy.keys() or any(d[k] is not v for k, v in copy.items()):
                return False
        for t, copy in self._types:
            if t.__dict__.keys() != copy.keys() or any(t.__dict__[k] is not v for k, v in copy.items()):
                return False
        return self._meta is None or bool(self._meta())


def holds(op: str, parent: Any, key: Any, expected: Any) -> bool:
    """One checked row of :class:`Hops` (``Hops.checked``): whether it reads as it did."""
    return _holds(op, parent, key, expected, MISSING_OBJECT)


def _holds(op: str, parent: Any, key: Any, expected: Any, absent: Any) -> bool:
    """One checked hop (see :class:`Hops`), as the C watch reads it."""
    try:
        if op == "attr":
            return getattr(parent, key) is expected
        if op == "attr_eq":
            return plain_equal(getattr(parent, key), expected)
        if op == "class":
            return type(parent) is expected
        if op == "code":
            return getattr(parent, "__code__", None) is expected
        if op in ("defaults", "kwdefaults"):
            return getattr(parent, f"__{op}__") is expected
        if op == "cell":
            return cell_contents(parent, absent) is expected
        if op == "item":
            return parent[key] is expected
        if op == "len":
            same_length: bool = len(parent) == expected
            return same_length
        if op == "contains":
            return (key in parent) is expected
        return len(parent) == len(expected) and all(a is b for a, b in zip(parent, expected))     # "seq"
    except (AttributeError, LookupError, TypeError, ValueError):       # ValueError: an empty closure cell
        return expected is absent and op in ("attr", "item")
