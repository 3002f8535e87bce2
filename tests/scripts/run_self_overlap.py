"""An argument whose own elements overlap in memory (``as_strided`` windows), written by the method
(tests/test_memory.py); prints a JSON report: per call, "refused" (UnsupportedInputError, nothing written) or whether it
equalled eager (output, the tensor under the argument).

usage: run_self_overlap.py CACHE_DIR [gears]

``gears``: x's dim 0 padded to 4 rows (``dim_gears`` by name): a padded copy is run and its rows copied back into the
windows, which ended as neither eager's memory nor its output (eager [2, 6, 6, 8, 8, 8], gearcache
[2, 4, 4, 6, 6, 8]).

Eager's ``x.add_(1)`` writes the windows' elements one after another, each seen by the next where they share memory;
the compiled graph wrote ``x + 1`` of the values read before (eager [2, 6, 6, 8, 8, 8], gearcache [2, 4, 6, 6, 8, 8]).
"""
import gc
import json
import sys

import torch

import gearcache
from gearcache import counters


class Bump(torch.nn.Module):
    def __init__(self, cache_dir=None, config=None):
        super().__init__()
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir, config=config)

    def step(self, x):
        x.add_(1)
        return x * 2


CALLS = [("plain", (3, 2), (2, 1)), ("plain", (3, 2), (2, 1)), ("windows", (3, 2), (1, 1)),
         ("windows", (3, 2), (1, 1)), ("transposed", (2, 3), (1, 2))]

report = []
config = None
if sys.argv[2:] == ["gears"]:
    config = gearcache.CompilerConfig()
    config.inference_config.dim_gears = {"x": {0: [4]}}
with torch.no_grad():
    m, e = Bump(sys.argv[1], config), Bump()
    for name, size, stride in CALLS:
        base, eager_base = torch.arange(6.), torch.arange(6.)
        try:
            out = m.cached(base.as_strided(size, stride))
        except gearcache.UnsupportedInputError as exc:
            untouched = torch.equal(base, eager_base) and ".clone()" in str(exc)
            report.append([name, "refused" if untouched else f"refused, wrote: {exc}"])
            continue
        ref = e.step(eager_base.as_strided(size, stride))
        report.append([name, bool(torch.equal(out, ref) and torch.equal(base, eager_base))])
print(json.dumps({"calls": report, "compiles": counters.compiles, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
