"""The gear plan's symbolic trace (gearcache/compiling/symbolic_trace.py): the output dims it cuts back and the
outputs it refuses. Only Dynamo traces run here (no compile), and one refused first call through the public API."""
import pytest
import torch

import gearcache
from gearcache import GearcacheError
from gearcache.call import signature
from gearcache.compiling.symbolic_trace import refuse_views_of_padded, symbolic_shapes


class Outputs(torch.nn.Module):
    """x is [B, 2] with B padded; y is [2] (never padded)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.))

    def view_of_padded(self, x, y):
        return x[:, 1:], x.sum(1)

    def view_of_unpadded(self, x, y):
        return y[1:], x * 2

    def computed(self, x, y):
        return x[:, 1:] * 2, self.table[1:]

    def derived_size(self, x, y):
        return x[1:] + 1


def trace(method, marked=((0, 0),)):
    args = (torch.ones(3, 2), torch.ones(2))
    leaves, key = signature.call_key(args, {})
    with torch.no_grad():
        return symbolic_shapes(method, method.__self__, key[0], leaves, list(marked))


def test_an_output_that_is_a_view_of_a_padded_argument_is_refused():
    """Before, a padded call returned a view of the padded copy: eager's ``x[:, 1:]`` follows later writes to ``x``
    (and writes through it reach ``x``); gearcache's did neither (``x.mul_(-1)`` after the call: [[11], [13], [15]]
    where eager shows [[-11], [-13], [-15]])."""
    m = Outputs()
    with pytest.raises(GearcacheError, match=r"Outputs.view_of_padded: output 0 is a view of the argument at "
                                             r"flattened position 0, whose dims have gears.*Fix: return a \.clone\(\)"):
        refuse_views_of_padded(m.view_of_padded, trace(m.view_of_padded), {0})
    refuse_views_of_padded(m.view_of_padded, trace(m.view_of_padded), set())       # x not padded: a view of x


def test_views_of_unpadded_arguments_and_state_and_computed_outputs_are_cut_as_before():
    m = Outputs()
    unpadded, computed = trace(m.view_of_unpadded), trace(m.computed)
    for method, traced in ((m.view_of_unpadded, unpadded), (m.computed, computed)):
        refuse_views_of_padded(method, traced, {0})
    assert unpadded.output_dims == {1: [(0, unpadded.symbols[0])]}
    assert computed.output_dims == {0: [(0, computed.symbols[0])]}
    with pytest.raises(GearcacheError, match="output 0 dim 0 has size .* derived from a padded dim but not equal"):
        trace(m.derived_size)


def test_the_first_call_of_a_method_returning_a_view_of_a_geared_argument_is_refused(tmp_path):
    class Viewer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = gearcache.CompilerConfig()
            config.inference_config.dim_gears = {"x": {0: [4, 8]}}
            self.cached = gearcache.cache_compile(self.step, cache_dir=str(tmp_path), config=config)

        def step(self, x):
            return x[:, 1:], x.sum(1)

    x = torch.arange(6.).view(3, 2)
    with torch.no_grad(), pytest.raises(GearcacheError, match="output 0 is a view of the argument"):
        Viewer().cached(x)
    assert torch.equal(x, torch.arange(6.).view(3, 2))


def test_a_geared_call_refused_for_a_graph_break_writes_nothing(tmp_path):
    """The gear plan's trace lists the breaks with ``torch._dynamo.explain``, which runs the method: the refused call
    wrote the buffer and the argument once. Both are as before the call (the model: test_capture's, its break found
    here by the gear plan's trace)."""
    from test_capture import BreaksAfterWrites

    model = BreaksAfterWrites(tmp_path)
    x, y = torch.ones(3, 2), torch.zeros(3)
    gearcache.set_dim_gears(x, {0: [2, 4]})
    with pytest.raises(gearcache.GraphBreakError, match="item"), torch.no_grad():
        model.cached(x, y)
    assert torch.equal(model.count, torch.zeros(3)) and torch.equal(y, torch.zeros(3))


class GearedCounting(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.calls = 0
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        self.calls += 1
        return x * 2


def test_a_geared_method_writing_python_state_is_refused_at_the_plan_and_writes_nothing(tmp_path):
    """The gear plan's trace refuses ``self.calls += 1`` as the capture does (a compiled entry would skip it)."""
    model = GearedCounting(tmp_path)
    with pytest.raises(GearcacheError, match=r"writes Python state .*\(self\)"), torch.no_grad():
        model.cached(gearcache.set_dim_gears(torch.ones(3, 2), {0: [2, 4]}))
    assert model.calls == 0
