"""Serve a geared model in this process: warm up every gear, then call every size 1..8; JSON report on the last line.

usage: run_gears.py CACHE_DIR [--hooks] [--workers N]
"""
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--hooks" in sys.argv:
    import compile_hooks

    compile_hooks.install()
import torch

from gearcache import CompilerConfig, counters
from gear_models import PairMLP

config = CompilerConfig()
config.inference_config.dim_gears = {"x": {0: [2, 4, 8]}, "y": {0: [2, 4, 8]}}
if "--workers" in sys.argv:
    config.inference_config.warmup_workers = int(sys.argv[sys.argv.index("--workers") + 1])
torch.manual_seed(0)
device = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")
model = PairMLP(sys.argv[1], config).eval().to(device)
report = {"equal": True}
with torch.inference_mode():
    report["gears"] = model.cached.warmup(torch.zeros(8, 4, device=device), torch.zeros(8, 4, device=device))
    before = counters.compiles + counters.traces
    for n in range(1, 9):
        x, y = torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)
        out, total = model.cached(x, y)
        ref, ref_total = model.fwd(x, y)
        report["equal"] &= out.shape == ref.shape and bool(torch.allclose(out, ref, atol=1e-5))
        report["equal"] &= bool(torch.allclose(total, ref_total, atol=1e-5))
    report["compiles_after_warmup"] = counters.compiles + counters.traces - before
report["counters"] = dict(vars(counters))
spans = model.cached.warmup_timeline.spans
report["phases"] = {phase: [start, end] for who, phase, start, end in spans if who == "all"}
if "--hooks" in sys.argv:
    report["hooks"] = compile_hooks.COUNTS
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
