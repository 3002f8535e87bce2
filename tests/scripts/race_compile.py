"""One of N processes racing to compile the same tiny method into one empty folder; prints a JSON report."""
import gc
import json
import sys

import torch

from gearcache import cache_compile, counters


class Tiny(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return torch.relu(self.lin(x))


model = Tiny(sys.argv[1])
x = torch.ones(2, 4)
with torch.no_grad():
    ok = bool(torch.allclose(model.cached(x), model.fwd(x)))
print(json.dumps({"equal": ok, "compiles": counters.compiles, "loads": counters.loads}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
