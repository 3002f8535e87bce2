"""``Dispatcher``: the base class of ``CachedFunction``, whose ``__call__`` is the first thing every call runs.

A call like the last plain one (the same number of positional tensors, and of scalars beside them of the same types
and values, no keywords, grad off, the same inference mode, ``check(*args)`` True: the C++ metadata check of
``signature.Matcher``, and the method's value guards still
watched valid: ``watch.valid()``, gearcache/keys/guard_watch.py) is served through the shortcut:
``entry.build(entry.run(args), args)``, counting ``entry.hits`` and ``counters.hits``. Every other call goes to the
subclass's ``_call(*args, **kwargs)``, which computes the signature key and sets the next shortcut with
``_set_shortcut(matcher, entry, counters, watch)`` (or none: ``_set_shortcut(None)``).

``gearcache.call._callpath.Dispatcher`` does this in C (no Python frame between the user's call and the entry's C
runner); ``PyDispatcher`` below is the same in Python, used where the extension is not built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .signature import Matcher

try:
    from ._callpath import Dispatcher as _NativeDispatcher
except ImportError:                 # pragma: no cover - depends on how gearcache was installed
    _NativeDispatcher = None


class Served(Protocol):
    """What the shortcut serves a call with: ``entry.build(entry.run(args), args)``, counting ``entry.hits`` (a loaded
    ``call.entry.Entry``, or an eager stand-in of the same interface)."""
    hits: int

    def run(self, leaves: tuple[Any, ...]) -> list[Any]: ...

    def build(self, outs: list[Any], leaves: tuple[Any, ...]) -> Any: ...


class Counts(Protocol):
    """What the shortcut counts its hits in (``gearcache.counters.counters``)."""
    hits: int


class Watch(Protocol):
    """What the shortcut asks first: whether the method's value guards still hold (``keys.guard_watch.GuardWatch``)."""

    def valid(self) -> bool: ...


class PyDispatcher:
    """``Dispatcher`` in Python (see the module docstring)."""

    _shortcut: tuple[Matcher, Served, Counts, Watch | None] | None = None
    shortcut_calls = 0

    def _set_shortcut(self, matcher: Matcher | None, entry: Served | None = None, counters: Counts | None = None,
                      watch: Watch | None = None) -> None:
        if matcher is None:
            self._shortcut = None
        elif entry is None or counters is None:
            raise TypeError("_set_shortcut: a matcher needs its entry and the counters")
        else:
            self._shortcut = (matcher, entry, counters, watch)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shortcut = self._shortcut
        if (shortcut is not None and not kwargs and (shortcut[3] is None or shortcut[3].valid())
                and shortcut[0](args)):
            matcher, entry, counters, _ = shortcut
            result = entry.build(entry.run(args), args)
            self.shortcut_calls += 1
            entry.hits += 1
            counters.hits += 1
            return result
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


if TYPE_CHECKING:                   # the C class has no stub: checkers see its Python twin
    Dispatcher = PyDispatcher
else:
    Dispatcher = _NativeDispatcher or PyDispatcher
"""The base class ``CachedFunction`` uses: the C one when ``gearcache.call._callpath`` is built."""
