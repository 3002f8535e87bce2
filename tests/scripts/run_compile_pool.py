"""A cold compile on CUDA in a fresh process: was Inductor's kernel-compile pool started before its first Triton
kernel was handed to Inductor's ``AsyncCompile.triton``? (gearcache captures with a backend of its own, so torch's
``inductor`` backend, which starts the pool, never runs.) A JSON report on the last line.

usage: run_compile_pool.py CACHE_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from torch._inductor import async_compile

import gearcache

seen: list[bool] = []        # per kernel handed to AsyncCompile.triton: whether the pool existed then
original = async_compile.AsyncCompile.triton


def probe(self, *args, **kwargs):
    seen.append(async_compile.AsyncCompile.process_pool.cache_info().currsize > 0)
    return original(self, *args, **kwargs)


async_compile.AsyncCompile.triton = probe


class Block(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return torch.nn.functional.layer_norm(x + self.down(torch.nn.functional.gelu(self.up(x))), (64,))


model = Block(sys.argv[1]).cuda()
x = torch.randn(8, 64, device="cuda")
with torch.no_grad():
    got, want = model.cached(x), model.fwd(x)
print(json.dumps({"kernels": len(seen), "pool_before_first_kernel": bool(seen and seen[0]),
                  "compiles": gearcache.counters.compiles, "max_diff": (got - want).abs().max().item(),
                  "compile_threads": async_compile.get_compile_threads()}))
