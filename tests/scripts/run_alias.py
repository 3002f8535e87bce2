"""A cached method whose output is a view of its input (run plans refuse it); prints a JSON report.

usage: run_alias.py CACHE_DIR
"""
import gc
import json
import sys

import torch

from gearcache import cache_compile, counters


class Alias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.run = cache_compile(self._forward, cache_dir=sys.argv[1])

    def _forward(self, x):
        return self.lin(x), x[:, :2]            # the second output is a view of the input


torch.manual_seed(0)
model = Alias()
x = torch.randn(3, 4)
with torch.no_grad():
    out, view = model.run(x)
    ref, ref_view = model._forward(x)
report = {"equal": bool(torch.allclose(out, ref) and torch.equal(view, ref_view)),
          "aliases_input": view.data_ptr() == x.data_ptr(),
          "counters": {k: v for k, v in vars(counters).items()}}
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
