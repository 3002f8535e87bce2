"""Warm start of PairMLP's three gears from a stored cache (their look-ups and loads side by side: warmup.driver's
find_all), then every size 1..8 against eager; JSON report on the last line: counters, the compiler hooks, and the
thread that looked up each gear. A warm-up that raises ``GearLoadError`` reports it instead. ``--autocast``: the
warm-up and the calls under autocast to bfloat16 (outputs compared with eager's, dtypes included). On the device
``GEARCACHE_TEST_DEVICE`` names (cpu by default), as run_gears.py, which fills the cache.

usage: run_gear_loads.py CACHE_DIR [--autocast]
"""
import gc
import contextlib
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compile_hooks

compile_hooks.install()
import torch

from gearcache import CompilerConfig, GearLoadError, counters
from gearcache.compiling.entry_life import EntryLife
from gear_models import PairMLP

finds: list = []            # (thread name, the gear's batch): the real look-up runs, this only records where
_find = EntryLife.find


def find(self, leaves, key, *rest):
    finds.append((threading.current_thread().name, int(leaves[0].shape[0])))
    return _find(self, leaves, key, *rest)


EntryLife.find = find
config = CompilerConfig()
config.inference_config.dim_gears = {"x": {0: [2, 4, 8]}, "y": {0: [2, 4, 8]}}
torch.manual_seed(0)
device = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")
model = PairMLP(sys.argv[1], config).eval().to(device)
report: dict = {"equal": True, "dtypes": []}
autocast = "--autocast" in sys.argv
atol = 1e-2 if autocast else 1e-5
with torch.inference_mode(), torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext():
    try:
        report["gears"] = model.cached.warmup(torch.zeros(8, 4, device=device), torch.zeros(8, 4, device=device))
    except GearLoadError as exc:
        report["error"] = {"message": str(exc), "gear": exc.gear, "method": exc.method,
                           "cause": type(exc.__cause__).__name__}
    else:
        before = counters.compiles + counters.traces
        for n in range(1, 9):
            x, y = torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)
            out, total = model.cached(x, y)
            ref, ref_total = model.fwd(x, y)
            report["dtypes"].append([str(out.dtype), str(ref.dtype)])
            report["equal"] &= out.dtype == ref.dtype and total.dtype == ref_total.dtype and out.shape == ref.shape
            report["equal"] &= bool(torch.allclose(out.float(), ref.float(), atol=atol))
            report["equal"] &= bool(torch.allclose(total.float(), ref_total.float(), atol=atol))
        report["compiles_after_warmup"] = counters.compiles + counters.traces - before
entries = [e for e in model.cached.life.table.values() if getattr(e, "guards", None) is not None]
report["guards"] = {"entries_sharing_a_set": max([sum(e.guards is f.guards for f in entries) for e in entries] or [0])}
report["counters"] = dict(vars(counters))
report["finds"] = finds
report["hooks"] = compile_hooks.COUNTS
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
