"""The padding walk's KV cache and causal mask roles (gearcache/gears/padding_cache.py), on a small attention layer
with a static cache as ``enable()`` serves one: its prompt's padded rows write the cache, and the attention reading
it is exact only with the mask argument it was given. Only Dynamo traces run here (no compile)."""
import pytest
import torch
import torch.nn.functional as F

from gearcache.call import signature
from gearcache.compiling.capture import symbolic_shapes
from gearcache.gears import padding
from gearcache.gears.padding_cache import Roles

B, T, L, H = 2, 5, 32, 8


class Attend(torch.nn.Module):
    """One attention layer over a static cache ``[B, 1, L, H]``, its writes at ``length + arange(T)``."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.q, self.k = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x, mask, keys, values, length):
        q, k = self.q(x)[:, None], self.k(x)[:, None]
        positions = torch.arange(x.shape[1]) + length
        length.add_(x.shape[1])
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, k)
        if self.variant == "full":
            mask = torch.ones_like(mask)
        if self.variant == "inplace":
            mask[..., 1] = True
        if self.variant == "shifted":
            mask = F.pad(mask[..., 1:], (0, 1))
        if self.variant == "boolcast":              # a bool mask added as numbers: 1 and 0 hide nothing
            mask = mask.float()
        if self.variant in ("cudnn", "inverted", "aligned", "weak", "leftpad", "cast"):  # a bool mask made additive
            fill = {"cudnn": -65504.0, "weak": -1.0}.get(self.variant, float("-inf"))
            mask = torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0))
            if self.variant == "aligned":           # as sdpa's memory-efficient path aligns a bias, then slices it
                mask = F.pad(mask, (0, 3))[..., :mask.shape[-1]]
            if self.variant == "leftpad":
                mask = F.pad(mask, (1, 0))[..., :mask.shape[-1]]
            if self.variant == "cast":
                mask = mask.double().contiguous().float()
        if self.variant == "written":
            return torch.softmax(q @ keys.transpose(-1, -2) + mask, -1) @ values
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if self.variant == "nomask" else mask,
                                             is_causal=self.variant == "nomask")
        if self.variant == "mean":
            out = out - out.mean(2, keepdim=True)
        return out


@pytest.mark.parametrize("variant, exact", [("causal", True), ("full", False), ("shifted", False), ("inplace", False),
                                            ("nomask", False), ("written", False), ("mean", False),
                                            ("cudnn", True), ("inverted", True), ("aligned", True), ("weak", False),
                                            ("leftpad", False), ("cast", True), ("boolcast", False)])
def test_an_attention_over_the_cache_is_exact_only_with_its_mask_argument(variant, exact):
    """The cache's own writes are no finding; the attention reading the pads' keys is exact with the mask argument
    (its causality is the caller's: enable()'s masks), and refused with a mask built, moved or written in the layer,
    sdpa's ``is_causal`` (top-left over a cache), an attention written out, or a mean over the positions after it.
    The bool-to-additive conversions of the kernels (``where(~m, -inf, 0)``, cuDNN's ``-65504``), the memory-efficient
    path's alignment (a pad on the right, sliced back from 0) and casts of an additive mask keep the mask; a weak fill,
    a pad on the left or a bool mask added as numbers do not."""
    module = Attend(variant)
    mask = torch.ones(B, 1, T, L, dtype=torch.bool).tril()
    if variant == "written":
        mask = torch.zeros(B, 1, T, L)
    args = (torch.randn(B, T, H), mask, torch.zeros(B, 1, L, H), torch.zeros(B, 1, L, H), torch.tensor(0))
    leaves, key = signature.call_key(args, {})
    marked = [(0, 0), (0, 1), (2, 0), (3, 0)] + ([] if variant == "nomask" else [(1, 0), (1, 2)])
    with torch.no_grad():
        trace = symbolic_shapes(module.forward, module, key[0], leaves, marked)
    report = padding.analyse(trace, {}, {0, 1, 2, 3}, roles=Roles(frozenset({2, 3, 4}), frozenset({1})))
    assert report.unsafe_writes == []
    assert (report.mixing == []) == exact, report.mixing
    without = padding.analyse(trace, {}, {0, 1, 2, 3})
    assert without.mixing, "without the roles, the cache's writes at padded positions are findings"
