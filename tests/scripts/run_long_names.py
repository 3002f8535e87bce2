"""A rotary-attention block like every transformers decoder's, through gearcache; a JSON report on the last line.

Its fused pointwise kernels feeding attention have names longer than the 150 characters Triton keeps in file names
(the case that made torch's static launcher refuse every real model's kernels). On the GPU each entry must load
through its run plan.

usage: run_long_names.py CACHE_DIR [--hooks] [--force-driver]
    --force-driver  the plan writer records every Triton kernel for the driver launcher (launch_driver.py), so the
                    driver path runs on real Inductor kernels
"""
import gc
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--hooks" in sys.argv:
    import compile_hooks

    compile_hooks.install()
import torch

import gearcache
from gearcache import counters

if "--force-driver" in sys.argv:
    from gearcache.runplan import kernel_records

    kernel_records.choose_launcher = lambda extra, arg_types: "driver"


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(torch.nn.Module):
    def __init__(self, cache_dir, dim=64, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(dim))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cached = gearcache.cache_compile(self.forward_, cache_dir=cache_dir)

    def forward_(self, x, positions):
        b, s, d = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(attn.transpose(1, 2).reshape(b, s, d))


cache_dir = sys.argv[1]
device = os.environ.get("GEARCACHE_TEST_DEVICE", "cuda")
torch.manual_seed(0)
model = RotaryAttention(cache_dir).to(device)
x = torch.randn(2, 16, 64, device=device)
positions = torch.arange(16, device=device)
report = {}
with torch.inference_mode():
    t0 = time.perf_counter()
    out = model.cached(x, positions)
    torch.cuda.synchronize() if device == "cuda" else None
    report["first_call_s"] = time.perf_counter() - t0
    ref = model.forward_(x, positions)
    report["max_diff"] = float((out - ref).abs().max())
    again = model.cached(x * 2, positions)
    report["max_diff_again"] = float((again - model.forward_(x * 2, positions)).abs().max())
plans = [json.loads(p.read_text()) for p in pathlib.Path(cache_dir).rglob("runplan/plan.json")]
report["plans"] = [{"supported": p["supported"], "reason": p.get("reason", ""),
                    "kernels": {name: {"launcher": rec.get("launcher", "static"), "name_length": len(rec["function"])}
                                for name, rec in p.get("triton", {}).items()}} for p in plans]
report["compiler_modules"] = sorted(m for m in sys.modules if m.split(".")[:2] in (["torch", "_inductor"],
                                                                                  ["torch", "_dynamo"]))
report["counters"] = dict(vars(counters))
if "--hooks" in sys.argv:
    report["hooks"] = compile_hooks.COUNTS
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
