"""Calls of a method that writes one argument and reads the other, with the two sharing memory in several ways
(tests/test_cached_function.py); prints a JSON report: whether each call equalled eager, and the counters.

usage: run_shared_memory.py CACHE_DIR
"""
import gc
import json
import sys

import torch

import gearcache
from gearcache import counters


class WritesOneReadsOther(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, y):
        y.mul_(2)                   # seen through x where they share memory
        return x + 1


PICK = {"equal": lambda b: (b[0:4], b[0:4]), "overlap": lambda b: (b[0:4], b[2:6]),
        "disjoint": lambda b: (b[0:4], b[4:8]), "separate": lambda b: (b[0:4].clone(), b[2:6].clone())}
ORDER = ["equal", "overlap", "disjoint", "separate", "overlap", "equal", "separate"]

m = WritesOneReadsOther(sys.argv[1])
equal = {}
with torch.no_grad():
    for n, kind in enumerate(ORDER):
        big = torch.randn(8, 8)
        eager_big = big.clone()
        args, eager_args = PICK[kind](big), PICK[kind](eager_big)
        out, ref = m.cached(*args), m.fwd(*eager_args)
        equal[f"{n}:{kind}"] = bool(torch.equal(out, ref) and torch.equal(big, eager_big)
                                    and all(torch.equal(a, b) for a, b in zip(args, eager_args)))
print(json.dumps({"equal": equal, "compiles": counters.compiles, "loads": counters.loads,
                  "traces": counters.traces}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
