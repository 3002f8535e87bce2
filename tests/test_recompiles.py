"""Warnings about a method compiling an entry per value of a scalar argument or per size of a tensor argument."""
import shutil
import warnings

import pytest
import torch

import gearcache
from gear_models import PairMLP
from gearcache import counters


class Tempered(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, temperature):
        return self.lin(x) / max(temperature, 1.0)      # every value below 1 traces the same graph: one compile


def test_a_scalar_argument_taking_a_third_value_is_warned_once(tmp_path):
    m = Tempered(tmp_path)
    x = torch.randn(2, 4)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="gearcache")
            m.cached(x, 0.1)
            m.cached(x, 0.5)
            m.cached(x, 0.1)                                # a hit: no new value
        with pytest.warns(UserWarning) as record, counters.expect(compiles=0, traces=1):
            out = m.cached(x, 0.9)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="gearcache")                  # once per method and argument
            m.cached(x, 0.7)
            m.cached(x, temperature=0.3)
    torch.testing.assert_close(out, m.fwd(x, 0.9))
    text = str(record[0].message)
    assert "Tempered.fwd" in text and "argument temperature is a Python float" in text, text
    assert "0.1, 0.5, 0.9" in text and "torch.tensor(temperature)" in text, text
    assert record[0].filename == __file__                   # points at the caller's line


def test_a_dim_taking_a_third_size_without_gears_is_warned_naming_lost_marks(gears_cache, tmp_path):
    """PairMLP's store holds gears 2, 4 and 8 and their plan; a process whose tensors carry no marks (and no gears by
    name) loads an exact entry per size: warned at the third size, once, naming the argument and the fix."""
    cache = tmp_path / "cache"
    shutil.copytree(gears_cache[0], cache, ignore=shutil.ignore_patterns("locks", "leases"))
    m = PairMLP(cache)
    with torch.inference_mode():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="gearcache")
            m.cached(torch.randn(2, 4), torch.randn(2, 4))
            m.cached(torch.randn(4, 4), torch.randn(4, 4))
        with pytest.warns(UserWarning) as record, counters.expect(compiles=0, loads=1):
            m.cached(torch.randn(8, 4), torch.randn(8, 4))
    texts = [str(w.message) for w in record]
    assert len(texts) == 2, texts                           # one per argument: x and y
    assert "argument x dim 0 took its 3rd size (2, 4, 8)" in texts[0], texts[0]
    assert "argument y dim 0 took its 3rd size (2, 4, 8)" in texts[1], texts[1]
    assert "gear plans" in texts[0] and "lost" in texts[0] and "inference_config.dim_gears" in texts[0], texts[0]



class Reciprocal(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, s):
        return 1.0 / (x * s) + s                        # s = 0.0: +inf; s = -0.0: -inf


def test_signed_zero_and_nan_scalars_are_served_as_eager_computes_them(tmp_path):
    """0.0 and -0.0 compare equal but their graphs differ: each call (the shortcut's, the key's) answers as eager
    does; NaNs, each unequal to every other, share one entry (no load per call)."""
    m = Reciprocal(tmp_path)
    x = torch.ones(3)
    with torch.no_grad():
        for s in [0.0, 0.0, -0.0, -0.0, 0.0, -0.0]:
            torch.testing.assert_close(m.cached(x, s), m.fwd(x, s), msg=repr(s))
        m.cached(x, float("nan"))
        with counters.expect(compiles=0, loads=0, traces=0):
            for _ in range(3):
                assert m.cached(x, float("nan")).isnan().all()
    assert len(m.cached._table) == 3
