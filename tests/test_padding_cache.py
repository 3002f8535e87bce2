"""The padding walk's KV cache and causal mask roles (gearcache/gears/padding_cache.py), on a small attention layer
with a static cache as ``enable()`` serves one: its prompt's padded rows write the cache, and the attention reading
it is exact only with the mask argument it was given. Only Dynamo traces run here (no compile)."""
import pytest
import torch
import torch.nn.functional as F

from gearcache.call import signature
from gearcache.compiling.symbolic_trace import symbolic_shapes
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
        if self.variant in ("padright", "written_padright"):   # keys 6.. shown (an additive 0) where they were hidden
            mask = mask if mask.is_floating_point() else torch.where(mask.logical_not(), float("-inf"), 0.0)
            mask = F.pad(mask[..., :6], (0, mask.shape[-1] - 6))
        if self.variant == "rebool":                # an additive mask cast to bool: True where it hid
            mask = torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0)).bool()
        if self.variant == "written_rebool":
            mask = torch.where(mask.bool(), 0.0, float("-inf"))
        if self.variant == "keyone":                # key 0's column broadcast over every key
            mask = mask[..., :1]
        if self.variant == "written_keyone":
            mask = mask[..., :1].expand(mask.shape)
        if self.variant in ("cloned", "written_cloned"):   # a copy of the mask, keys 5 to 7 shown in it after
            mask = mask if mask.is_floating_point() else torch.where(mask.logical_not(), float("-inf"), 0.0)
            mask = mask.clone()
            mask[..., 5:8] = 0.0
        if self.variant in ("kcopy", "written_kcopy"):     # a copy of the keys, a pad's (position 6) put at 0
            keys = keys.clone()
            keys[:, :, 0] = keys[:, :, 6]
        if self.variant == "boolfill":              # zeros_like of a bool mask stays bool: True where it hid
            mask = torch.zeros_like(mask).masked_fill_(mask.logical_not(), float("-inf"))
        if self.variant in ("qcache", "written_qcache"):   # a query made from the cache: it reads the pads' keys
            q = q + keys.sum(2, keepdim=True)
        if self.variant == "kview":                 # positions regrouped: [L, H] seen as [L / 2, 2 H]
            return F.scaled_dot_product_attention(torch.cat([q, q], -1), keys.view(-1, 1, L // 2, 2 * H),
                                                  values.view(-1, 1, L // 2, 2 * H), attn_mask=mask[..., :L // 2])
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
        added = torch.add(scores, mask, alpha=-1) if self.variant == "written_alpha" else scores + mask
        if self.variant == "written_scorewrite":          # scores written at the pads' keys after the mask's add
            added[..., 5:8] = 1000.0
        probs = torch.softmax(added.float(), dim).to(q.dtype)
        if self.variant == "written_probwrite":           # weights written at the pads' keys after the softmax
            probs[..., 5:8] = 0.3
        if self.variant == "written_scaled":              # the weights changed per key after the softmax
            probs = probs * torch.arange(probs.shape[-1])
        return probs @ (values.flip(2) if self.variant == "written_flip" else values)


def _args(variant, t, seed=0):
    """The layer's arguments for a prompt of ``t`` tokens into an empty cache (the mask additive for ``written*``)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, 1, t, L, dtype=torch.bool).tril()
    if variant.startswith("written"):         # transformers' mask for an eager attention: additive
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return torch.randn(B, t, H, generator=g), mask, torch.zeros(B, 1, L, H), torch.zeros(B, 1, L, H), torch.tensor(0)


@pytest.mark.parametrize("variant, exact", [("causal", True), ("full", False), ("shifted", False), ("inplace", False),
                                            ("nomask", False), ("mean", False),
                                            ("written", True), ("written_cap", True), ("written_roll", False),
                                            ("written_shifted", False), ("written_bool", False), ("written_dim", False),
                                            ("written_scaled", False), ("written_flip", False),
                                            ("cudnn", True), ("inverted", True), ("aligned", True), ("weak", False),
                                            ("leftpad", False), ("cast", True), ("boolcast", False),
                                            ("padright", False), ("rebool", False), ("keyone", False),
                                            ("qcache", False), ("kview", False), ("written_padright", False),
                                            ("written_rebool", False), ("written_keyone", False),
                                            ("written_qcache", False), ("written_alpha", False),
                                            ("cloned", False), ("kcopy", False), ("written_cloned", False),
                                            ("written_kcopy", False), ("boolfill", False),
                                            ("written_scorewrite", False), ("written_probwrite", False)])
def test_an_attention_over_the_cache_is_exact_only_with_its_mask_argument(variant, exact):
    """The cache's own writes are no finding; the attention reading the pads' keys is exact with the mask argument
    (its causality is the caller's: enable()'s masks), and refused with a mask built, moved or written in the layer,
    sdpa's ``is_causal`` (top-left over a cache), or a mean over the positions after it. An attention written out
    (softmax of the scores plus the mask, times the values) is exact with the additive mask argument added to scores
    whose keys are the cache's in place (a scale or a soft cap on the way), and refused with the keys moved, the mask
    shifted or bool, the softmax over another dim, the weights changed per key or the values moved.
    The bool-to-additive conversions of the kernels (``where(~m, -inf, 0)``, cuDNN's ``-65504``), the memory-efficient
    path's alignment (a pad on the right, sliced back from 0) and casts of an additive mask keep the mask; a weak fill,
    a pad on the left or a bool mask added as numbers do not. Nor do a mask whose keys leave their place (a pad on the
    right of a slice of them, one key's column broadcast over all), an additive mask cast to bool (it keeps what it
    hid), a query made from the cache, keys whose positions a view regroups, the mask subtracted (``alpha=-1``), or a
    copy of the mask or keys written in place after the copy, or the scores or weights written in place at the pads'
    keys."""
    module = Attend(variant)
    args = _args(variant, T)
    leaves, key = signature.call_key(args, {})
    marked = [(0, 0), (0, 1), (2, 0), (3, 0)] + ([] if variant == "nomask" else [(1, 0), (1, 2)])
    with torch.no_grad():
        trace = symbolic_shapes(module.forward, module, key[0], leaves, marked)
    report = padding.analyse(trace, {}, {0, 1, 2, 3}, roles=Roles(frozenset({2, 3, 4}), frozenset({1})))
    assert report.unsafe_writes == []
    assert (report.mixing == []) == exact, report.mixing
    without = padding.analyse(trace, {}, {0, 1, 2, 3})
    assert without.mixing, "without the roles, the cache's writes at padded positions are findings"



@pytest.mark.parametrize("variant", ["causal", "written", "padright", "rebool", "keyone", "qcache", "kview",
                                     "written_padright", "written_rebool", "written_keyone", "written_qcache",
                                     "written_alpha", "cloned", "kcopy", "written_cloned", "written_kcopy",
                                     "boolfill", "written_scorewrite", "written_probwrite"])
def test_the_attentions_refused_read_the_pads_keys_into_real_rows(variant):
    """The refusals above are needed: run eagerly on the real prompt (5 tokens) and padded to 8 tokens (other data in
    the padded rows, the real rows' the same), the real rows' outputs differ; the layers proved exact agree."""
    module = Attend(variant)
    real, padded = _args(variant, T), _args(variant, 8, seed=1)
    padded[0][:, :T] = real[0]
    with torch.no_grad():
        differs = (module(*real) - module(*padded)[:, :, :T]).abs().max().item()
    assert (differs == 0.0) == (variant in ("causal", "written")), differs
