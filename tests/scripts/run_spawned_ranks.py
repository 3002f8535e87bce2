"""Two ranks started by ``torch.multiprocessing.spawn`` (no ``RANK`` / ``WORLD_SIZE`` in the environment), each
building its model *before* ``init_process_group``, as such jobs often do; the method reads the rank
(``dist.get_rank()``, which Dynamo folds into the graph as a constant). Rank ``first`` compiles first, then the other
calls. Writes ``<out>/rank{r}.json``: whether the output equals eager, the folder its entries went to, the error its
call raised (``{"type", "message"}``, else None).

usage: run_spawned_ranks.py CACHE OUT PORT [given-env-rank | smoke-before-group [torchrun-env]]
``given-env-rank``: ``cache_compile(..., global_rank=int(os.environ.get("RANK", 0)))``, torchrun code copied into a
spawned job, where ``RANK`` is not set: every rank passes 0. ``smoke-before-group``: the method reads
``dist.get_rank() if dist.is_initialized() else 0`` and each rank calls it once before ``init_process_group`` (a
smoke test of the model; ``smoke_equal`` in the report), then as above. ``torchrun-env``: ``RANK`` and ``WORLD_SIZE``
set as torchrun sets them, so that the rank folder before the group is already the rank's own."""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gearcache
from gearcache import counters


class ByRank(torch.nn.Module):
    def __init__(self, cache: str, given_env_rank: bool):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        kwargs = {"global_rank": int(os.environ.get("RANK", 0))} if given_env_rank else {}
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache, **kwargs)

    def fwd(self, x):
        return self.lin(x) + (dist.get_rank() if dist.is_initialized() else 0)


def run(rank: int, cache: str, out: str, port: str, mode: str, env: str) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    if env == "torchrun-env":
        os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    torch.manual_seed(0)
    model = ByRank(cache, mode == "given-env-rank")      # before the process group exists
    x = torch.ones(2, 4)
    smoke_equal = None
    if mode == "smoke-before-group":
        with torch.no_grad():
            smoke_equal = bool(torch.equal(model.cached(x), model.fwd(x)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with torch.no_grad():
        if rank == 1:
            dist.barrier()                     # rank 0's entry is stored before rank 1 looks
        try:
            got, error = model.cached(x), None
        except Exception as exc:
            got, error = None, {"type": type(exc).__name__, "message": str(exc)}
        if rank == 0:
            dist.barrier()
        want = model.fwd(x)
    report = {"rank": rank, "equal": got is not None and bool(torch.equal(got, want)), "error": error,
              "smoke_equal": smoke_equal,
              "folder": None if error else model.cached.topology.folder,
              "compiles": counters.compiles, "loads": counters.loads}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(*sys.argv[1:4], *(sys.argv[4:6] + ["", ""])[:2]), nprocs=2)
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
