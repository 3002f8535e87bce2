"""Methods over memory shared across storage objects (gearcache/call/memory.py, call/state_alias.py), compiled or
loaded, each call compared with eager on a twin module; prints a JSON report: per case "refused"
(UnsupportedInputError, and the NumPy array as before the call) or whether it equalled eager (output and array), and
the counters.

usage: run_memory.py CACHE_DIR

Cases: ``reads``: ``x * 2 + y`` over two ``from_numpy`` views of one array (served: its own entry); ``writes``:
``y.mul_(2); return x + y`` so (refused; before: [2, 5] for eager's [2, 6]), after an apart call that set the
shortcut; ``state writes``: buffers ``a``, ``b`` from ``from_numpy`` views of one array, ``a.add_(1)`` between two
reads of ``b`` (refused; before: [29, 29] for eager's [32, 32]); ``state reads``: the same buffers only read
(served); ``unchecked``: ``writes`` with ``check_signature=False`` after an apart call: views of one tensor served
by an entry of their own (before: the first entry, [5, 8] for eager's [5, 10]), ``from_numpy`` views refused.
"""
import gc
import json
import sys

import numpy
import torch

import gearcache
from gearcache import counters


class Shared(torch.nn.Module):
    def __init__(self, cache_dir=None):
        super().__init__()
        self.array = numpy.arange(1, 10, dtype=numpy.float32)
        self.register_buffer("a", torch.from_numpy(self.array[:4]))
        self.register_buffer("b", torch.from_numpy(self.array[1:5]))       # other storage object, shared bytes
        if cache_dir is not None:
            for name in ("reads", "writes", "state_writes", "state_reads"):
                setattr(self, f"cached_{name}", gearcache.cache_compile(getattr(self, name), cache_dir=cache_dir))
            self.cached_unchecked = gearcache.cache_compile(self.writes, cache_dir=cache_dir,
                                                            config=gearcache.CompilerConfig(check_signature=False))

    def unchecked(self, x, y):
        return self.writes(x, y)

    def reads(self, x, y):
        return x * 2 + y

    def writes(self, x, y):
        y.mul_(2)
        return x + y

    def state_writes(self, x):
        s = self.b.sum()
        self.a.add_(1)
        return x + s + self.b.sum()

    def state_reads(self, x):
        return x + self.a.sum() * self.b


def views(module):
    """x, y: ``from_numpy`` views of one new array, overlapping by one element."""
    module.scratch = numpy.arange(1, 5, dtype=numpy.float32)
    return torch.from_numpy(module.scratch[:2]), torch.from_numpy(module.scratch[1:3])


def one_tensor_views(module):
    """x, y: overlapping views of one tensor (one storage object: compiled as views of one base)."""
    t = torch.arange(1., 5.)
    return t[:2], t[1:3]


def case(m, e, name, make):
    """Run ``name`` on ``m`` (cached) and ``e`` (eager) with the arguments ``make(module)``."""
    args, eager_args = make(m), make(e)
    arrays = (m.array.copy(), getattr(m, "scratch", numpy.zeros(0)).copy())
    try:
        out = getattr(m, f"cached_{name}")(*args)
    except gearcache.UnsupportedInputError as exc:
        untouched = (numpy.array_equal(arrays[0], m.array) and
                     numpy.array_equal(arrays[1], getattr(m, "scratch", numpy.zeros(0))))
        return "refused" if untouched and ".clone()" in str(exc) else f"refused, wrote: {exc}"
    ref = getattr(e, name)(*eager_args)
    return bool(torch.equal(out, ref) and numpy.array_equal(m.array, e.array)
                and numpy.array_equal(getattr(m, "scratch", 0), getattr(e, "scratch", 0)))


def main():
    m, e = Shared(sys.argv[1]), Shared()
    report = {}
    with torch.no_grad():
        report["reads"] = case(m, e, "reads", views)
        for k in range(2):          # apart calls: the second through the shortcut
            report[f"writes apart {k}"] = case(m, e, "writes", lambda _m: (torch.ones(2), torch.ones(2)))
        shortcut = m.cached_writes.shortcut_calls
        report["writes"] = case(m, e, "writes", views)
        report["state writes"] = case(m, e, "state_writes", lambda _m: (torch.ones(2),))
        report["state reads"] = case(m, e, "state_reads", lambda _m: (torch.ones(4),))
        # check_signature=False: the first entry serves unkeyed calls, not arguments over one memory it writes
        report["unchecked apart"] = case(m, e, "unchecked", lambda _m: (torch.ones(2), torch.ones(2)))
        report["unchecked: one tensor's views"] = case(m, e, "unchecked", one_tensor_views)
        report["unchecked: numpy views"] = case(m, e, "unchecked", views)
    print(json.dumps({"calls": report, "compiles": counters.compiles, "loads": counters.loads,
                      "shortcut_served_apart": shortcut > 0}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
