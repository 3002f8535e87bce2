"""What the padding analysis (padding.py) found for a gear plan, and its JSON form in the plan's record.

Kept apart from the analysis so that loading a gear plan imports neither sympy nor the analysis (a warm start reads
the report, it never analyses). On disk (the gear plan's JSON, key ``"padding"``): ``{"complete": bool, "mixing":
[F], "unsafe_writes": [F], "written_leaves": [int], "written_state": [str], "meets": [[str, str]], "pad_values":
[[int, value]]}`` with ``F = {"op", "where", "why", "reaches"}`` and ``value`` the pad value of a padded leaf (a
bool, int or float; JSON's ``Infinity`` for an infinite one).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Finding:
    op: str             # the ATen op, e.g. "aten.mean.dim"
    where: str          # the user's source line, e.g. "model.py:12 in fwd: return h - h.mean(0)"
    why: str            # e.g. "reduces over a padded dim"
    reaches: str        # e.g. "output 0", "buffer total", "argument kv"

    def __str__(self) -> str:
        return f"{self.op} at {self.where or '(source unknown)'}: {self.why}; it reaches {self.reaches}"


@dataclasses.dataclass
class PaddingReport:
    """What :func:`analyse` found (see the module docstring)."""
    complete: bool = True
    mixing: list[Finding] = dataclasses.field(default_factory=list)
    unsafe_writes: list[Finding] = dataclasses.field(default_factory=list)
    written_leaves: list[int] = dataclasses.field(default_factory=list)
    written_state: list[str] = dataclasses.field(default_factory=list)
    meets: list[list[str]] = dataclasses.field(default_factory=list)
    pad_values: dict[int, Any] = dataclasses.field(default_factory=dict)     # padded leaf -> its pad value

    def to_json(self) -> dict[str, Any]:
        return {"complete": self.complete, "mixing": [dataclasses.asdict(f) for f in self.mixing],
                "unsafe_writes": [dataclasses.asdict(f) for f in self.unsafe_writes],
                "written_leaves": list(self.written_leaves), "written_state": list(self.written_state),
                "meets": [list(m) for m in self.meets],
                "pad_values": [[leaf, value] for leaf, value in sorted(self.pad_values.items())]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PaddingReport":
        return cls(bool(data["complete"]), [Finding(**f) for f in data["mixing"]],
                   [Finding(**f) for f in data["unsafe_writes"]], [int(i) for i in data["written_leaves"]],
                   [str(n) for n in data["written_state"]], [[str(a), str(b)] for a, b in data["meets"]],
                   {int(leaf): value for leaf, value in data["pad_values"]})
