"""A bfloat16 chain whose compiled code equals eager only with Inductor's ``emulate_precision_casts`` (eager rounds
every op to bfloat16; Inductor keeps the chain in float32 otherwise), served by gearcache from CACHE_DIR in this fresh
process, under whatever ``TORCHINDUCTOR_*`` environment the test gives it. JSON report on the last line: the largest
difference from eager, ``compiles`` and ``loads``, and the environment variable as this process saw it.

usage: run_bf16_chain.py CACHE_DIR
"""
import json
import os
import sys

import torch
from torch import nn

from gearcache import cache_compile, counters


class Chain(nn.Module):
    def __init__(self, cache_dir: str):
        super().__init__()
        self.cached = cache_compile(self.run, cache_dir=cache_dir)

    def run(self, x, y, z):
        return ((x * y + z) * y - x) * z


torch.manual_seed(0)
x, y, z = (torch.randn(4096, dtype=torch.bfloat16) for _ in range(3))
model = Chain(sys.argv[1])
with torch.inference_mode():
    out, ref = model.cached(x, y, z), model.run(x, y, z)
print(json.dumps({"diff": (out.float() - ref.float()).abs().max().item(), "compiles": counters.compiles,
                  "loads": counters.loads, "emulate": os.environ.get("TORCHINDUCTOR_EMULATE_PRECISION_CASTS")}))
