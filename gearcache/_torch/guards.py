"""Dynamo's guards for a capture, recorded in plain terms (:class:`DynamoGuard`), for
gearcache/keys/guards_from_dynamo.py to turn into value guards. Mechanism: torch.compile's ``guard_filter_fn`` option
(gearcache/compiling/capture.py passes :func:`guard_recording_options`), which receives every guard while Dynamo's
installed globals still exist.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class DynamoGuard:
    """One of Dynamo's guards for a capture, in plain terms (keys/guards_from_dynamo.py turns it into a value guard).

    ``kind``: Dynamo's guard type (``"CONSTANT_MATCH"``, ``"TYPE_MATCH"``, ...); ``source``: the guarded object as
    the Python expression Dynamo evaluates it with (``L['self']._modules['ln'].eps``, ``G['SCALE']``; ``""`` for
    global-state guards); ``value``: the object (``has_value`` False where there is none, e.g. a missing attribute);
    ``detail``: what the guard checks beyond the object: ``{"attr": name}`` (``HASATTR``,
    ``NOT_PRESENT_IN_GENERIC_DICT``), ``{"key": key, "invert": bool}`` (``DICT_CONTAINS`` and the like),
    ``{"other": source}`` (``DUPLICATE_INPUT``: the two sources are one object)."""

    kind: str
    source: str
    has_value: bool
    value: Any      # the guarded object: any value of the user's program
    detail: dict[str, Any]


# Names of the globals Dynamo installs (install_global / install_global_by_id); an earlier capture in the process may
# have left one in the module before this capture began
_DYNAMO_GLOBAL = re.compile(r"__import_\w+|__builtins_dict__\w*|_\d+_c\d+|___\w+")


@dataclasses.dataclass
class GuardRecording:
    """What :func:`guard_recording_options` records: ``guards`` (:class:`DynamoGuard`, in Dynamo's order) and
    ``installed``, the globals Dynamo added to the method's module for the trace (``__import_torch_dot_nn``-style
    modules, ``__builtins_dict___0``, ``_<id>_c<n>`` objects), which guard sources start from; Dynamo removes them
    when the method's cache entries are reset."""
    guards: list[DynamoGuard] = dataclasses.field(default_factory=list)
    installed: dict[str, Any] = dataclasses.field(default_factory=dict)


def guard_recording_options(recording: GuardRecording, globals_: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(options=...)`` under which Dynamo hands every guard of the capture of a function whose globals
    are ``globals_`` to ``recording`` and keeps them all. Mechanism: torch.compile's ``guard_filter_fn`` option (its
    entries: ``name``, ``has_value``, ``value``, ``guard_type``, ``orig_guard``), called while Dynamo's installed
    globals are still there; a fresh dict per call (torch pops the option from it)."""
    before = set(globals_)

    def record(entries: Any) -> list[bool]:     # torch's GuardFilterEntry list: no public type across versions
        recording.guards.extend(_dynamo_guard(e) for e in entries)
        recording.installed.update({k: globals_[k] for k in list(globals_)
                                    if k not in before or _DYNAMO_GLOBAL.fullmatch(k)})
        return [True] * len(entries)

    return {"guard_filter_fn": record}


def _source_name(source: Any) -> str:
    name = source.name
    text: str = name() if callable(name) else name      # a Dynamo Source: untyped here
    return text


def _dynamo_guard(entry: Any) -> DynamoGuard:     # a GuardFilterEntry: no public type across versions
    guard = entry.orig_guard
    source = guard.originating_source
    keywords = dict(getattr(guard.create_fn, "keywords", None) or {})
    kind = entry.guard_type
    detail: dict[str, Any] = {}
    name = _source_name(source)
    if kind in ("HASATTR", "NOT_PRESENT_IN_GENERIC_DICT"):
        if "attr" in keywords:
            detail["attr"] = keywords["attr"]
        else:       # older Dynamo (2.11): the source is the attribute itself, the value the attribute's, not the
            detail["attr"], name = source.member, _source_name(source.base)     # base's that the guard reads
            return DynamoGuard(kind, "" if name is None else name, False, None, detail)
    elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"):
        detail["key"] = keywords.get("key")
        detail["invert"] = bool(keywords.get("invert", kind.endswith("NOT_CONTAINS")))
    elif kind == "DUPLICATE_INPUT" and "source_b" in keywords:
        detail["other"] = _source_name(keywords["source_b"])
    return DynamoGuard(kind, "" if name is None else name, bool(entry.has_value),
                       entry.value if entry.has_value else None, detail)

