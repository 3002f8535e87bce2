"""Capture: a graph break is an error that lists every break with its user source line and the fixes."""
import pytest
import torch

import gearcache


class Breaks(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        y = x * 2
        if y.sum().item() > 0:          # data-dependent Python branch: a graph break
            y = y + 1
        return y


def test_graph_break_lists_reason_line_and_fixes(tmp_path):
    with pytest.raises(gearcache.GraphBreakError) as info:
        with torch.no_grad():
            Breaks(tmp_path).cached(torch.ones(3))
    err = info.value
    assert err.breaks, "at least one break is reported"
    text = str(err)
    assert "test_capture.py" in text and "item()" in text       # the user's source line
    assert "torch.where" in text and ".item()" in text           # how to fix the common ones
    artifacts = tmp_path / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), "nothing is published for an uncapturable method"


def test_method_returning_nested_structures_round_trips(tmp_path):
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=tmp_path)

        def fwd(self, x, extra, scale=2):
            return {"y": x * self.w * scale, "pair": (extra[0] + 1, extra[1]), "n": 7, "w": self.w}

    m = Nested()
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    with torch.no_grad():
        out = m.cached(x, [a, b], scale=3)
        ref = m.fwd(x, [a, b], scale=3)
    assert list(out) == ["y", "pair", "n", "w"]
    torch.testing.assert_close(out["y"], ref["y"])
    torch.testing.assert_close(out["pair"][0], ref["pair"][0])
    assert out["pair"][1] is b and out["w"] is m.w and out["n"] == 7
