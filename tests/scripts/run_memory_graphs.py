"""Memory shared between a call's tensors under CUDA graphs (``mode="reduce-overhead"``; tests/test_memory.py, GPU):
each call compared with eager on a twin module; prints a JSON report: per call, "refused" (UnsupportedInputError,
nothing written) or whether it equalled eager (output and every tensor under the arguments), and the counters.

usage: run_memory_graphs.py CACHE_DIR

A graph copies its inputs into static buffers before a replay and back after, so inputs that share memory would be
written apart: ``views`` (``y.mul_(2); return x + y``, ``x``, ``y`` overlapping views of one tensor) and ``windows``
(``x.add_(1)`` on ``as_strided`` windows whose elements overlap) must be refused or equal eager; ``kv`` (gears on the
batch, ``k``, ``v`` = ``kv[0]``, ``kv[1]``, written in place, 3 rows padded to 4) likewise.
"""
import gc
import json
import sys

import torch

import gearcache
from gearcache import counters


class Steps(torch.nn.Module):
    def __init__(self, cache_dir=None):
        super().__init__()
        if cache_dir is None:
            return
        config = gearcache.CompilerConfig(mode="reduce-overhead")
        self.c_views = gearcache.cache_compile(self.views, cache_dir=cache_dir, config=config)
        self.c_windows = gearcache.cache_compile(self.windows, cache_dir=cache_dir, config=config)
        geared = gearcache.CompilerConfig(mode="reduce-overhead")
        geared.inference_config.dim_gears = {"x": {0: [2, 4]}, "k": {0: [2, 4]}, "v": {0: [2, 4]}}
        self.c_kv = gearcache.cache_compile(self.kv, cache_dir=cache_dir, config=geared)

    def views(self, x, y):
        y.mul_(2)
        return x + y

    def windows(self, x):
        x.add_(1)
        return x * 2

    def kv(self, x, k, v):
        k.add_(x)
        v.mul_(2)
        return (k * v).sum(-1)


def one_tensor(rows):
    t = torch.arange(1., 7., device="cuda")
    return t, (t[:4], t[2:6]) if rows == "overlapping" else (t[:2], t[4:6])


def windows(kind):
    t = torch.arange(6., device="cuda")
    return t, (t.as_strided((3, 2), (1, 1)) if kind == "overlapping" else t.view(3, 2),)


def kv_views(rows):
    kv = torch.arange(2 * rows * 3, dtype=torch.float32, device="cuda").view(2, rows, 3)
    return kv, (torch.ones(rows, 3, device="cuda"), kv[0], kv[1])


CALLS = [("views", one_tensor, "apart"), ("views", one_tensor, "apart"), ("views", one_tensor, "overlapping"),
         ("windows", windows, "plain"), ("windows", windows, "plain"), ("windows", windows, "overlapping"),
         ("kv", kv_views, 2), ("kv", kv_views, 2), ("kv", kv_views, 3), ("kv", kv_views, 3)]


def run(m, e, name, make, arg):
    """One call of ``name`` on ``m`` (cached) and ``e`` (eager): True where it equals eager, else "refused"."""
    base, args = make(arg)
    eager_base, eager_args = make(arg)
    before = base.clone()
    try:
        out = getattr(m, "c_" + name)(*args)
    except gearcache.UnsupportedInputError as exc:
        return "refused" if torch.equal(base, before) and ".clone()" in str(exc) else f"refused, wrote: {exc}"
    ref = getattr(e, name)(*eager_args)
    return bool(torch.equal(out, ref) and torch.equal(base, eager_base) and
                all(torch.equal(a, b) for a, b in zip(args, eager_args)))


with torch.inference_mode():
    m, e = Steps(sys.argv[1]), Steps()
    report = [[name, str(arg), run(m, e, name, make, arg)] for name, make, arg in CALLS]
print(json.dumps({"calls": report, "compiles": counters.compiles, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
