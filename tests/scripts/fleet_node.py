"""One fleet node: a tiny model through gearcache with a remote store; prints a JSON report on the last line.

usage: fleet_node.py CACHE_DIR [CONFIG_JSON]   (CONFIG_JSON: CompilerConfig fields, e.g. '{"remote": "redis://..."}')

The report has the counters' change over the first call (compiles, traces, remote_loads, ...), the first call's
seconds, whether every output equals eager, and whether redis-py was imported (a node that only fetches never
needs it). Also used by benchmarks/fleet.py.
"""
import gc
import json
import logging
import os
import sys
import time

import torch

from gearcache import CompilerConfig, cache_compile, counters

ROWS = 8


class Node(torch.nn.Module):
    def __init__(self, cache_dir, config):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return torch.relu(self.lin(x)) * 2 - 1


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    config = CompilerConfig(**(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}))
    torch.manual_seed(0)
    model = Node(sys.argv[1], config).eval()
    x = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(1))
    before = counters.snapshot()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.cached(x)
        first = time.perf_counter() - t0
        equal = torch.equal(out, model.fwd(x)) or torch.allclose(out, model.fwd(x), atol=1e-6)
    delta = {k: v for k, v in counters.delta(before).items() if not k.endswith("_seconds")}
    print(json.dumps({"pid": os.getpid(), "first_call_s": first, "equal": bool(equal),
                      "redis_py_imported": "redis" in sys.modules, **delta}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
