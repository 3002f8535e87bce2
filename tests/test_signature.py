import pytest
import torch

import gearcache
from gearcache.signature import call_key, describe, matcher, short


def key_of(*args, **kwargs):
    return call_key(args, kwargs)[1]


def test_same_shapes_same_key():
    assert key_of(torch.zeros(2, 3), torch.ones(4)) == key_of(torch.randn(2, 3), torch.randn(4))
    assert key_of(torch.zeros(2), n=3) == key_of(torch.ones(2), n=3)


def test_key_is_hashable():
    assert len({key_of(torch.zeros(2)), key_of(torch.zeros(2), [torch.zeros(1)], n=1)}) == 2


@pytest.mark.parametrize("kwargs", [False, True], ids=["fast_path", "general_path"])
def test_key_sensitivity(kwargs):
    x = torch.randn(3, 4)

    def k(t):
        return key_of(t, flag=1) if kwargs else key_of(t)

    base = k(x)
    assert k(torch.randn(3, 5)) != base                        # shape
    assert k(x.t()) != k(x.t().contiguous())                   # stride: same shape, non-contiguous view vs copy
    assert x.t().shape == x.t().contiguous().shape
    assert k(x.double()) != base                               # dtype
    assert k(torch.empty(3, 4, device="meta")) != base         # device
    with torch.no_grad():
        no_grad = k(x)
    with torch.inference_mode():
        inference = k(x)
    assert len({base, no_grad, inference}) == 3                # grad mode


def test_grad_mode_recorded_in_key():
    assert key_of(torch.zeros(1))[1] == (True, False)
    with torch.no_grad():
        assert key_of(torch.zeros(1))[1] == (False, False)
    with torch.inference_mode():
        assert key_of(torch.zeros(1))[1] == (False, True)


def test_device_and_dtype_values_in_key():
    x = torch.zeros(2)
    assert key_of(x, "cpu") != key_of(x, "meta")
    assert key_of(x, torch.device("cpu")) != key_of(x, torch.device("meta"))
    assert key_of(x, torch.float32) != key_of(x, torch.float16)


def test_nested_args_flatten_in_order():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    leaves, key = call_key((a, [b, (c, 5)]), {"opts": {"d": d, "s": "mean"}, "n": None})
    assert len(leaves) == 7
    assert all(x is y for x, y in zip(leaves, (a, b, c, 5, d, "mean", None)))


def test_structure_is_part_of_key():
    x, y = torch.zeros(2), torch.zeros(2)
    assert key_of([x, y]) != key_of((x, y))
    assert key_of(x, y) != key_of([x, y])
    assert key_of(x, a=y) != key_of(x, b=y)
    assert key_of(x, a=y) != key_of(x, y)
    assert key_of({"a": x, "b": y}) != key_of({"b": x, "a": y})


def test_plain_tensors_fast_path_leaves_are_args():
    args = (torch.zeros(2), torch.ones(3))
    leaves, _ = call_key(args, {})
    assert leaves is args


def test_scalar_values_are_part_of_key():
    x = torch.zeros(2)
    assert key_of(x, 3) == key_of(x, 3)
    assert key_of(x, 3) != key_of(x, 4)
    assert len({key_of(x, 1), key_of(x, 1.0), key_of(x, True)}) == 3
    assert key_of(x, mode="a") != key_of(x, mode="b")
    assert key_of(x, k=None) != key_of(x, k=0)


@pytest.mark.parametrize("bad", [object(), {1, 2}, b"bytes", range(3)])
def test_unsupported_arg_type(bad):
    with pytest.raises(gearcache.UnsupportedInputError, match=type(bad).__qualname__):
        call_key((torch.zeros(1), bad), {})
    with pytest.raises(TypeError):              # also a TypeError
        call_key((), {"x": [bad]})


def test_describe_fields():
    x = torch.zeros(4, 6)[:, :3]
    with torch.inference_mode():
        leaves, key = call_key((x, 2.5), {})
    desc = describe(leaves, key)
    assert set(desc) == {"structure", "grad_enabled", "inference_mode", "leaves"}
    assert (desc["grad_enabled"], desc["inference_mode"]) == (False, True)
    assert desc["leaves"][0] == {"shape": [4, 3], "stride": [6, 1], "dtype": "torch.float32", "device": "cpu",
                                 "contiguous": False}
    assert desc["leaves"][1] == {"type": "float", "value": "2.5"}
    assert isinstance(desc["structure"], str)


def test_describe_fast_path():
    leaves, key = call_key((torch.zeros(2, dtype=torch.int64),), {})
    desc = describe(leaves, key)
    assert desc["grad_enabled"] is True and desc["inference_mode"] is False
    assert desc["leaves"] == [{"shape": [2], "stride": [1], "dtype": "torch.int64", "device": "cpu",
                               "contiguous": True}]


def test_short():
    with torch.no_grad():
        leaves, key = call_key((torch.zeros(4, 16), torch.zeros(4, 8, dtype=torch.float16)), {"n": 3})
    assert short(describe(leaves, key)) == "(float32[4, 16] cpu, float16[4, 8] cpu, int=3) grad=off"
    leaves, key = call_key((torch.zeros(1),), {})
    assert short(describe(leaves, key)).endswith(" grad=on")


def test_matcher_says_true_only_for_calls_with_the_same_key():
    x, kv = torch.randn(2, 4), torch.randn(3, 2, 5)
    with torch.no_grad():
        leaves, key = call_key((x, kv), {})
        matches = matcher(leaves, key)
        assert matches is not None
        assert matches((torch.randn(2, 4), torch.zeros(3, 2, 5)))          # other values, same signature
        variants = [
            (torch.randn(2, 5), kv),                                       # shape
            (torch.randn(4, 2).t(), kv),                                   # stride, same shape
            (x.double(), kv),                                              # dtype
            (torch.empty(2, 4, device="meta"), kv),                        # device
            (x,),                                                          # count
            (x, kv, kv),
            (x, 3),                                                        # not a tensor
        ]
        for args in variants:
            assert not matches(args), args
            assert call_key(args, {})[1] != key
        assert not matches((x, torch.nn.Parameter(kv)))    # same key, another Python type: False is safe (stricter)
    assert not matches((x, kv))                                            # grad on
    with torch.inference_mode():
        assert not matches((x, kv))                                        # inference mode
        assert not matches((torch.randn(2, 4), torch.randn(3, 2, 5)))      # inference tensors, inference mode


def test_matcher_is_only_made_for_positional_tensors_with_grad_off():
    x = torch.randn(2)
    assert matcher(*call_key((x,), {})) is None                            # grad on: the call checks requires_grad
    with torch.no_grad():
        assert matcher(*call_key((x,), {"n": 1})) is None
        assert matcher(*call_key((x, 1), {})) is None
        assert matcher(*call_key(([x],), {})) is None
