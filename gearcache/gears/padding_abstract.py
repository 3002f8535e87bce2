"""The abstract values the padding walk (padding_walk.py) follows per graph node, and what their pad regions hold.

A tensor node's value is a :class:`TensorValue`: its dims as factors (padding_factors.py), whether it is *dirty*
(its real rows may differ from eager's: an :class:`Origin` names the op that made them so), the storage it views
(a :class:`Storage` per base node: its pad and how often it was written), and its :class:`Pad`, what its pad region
(the elements past the real size of a padded dim) holds: a constant (gearcache/gears/pad_values.py), positions
(:class:`Positions`, ``arange`` over a padded size), indices in a range (:class:`InRange`), values gathered from a
tensor (:class:`Gathered`), copies of real rows (:data:`REAL_ROW_COPIES`) or UNKNOWN (real data). A size node's
value is a :class:`SizeValue`. Also here: the small readers the walk and the rules share (:func:`tensors_in`,
:func:`covers`, ...; ``source_line``: gearcache/_torch/capture.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch

from . import pad_values as pv
from .pad_values import UNKNOWN, PadValue
from .padding_factors import Dim, is_padded_dim

@dataclasses.dataclass(frozen=True)
class Origin:
    """Why a value's real rows may differ from eager's: the op that made it so."""
    op: str
    where: str
    why: str
    positional: bool        # the op moves rows (a write through such a view lands elsewhere than eager's)
    pads: frozenset[int] | None = None   # the padded leaves whose pad values could make the op exact (None: none could)


@dataclasses.dataclass(frozen=True)
class Positions:
    """The pad of ``arange(start, start + s)`` over a padded size ``s``: element i holds ``start + i``, so the padded
    rows hold positions past every real one, below ``start + bound`` (``bound``: the largest gear of ``s``; None if
    unknown)."""
    start: int
    bound: int | None


@dataclasses.dataclass(frozen=True)
class InRange:
    """A pad region of integers in ``[low, high)``, whatever the padded rows' data: the indices ``topk``, ``sort`` and
    ``argmax`` return along an unpadded dim of size ``high`` (``low`` 0); a valid index into a dim of that size."""
    low: int
    high: int


@dataclasses.dataclass(frozen=True)
class Gathered:
    """The pad of ``index_select(src, dim, index)`` along a padded index: every element holds ``src``'s value at
    ``index`` along ``dim`` (``src``, ``index``: their nodes; ``writes``: ``src``'s storage's writes then)."""
    src: str
    writes: int
    dim: int
    index: str


@dataclasses.dataclass(frozen=True)
class RealRowCopies:
    """A pad region that repeats real data: each padded element equals the element at a real index of the padded dim
    (a tensor without the padded dim expanded over it, and what row-wise ops make of it): as valid an index as the
    real rows, never a neutral value."""


REAL_ROW_COPIES = RealRowCopies()
Held = Union[PadValue, Positions, InRange, Gathered, RealRowCopies, None]
"""What a pad region holds: a constant, positions, values gathered from a tensor, copies of real rows, or UNKNOWN."""


@dataclasses.dataclass(frozen=True)
class Pad:
    """What a value's pad region holds: a constant (exact in the value's dtype), a symbolic value, or UNKNOWN."""
    value: Held = UNKNOWN
    leaves: frozenset[int] = frozenset()     # the padded leaves whose pad values it follows from (or that could make an
    #                                     UNKNOWN one known: a result that was not exact)
    follows: bool = True                # its pad region lies inside its storage's (a write into it reaches it)


NO_PAD = Pad()
"""Real data in the pad region (or no pad region): no pad value of any input changes that."""


@dataclasses.dataclass
class TensorValue:
    """A tensor node's abstract value: its dims (one Dim each), whether its real rows may differ from eager's
    (``dirty``), the storage it views, whether a view on its way moved rows, and its pad."""
    dims: tuple[Dim, ...]             # one Dim per dim
    dirty: Origin | None
    base: str               # the storage it views: the name of the node that made it
    moved: Origin | None = None    # an op on the way here moved rows (a write through it lands elsewhere)
    pad: Pad = NO_PAD         # its pad region's values when it was made (see GraphWalk.pad: writes change them)
    dtype: torch.dtype = torch.float32
    seen: int = 0           # how many writes its storage had when it was made
    name: str = ""          # the node that made it


@dataclasses.dataclass
class Storage:
    """A storage the graph reads or makes: its dims, what its pad region holds, how often it was written."""
    dims: tuple[Dim, ...]
    pad: Pad
    writes: int = 0
    fresh: bool = False     # made by a factory op (empty, zeros, full...): no real rows of its own until written
    const: Held = UNKNOWN   # the value of every element (a fill never written since), or UNKNOWN


@dataclasses.dataclass
class SizeValue:
    """A SymInt, SymFloat or SymBool the graph computes."""
    padded: bool            # depends on a marked dim's size
    dirty: Origin | None


AbstractValue = Union[TensorValue, SizeValue, list["AbstractValue"], None]
"""A node's abstract value: a tensor's, a size's, a list of them (an op with several outputs), or None (a value the
walk does not follow)."""


def graph_constant(value: Any) -> Held:
    """The value of a one-element constant tensor of the graph (its every element); UNKNOWN for anything else."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex() or value.is_meta:
        return UNKNOWN
    try:
        return value.reshape(()).item()
    except Exception:                   # noqa: BLE001 - a tensor without data (fake): unknown
        return UNKNOWN


def tensors_in(values: list[AbstractValue]) -> list[TensorValue]:
    """The TensorValues among ``values``, nested lists included, in order."""
    out = []
    for v in values:
        if isinstance(v, TensorValue):
            out.append(v)
        elif isinstance(v, list):
            out.extend(tensors_in(v))
    return out


def covers(op: tuple[Dim, ...], out: tuple[Dim, ...]) -> bool:
    """Whether an operand of dims ``op``, broadcast to ``out``, has every padded dim of ``out`` (so each element of
    the output's pad region reads the operand's pad region)."""
    lead = len(out) - len(op)
    return all(k >= lead and is_padded_dim(op[k - lead]) for k, d in enumerate(out) if is_padded_dim(d))


def constant_pad(value: Any, dtype: torch.dtype) -> Pad:
    """The pad of a tensor filled with ``value`` (a Python number; anything else: real data)."""
    if isinstance(value, (bool, int, float)):
        try:
            return Pad(pv.exact(value, dtype))
        except ValueError:
            return NO_PAD
    return NO_PAD


def describe_held(v: Held) -> str:
    """What a pad region holds, for a message."""
    if v is REAL_ROW_COPIES:
        return "copies of real rows"
    if isinstance(v, Positions):
        bound = f"below {v.start + v.bound}" if v.bound is not None else "with no known bound"
        return f"the positions after the real ones ({v.start} + row, {bound})"
    if isinstance(v, Gathered):
        return "values gathered from another tensor"
    if isinstance(v, InRange):
        return f"indices from {v.low} to {v.high - 1}"
    return pv.describe(v)
