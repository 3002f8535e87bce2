import json
import threading

import pytest
import torch
from torch_settings import attribute, setting

import gearcache
from gearcache._torch import state as torch_state
from gearcache.call.signature import call_key, describe, matcher, shared_memory_message, short


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
    assert key_of(torch.zeros(1))[1][:2] == (True, False)
    with torch.no_grad():
        assert key_of(torch.zeros(1))[1][:2] == (False, False)
    with torch.inference_mode():
        assert key_of(torch.zeros(1))[1][:2] == (False, True)


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
    assert set(desc) == {"structure", "grad_enabled", "inference_mode", "autocast", "leaves"}
    assert (desc["grad_enabled"], desc["inference_mode"], desc["autocast"]) == (False, True, {})
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
        assert matcher(*call_key(([x],), {})) is None
        assert matcher(*call_key((x, "a"), {})) is None                    # a string: the key's path
        assert matcher(*call_key((1, 2.0), {})) is None                    # no tensor
        assert matcher(*call_key((x, 1), {})) is not None                  # scalars beside tensors: compared


def test_a_matcher_compares_positional_scalars_by_type_and_value():
    # A served step's call (tensors and an int such as keep_last) takes the shortcut: its matcher says True exactly
    # when the call's key would be the same, the scalars compared by type (1 is not True nor 1.0) and value.
    x, pad = torch.randn(2, 4), torch.zeros((), dtype=torch.long)
    args = (x, pad, 1, 0.5, None, False)
    changes = {0: [x.double(), x.t()], 1: [pad.float()], 2: [2, True, 1.0], 3: [1.5, float("nan")], 4: [0],
               5: [0, True]}
    with torch.no_grad():
        leaves, key = call_key(args, {})
        matches = matcher(leaves, key)
        assert matches is not None and matches(args)
        assert matches((torch.randn(2, 4), torch.ones((), dtype=torch.long), 1, 0.5, None, False))  # other values
        for i, others in changes.items():
            for other in others:
                changed = args[:i] + (other,) + args[i + 1:]
                assert call_key(changed, {})[1] != key, changed
                assert not matches(changed), changed
        assert not matches(args[:-1])                                       # count


def test_signed_zeros_and_nans_are_keyed_as_they_compile():
    # 0.0 and -0.0 compare equal but a graph specialized on one gives another answer for the other (1 / (x * s)):
    # each its own key, and a matcher made for one says False for the other. Every NaN (no two equal) one key.
    x = torch.zeros(2)
    assert key_of(x, 0.0) != key_of(x, -0.0) and key_of(x, 0.0) == key_of(x, 0.0)
    assert key_of(x, float("nan")) == key_of(x, float("nan")) != key_of(x, 0.0)
    assert key_of(x, 0.0) != key_of(x, 0) and key_of(x, 1.5) != key_of(x, -1.5)
    with torch.no_grad():
        for made, other in [(0.0, -0.0), (-0.0, 0.0)]:
            matches = matcher(*call_key((x, made), {}))
            assert matches is not None and matches((x, made)) and not matches((x, other))



GLOBAL_STATES = {
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast_dtype": lambda: torch.autocast("cpu", dtype=torch.float16),
    "default_dtype": lambda: setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
    "deterministic": lambda: setting(torch.are_deterministic_algorithms_enabled,
                                      torch.use_deterministic_algorithms, True),
    "cuda_tf32": lambda: attribute(torch.backends.cuda.matmul, "allow_tf32", True),
    "cudnn_sdp": lambda: setting(torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp,
                                  False),
}


@pytest.mark.parametrize("name", [n for n in GLOBAL_STATES if n != "cudnn_sdp"])
def test_global_torch_state_is_part_of_the_key(name):
    x = torch.randn(2, 4)
    with torch.no_grad():
        plain = call_key((x,), {})[1]
        with GLOBAL_STATES[name]():
            changed = call_key((x,), {})[1]
        assert call_key((x,), {})[1] == plain
    assert changed != plain
    assert changed[1][:2] == plain[1][:2]           # grad and inference mode unchanged: the state tag differs
    assert json.loads(changed[1][2]) != json.loads(plain[1][2])


@pytest.mark.parametrize("name", GLOBAL_STATES)
def test_every_setting_changes_the_global_state_factor(name):
    plain = torch_state.global_state()
    with GLOBAL_STATES[name]():
        changed = torch_state.global_state()
    assert changed != plain
    assert torch_state.global_state() == plain


