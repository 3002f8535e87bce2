"""gearcache on a tensor-parallel decoder: cached prefill and decode with all-reduces inside, under torchrun.

    python examples/tp_decoder.py --nproc 2 --toy              # CPU, gloo, toy size: a cold and a warm start
    python examples/tp_decoder.py --nproc 4                    # GPUs, NCCL, reference size, CUDA graphs per gear
    torchrun --standalone --nproc-per-node 2 examples/tp_decoder.py --child --toy --cache-dir DIR   # one start

The reference decoder (benchmarks/reference_decoder.py: hidden 1024, 16 heads, 8 layers, vocab 32000, bf16 on GPU)
sharded Megatron-style over the ``N`` ranks of the default process group: every block's QKV and MLP-up projections
are column-parallel (each rank holds ``16 / N`` heads and ``4096 / N`` MLP columns), attention-out and MLP-down are
row-parallel, each followed by ``dist.all_reduce`` inside the cached methods (biases added once, after the reduce).
Embeddings, layer norms and the LM head are replicated. Each rank holds its heads' slice of the KV cache
``kv [layers, 2, batch, heads / N, max_len, head_dim]``.

``prefill`` and ``decode`` are cached with ``cache_compile`` (``tp_rank=rank``) and their batch is padded to gears
1, 2, 4, ..., 64 (``--gears``); on GPU with ``mode="reduce-overhead"``, so every gear is one CUDA graph with NCCL's
all-reduce captured inside it. The weights are the shards of one seeded unsharded model, so the sharded eager model
is checked against it first. A start then warms up every gear (compile or load, and capture), generates a few tokens
greedily and checks every rank's logits against the sharded eager model. The parent mode runs a cold start and a
warm start, each a fresh ``torchrun`` with empty Inductor/Triton caches; the last line of output is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SIZES = {"reference": {"d": 1024, "heads": 16, "layers": 8, "vocab": 32000, "tmax": 256},
         "toy": {"d": 64, "heads": 8, "layers": 1, "vocab": 256, "tmax": 32}}       # 8 heads: up to 8 ranks
GEARS = [1, 2, 4, 8, 16, 32, 64]


# ------------------------------------------------------------------------------------------------ the unsharded model
class Block(nn.Module):
    """One block of the reference decoder."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, kv, pos, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        kc, vc = kv[0].index_copy(2, pos, k), kv[1].index_copy(2, pos, v)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, torch.stack([kc, vc])


