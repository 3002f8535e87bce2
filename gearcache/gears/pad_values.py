"""Pad values: what the padding rows of a tensor hold, and which values leave a reduction's result unchanged.

The padding analysis (padding.py) follows, for every tensor of a geared method's graph, what its *pad region* holds
(the elements past the real size along a padded dim): a known constant (a Python number, exactly as the tensor's
dtype holds it), or :data:`UNKNOWN`. A reduction over a padded dim is exact when the pad region holds its *neutral*
value (:func:`neutral`): ``0`` before a sum, ``1`` before a product, ``+inf`` (an integer dtype's largest value)
before a min, ``-inf`` (the smallest) before a max, a softmax or a log-sum-exp. The pad value of each padded input
is chosen among :func:`candidates` so that every such use is exact (padding.py ``analyse``).

Constants are followed through pointwise ops by running the op on one-element tensors of the same dtypes and ranks
(:func:`evaluate`), on the CPU; a result is kept only when the op computes it *exactly*: the same in float64 as in
the tensor's dtype (so no compiler's choice of precision, fusion or device changes it: ``1 + 1e-3 - 1`` in bfloat16
rounds to 0, but not in float32, and is not kept).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Union

import torch

PadValue = Union[bool, int, float]
UNKNOWN = None
"""A pad region whose values gearcache cannot tell (real data, or an inexact result)."""

# Reductions, by ATen op name, and the pad their reduced dims need: "zero", "one", "top" (the dtype's largest value:
# +inf, iinfo.max, True), "bottom" (-inf, iinfo.min, False).
REDUCTIONS: dict[str, str] = {
    **dict.fromkeys(["sum", "nansum", "count_nonzero", "any"], "zero"),
    "prod": "one", "all": "one",
    **dict.fromkeys(["amin", "min", "argmin"], "top"),
    **dict.fromkeys(["amax", "max", "argmax", "logsumexp"], "bottom"),
}
SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"}
"""Along a padded dim these need ``-inf`` in the pad region (a weight of exactly 0)."""
ARG_REDUCTIONS = {"argmin", "argmax", "min", "max"}
"""Reductions that return positions along the reduced dims (``min``/``max`` over a dim: their indices)."""


def neutral(kind: str, dtype: torch.dtype) -> PadValue | None:
    """The pad value that ``kind`` (see :data:`REDUCTIONS`) needs in a tensor of ``dtype``; None if none is
    representable (a complex dtype)."""
    if dtype == torch.bool:
        return {"zero": False, "one": True, "top": True, "bottom": False}[kind]
    if dtype.is_complex:
        return {"zero": 0.0, "one": 1.0}.get(kind)
    if dtype.is_floating_point:
        return {"zero": 0.0, "one": 1.0, "top": math.inf, "bottom": -math.inf}[kind]
    info = torch.iinfo(dtype)
    return {"zero": 0, "one": 1, "top": info.max, "bottom": info.min}[kind]


def known(value: object) -> bool:
    """Whether ``value`` is a known constant (a bool, int or float; not UNKNOWN nor a symbolic value)."""
    return isinstance(value, (bool, int, float))


def is_neutral(kind: str, value: object, dtype: torch.dtype) -> bool:
    """Whether a pad region holding ``value`` leaves the reduction ``kind`` over it exact."""
    want = neutral(kind, dtype)
    return known(value) and want is not None and same(value, want)


def describe(value: object) -> str:
    """A pad value for a message: ``0``, ``-inf``, ``unknown values``."""
    if not known(value):
        return "values gearcache cannot tell (real data, or a result it cannot compute exactly)"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def candidates(dtype: torch.dtype) -> list[PadValue]:
    """The pad values gearcache tries for a padded input of ``dtype``, in order (0 first: the value a pad token id or
    a zero row usually wants)."""
    if dtype == torch.bool:
        return [False, True]
    if dtype.is_floating_point:
        return [0.0, -math.inf, math.inf, 1.0]
    if dtype.is_complex:
        return [0.0]
    info = torch.iinfo(dtype)
    return [0, info.min, info.max, 1]


def exact(value: Any, dtype: torch.dtype) -> PadValue:
    """``value`` as a tensor of ``dtype`` holds it (a Python bool, int or float); ``ValueError`` if it does not fit
    (``-inf`` or ``0.5`` in an integer dtype, a value past the dtype's range, a complex dtype)."""
    if dtype == torch.bool:
        if isinstance(value, (bool, int, float)) and value in (0, 1):
            return bool(value)
        raise ValueError(f"a {dtype} tensor cannot hold {value!r}")
    if dtype.is_complex:
        raise ValueError(f"gearcache pads no {dtype} tensor")
    if dtype.is_floating_point:
        return float(torch.tensor(float(value), dtype=torch.float64).to(dtype).item())
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"a {dtype} tensor cannot hold {value!r}")
    info = torch.iinfo(dtype)
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"a {dtype} tensor cannot hold {value!r} (its range is {info.min} to {info.max})")
    return int(value)


