"""One fresh process of the corpus benchmark (benchmarks/models.py): build a corpus model, run its workload.

usage: _model_start.py MODEL VARIANT STORE DEVICE DTYPE SIZE   (VARIANT: gearcache | eager)
Prints one JSON line: setup_s (process start to the model built), first_call_s (the workload's first call),
first_calls_s (the calls that reach an entry for the first time, summed), per-call times, gearcache's counters, and
for gearcache the max |diff| of every output against eager HF on the same inputs (computed after the timed calls).
"""
import time

T_PROCESS = time.perf_counter()
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
name, variant, store, device, dtype_name, size = sys.argv[1:7]
import torch

import corpus

dtype = getattr(torch, dtype_name)
cached = variant == "gearcache"
w = corpus.workload(name, size, device, dtype, store if cached else None)
if device.startswith("cuda"):
    torch.cuda.synchronize()
report = {"model": name, "variant": variant, "setup_s": time.perf_counter() - T_PROCESS}
outputs, times = corpus.run_workload(w, cached, device)
report["first_call_s"] = times[0]
report["first_calls_s"] = sum(t for t, first in zip(times, w.first) if first)
report["call_s"] = times
report["calls"] = [label for label, _ in w.calls]
if cached:
    from gearcache import counters

    report["counters"] = {k: v for k, v in vars(counters).items()}
    with torch.inference_mode():
        report["max_abs_diff"] = corpus.max_abs_diff(outputs, w.reference())
        report.update(w.check(outputs))
print(json.dumps(report))
