"""Warm start of Flip's two gears (2, 4) from CACHE_DIR with ``flip`` set to FLIP, then sizes 1..4 against eager; JSON
report on the last line: counters, whether every output equals eager. ``--mid-pass``: ``flip`` starts False and is
set to FLIP right after the warm-up's first gear look-up (as another thread would, mid-pass).

usage: run_flip.py CACHE_DIR FLIP [--mid-pass]
"""
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from gearcache import CompilerConfig, counters
from gearcache.compiling.entry_life import EntryLife
from gear_models import Flip

config = CompilerConfig()
config.inference_config.dim_gears = {"x": {0: [2, 4]}}
config.inference_config.warmup_workers = 1
torch.manual_seed(0)
model = Flip(sys.argv[1], config).eval()
flip = sys.argv[2] == "True"
if "--mid-pass" in sys.argv:
    real_find = EntryLife.find

    def find(self, leaves, key, *rest):
        found = real_find(self, leaves, key, *rest)
        model.flip = flip
        return found
    EntryLife.find = find
else:
    model.flip = flip
report = {"equal": True}
with torch.inference_mode():
    report["gears"] = model.cached.warmup(torch.zeros(4, 4))
    if "--mid-pass" in sys.argv:
        EntryLife.find = real_find
    for n in (1, 2, 3, 4):
        x = torch.randn(n, 4)
        report["equal"] &= bool(torch.allclose(model.cached(x), model.fwd(x), atol=1e-6))
report["counters"] = dict(vars(counters))
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
