"""Tiny models for tests: small enough that a CPU Inductor compile takes a few seconds."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from gearcache import cache_compile

VOCAB, D, TMAX = 64, 32, 16


class TinyLM(nn.Module):
    """A toy decoder with separate prefill and decode entry points and a KV-like cache tensor."""

    def __init__(self, cache_dir=None, config=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("scale", torch.tensor(0.5))
        self.cached_prefill = cache_compile(self.prefill, cache_dir=cache_dir, config=config)
        self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir, config=config)

    def prefill(self, ids, kv):            # ids [B, T]; kv [B, TMAX, D]
        h = torch.tanh(self.proj(self.emb(ids)))
        kv = torch.cat([h, kv[:, ids.shape[1]:]], dim=1)
        return self.head(h) * self.scale, kv

    def decode(self, ids, kv, pos):        # ids [B, 1]; pos [1] (int64)
        h = torch.tanh(self.proj(self.emb(ids)))
        kv = kv.index_copy(1, pos, h)
        attn = torch.softmax(h @ kv.transpose(1, 2), dim=-1) @ kv
        return self.head(attn) * self.scale, kv

    def forward(self, ids, kv, pos=None):
        return self.cached_prefill(ids, kv) if ids.shape[1] > 1 else self.cached_decode(ids, kv, pos)


def make(cache_dir=None, config=None, seed=0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(cache_dir, config).eval()


def inputs(batch=2, seq=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    kv = torch.randn(batch, TMAX, D, generator=g)
    step = torch.randint(0, VOCAB, (batch, 1), generator=g)
    return ids, kv, step, torch.tensor([seq])


def _mul_to_add(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.mul.Tensor:
            node.target = torch.ops.aten.add.Tensor


@functools.cache
def _custom_graph_pass() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass     # imports Inductor's config: only when used

    class MulToAdd(CustomGraphPass):
        """A user's post-grad pass that changes what the code computes (``x * y`` becomes ``x + y``), identified by
        ``uuid()`` as torch's custom passes are."""

        def __init__(self, version: str = "1"):
            self.version = version

        def __call__(self, graph: torch.fx.Graph) -> None:
            _mul_to_add(graph)

        def uuid(self) -> str:
            return f"mul-to-add-{self.version}"

    return MulToAdd


def __getattr__(name: str) -> type:
    if name == "MulToAdd":
        return _custom_graph_pass()
    raise AttributeError(name)


class Product(nn.Module):
    """``x * y`` cached: a graph whose one multiplication a custom pass or a dispatch mode can change."""

    def __init__(self, cache_dir):
        super().__init__()
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, y):
        return x * y
