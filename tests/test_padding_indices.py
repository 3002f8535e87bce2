"""The padding proof's indices (gearcache/gears/padding_rules_reductions.py ``_indices_pad``, padding_rule_context.py
``invalid_index``, padding_rules_indexing.py): indices ``topk``/``sort``/``argmax`` return along an unpadded dim are
valid positions in the padded rows too (``InRange``); an index's pad must be a valid position where it is read or
written (a scatter). Only Dynamo traces and eager runs here (no compile)."""
import pytest
import torch

from gearcache.call import signature
from gearcache.compiling.symbolic_trace import symbolic_shapes
from gearcache.gears import padding


def _report(method, args, marked):
    """The padding report of ``method`` called with ``args``, the (leaf, dim) pairs ``marked`` padded."""
    leaves, key = signature.call_key(args, {})
    with torch.no_grad():
        trace = symbolic_shapes(method, method.__self__, key[0], leaves, marked)
    return padding.analyse(trace, {}, {leaf for leaf, _ in marked}), trace


class Routing(torch.nn.Module):
    """A mixture of experts' routing (transformers' ``batched_mm_experts_forward``): each token's top-2 of 4 experts
    index the experts' weights; x is [B, 4] (B padded)."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.router = torch.nn.Linear(4, 4)
        self.experts = torch.nn.Parameter(torch.randn(3 if variant == "smaller" else 4, 4, 4))

    def forward(self, x):
        logits = self.router(x)
        if self.variant == "argmax":
            ids = logits.argmax(-1, keepdim=True)
        elif self.variant == "over_rows":             # ranks along the padded dim: the padded rows take part
            ids = logits.argsort(dim=0)[:, :2]
        else:
            ids = logits.topk(2, dim=-1).indices
        if self.variant == "shifted":                 # arithmetic on the indices: no longer known in range
            ids = ids + 1
        if self.variant == "aminmax":                 # aminmax's second output is a maximum, not an index: 7 where
            ids = torch.aminmax(torch.where(x[:, :2] == 0, 7, ids), dim=-1, keepdim=True).max     # a row is 0
        weights = self.experts[ids.reshape(-1)]                            # [B * k, 4, 4]
        rows = x.repeat_interleave(ids.shape[-1], dim=0)
        out = torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)
        return out.view(x.shape[0], ids.shape[-1], 4).sum(1)


@pytest.mark.parametrize("variant, exact", [("topk", True), ("argmax", True), ("smaller", False), ("shifted", False),
                                            ("over_rows", False), ("aminmax", False)])
def test_indices_topk_returns_along_an_unpadded_dim_are_valid_in_the_pad_too(variant, exact):
    """``topk``/``argmax`` along the experts' dim (4) give integers in [0, 4) whatever the padded rows hold: a valid
    index into the experts' weights (4 of them), so the routing is per token and exact; not into 3 experts, not
    once shifted by arithmetic, and a top-k along the padded dim itself ranks the padded rows. ``aminmax``'s second
    output is values (a maximum, 7 in rows of zeros: the padded rows), not indices: run padded, it reads out of
    range."""
    torch.manual_seed(0)
    module = Routing(variant)
    report, _ = _report(module.forward, (torch.randn(4, 4),), [(0, 0)])
    assert (report.mixing == []) == exact, report.mixing
    if variant in ("smaller", "shifted", "aminmax"):
        assert any("not a valid position" in f.why for f in report.mixing), report.mixing
    if variant == "aminmax":                           # the real rows (random) route; the padded rows (0) do not
        x = torch.randn(3, 4)
        assert module(x).shape == (3, 4)
        with pytest.raises(IndexError):
            module(torch.cat([x, torch.zeros(1, 4)]))


class Scatter(torch.nn.Module):
    """A mixture of experts' routing mask: ``zeros.scatter(1, ids, 1)`` at each token's top-2 of 4 experts; x is
    [B, 4] (B padded). ``zero_rows``: rows of zeros (the padded rows with a pad of 0) scatter at 7 instead."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, x):
        ids = x.topk(2, dim=-1).indices
        if self.variant == "zero_rows":
            ids = torch.where(x[:, :2] == 0, 7, ids)
        return torch.zeros_like(x).scatter(1, ids, 1.0) * x


@pytest.mark.parametrize("variant", ["topk", "zero_rows"])
def test_a_scatter_at_a_padded_index_needs_a_pad_that_is_a_valid_position(variant):
    """A scatter's padded rows (in line with its target's) write at their index's pad: it must be a valid position
    (topk's indices are; 7 is not, so the pad search takes a pad for x whose rows are not zeros). Run padded with the
    pad values the report chose, the real rows equal eager's (with a pad of 0 the padded run read out of range)."""
    module = Scatter(variant)
    x = torch.randn(3, 4)
    report, _ = _report(module.forward, (x,), [(0, 0)])
    assert report.mixing == [], report.mixing
    padded = torch.cat([x, torch.full((2, 4), report.pad_values.get(0, 0.0))])
    assert torch.equal(module(padded)[:3], module(x))
