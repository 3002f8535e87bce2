"""One cached method on one GPU, for the device-index test; a JSON report on the last line.

usage: run_device_index.py CACHE_DIR DEVICE_INDEX GLOBAL_RANK [--bound]
``--bound``: the method also returns a view of its input, which gets no run plan: the artifact is bound to its GPU.
The model (a matmul, a fused pointwise kernel, a tensor made on the inputs' device) sits on cuda:DEVICE_INDEX; the
entry is keyed by GLOBAL_RANK. Compile hooks count every trace and compile in this process.
"""
import gc
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compile_hooks  # noqa: E402

compile_hooks.install()
import torch  # noqa: E402

import gearcache  # noqa: E402
from gearcache import counters  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, cache_dir, rank):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(32, 32)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, global_rank=rank)

    def fwd(self, x):
        ramp = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)
        out = torch.relu(self.proj(x)) * 2 + ramp
        return (out, x[0]) if BOUND else out


cache_dir, index, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BOUND = "--bound" in sys.argv[4:]
device = torch.device("cuda", index)
model = Block(cache_dir, rank).to(device)
x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(device)
with torch.inference_mode():
    out = model.cached(x)
    ref = model.fwd(x)
    again = model.cached(x * 3)
    ref_again = model.fwd(x * 3)
if BOUND:
    (out, view), (ref, ref_view), (again, _), (ref_again, _) = out, ref, again, ref_again
    assert torch.equal(view, ref_view)
torch.cuda.synchronize(device)
plans = {p.parent.parent.name: json.loads(p.read_text()) for p in pathlib.Path(cache_dir).rglob("runplan/plan.json")}
print(json.dumps({
    "out_device": str(out.device), "current_device": torch.cuda.current_device(),
    "max_diff": float((out - ref).abs().max()), "max_diff_again": float((again - ref_again).abs().max()),
    "counters": {k: v for k, v in vars(counters).items() if isinstance(v, int)}, "hooks": dict(compile_hooks.COUNTS),
    "plans": {k: {f: p.get(f) for f in ("supported", "reason", "device_free", "device_index", "device_reason")}
              for k, p in plans.items()},
}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
