"""Methods that return their inputs as they are (``return x``, the module's buffer, ``x`` written in place): each
call compared with eager on a twin module, down to the objects returned (the caller's tensor, the module's buffer);
prints a JSON report: per method, whether it equalled eager, and the counters.

usage: run_returns_inputs.py CACHE_DIR
"""
import gc
import json
import sys

import torch

import gearcache


class M(torch.nn.Module):
    """Four methods returning inputs as they are; ``buf`` a buffer."""

    def __init__(self, d=None):
        super().__init__()
        self.register_buffer("buf", torch.arange(3.))
        if d:
            for n in ("same", "bumped", "state", "pair"):
                setattr(self, "c_" + n, gearcache.cache_compile(getattr(self, n), cache_dir=d))

    def same(self, x):
        return x

    def bumped(self, x):
        x.add_(1)
        return x

    def state(self, x):
        return self.buf

    def pair(self, x):
        return x, self.buf


def described(out, x, module):
    """Each returned tensor: whether it is the argument, whether it is the buffer, and its values."""
    return [(t is x, t is module.buf, t.tolist()) for t in (out if isinstance(out, tuple) else (out,))]


def main():
    m, e = M(sys.argv[1]), M()
    report = {}
    with torch.no_grad():
        for n in ("same", "bumped", "state", "pair"):
            xm, xe = torch.ones(3), torch.ones(3)
            om, oe = getattr(m, "c_" + n)(xm), getattr(e, n)(xe)
            report[n] = described(om, xm, m) == described(oe, xe, e)
    print(json.dumps({"calls": report, "compiles": gearcache.counters.compiles, "loads": gearcache.counters.loads}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
