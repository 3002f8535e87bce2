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
        if self.variant.startswith("written"):     # an attention written out, as transformers' eager attention
            return self._written_out(q, mask, keys, values)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if self.variant == "nomask" else mask,
                                             is_causal=self.variant == "nomask")
        if self.variant == "mean":
            out = out - out.mean(2, keepdim=True)
        return out

    def _written_out(self, q, mask, keys, values):
        scores = (q @ keys.transpose(-1, -2)) * 0.25
        if self.variant == "written_cap":                 # a soft cap (Gemma 2): elementwise, every key in place
            scores = torch.tanh(scores / 30.0) * 30.0
        if self.variant == "written_roll":                # the keys moved before the mask is added
            scores = torch.roll(scores, 1, -1)
        if self.variant == "written_shifted":
            mask = F.pad(mask[..., 1:], (0, 1))
        if self.variant == "written_bool":                # a bool mask added as numbers
            mask = mask > 0
        dim = -2 if self.variant == "written_dim" else -1
        probs = torch.softmax((scores + mask).float(), dim).to(q.dtype)
        if self.variant == "written_scaled":              # the weights changed per key after the softmax
            probs = probs * torch.arange(probs.shape[-1])
        return probs @ (values.flip(2) if self.variant == "written_flip" else values)


@pytest.mark.parametrize("variant, exact", [("causal", True), ("full", False), ("shifted", False), ("inplace", False),
                                            ("nomask", False), ("mean", False),
                                            ("written", True), ("written_cap", True), ("written_roll", False),
                                            ("written_shifted", False), ("written_bool", False), ("written_dim", False),
                                            ("written_scaled", False), ("written_flip", False),
                                            ("cudnn", True), ("inverted", True), ("aligned", True), ("weak", False),
                                            ("leftpad", False), ("cast", True), ("boolcast", False)])
def test_an_attention_over_the_cache_is_exact_only_with_its_mask_argument(variant, exact):
    """The cache's own writes are no finding; the attention reading the pads' keys is exact with the mask argument
    (its causality is the caller's: enable()'s masks), and refused with a mask built, moved or written in the layer,
    sdpa's ``is_causal`` (top-left over a cache), or a mean over the positions after it. An attention written out
    (softmax of the scores plus the mask, times the values) is exact with the additive mask argument added to scores
    whose keys are the cache's in place (a scale or a soft cap on the way), and refused with the keys moved, the mask
    shifted or bool, the softmax over another dim, the weights changed per key or the values moved.
    The bool-to-additive conversions of the kernels (``where(~m, -inf, 0)``, cuDNN's ``-65504``), the memory-efficient
    path's alignment (a pad on the right, sliced back from 0) and casts of an additive mask keep the mask; a weak fill,
    a pad on the left or a bool mask added as numbers do not."""
    module = Attend(variant)
    mask = torch.ones(B, 1, T, L, dtype=torch.bool).tril()
    if variant.startswith("written"):         # transformers' mask for an eager attention: additive
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
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
