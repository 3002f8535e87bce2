"""A value guard, the record: what is checked (``kind``) about the object at a ``path``
(gearcache/keys/guard_paths.py), with which argument (``arg``), and the fingerprint it must have (``expected``:
gearcache/keys/guard_fingerprints.py). gearcache/keys/guard_sets.py tells what value guards are for.

On-disk form, one item of the entry manifest's (and the gear plan record's) ``"guards"``:
``[kind, path, arg, expected]``. ``arg`` is None, an attribute name (``hasattr``, ``in_dict``), a key (``contains``)
or another path (``same_as``). The kinds and their fingerprints are in ``guard_fingerprints._FINGERPRINT``. A local
guard (kind ``"live"``, gearcache/keys/guards_from_dynamo.py) expects the live object itself (:class:`LiveObject`)
and is never written.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .guard_paths import GuardPath, path_json, path_text, path_tuple


@dataclasses.dataclass(frozen=True)
class ValueGuard:
    """One Python value a capture depends on: ``kind`` of check on the object at ``path`` must give ``expected``."""
    kind: str
    path: GuardPath             # (root, *steps), steps as tuples
    arg: Any                    # see the module docstring
    expected: Any               # the fingerprint (JSON); for a local guard, the live object itself

    def text(self) -> str:
        """``self.ln.eps``-style, for messages."""
        return path_text(self.path)

    def to_json(self) -> list[Any]:
        arg = path_json(self.arg) if self.kind == "same_as" else self.arg
        return [self.kind, path_json(self.path), arg, self.expected]

    @classmethod
    def from_json(cls, data: list[Any]) -> "ValueGuard":
        kind, path, arg, expected = data
        if kind == "same_as":
            arg = path_tuple(arg)
        return cls(kind, path_tuple(path), arg, expected)


@dataclasses.dataclass(frozen=True, eq=False)
class LiveObject:
    """A local guard's expected value: equal only to the same object."""
    obj: Any

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, LiveObject) and other.obj is self.obj

    __hash__ = object.__hash__
