"""Outputs that view an argument or a module tensor under CUDA graphs (``mode="reduce-overhead"``;
tests/test_graphed_entry.py, GPU): each call compared with eager on a twin module, then, after writes to the argument
and the buffer, compared again (eager's output is a view: the writes show through it). Prints a JSON report: per
mode and case the calls' results, True (equal before and after the writes, the argument too), "refused"
(UnsupportedInputError) or what differed; and the counters.

usage: run_graph_output_aliases.py CACHE_DIR

Before: with ``graph_outputs="copy"`` (the default) both views came back as copies, and with ``"view"`` the
argument's view was a view of the graph's static copy of the argument: later writes did not show through either.
"""
import gc
import json
import sys

import torch

import gearcache
from gearcache import counters

MODES = ("copy", "view", "view-checked")
CASES = ("arg_view", "state_view", "written_view", "as_int")


class Views(torch.nn.Module):
    def __init__(self, cache_dir=None, outputs="copy"):
        super().__init__()
        self.register_buffer("table", torch.arange(4., device="cuda"))
        if cache_dir is not None:
            config = gearcache.CompilerConfig(mode="reduce-overhead")
            config.inference_config.graph_outputs = outputs
            for name in CASES:
                setattr(self, "c_" + name, gearcache.cache_compile(getattr(self, name), cache_dir=cache_dir,
                                                                   config=config))

    def arg_view(self, x):
        return x[1:], x * 2

    def state_view(self, x):
        return self.table[1:], x + 1

    def written_view(self, x):
        x.add_(1)
        return x.view(2, 2), x.sum()

    def as_int(self, x):
        return x.view(torch.int32), x + 1


def call(m, e, name, layout):
    """One call of ``name`` with ``x`` laid out as ``layout``: True, "refused" or what differed."""
    def make():
        base = torch.arange(8., device="cuda") + 10
        return base, (base[:4] if layout == "contiguous" else base[::2])
    (bm, xm), (be, xe) = make(), make()
    try:
        om = getattr(m, "c_" + name)(xm)
    except gearcache.UnsupportedInputError as exc:
        return "refused" if torch.equal(bm, be) and "Fix:" in str(exc) else f"refused, wrote: {exc}"
    oe = getattr(e, name)(xe)
    if not (all(torch.equal(a, b) for a, b in zip(om, oe)) and torch.equal(bm, be)):
        return "differs"
    xm.mul_(-1), xe.mul_(-1), m.table.add_(100), e.table.add_(100)
    return True if all(torch.equal(a, b) for a, b in zip(om, oe)) else "differs after writes"


report = {}
with torch.inference_mode():
    for outputs in MODES:
        m, e = Views(f"{sys.argv[1]}/{outputs}", outputs), Views()
        for name in CASES:
            report[f"{outputs} {name}"] = [call(m, e, name, layout)
                                           for layout in ("contiguous", "contiguous", "contiguous", "strided")]
print(json.dumps({"calls": report, "compiles": counters.compiles, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
