"""Two processes started by ``torch.multiprocessing.spawn`` that join two process groups in turn: ranks 0 and 1,
then (``destroy_process_group``, ``init_process_group`` again) the ranks swapped, as a test suite or an elastic
restart in one process does. One model per process across both; its method reads ``dist.get_rank()`` (folded into
the graph) and all-reduces. Writes ``<out>/proc{p}.json``: per group, the rank, whether the output equals eager, the
entry folder.

usage: run_regrouped_ranks.py CACHE OUT PORT PORT2"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gearcache


class ByRank(torch.nn.Module):
    def __init__(self, cache: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache)

    def fwd(self, x):
        y = self.lin(x) * (dist.get_rank() + 1)
        dist.all_reduce(y)
        return y + dist.get_rank()


def run(proc: int, cache: str, out: str, port: str, port2: str) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    model = ByRank(cache)
    x = torch.ones(2, 4) + proc
    report = []
    for rank, p in ((proc, port), (1 - proc, port2)):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=p)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        with torch.no_grad():
            got = model.cached(x)
            want = model.fwd(x)
        report.append({"rank": rank, "equal": bool(torch.equal(got, want)), "folder": model.cached.topology.folder})
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out, f"proc{proc}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    mp.spawn(run, args=tuple(sys.argv[1:5]), nprocs=2)
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
