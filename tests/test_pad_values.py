"""Pad values (gearcache/gears/pad_values.py): neutral values per reduction and dtype, exact conversion of a user's
value, and the exact evaluation of pointwise ops on pad values (a result is kept only when no precision could change
it)."""
import math

import pytest
import torch

from gearcache.gears import pad_values as pv

aten = torch.ops.aten


@pytest.mark.parametrize("kind, dtype, want", [
    ("zero", torch.float32, 0.0), ("one", torch.bfloat16, 1.0), ("top", torch.float16, math.inf),
    ("bottom", torch.float32, -math.inf), ("top", torch.int64, torch.iinfo(torch.int64).max),
    ("bottom", torch.int32, torch.iinfo(torch.int32).min), ("top", torch.bool, True), ("bottom", torch.bool, False),
])
def test_neutral_values_per_reduction_and_dtype(kind, dtype, want):
    assert pv.neutral(kind, dtype) == want and type(pv.neutral(kind, dtype)) is type(want)
    assert pv.is_neutral(kind, want, dtype)
    assert not pv.is_neutral(kind, pv.UNKNOWN, dtype)


def test_a_users_value_is_taken_as_its_dtype_holds_it_or_refused():
    assert pv.exact(-1.0, torch.int64) == -1 and isinstance(pv.exact(-1.0, torch.int64), int)
    assert pv.exact(0.1, torch.bfloat16) == 0.10009765625
    assert pv.exact(float("-inf"), torch.float16) == -math.inf
    assert pv.exact(1, torch.bool) is True
    for value, dtype in ((float("inf"), torch.int64), (0.5, torch.int32), (2 ** 40, torch.int32), (2, torch.bool)):
        with pytest.raises(ValueError, match="cannot hold"):
            pv.exact(value, dtype)


def test_candidates_start_with_zero_and_cover_every_neutral_value():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool):
        cands = pv.candidates(dtype)
        assert cands[0] == 0
        for kind in ("zero", "one", "top", "bottom"):
            assert any(pv.same(c, pv.neutral(kind, dtype)) for c in cands), (dtype, kind)


@pytest.mark.parametrize("op, args, inputs, out, want", [
    (aten.neg.default, ("x",), [("x", math.inf, torch.float32, 2)], torch.float32, -math.inf),
    (aten.mul.Tensor, ("x", -2.0), [("x", -math.inf, torch.float32, 2)], torch.float32, math.inf),
    (aten.exp.default, ("x",), [("x", -math.inf, torch.bfloat16, 1)], torch.bfloat16, 0.0),
    (aten.masked_fill.Scalar, ("x", "m", -math.inf), [("x", 0.0, torch.float32, 2), ("m", True, torch.bool, 2)],
     torch.float32, -math.inf),
    (aten.clamp.default, ("x", 0), [("x", -1, torch.int64, 1)], torch.int64, 0),
    (aten.ge.Scalar, ("x", 0), [("x", -1, torch.int64, 1)], torch.bool, False),
    (aten.add.Tensor, ("x", "y"), [("x", 1, torch.int64, 1), ("y", 0.5, torch.float32, 0)], torch.float32, 1.5),
])
def test_pointwise_ops_on_pad_values_are_evaluated_exactly(op, args, inputs, out, want):
    got = pv.evaluate(op, args, {}, inputs, out)
    assert pv.same(got, want), (got, want)


@pytest.mark.parametrize("op, args, inputs, out", [
    (aten.add.Tensor, ("x", 1e-3), [("x", 1.0, torch.bfloat16, 2)], torch.bfloat16),   # 1.001 rounds to 1 in bf16
    (aten.exp.default, ("x",), [("x", 1.0, torch.float32, 1)], torch.float32),         # e: float32 != float64
    (aten.mul.Tensor, ("x", 0.1), [("x", 3.0, torch.float32, 1)], torch.float32),
])
def test_a_result_any_precision_could_change_is_unknown(op, args, inputs, out):
    """A fused kernel may compute a bfloat16 chain in float32 without rounding in between: only a result that is
    the same in float64 is kept."""
    assert pv.evaluate(op, args, {}, inputs, out) is pv.UNKNOWN


def test_conversions_between_dtypes():
    assert pv.convert(0.0, torch.int64) == 0 and pv.convert(2.7, torch.int32) == 2
    assert pv.convert(math.inf, torch.int64) is pv.UNKNOWN, "undefined in C"
    assert pv.convert(3, torch.bool) is True and pv.convert(1, torch.float16) == 1.0
    assert pv.convert(pv.UNKNOWN, torch.float32) is pv.UNKNOWN
    assert pv.same(math.nan, math.nan) and pv.same(-0.0, 0.0) and not pv.same(True, 1)
    assert pv.describe(math.inf) == "+inf" and pv.describe(-1.0) == "-1" and pv.describe(0.5) == "0.5"