def same(a: object, b: object) -> bool:
    """Equal pad values (NaN equals NaN; ``-0.0`` equals ``0.0``; a bool equals only a bool)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def finite(value: object) -> bool:
    """A known pad value that is a finite number (a product with it and 0 is 0)."""
    return known(value) and not (isinstance(value, float) and not math.isfinite(value))


def evaluate(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             inputs: list[tuple[Any, PadValue, torch.dtype, int]],
             out_dtype: torch.dtype) -> PadValue | None:
    """The pad value of ``op(*args, **kwargs)``'s output when each input ``(placeholder, value, dtype, rank)`` holds
    ``value``: the op run on tensors of shape ``[1] * rank`` (so type promotion is the graph's); :data:`UNKNOWN` if
    it fails or is not exact (its float64 result differs)."""
    try:
        narrow = _run(op, args, kwargs, {p: _full(v, dtype, rank) for p, v, dtype, rank in inputs})
        wide = _run(op, args, kwargs, {p: _full(v, _wide(dtype), rank) for p, v, dtype, rank in inputs})
    except Exception:                   # noqa: BLE001 - an op that cannot run on one-element CPU tensors: unknown
        return UNKNOWN
    if not isinstance(narrow, torch.Tensor) or narrow.numel() != 1 or narrow.dtype != out_dtype:
        return UNKNOWN
    if not isinstance(wide, torch.Tensor) or wide.numel() != 1 or out_dtype.is_complex:
        return UNKNOWN
    value, wide_value = narrow.reshape(()).item(), wide.reshape(()).item()
    if out_dtype.is_floating_point:
        return value if same(float(value), float(wide_value)) else UNKNOWN
    return value if value == wide_value else UNKNOWN


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype.is_floating_point else dtype


def _full(value: PadValue, dtype: torch.dtype, rank: int) -> torch.Tensor:
    return torch.full([1] * rank, value, dtype=dtype)


def _run(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
         values: dict[torch.fx.Node, torch.Tensor]) -> Any:
    """``op`` with every placeholder in ``args``/``kwargs`` (an FX node) replaced by its tensor from ``values``, on the
    CPU (a ``device`` argument is the CPU)."""
    def sub(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return values[a] if _hashable(a) and a in values else a

    cpu = {k: (torch.device("cpu") if k == "device" and v is not None else sub(v)) for k, v in kwargs.items()}
    with torch.no_grad():
        return op(*[sub(a) for a in args], **cpu)


def _hashable(a: Any) -> bool:
    try:
        hash(a)
    except TypeError:
        return False
    return True


def convert(value: object, dtype: torch.dtype) -> PadValue | None:
    """A pad value copied into a tensor of ``dtype`` (``copy_``, a sum's wider dtype): rounded to a float dtype,
    truncated to an integer one (:data:`UNKNOWN` for a non-finite float there: that conversion is undefined),
    ``!= 0`` for bool."""
    if not isinstance(value, (bool, int, float)) or dtype.is_complex:
        return UNKNOWN
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return exact(value, dtype)
    if isinstance(value, float) and not math.isfinite(value):
        return UNKNOWN
    try:
        return exact(int(value), dtype)
    except ValueError:
        return UNKNOWN
