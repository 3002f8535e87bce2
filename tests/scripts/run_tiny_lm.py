"""Run TinyLM's prefill and decode through gearcache in this process; print a JSON report on the last line.

usage: run_tiny_lm.py CACHE_DIR [--hooks] [--mutate-weights] [--no-c-extension]

--no-c-extension: gearcache runs as where its C extension (gearcache.call._callpath) is not built: the import fails.
"""
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--no-c-extension" in sys.argv:
    sys.modules["gearcache.call._callpath"] = None          # `import gearcache.call._callpath` raises ImportError
if "--hooks" in sys.argv:
    import compile_hooks

    compile_hooks.install()
import torch

import models
from gearcache import counters, native
from gearcache.call import dispatch
from gearcache.call import entry

cache_dir = sys.argv[1]
device = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")
model = models.make(cache_dir).to(device)
ids, kv, step, pos = (t.to(device) for t in models.inputs())
report = {}
with torch.inference_mode():
    t0 = time.perf_counter()
    logits, kv1 = model(ids, kv)
    report["first_call_s"] = time.perf_counter() - t0
    logits2, kv2 = model(step, kv1, pos)
    for _ in range(2):                                 # like the last call: served through the shortcut
        again, _ = model(step, kv1, pos)
        report.setdefault("repeat_equal", True)
        report["repeat_equal"] &= bool(torch.equal(again, logits2))
    ref1, refkv1 = model.prefill(ids, kv)
    ref2, refkv2 = model.decode(step, refkv1, pos)
    report["equal"] = all(torch.allclose(a, b, atol=1e-5) for a, b in
                          [(logits, ref1), (kv1, refkv1), (logits2, ref2), (kv2, refkv2)])
    if "--mutate-weights" in sys.argv:
        model(ids, kv)                                 # the prefill after the changes takes the shortcut
        model.head.weight.mul_(2.0)                                        # in place
        model.proj.weight = torch.nn.Parameter(torch.randn_like(model.proj.weight))   # a new Parameter object
        model.scale.fill_(3.0)                                             # a buffer
        out, _ = model(ids, kv)
        ref, _ = model.prefill(ids, kv)
        report["mutated_equal"] = bool(torch.allclose(out, ref, atol=1e-5))
        report["mutated_changed"] = not bool(torch.allclose(out, logits, atol=1e-3))
report["device"] = str(kv.device)
report["precompiled_headers"] = os.environ.get("GEARCACHE_CPP_PCH", "0") == "1"     # gearcache's default: off
report["call_path"] = {"native_entries": entry.NATIVE, "dispatcher": dispatch.Dispatcher.__module__,
                       "native_checks": native.guards(build_if_missing=False) is not None,
                       "shortcut_calls": model.cached_prefill.shortcut_calls + model.cached_decode.shortcut_calls}
# torch's compiler stack, which a warm start must not import (the hooks above import it themselves)
report["compiler_modules"] = sorted(m for m in sys.modules if m.split(".")[:2] in (["torch", "_inductor"],
                                                                                  ["torch", "_dynamo"]))
report["sympy_imported"] = "sympy" in sys.modules        # only a trace or the padding analysis needs it (~0.2 s)
report["counters"] = {k: v for k, v in vars(counters).items()}
if "--hooks" in sys.argv:
    report["hooks"] = compile_hooks.COUNTS
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
