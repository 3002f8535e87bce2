"""Two ranks started by ``torch.multiprocessing.spawn`` with torchrun's ``RANK`` / ``WORLD_SIZE`` set, a method
padded to gears 4, 8 of its batch whose graph holds ``dist.is_initialized()`` (Dynamo folds it): before
``init_process_group`` it is a linear layer, after it the rows are exchanged between ranks by ``all_to_all_single``
along the padded batch, which the padding analysis refuses. ``smoke``: each rank calls it once before the group
exists (``smoke_equal`` in the report), which proves and stores a gear plan for the graph without the exchange.

usage: run_spawned_gear_plan.py CACHE OUT PORT [smoke]
Writes ``<out>/rank{r}.json``: ``outcome`` ("served" with ``equal``, or "refused" with ``error``), ``smoke_equal``."""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gearcache
from gearcache import CompilerConfig
from gearcache.errors import PaddingUnsafeError


class Exchange(torch.nn.Module):
    def __init__(self, cache: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        config = CompilerConfig()
        config.inference_config.dim_gears = {"x": {0: [4, 8]}}
        self.cached = gearcache.cache_compile(self.fwd, config=config, cache_dir=cache)

    def fwd(self, x):
        y = self.lin(x)
        if dist.is_initialized():
            out = torch.empty_like(y)
            dist.all_to_all_single(out, y)
            y = out
        return y


def run(rank: int, cache: str, out: str, port: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    model = Exchange(cache)
    x = torch.arange(8.0).reshape(2, 4) + 10 * rank          # 2 rows: padded to gear 4
    report: dict = {"rank": rank, "smoke_equal": None}
    if mode == "smoke":
        with torch.inference_mode():
            report["smoke_equal"] = bool(torch.equal(model.cached(x.clone()), model.fwd(x.clone())))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with torch.inference_mode():
        try:
            got = model.cached(x.clone())
            report.update(outcome="served", equal=bool(torch.allclose(got, model.fwd(x.clone()))))
        except PaddingUnsafeError as exc:
            report.update(outcome="refused", error=str(exc))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(*sys.argv[1:4], sys.argv[4] if len(sys.argv) > 4 else ""), nprocs=2)
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
