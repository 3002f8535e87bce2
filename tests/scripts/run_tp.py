"""A tensor-parallel toy under torchrun (gloo): a row-parallel linear with dist.all_reduce inside the cached method,
followed by all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single.

usage: torchrun --standalone --nproc-per-node N run_tp.py CACHE_DIR OUT_DIR [--uneven]
Each rank writes OUT_DIR/rank{r}.json: its counters, whether its output equals eager, its topology folder, and which
of torch._dynamo / torch._inductor were imported after the first call (before the eager reference runs).
GEARCACHE_TEST_EXTRA_GROUP=1 creates one more process group (a job whose group layout differs).
``--uneven``: the last rank holds a narrower shard (6 input features instead of 8), as when a dim does not divide
evenly: its graph differs from the others'.
"""
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from gearcache import cache_compile, counters
from gearcache.graphs import gear_threads


class RowParallelLinear(torch.nn.Module):
    def __init__(self, cache_dir, rank, features):
        super().__init__()
        torch.manual_seed(100 + rank)                 # different weights on every rank
        self.shard = torch.nn.Linear(features, 4, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(4))
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, tp_rank=rank)

    def fwd(self, x_local):
        y = self.shard(x_local)
        dist.all_reduce(y)
        y = y + self.bias
        # The other collectives Dynamo captures, on the live group: gather every rank's y, reduce-scatter it back, swap
        # row blocks between ranks.
        gathered = y.new_empty(dist.get_world_size() * y.shape[0], y.shape[1])
        dist.all_gather_into_tensor(gathered, y)
        scattered = torch.empty_like(y)
        dist.reduce_scatter_tensor(scattered, gathered * self.bias)
        swapped = torch.empty_like(scattered)
        dist.all_to_all_single(swapped, scattered)
        return y, swapped.relu()


def main() -> None:
    cache_dir, out_dir = sys.argv[1], sys.argv[2]
    device = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")
    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if os.environ.get("GEARCACHE_TEST_EXTRA_GROUP"):
        dist.new_group(list(range(dist.get_world_size())))     # unused by the graph: only the job's layout differs
    uneven = "--uneven" in sys.argv[3:] and rank == int(os.environ["WORLD_SIZE"]) - 1
    features = 6 if uneven else 8
    model = RowParallelLinear(cache_dir, rank, features).eval().to(device)
    x = torch.randn(4, features, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.cached(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
    imported = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    with torch.no_grad():
        ref = model.fwd(x)
    report = {"rank": rank, "equal": all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref)),
              "counters": dict(vars(counters)),
              "imported_before_eager": imported,
              "topology": model.cached.topology.folder, "first_call_s": first_call_s, "device": device,
              "akeys": sorted(e.manifest["akey"] for e in model.cached.life.table.values()),
              "captures_in_one_thread": gear_threads.collectives_possible()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()                  # no rank tears its connections down while a peer still uses them (gloo aborted
    dist.destroy_process_group()    # a rank with "terminate called without an active exception" once in CI)


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
