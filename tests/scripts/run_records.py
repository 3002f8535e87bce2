"""A method returning a named tuple holding a dataclass (and a dict around them): compared with eager on a twin
module, down to the result's classes; prints a JSON report: whether it equalled eager, and the counters.

usage: run_records.py CACHE_DIR
"""
import collections
import dataclasses
import gc
import json
import sys

import torch

import gearcache

Pair = collections.namedtuple("Pair", "box doubled")


@dataclasses.dataclass
class Box:
    t: torch.Tensor
    n: int


class M(torch.nn.Module):
    def __init__(self, d=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if d:
            self.c_rec = gearcache.cache_compile(self.rec, cache_dir=d)

    def rec(self, x):
        return {"pair": Pair(Box(self.lin(x).relu(), 3), x * 2)}


def same(a, b):
    pa, pb = a["pair"], b["pair"]
    return (type(pa) is type(pb) is Pair and type(pa.box) is type(pb.box) is Box and pa.box.n == pb.box.n == 3
            and torch.equal(pa.box.t, pb.box.t) and torch.equal(pa.doubled, pb.doubled))


def main():
    torch.manual_seed(0)
    m = M(sys.argv[1])
    e = M()
    e.load_state_dict(m.state_dict())
    x = torch.randn(2, 4)
    with torch.no_grad():
        equal = same(m.c_rec(x), e.rec(x)) and same(m.c_rec(x + 1), e.rec(x + 1))
    print(json.dumps({"equal": equal, "compiles": gearcache.counters.compiles, "loads": gearcache.counters.loads}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