class Decoder(nn.Module):
    """The reference decoder (unsharded); ``run`` serves both prefill (``ids [B, T]``, ``pos [T]``) and decode
    (``ids [B, 1]``, ``pos [1]``). ``kv [layers, 2, B, heads, tmax, head_dim]``."""

    def __init__(self, d: int, heads: int, layers: int, vocab: int, tmax: int, block=Block):
        super().__init__()
        self.tmax = tmax
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(tmax, d)
        self.blocks = nn.ModuleList(block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def run(self, ids, kv, pos):
        h = self.wte(ids) + self.wpe(pos)
        mask = torch.arange(self.tmax, device=ids.device)[None, :] <= pos[:, None]
        new = []
        for i, block in enumerate(self.blocks):
            h, layer_kv = block(h, kv[i], pos, mask)
            new.append(layer_kv)
        return self.head(self.ln_f(h)), torch.stack(new)


# -------------------------------------------------------------------------------------------------- the sharded model
def all_reduce(y: torch.Tensor, group=None) -> torch.Tensor:
    dist.all_reduce(y, group=group)
    return y


class TPBlock(nn.Module):
    """This rank's shard of a block: column-parallel QKV and MLP-up, row-parallel attention-out and MLP-down, the
    partial sums all-reduced over ``group`` (None: the default group)."""

    def __init__(self, d: int, heads: int, tp: int, group=None):
        super().__init__()
        self.group = group
        self.heads, self.head_dim = heads // tp, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d // tp)                         # this rank's heads' q, k and v
        self.proj = nn.Linear(d // tp, d, bias=False)                 # partial sums, all-reduced
        self.proj_bias = nn.Parameter(torch.zeros(d))
        self.fc1 = nn.Linear(d, 4 * d // tp)
        self.fc2 = nn.Linear(4 * d // tp, d, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x, kv, pos, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        kc, vc = kv[0].index_copy(2, pos, k), kv[1].index_copy(2, pos, v)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        x = x + all_reduce(self.proj(y.transpose(1, 2).reshape(b, t, -1)), self.group) + self.proj_bias
        x = x + all_reduce(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.group) + self.fc2_bias
        return x, torch.stack([kc, vc])

    @torch.no_grad()
    def load_shard(self, full: Block, rank: int, tp: int) -> None:
        d, hd = full.qkv.in_features, self.head_dim
        heads = slice(rank * self.heads, (rank + 1) * self.heads)
        cols = slice(rank * d // tp, (rank + 1) * d // tp)
        mlp = slice(rank * 4 * d // tp, (rank + 1) * 4 * d // tp)
        self.qkv.weight.copy_(full.qkv.weight.view(3, full.heads, hd, d)[:, heads].reshape(-1, d))
        self.qkv.bias.copy_(full.qkv.bias.view(3, full.heads, hd)[:, heads].reshape(-1))
        self.proj.weight.copy_(full.proj.weight[:, cols])
        self.proj_bias.copy_(full.proj.bias)
        self.fc1.weight.copy_(full.fc1.weight[mlp])
        self.fc1.bias.copy_(full.fc1.bias[mlp])
        self.fc2.weight.copy_(full.fc2.weight[:, mlp])
        self.fc2_bias.copy_(full.fc2.bias)
        self.ln1.load_state_dict(full.ln1.state_dict())
        self.ln2.load_state_dict(full.ln2.state_dict())


class TPDecoder(Decoder):
    """This rank's shard of the decoder, with ``cached_prefill`` and ``cached_decode``."""

    def __init__(self, sizes: dict, tp: int, rank: int, *, cache_dir: str | None, mode: str, gears: list[int],
                 padding_check: str | None = None, warmup_workers: int | None = None):
        from gearcache import CompilerConfig, cache_compile

        super().__init__(**sizes, block=lambda d, heads: TPBlock(d, heads, tp))
        config = CompilerConfig(mode=mode)
        config.inference_config.dim_gears = {"ids": {0: gears}, "kv": {2: gears}}      # batch, zipped
        if padding_check is not None:
            config.inference_config.padding_check = padding_check
        config.inference_config.warmup_workers = warmup_workers
        self.cached_prefill = cache_compile(self.prefill, config=config, cache_dir=cache_dir, tp_rank=rank)
        self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir, tp_rank=rank)

    def prefill(self, ids, kv, pos):        # ids [B, T], pos [T]
        return self.run(ids, kv, pos)

    def decode(self, ids, kv, pos):         # ids [B, 1], pos [1]
        return self.run(ids, kv, pos)

    @torch.no_grad()
    def load_shards(self, full: Decoder, rank: int, tp: int) -> None:
        for name in ("wte", "wpe", "ln_f", "head"):
            getattr(self, name).load_state_dict(getattr(full, name).state_dict())
        for mine, theirs in zip(self.blocks, full.blocks):
            mine.load_shard(theirs, rank, tp)


def build(sizes: dict, *, cache_dir: str | None, mode: str, gears: list[int], device: str, dtype: torch.dtype,
          padding_check: str | None = None, warmup_workers: int | None = None):
    """``(this rank's TPDecoder, the unsharded Decoder)`` on ``device``, both from one seeded model.
    ``padding_check``, ``warmup_workers``: the config's ``inference_config`` settings (None: their defaults)."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    if sizes["heads"] % tp:
        raise SystemExit(f"--nproc {tp}: the decoder's {sizes['heads']} heads must divide evenly over the ranks")
    torch.manual_seed(0)
    full = Decoder(**sizes).eval()
    model = TPDecoder(sizes, tp, rank, cache_dir=cache_dir, mode=mode, gears=gears,
                      padding_check=padding_check, warmup_workers=warmup_workers).eval()
    model.load_shards(full, rank, tp)
    return model.to(device, dtype), full.to(device, dtype)


def kv_cache(sizes: dict, batch: int, device: str, dtype: torch.dtype, *, sharded: bool = True) -> torch.Tensor:
    heads = sizes["heads"] // dist.get_world_size() if sharded else sizes["heads"]
    return torch.zeros(sizes["layers"], 2, batch, heads, sizes["tmax"], sizes["d"] // sizes["heads"], device=device,
                       dtype=dtype)


def shard_kv(kv: torch.Tensor) -> torch.Tensor:
    """This rank's heads of an unsharded KV cache."""
    n = kv.shape[3] // dist.get_world_size()
    return kv[:, :, :, dist.get_rank() * n:(dist.get_rank() + 1) * n].contiguous()


# ------------------------------------------------------------------------------------------------------- one start
def setup(device_kind: str) -> tuple[str, torch.dtype]:
    """Join the job's process group; returns (this rank's device, dtype)."""
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        return f"cuda:{torch.cuda.current_device()}", torch.bfloat16
    dist.init_process_group("gloo")
    return "cpu", torch.float32


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 0.15, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_start(args) -> dict:
    from gearcache import counters, release_graphs

    device, dtype = setup(args.device)
    sizes = SIZES["toy" if args.toy else "reference"]
    mode = "reduce-overhead" if device.startswith("cuda") else "default"
    model, full = build(sizes, cache_dir=args.cache_dir, mode=mode, gears=args.gears, device=device, dtype=dtype)
    tol = tolerance(dtype)
    b, t = args.batch, args.prompt_len
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, sizes["vocab"], (b, t), generator=g).to(device)
    full_kv = torch.randn(sizes["layers"], 2, b, sizes["heads"], sizes["tmax"], sizes["d"] // sizes["heads"],
                          generator=g).to(device, dtype)
    with torch.inference_mode():
        # The sharded eager model computes what the unsharded one does.
        want, _ = full.run(prompt, full_kv, torch.arange(t, device=device))
        got, _ = model.prefill(prompt, shard_kv(full_kv), torch.arange(t, device=device))
        sharding_ok = torch.allclose(got.float(), want.float(), **tol)
        kv = kv_cache(sizes, b, device, dtype)
        dist.barrier()
        t0 = time.perf_counter()
        logits, kv = model.cached_prefill(prompt, kv, torch.arange(t, device=device))
        sync(device)
        first_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.cached_prefill.warmup(prompt, kv_cache(sizes, b, device, dtype), torch.arange(t, device=device))
        ids = logits[:, -1:].argmax(-1)
        model.cached_decode.warmup(ids, kv, torch.tensor([t], device=device))
        sync(device)
        warmup_s = time.perf_counter() - t0
        compiles_before = counters.compiles + counters.traces
        equal, tokens = True, []
        for step in range(t, t + args.new_tokens):
            pos = torch.tensor([step], device=device)
            ref_logits, _ = model.decode(ids, kv, pos)
            logits, kv = model.cached_decode(ids, kv, pos)
            equal &= bool(torch.allclose(logits.float(), ref_logits.float(), **tol))
            ids = logits[:, -1:].argmax(-1)
            tokens.append(ids[:, 0].tolist())
        sync(device)
    report = {"rank": dist.get_rank(), "device": device, "sharded_equals_unsharded": bool(sharding_ok),
              "equal_eager": equal, "tokens": tokens, "first_prefill_s": first_prefill, "warmup_s": warmup_s,
              "compiles_after_warmup": counters.compiles + counters.traces - compiles_before,
              "counters": dict(vars(counters))}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    del model
    release_graphs()                # CUDA graphs that captured NCCL collectives keep NCCL busy at its teardown
    dist.barrier()
    dist.destroy_process_group()
    return {"ranks": reports}


# ------------------------------------------------------------------------------------------------------ the parent
def run_torchrun(args, label: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fresh_process import run_fresh

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--child", "--cache-dir", args.cache_dir, "--device", args.device,
           "--gears", ",".join(map(str, args.gears)), "--batch", str(args.batch),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)] + (["--toy"] if args.toy else [])
    r = run_fresh(cmd, label)
    ranks = r["ranks"]
    c = [x["counters"] for x in ranks]
    print(f"\n{label}, {args.nproc} ranks on {ranks[0]['device'].split(':')[0]}, fresh torchrun:\n"
          f"  first prefill call (max over ranks) {max(x['first_prefill_s'] for x in ranks):7.3f} s   "
          f"every gear ready {max(x['warmup_s'] for x in ranks):7.3f} s   whole job {r['process_s']:6.1f} s\n"
          f"  compiled {sum(x['compiles'] for x in c)} graphs over all ranks, loaded {sum(x['loads'] for x in c)}, "
          f"captured {sum(x['graph_captures'] for x in c)} CUDA graphs; every rank equals eager: "
          f"{all(x['equal_eager'] for x in ranks)}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (tensor-parallel degree)")
    ap.add_argument("--toy", action="store_true", help="toy sizes (hidden 64, 8 heads, 1 layer)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-dir", default=None, help="the store (default: a temporary one, removed afterwards)")
    ap.add_argument("--gears", type=lambda s: [int(g) for g in s.split(",")], default=GEARS)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--child", action="store_true", help="one start, under torchrun")
    args = ap.parse_args()
    if args.child:
        out = one_start(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(out))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fresh_process import cold_then_warm

    cold, warm = cold_then_warm(run_torchrun, args, "tp-decoder",
                                f"gearcache tensor-parallel decoder, {args.nproc} ranks")
    ok = all(x["equal_eager"] and x["sharded_equals_unsharded"] for r in (cold, warm) for x in r["ranks"])
    same_tokens = [x["tokens"] for x in cold["ranks"]] == [x["tokens"] for x in warm["ranks"]]
    summary = {"example": "tp_decoder", "ok": ok and same_tokens, "nproc": args.nproc, "toy": args.toy,
               "equal_eager": ok, "tokens_same_cold_and_warm": same_tokens}
    for name, r in (("cold", cold), ("warm", warm)):
        c = [x["counters"] for x in r["ranks"]]
        summary[name] = {"first_prefill_s_max": max(x["first_prefill_s"] for x in r["ranks"]),
                         "warmup_s_max": max(x["warmup_s"] for x in r["ranks"]),
                         "compiles": sum(x["compiles"] for x in c), "traces": sum(x["traces"] for x in c),
                         "loads": sum(x["loads"] for x in c), "direct_loads": sum(x["direct_loads"] for x in c),
                         "compiles_after_warmup": sum(x["compiles_after_warmup"] for x in r["ranks"])}
    print(json.dumps(summary))
    if not summary["ok"]:
        raise SystemExit("tp_decoder: outputs differ from eager")


if __name__ == "__main__":
    main()
