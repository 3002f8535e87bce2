"""The torch.compile route: one Dynamo graph for every gear, one gearcache entry per gear, outputs equal eager."""
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
