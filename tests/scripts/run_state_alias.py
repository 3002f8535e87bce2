"""Calls of an entry captured with plain tensors, passing (views of) the module's own buffers as arguments
(tests/test_cached_function.py); prints a JSON report: per call, "refused" (UnsupportedInputError, and nothing
written: the module's buffers and the arguments as before the call) or whether it equalled eager (outputs, buffers,
arguments), and the counters.

usage: run_state_alias.py CACHE_DIR [gears]

The method writes ``count`` and the argument ``y`` and reads ``x``, ``table`` and ``y``: an argument on ``count``'s
storage, or ``y`` on ``table``'s, shares memory with a module tensor the entry writes, or reads where it writes the
argument; ``x`` on ``table``'s storage only reads memory the entry only reads (served). Each shared call comes right
after a plain call of the same signature, which set the dispatcher's shortcut: its matcher must pass the call on to
the key's path. ``gears``: x and y padded to 4 rows (a padded argument is a copy, copied back after the run), and
8 rows served by an entry of their own (``past_largest_gear="compile"``).
"""
import gc
import json
import sys

import numpy
import torch

import gearcache
from gearcache import CompilerConfig, counters


class StepWithState(torch.nn.Module):
    def __init__(self, cache_dir=None, config=None):
        super().__init__()
        self.register_buffer("count", torch.arange(8.)[:4])     # its storage holds 8 floats: 4 are no buffer's
        self.register_buffer("table", torch.arange(4.) + 10)
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir, config=config)

    def step(self, x, y):
        self.count.add_(1)
        y.mul_(2)
        return x * 3 + y + self.table.sum()


def numpy_pair(x_rows, y_rows):
    """x and y as ``torch.from_numpy`` views of one NumPy array: two storage objects over shared bytes."""
    array = numpy.arange(1, 5, dtype=numpy.float32)
    return torch.from_numpy(array[x_rows]), torch.from_numpy(array[y_rows])


def one_tensor_pair(_m):
    """x and y as views of one tensor (one storage object): compiled as views of one base, served."""
    t = torch.arange(1., 5.)
    return t[:2], t[1:3]


def beyond_count(m):
    """A tensor on ``count``'s storage past its elements (a different view of the same storage)."""
    return torch.empty(0).set_(m.count.untyped_storage(), 4, (2,), (1,))


SHARED = {            # name: (x, y) of module m
    "x=count": lambda m: (m.count[:2], torch.ones(2)),
    "x=count[2:4]": lambda m: (m.count[2:4], torch.ones(2)),
    "x=beyond count": lambda m: (beyond_count(m), torch.ones(2)),
    "y=table": lambda m: (torch.ones(2), m.table[:2]),
    "y=table[1:3]": lambda m: (torch.ones(2), m.table[1:3]),
    "y=count[1:3]": lambda m: (torch.ones(2), m.count[1:3]),
    "x=count[::2]": lambda m: (m.count[::2], torch.ones(2)),       # another stride: refused at its capture
    "x=table": lambda m: (m.table[:2], torch.ones(2)),              # read-only on both sides: served
    "clones": lambda m: (m.count[:2].clone(), m.table[:2].clone()),
    # arguments over one memory, apart from the module's: y is written, x read
    "x, y: numpy views": lambda m: numpy_pair(slice(0, 2), slice(1, 3)),          # refused: torch compiles them apart
    "x, y: numpy views, one start": lambda m: numpy_pair(slice(0, 2), slice(0, 2)),
    "x, y: one tensor's views": one_tensor_pair,                   # served (padded: refused, as copies)
}
PAST_LARGEST = {      # 8 rows, past a largest gear of 4 (gears only)
    "x=count's storage, 8 rows": lambda m: (torch.empty(0).set_(m.count.untyped_storage(), 0, (8,), (1,)),
                                            torch.ones(8)),
}


def state(m, args):
    return [t.clone() for t in (m.count, m.table, *args)]


def one(m, e, name, report, label=None):
    """Two plain calls (the second served by the shortcut), then the shared one (reported as ``label``, else
    ``name``); each compared with eager on the twin ``e``. Returns the shortcut's calls before the second plain one."""
    label = label or name
    rows = 8 if name in PAST_LARGEST else 2
    m.cached(torch.ones(rows), torch.ones(rows))    # (the shortcut is set again after a refused call compiled)
    e.step(torch.ones(rows), torch.ones(rows))
    plain_before = m.cached.shortcut_calls
    report[f"{label}: plain"] = bool(torch.equal(m.cached(torch.ones(rows), torch.ones(rows)),
                                                e.step(torch.ones(rows), torch.ones(rows))))
    args, eager_args = {**SHARED, **PAST_LARGEST}[name](m), {**SHARED, **PAST_LARGEST}[name](e)
    before = state(m, args)
    try:
        out = m.cached(*args)
    except gearcache.UnsupportedInputError as exc:
        after = state(m, args)
        untouched = all(torch.equal(a, b) for a, b in zip(before, after))
        report[label] = "refused" if untouched and ".clone()" in str(exc) else f"refused, wrote: {exc}"
        return plain_before
    ref = e.step(*eager_args)
    report[label] = bool(torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(state(m, args),
                                                                                        state(e, eager_args))))
    return plain_before


def main():
    config = None
    if sys.argv[2:] == ["gears"]:
        config = CompilerConfig()
        config.inference_config.dim_gears = {"x": {0: [4]}, "y": {0: [4]}}
        config.inference_config.past_largest_gear = "compile"       # 8 rows: an entry of their own
    m, e = StepWithState(sys.argv[1], config), StepWithState()
    report = {}
    with torch.no_grad():
        shortcut = []
        for name in SHARED:
            before = one(m, e, name, report)
            shortcut.append(m.cached.shortcut_calls > before)
        m.count = torch.zeros(4)            # a buffer replaced: the entry is bound anew, its rules too
        e.count = torch.zeros(4)
        one(m, e, "x=count", report, "replaced: x=count")
        m.table.data = torch.arange(4.) + 20    # .data swapped: another storage
        e.table.data = torch.arange(4.) + 20
        one(m, e, "y=table", report, "swapped: y=table")
        one(m, e, "clones", report, "after: clones")
        for name in PAST_LARGEST if config is not None else ():
            one(m, e, name, report)
    print(json.dumps({"calls": report, "shortcut_served_plain": shortcut, "compiles": counters.compiles,
                      "loads": counters.loads, "traces": counters.traces}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
