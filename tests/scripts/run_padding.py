"""Serve six geared models whose padding the analysis handles differently, against eager twins; JSON report on the
last line. Run twice on one folder: the first process compiles (cold), the second loads (warm): the padding report
(and its pad values) comes from the stored gear plan there, so refusals happen without a trace or a compiler.

* KVStep: row-wise, writes its padded KV cache argument in place (copied back);
* RunningSum: adds the batch's sums to a buffer: exact with pad value 0 (chosen);
* BatchSoftmax: a softmax over the batch: exact with pad value -inf (given in the config);
* BatchMin: column minima of a float and an int64 input, and ``(-x).amax(0)``: exact with +inf and iinfo.max
  (chosen); its first calls hold mixed signs and small ids, its later ones only positive values and large ids, where a
  pad of 0 would be the minimum;
* SeenRows: writes ``self.seen[:B]``: refused before anything runs (the buffer keeps every row);
* Center: ``h - h.mean(0)``: not exact with any pad value: refused when the gear plan is built, before anything
  compiles or runs.

The first four warm up their one gear (4), then serve batches 1..4 (3 of them padded) twice; every output, the KV
cache and the buffer are compared with an eager twin (the same weights and state, called directly). No gear is
tested against eager (``padding_verifications`` stays 0): padding is proved from the graph.

usage: run_padding.py CACHE_DIR [--hooks]
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

from gear_models import BatchMin, BatchSoftmax, Center, KVStep, RunningSum, SeenRows
from gearcache import CompilerConfig, PaddingUnsafeError, counters

DEVICE = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")


def config(gears: dict, pads: dict | None = None) -> CompilerConfig:
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = gears
    cfg.inference_config.pad_values = pads or {}
    return cfg


def pair(cls, cfg):
    torch.manual_seed(0)
    model = cls(sys.argv[1], cfg).to(DEVICE)
    twin = cls(sys.argv[1]).to(DEVICE)
    twin.load_state_dict(model.state_dict())
    return model, twin


def same(a, b) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


def kv_step() -> dict:
    model, twin = pair(KVStep, config({"x": {0: [4]}, "kv": {0: [4]}}))
    equal, before = True, counters.snapshot()
    model.cached.warmup(torch.zeros(4, 1, 4, device=DEVICE), torch.zeros(4, 6, 4, device=DEVICE),
                        torch.tensor([0], device=DEVICE))
    for step in range(2):
        for n in range(1, 5):
            kv = torch.randn(n, 6, 4, device=DEVICE)
            twin_kv = kv.clone()
            x, pos = torch.randn(n, 1, 4, device=DEVICE), torch.tensor([step + 1], device=DEVICE)
            equal &= same(model.cached(x, kv, pos), twin.fwd(x, twin_kv, pos)) and same(kv, twin_kv)
    return {"equal": equal, "counters": counters.delta(before)}


def running_sum() -> dict:
    model, twin = pair(RunningSum, config({"x": {0: [4]}}))
    equal, before = True, counters.snapshot()
    example = torch.ones(4, 4, device=DEVICE)
    model.cached.warmup(example)        # leaves the buffer as it was (warmup's runs and the plan's trace keep state)
    equal &= same(model.total, twin.total)
    for _ in range(2):
        for n in range(1, 5):
            x = torch.randn(n, 4, device=DEVICE)
            equal &= same(model.cached(x), twin.fwd(x)) and same(model.total, twin.total)
    return {"equal": equal, "counters": counters.delta(before)}


def batch_softmax() -> dict:
    model, twin = pair(BatchSoftmax, config({"x": {0: [4]}}, {"x": float("-inf")}))
    equal, before = True, counters.snapshot()
    model.cached.warmup(torch.zeros(4, 3, device=DEVICE))
    for _ in range(2):
        for n in range(1, 5):
            x = torch.randn(n, 3, device=DEVICE)
            equal &= same(model.cached(x), twin.fwd(x))
    return {"equal": equal, "counters": counters.delta(before)}


def batch_min() -> dict:
    model, twin = pair(BatchMin, config({"x": {0: [4]}, "ids": {0: [4]}}))
    equal, before = True, counters.snapshot()
    model.cached.warmup(torch.zeros(4, 3, device=DEVICE), torch.zeros(4, 2, dtype=torch.long, device=DEVICE))
    for step in range(2):
        for n in range(1, 5):
            x = torch.randn(n, 3, device=DEVICE)
            ids = torch.randint(0, 5, (n, 2), device=DEVICE)
            if step:                            # all positive, all ids >= 5: a pad of 0 would be the minimum
                x, ids = x.abs() + 0.5, ids + 5
            got, want = model.cached(x, ids), twin.fwd(x, ids)
            equal &= all(same(a, b) if a.is_floating_point() else bool(torch.equal(a, b)) for a, b in zip(got, want))
    pads = {d.name: d.pad_value for d in model.cached.gear_life.plan.dims}
    return {"equal": equal, "counters": counters.delta(before), "pad_values": pads}


def refused(cls, state: str | None) -> dict:
    """A batch of 3 on gear 4: the PaddingUnsafeError's message (None if served), whether the model's ``state``
    buffer kept its value."""
    model = cls(sys.argv[1], config({"x": {0: [4]}})).to(DEVICE)
    before, kept = counters.snapshot(), getattr(model, state).clone() if state else None
    try:
        model.cached(torch.randn(3, 4, device=DEVICE))
        error = None
    except PaddingUnsafeError as exc:
        error = str(exc)
    unchanged = kept is None or bool(torch.equal(getattr(model, state), kept))
    return {"error": error, "state_unchanged": unchanged, "counters": counters.delta(before)}


with torch.inference_mode():
    report = {"kv_step": kv_step(), "running_sum": running_sum(), "batch_softmax": batch_softmax(),
              "batch_min": batch_min(), "seen_rows": refused(SeenRows, "seen"), "center": refused(Center, None)}
report["counters"] = dict(vars(counters))
if "--hooks" in sys.argv:
    report["hooks"] = compile_hooks.COUNTS
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
