"""The torch.compile route: one Dynamo graph for every gear, one gearcache entry per gear, outputs equal eager."""
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch.fx.experimental._config as fx_config

from gearcache import CompilerConfig, counters, get_backend, set_dim_gears


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)

    def forward(self, a, b):
        return self.lin(a + b), a.sum(1)


@pytest.mark.slow
def test_backend_serves_every_size_from_one_graph(tmp_path):
    torch.manual_seed(0)
    model = Pair().eval()
    compiled = torch.compile(model, fullgraph=True,
                             backend=get_backend(compiler_config=CompilerConfig(), cache_dir=tmp_path))
    a = set_dim_gears(torch.ones(2, 2), {0: [2, 4, 8]})
    b = set_dim_gears(torch.ones(2, 2), {0: [2, 4, 8]})
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    # Dynamo specialises sizes 0 and 1 by default; size-oblivious tracing keeps size 1 in the same graph.
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True), counters.expect(compiles=3):
        compiled(a, b)
        for n in range(1, 9):
            x, y = torch.randn(n, 2), torch.randn(n, 2)
            out, total = compiled(x, y)
            ref, ref_total = model(x, y)
            assert out.shape == (n, 3)
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(total, ref_total)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs_before == 1, "no recompiles across gears"


class WritesState(torch.nn.Module):
    """Writes its input ``state`` in place along the gear dim (the differential tester's reproducer)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, state):
        h = self.lin(x)
        state.mul_(0.5).add_(h)
        return h + state


class Centres(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def _geared_compile(model, tmp_path, **inference):
    config = CompilerConfig()
    for k, v in inference.items():
        setattr(config.inference_config, k, v)
    return torch.compile(model, fullgraph=True, backend=get_backend(compiler_config=config, cache_dir=tmp_path))


def test_an_input_written_in_place_on_a_padded_call_gets_its_real_rows_back(tmp_path):
    torch.manual_seed(0)
    model = WritesState().eval()
    compiled = _geared_compile(model, tmp_path)
    x, state = torch.randn(3, 4), torch.randn(3, 4)
    want_state = state.clone()
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        out = compiled(set_dim_gears(x, {0: [2, 4]}), set_dim_gears(state, {0: [2, 4]}))
        want = model(x, want_state)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, want_state)


def test_an_op_mixing_padded_rows_is_refused_on_this_route_unless_the_check_is_off(tmp_path):
    import pytest

    from gearcache import PaddingUnsafeError

    x = torch.randn(3, 4)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        with pytest.raises(PaddingUnsafeError, match="mean"):
            _geared_compile(Centres(), tmp_path)(set_dim_gears(x.clone(), {0: [2, 4]}))
        torch._dynamo.reset()
        served = _geared_compile(Centres(), tmp_path, padding_check="off")(set_dim_gears(x.clone(), {0: [2, 4]}))
    assert served.shape == (3, 4)       # off: served as asked (padding changes the mean: the user's assertion)


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, alpha):
        return self.lin(x) * alpha


@pytest.mark.slow
def test_a_float_argument_that_changes_is_read_from_the_call(tmp_path):
    """A float argument whose value changes between calls: Dynamo recompiles with it as a 0-dim tensor read by
    ``item()``. gearcache's static retrace of that graph bound the item's unbacked symbol, and Inductor's retrace in
    a fresh shape environment, binding its own of the same name, raised "possible memo disaster" (found by the
    differential tester: its case 2 on seed 0). The value is read from each call, never baked in."""
    torch.manual_seed(0)
    model = Scaled().eval()
    compiled = torch.compile(model, fullgraph=True, backend=get_backend(CompilerConfig(), cache_dir=tmp_path))
    with torch.no_grad():
        for n, alpha in ((2, 2.0), (4, 0.5), (4, 0.7), (2, 3.0)):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x, alpha), model(x, alpha))


def test_a_second_backend_over_the_same_folder_loads_each_gear(tmp_path):
    """The route compiles and loads through the same seam as cache_compile's entries (compiling/pipeline.py): a
    fresh trace over a folder that has the gears' artifacts loads them (counted as loads), compiling nothing."""
    import torch._dynamo
    torch.manual_seed(0)
    model = Pair().eval()
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    outs = []
    for expected in ({"compiles": 2, "loads": 0}, {"compiles": 0, "loads": 2}):
        torch._dynamo.reset()
        compiled = _geared_compile(model, tmp_path)
        with torch.no_grad(), counters.expect(misses=2, **expected):
            outs.append([compiled(set_dim_gears(a[:n], {0: [2, 4]}), set_dim_gears(b[:n], {0: [2, 4]}))
                         for n in (2, 3)])
    for first, second in zip(*outs):
        torch.testing.assert_close(first, second)
    with torch.no_grad():
        torch.testing.assert_close(outs[1][1], model(a, b))


class ReturnsAView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), x[:, :2]


def test_an_output_viewing_a_geared_input_is_refused_as_on_the_cached_method_route(tmp_path):
    """A padded call copies its geared input, so an output that views it would be a view of the copy: eager's later
    writes to ``x`` did not show in it (served silently; ``cache_compile`` refuses it: symbolic_trace's
    ``refuse_views_of_padded``). Refused here too, at the first call, naming the output and the fix."""
    from gearcache.errors import GearcacheError

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        with pytest.raises(GearcacheError, match=r"output 1 is a view of graph input \d+.*\.clone\(\)"):
            _geared_compile(ReturnsAView(), tmp_path)(set_dim_gears(torch.randn(3, 4), {0: [2, 4]}))
