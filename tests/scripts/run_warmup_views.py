"""A warm-up whose gears are compiled in worker processes, of a method writing the buffer ``c`` and reading ``d``,
views of one tensor (tests/test_warmup.py); prints a JSON report: per call, whether it equalled eager (output, the
tensor under both buffers), and the counters.

usage: run_warmup_views.py CACHE_DIR (warmup WORKERS | calls)

A worker rebuilds each example input on a base of its own, so the graph was compiled with ``c`` and ``d`` apart:
``d.sum()`` read before the write to ``c`` (eager [82], gearcache [60]), and the artifacts in the store served every
later process so. ``calls``: no warm-up (a fresh process loading the entries).
"""
import gc
import json
import sys

import torch

import gearcache
from gearcache import CompilerConfig, counters


class Views(torch.nn.Module):
    def __init__(self, cache_dir=None, workers=None):
        super().__init__()
        self.t = torch.arange(16.)
        self.register_buffer("c", self.t[0:8])
        self.register_buffer("d", self.t[4:12])
        if cache_dir is not None:
            config = CompilerConfig()
            config.inference_config.dim_gears = {"x": {0: [2, 4]}}
            config.inference_config.warmup_workers = workers
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir, config=config)

    def step(self, x):
        self.c.mul_(2)
        return self.d.sum() + x


with torch.no_grad():
    m, e = Views(sys.argv[1], int(sys.argv[3]) if sys.argv[2] == "warmup" else None), Views()
    gears = m.cached.warmup(torch.zeros(3)) if sys.argv[2] == "warmup" else 0
    compiled = counters.compiles
    equal = []
    for rows in (1, 3, 2):
        out, ref = m.cached(torch.zeros(rows)), e.step(torch.zeros(rows))
        equal.append(bool(torch.equal(out, ref) and torch.equal(m.t, e.t)))
print(json.dumps({"equal": equal, "gears": gears, "compiles": compiled, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
