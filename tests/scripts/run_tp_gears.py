"""A tensor-parallel MLP with gears under torchrun (gloo): warm-up of every gear, a sweep against eager, teardown.

usage: torchrun --standalone --nproc-per-node N run_tp_gears.py CACHE_DIR OUT_DIR

The cached method is a column-parallel ``fc1``, GELU, a row-parallel ``fc2`` whose partial sums are all-reduced
(``dist.all_reduce`` inside the method), its batch padded to gears. Each rank writes ``OUT_DIR/rank{r}.json``: its
gears, counters after the warm-up and after the sweep, whether the sweep (batches 1..largest gear) equals eager,
which of torch._dynamo / torch._inductor were imported before the sweep, the error (type and message) if warm-up
raised, and whether ``destroy_process_group`` returned (and in how long), with the gearcache threads still alive.
Each rank writes its pid to ``OUT_DIR/rank{r}.pid`` first.

Environment: ``GEARS`` (default ``1,2,4``); ``GEARS_RANK_<r>``: other gears for rank r (ranks that diverge);
``STALL_RANK``: a rank that never reaches warm-up (it sleeps); ``RANK_TIMEOUT_S``: ``config.rank_timeout_s``;
``WARMUP_WORKERS``; ``PADDING_CHECK`` (default ``off``); ``REMOTE_CLAIM_TTL_S`` (with ``GEARCACHE_REMOTE``: a fleet
node); ``COMPILE_HOOKS=1``: count calls of torch's compiler entry points (tests/compile_hooks.py, reported as
``compile_hooks``); ``GEARCACHE_TEST_DEVICE=cuda`` runs on NCCL with
``mode="reduce-overhead"`` (CUDA graphs). A rank whose warm-up raised exits with status 3 once every rank but the
stalled one has written its report (at most 120 s later).
"""
import gc
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gearcache import CompilerConfig, GearcacheError, cache_compile, counters

D, HIDDEN = 8, 32


class TPMlp(torch.nn.Module):
    def __init__(self, cache_dir: str, config: CompilerConfig, rank: int, world: int):
        super().__init__()
        torch.manual_seed(0)
        fc1, fc2 = torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, D)     # the unsharded layers, then this shard
        cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        self.fc1 = torch.nn.Linear(D, HIDDEN // world)
        self.fc2 = torch.nn.Linear(HIDDEN // world, D, bias=False)
        self.bias = torch.nn.Parameter(fc2.bias.detach().clone())
        with torch.no_grad():
            self.fc1.weight.copy_(fc1.weight[cols])
            self.fc1.bias.copy_(fc1.bias[cols])
            self.fc2.weight.copy_(fc2.weight[:, cols])
        self.cached = cache_compile(self.fwd, config=config, cache_dir=cache_dir, tp_rank=rank)

    def fwd(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        dist.all_reduce(y)
        return y + self.bias


def config_for(rank: int) -> tuple[CompilerConfig, list[int]]:
    gears = [int(g) for g in os.environ.get(f"GEARS_RANK_{rank}", os.environ.get("GEARS", "1,2,4")).split(",")]
    on_cuda = os.environ.get("GEARCACHE_TEST_DEVICE") == "cuda"
    config = CompilerConfig(mode="reduce-overhead" if on_cuda else "default")
    config.inference_config.dim_gears = {"x": {0: gears}}
    config.inference_config.padding_check = os.environ.get("PADDING_CHECK", "off")
    if os.environ.get("WARMUP_WORKERS"):
        config.inference_config.warmup_workers = int(os.environ["WARMUP_WORKERS"])
    if os.environ.get("RANK_TIMEOUT_S"):
        config.rank_timeout_s = float(os.environ["RANK_TIMEOUT_S"])
    if os.environ.get("REMOTE_CLAIM_TTL_S"):
        config.remote_claim_ttl_s = float(os.environ["REMOTE_CLAIM_TTL_S"])
    return config, gears


def sweep(model: TPMlp, largest: int, device: str) -> bool:
    equal = True
    for b in range(1, largest + 1):
        x = torch.randn(b, D, generator=torch.Generator().manual_seed(b)).to(device)
        equal &= bool(torch.allclose(model.cached(x), model.fwd(x), atol=1e-5, rtol=1e-5))
    return equal


def teardown(device: str) -> dict:
    """``destroy_process_group`` bounded to 30 s (gearcache.release_graphs() first); the gearcache threads left."""
    import gearcache

    if hasattr(gearcache, "release_graphs"):        # (absent before it was added: the test also runs on old code)
        gearcache.release_graphs()
    dist.barrier()
    t0 = time.perf_counter()
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(30)
    return {"destroy_returned": not worker.is_alive(), "destroy_s": time.perf_counter() - t0,
            "gearcache_threads": sorted(t.name for t in threading.enumerate()
                                        if t.name.startswith("gearcache") and t.is_alive())}


def main() -> None:
    cache_dir, out_dir = sys.argv[1], sys.argv[2]
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))                       # (a test that kills the job kills each rank by its pid)
    device = "cpu"
    if os.environ.get("GEARCACHE_TEST_DEVICE") == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hooks = None
    if os.environ.get("COMPILE_HOOKS"):                 # counters on torch's compiler entry points
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import compile_hooks as hooks

        hooks.install()
    config, gears = config_for(rank)
    model = TPMlp(cache_dir, config, rank, world).eval().to(device)
    report: dict = {"rank": rank, "gears": gears, "error": None}
    if os.environ.get("STALL_RANK") == str(rank):
        time.sleep(600)                                 # never reaches warm-up within the test's time
    with torch.inference_mode():
        try:
            t0 = time.perf_counter()
            model.cached.warmup(torch.randn(max(gears), D).to(device))
            report["warmup_s"] = time.perf_counter() - t0
        except GearcacheError as exc:
            report["error"] = {"type": type(exc).__name__, "message": str(exc)}
        report["counters_after_warmup"] = dict(vars(counters))
        report["imported_before_sweep"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
        if report["error"] is None:
            report["equal"] = sweep(model, max(gears), device)
            report["counters"] = dict(vars(counters))
            report["compile_hooks"] = dict(hooks.COUNTS) if hooks is not None else None
    if report["error"] is not None:
        _write(out_dir, rank, report)
        _await_reports(out_dir, world)
        os._exit(3)                                     # torchrun then stops the other ranks
    del model
    report.update(teardown(device))
    _write(out_dir, rank, report)


def _await_reports(out_dir: str, world: int) -> None:
    """Before a failed rank exits (and torchrun stops the others): wait up to 120 s for every rank but the stalled
    one to write its report, so a loaded machine's slower ranks are not stopped before they report their error."""
    others = [r for r in range(world) if str(r) != os.environ.get("STALL_RANK")]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out_dir, f"rank{r}.json"))
                                                  for r in others):
        time.sleep(0.1)


def _write(out_dir: str, rank: int, report: dict) -> None:
    tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))     # a reader never sees half a report


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
