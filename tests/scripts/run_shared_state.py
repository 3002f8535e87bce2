"""Module tensors over one memory (tests/test_state_alias.py): a method writing the buffer ``b1`` and reading
``b2``, the two over shared bytes in several ways; prints a JSON report: per way, per call, "refused"
(UnsupportedInputError, and nothing written) or whether it equalled eager (output, both buffers, the array).

usage: run_shared_state.py CACHE_DIR

``numpy overlap`` / ``numpy one start``: ``torch.from_numpy`` views of one array as two buffers, two storage objects
over shared bytes, which torch compiles as apart (the entry read ``b2`` before its write to ``b1``); ``one tensor's
views``: views of one tensor (one storage object: torch compiles them as views of one base); ``b1 one further``: the
same with b1 from element 1 (the entry of b1 at 0, keyed alike, served it and wrote the element before b1); ``b1's
own elements overlap``: ``as_strided`` windows (eager's ``mul_`` writes them one after another, each seen by the
next); ``apart``: none shared. Sizes over 1000 elements, so the compiled reduction runs vector loops.
"""
import gc
import json
import sys

import numpy
import torch

import gearcache
from gearcache import counters

N = 2000


def one_tensor(t, b1_at=0):
    """b1 and b2 views of one tensor, b1 from ``b1_at``."""
    return t[b1_at:b1_at + N], t[N // 2:N // 2 + N]


WAYS = {
    "numpy overlap": lambda a: (torch.from_numpy(a[:N]), torch.from_numpy(a[N // 2:N // 2 + N])),
    "numpy one start": lambda a: (torch.from_numpy(a[:N]), torch.from_numpy(a[:N])),
    "one tensor's views": lambda a: one_tensor(torch.from_numpy(a)),
    "one tensor's views, b1 one further": lambda a: one_tensor(torch.from_numpy(a), 1),
    "b1's own elements overlap": lambda a: (torch.from_numpy(a[:N // 2 + 1]).as_strided((N // 2, 2), (1, 1)),
                                            torch.from_numpy(a[N:].copy())),
    "apart": lambda a: (torch.from_numpy(a[:N].copy()), torch.from_numpy(a[N // 2:N // 2 + N].copy())),
}


class TwoBuffers(torch.nn.Module):
    def __init__(self, way, cache_dir=None):
        super().__init__()
        self.array = numpy.arange(2 * N, dtype=numpy.float32) / N
        b1, b2 = WAYS[way](self.array)
        self.register_buffer("b1", b1)
        self.register_buffer("b2", b2)
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir)

    def step(self, x):
        self.b1.mul_(2)
        return self.b2.sum() + self.b1.sum() + x


def state(m):
    return [m.b1.clone(), m.b2.clone(), torch.from_numpy(m.array.copy())]


def call(m, e):
    """One call of the cached method and of the eager twin: "refused" (nothing written) or whether they agree."""
    before = state(m)
    try:
        out = m.cached(torch.ones(1))
    except gearcache.UnsupportedInputError as exc:
        assert "b1" in str(exc) and ".clone()" in str(exc), str(exc)
        return "refused" if all(torch.equal(p, q) for p, q in zip(before, state(m))) else "refused, written"
    ref = e.step(torch.ones(1))
    return bool(torch.equal(out, ref) and all(torch.equal(p, q) for p, q in zip(state(m), state(e))))


report = {}
with torch.no_grad():
    for way in WAYS:
        m, e = TwoBuffers(way, sys.argv[1]), TwoBuffers(way)
        report[way] = [call(m, e) for _ in range(3)]
print(json.dumps({"calls": report, "compiles": counters.compiles, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