def test_sdpa_backends_are_seen_per_call_by_the_native_snapshot_and_at_a_miss_by_dynamos(checks):
    # Dynamo's C++ snapshot does not cover the SDPA backends (torch.compile does not guard them either): a running
    # process keeps serving the signatures it has, and a new signature (a miss) computes the entry key afresh with
    # them. gearcache's native snapshot covers them: the next call's key has them.
    x = torch.randn(2, 4)
    plain = call_key((x,), {})[1]
    with GLOBAL_STATES["cudnn_sdp"]():
        assert torch_state.global_state()["sdp"]["cudnn"] is False
        if checks == "native":
            assert call_key((x,), {})[1] != plain
        else:
            assert call_key((x,), {})[1] == plain
    assert call_key((x,), {})[1] == plain


@pytest.mark.parametrize("name", GLOBAL_STATES)
def test_the_matcher_says_false_under_another_global_state(name, checks):
    # (Dynamo's snapshot does not cover the SDPA backends, as torch.compile does not guard them: its matcher keeps
    # saying True; a miss keys them)
    blind = checks == "dynamo" and name == "cudnn_sdp"
    x = torch.randn(2, 4)
    with torch.no_grad():
        matches = matcher(*call_key((x,), {}))
        assert matches((x,))
        with GLOBAL_STATES[name]():
            assert matches((x,)) is blind
        assert matches((x,))


def test_the_matcher_is_not_made_for_a_key_of_another_state():
    x = torch.randn(2, 4)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            leaves, key = call_key((x,), {})
        assert matcher(leaves, key) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert matcher(leaves, key)((x,))


def test_the_state_tag_is_per_thread():
    x = torch.randn(2, 4)
    seen = {}

    def other():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            seen["other"] = call_key((x,), {})[1]

    with torch.no_grad():
        before = call_key((x,), {})[1]
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert call_key((x,), {})[1] == before
    assert seen["other"] != before
    assert json.loads(seen["other"][1][2])["autocast"] == {"cpu": "torch.bfloat16"}


def test_views_of_one_storage_are_keyed_by_where_they_sit_and_get_no_shortcut():
    """Distinct tensors on one storage add ("storage", first leaf on it, storage offset, base) to their keys (Dynamo
    compiles them as views of one base), so equal views, overlapping ones, disjoint ones and separate tensors have
    four keys; such calls get no shortcut matcher, and a matcher for an entry that writes an input refuses a later
    call whose tensors share a storage."""
    big = torch.randn(8, 8)
    calls = {"equal views": (big[0:4], big[0:4]), "overlapping": (big[0:4], big[2:6]),
             "disjoint": (big[0:4], big[4:8]), "separate": (big[0:4].clone(), big[4:8].clone())}
    with torch.no_grad():
        keys = {name: call_key(args, {})[1] for name, args in calls.items()}
        assert len(set(keys.values())) == 4
        over = ((8, 8), (8, 1), 0)                                  # big: the base of the views
        assert keys["overlapping"][3][-1] == ("storage", 0, 16, over) and keys["disjoint"][3][-1] == \
            ("storage", 0, 32, over)
        assert describe(calls["overlapping"], keys["overlapping"])["leaves"][1]["storage_offset"] == 16
        assert matcher(calls["overlapping"], keys["overlapping"]) is None
        separate = calls["separate"]
        plain, writes = matcher(separate, keys["separate"]), matcher(separate, keys["separate"], True)
        assert plain(calls["disjoint"]) and plain(separate)        # reads only: views read the same values
        assert writes(separate) and not writes(calls["disjoint"]) and not writes((big, big))


def test_the_refusal_of_inputs_sharing_memory_names_the_arguments():
    def fwd(x, cache, scale=1.0):
        return x

    base = torch.randn(4, 8)
    other = torch.randn(4, 8)
    args, kwargs = (base[:2], [other, base[2:]]), {}
    leaves, key = call_key(args, kwargs)
    message = shared_memory_message("M.fwd", key, "padding copies them", fwd, leaves)
    assert "arguments x, cache[1] are one tensor or views of one storage" in message, message
    assert "padding copies them" in message and "Fix:" in message
    same = torch.randn(3)
    leaves, key = call_key((same, [same]), {})
    assert "arguments x, cache[0]" in shared_memory_message("M.fwd", key, "why", fwd, leaves)
    assert "flattened position 0" in shared_memory_message("M.fwd", key, "why")      # no method: positions
