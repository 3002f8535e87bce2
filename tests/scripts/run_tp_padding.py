"""Padding through collectives under torchrun (gloo), default settings: a decode gear of examples/tp_decoder.py (real
batch 3 padded to gear 4, all_reduce inside) and a few row-block collectives, each against eager on every rank.

usage: torchrun --standalone --nproc-per-node N run_tp_padding.py CACHE_DIR OUT_DIR DTYPE
Each rank writes OUT_DIR/rank{r}.json: per case its outcome (``served``: the compiled call's outputs and written
tensors, against eager; or the ``PaddingUnsafeError`` it raised), the counters it moved, and the gear plan's padding
report (mixing findings, pad values).

Cases (each a cached method of its own, gears {1, 2, 4} on the batch, called with a batch of 3):
* ``decode``: TPDecoder.decode of the toy size (embedding of the padded ids, attention over the KV cache, two
  all_reduces per block, the KV cache argument padded alike);
* ``gather_rows``: all_gather_into_tensor of the padded rows, split back into rank blocks (``view(N, B, ...)``):
  rows stay in line inside each rank's block;
* ``scatter_rows``: reduce_scatter_tensor of the ranks' blocks stacked along dim 0 (``cat`` of N padded blocks):
  each rank's block keeps its padded rows inside it;
* ``exchange_features``: all_to_all_single along an unpadded dim 0 (features), the padded batch in dim 1;
* ``exchange_batch``: all_to_all_single along the padded dim 0: each rank's block would take other rows with the
  padded size: refused, with the op named.
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import tp_decoder  # noqa: E402

from gearcache import CompilerConfig, PaddingUnsafeError, cache_compile, counters  # noqa: E402

GEARS = [1, 2, 4]


class Collectives(torch.nn.Module):
    """Row-block collectives on a padded batch ``x [B, 8]``."""

    def __init__(self, cache_dir: str, rank: int):
        super().__init__()
        torch.manual_seed(100 + rank)               # other weights on every rank
        self.lin = torch.nn.Linear(8, 8)
        config = CompilerConfig()
        config.inference_config.dim_gears = {"x": {0: GEARS}}
        for name in ("gather_rows", "scatter_rows", "exchange_features", "exchange_batch"):
            setattr(self, f"cached_{name}", cache_compile(getattr(self, name), config=config, cache_dir=cache_dir,
                                                          tp_rank=rank))

    def gather_rows(self, x):
        y = self.lin(x)
        n = dist.get_world_size()
        out = y.new_empty(n * y.shape[0], y.shape[1])
        dist.all_gather_into_tensor(out, y)
        return out.view(n, y.shape[0], -1).sum(0).relu()        # every rank's row b, summed

    def scatter_rows(self, x):
        y = self.lin(x)
        n = dist.get_world_size()
        blocks = torch.cat([y * (k + 1) for k in range(n)], 0)     # [n * B, 8]: rank k's block is (k + 1) * y
        out = torch.empty_like(y)
        dist.reduce_scatter_tensor(out, blocks)
        return out

    def exchange_features(self, x):
        y = self.lin(x).t().contiguous()                         # [8, B]: features along dim 0, the batch in dim 1
        out = torch.empty_like(y)
        dist.all_to_all_single(out, y)
        return out.t() * 2

    def exchange_batch(self, x):
        y = self.lin(x)                                          # [B, 8]: blocks of the padded batch
        out = torch.empty_like(y)
        dist.all_to_all_single(out, y)
        return out


def run(cached, eager, args, tol: dict) -> dict:
    before = counters.snapshot()
    try:
        with torch.inference_mode():
            got = cached(*[a.clone() for a in args])
    except PaddingUnsafeError as exc:
        return {"outcome": "refused", "error": str(exc), "counters": counters.delta(before)}
    with torch.inference_mode():
        want = eager(*[a.clone() for a in args])
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    equal = all(torch.allclose(g.float(), w.float(), **tol) for g, w in zip(got, want))
    plan = cached.gear_life.plan
    return {"outcome": "served", "equal": equal, "counters": counters.delta(before),
            "mixing": [str(f) for f in plan.padding.mixing],
            "pad_values": {d.name: d.pad_value for d in plan.dims}}


def main() -> None:
    cache_dir, out_dir, dtype_name = sys.argv[1], sys.argv[2], sys.argv[3]
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = tp_decoder.SIZES["toy"]
    model, _ = tp_decoder.build(sizes, cache_dir=cache_dir, mode="default", gears=GEARS, device="cpu", dtype=dtype)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, sizes["vocab"], (3, 1), generator=g)
    kv = torch.randn(sizes["layers"], 2, 3, sizes["heads"] // dist.get_world_size(), sizes["tmax"],
                     sizes["d"] // sizes["heads"], generator=g).to(dtype)
    tol = tp_decoder.tolerance(dtype)
    report = {"decode": run(model.cached_decode, model.decode, (ids, kv, torch.tensor([5])), tol)}
    rows = Collectives(cache_dir, rank).eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7 + rank))
    for name in ("gather_rows", "scatter_rows", "exchange_features", "exchange_batch"):
        report[name] = run(getattr(rows, f"cached_{name}"), getattr(rows, name), (x,), {"atol": 1e-5, "rtol": 1e-5})
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
