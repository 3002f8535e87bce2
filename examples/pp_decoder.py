"""gearcache on a decoder split into pipeline stages, each stage tensor-parallel: 2 stages x TP 2 on 4 ranks.

    python examples/pp_decoder.py --toy --device cpu           # CPU, gloo, tiny size: a cold and a warm start
    python examples/pp_decoder.py                              # 4 GPUs, NCCL, reference size, CUDA graphs per gear
    torchrun --standalone --nproc-per-node 4 examples/pp_decoder.py --child --toy --cache-dir DIR   # one start

The decoder of examples/tp_decoder.py (the reference decoder: hidden 1024, 16 heads, 8 layers, vocab 32000, bf16 on
GPU) cut into ``--pp`` pipeline stages of consecutive layers; rank ``g`` is stage ``g // tp``, tensor-parallel rank
``g % tp`` (``tp = world / pp``). Stage 0 holds the embeddings, the last stage the final norm and the LM head; each
stage's blocks are sharded Megatron-style over its TP group (``dist.new_group``), the all-reduces inside the cached
methods. Each stage caches its ``prefill`` and ``decode`` with ``cache_compile(..., tp_rank=t, pp_rank=p)`` in one
shared cache folder: entries per rank under ``entries/world4_rank{g}_tp{t}_pp{p}/``, artifacts shared by the ranks of
a stage. Batch gears 1, 2, 4, ... (``--gears``) on every stage's input and KV cache; on GPU ``mode="reduce-overhead"``.

Activations go from stage to stage with ``dist.send``/``dist.recv`` (each TP rank to the same TP rank of the next
stage); the last stage picks the next token (greedy) and sends it back to stage 0. A start warms up every gear of its
stage (compile or load, and capture; the fences of gearcache/ranks/phases.py pair only the ranks of a TP group), then
generates ``--new-tokens`` tokens, which are compared with the unsplit eager model's. The parent mode runs a cold and
a warm start, each a fresh ``torchrun`` with empty Inductor/Triton caches; the last line of output is a JSON summary.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_decoder import Decoder, TPBlock, setup, sync  # noqa: E402

SIZES = {"reference": {"d": 1024, "heads": 16, "layers": 8, "vocab": 32000, "tmax": 256},
         "toy": {"d": 32, "heads": 4, "layers": 2, "vocab": 64, "tmax": 16}}
GEARS = [1, 2, 4, 8, 16, 32, 64]


class Stage(nn.Module):
    """Layers ``layers`` of the decoder on one pipeline stage, sharded over its TP group; ``run`` takes token ids on
    the first stage and the previous stage's hidden states otherwise, and returns logits on the last stage and hidden
    states otherwise, with the stage's new KV cache ``[its layers, 2, B, heads / tp, tmax, head_dim]``."""

    def __init__(self, sizes: dict, layers: range, *, pp: int, stages: int, tp: int, tp_rank: int, group,
                 cache_dir: str | None, mode: str, gears: list[int], padding_check: str | None):
        from gearcache import CompilerConfig, cache_compile

        super().__init__()
        d, self.tmax, self.layers = sizes["d"], sizes["tmax"], layers
        self.first, self.last = pp == 0, pp == stages - 1
        if self.first:
            self.wte, self.wpe = nn.Embedding(sizes["vocab"], d), nn.Embedding(sizes["tmax"], d)
        self.blocks = nn.ModuleList(TPBlock(d, sizes["heads"], tp, group) for _ in layers)
        if self.last:
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, sizes["vocab"], bias=False)
        config = CompilerConfig(mode=mode)
        config.inference_config.dim_gears = {"x": {0: gears}, "kv": {2: gears}}      # batch, zipped
        if padding_check is not None:
            config.inference_config.padding_check = padding_check
        self.cached_prefill = cache_compile(self.prefill, config=config, cache_dir=cache_dir, tp_rank=tp_rank,
                                            pp_rank=pp)
        self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir, tp_rank=tp_rank,
                                           pp_rank=pp)

    def run(self, x, kv, pos):
        h = self.wte(x) + self.wpe(pos) if self.first else x
        mask = torch.arange(self.tmax, device=x.device)[None, :] <= pos[:, None]
        new = []
        for i, block in enumerate(self.blocks):
            h, layer_kv = block(h, kv[i], pos, mask)
            new.append(layer_kv)
        out = self.head(self.ln_f(h)) if self.last else h
        return out, torch.stack(new)

    def prefill(self, x, kv, pos):          # x: ids [B, T] (first stage) or hidden [B, T, d]; pos [T]
        return self.run(x, kv, pos)

    def decode(self, x, kv, pos):           # x: ids [B, 1] or hidden [B, 1, d]; pos [1]
        return self.run(x, kv, pos)

    @torch.no_grad()
    def load_shards(self, full: Decoder, tp_rank: int, tp: int) -> None:
        names = (["wte", "wpe"] if self.first else []) + (["ln_f", "head"] if self.last else [])
        for name in names:
            getattr(self, name).load_state_dict(getattr(full, name).state_dict())
        for mine, i in zip(self.blocks, self.layers):
            mine.load_shard(full.blocks[i], tp_rank, tp)


class Layout:
    """Where this rank sits: stage ``pp`` of ``stages``, TP rank ``tp_rank`` of ``tp``, its TP group, and its peers
    on the previous and next stage (same TP rank)."""

    def __init__(self, stages: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % stages:
            raise SystemExit(f"{world} ranks do not split into {stages} pipeline stages")
        self.stages, self.tp = stages, world // stages
        self.pp, self.tp_rank = divmod(rank, self.tp)
        groups = [dist.new_group(list(range(s * self.tp, (s + 1) * self.tp))) for s in range(stages)]   # every rank
        self.group = groups[self.pp]
        self.prev = rank - self.tp if self.pp > 0 else None
        self.next = rank + self.tp if self.pp < stages - 1 else None
        self.first_rank_of_last = (stages - 1) * self.tp + self.tp_rank     # who sends the tokens back


def build(sizes: dict, layout: Layout, *, cache_dir: str | None, mode: str, gears: list[int], device: str,
          dtype: torch.dtype, padding_check: str | None) -> tuple[Stage, Decoder]:
    """``(this rank's Stage, the unsharded Decoder)`` on ``device``, both from one seeded model."""
    if sizes["heads"] % layout.tp or sizes["layers"] % layout.stages:
        raise SystemExit(f"{sizes['heads']} heads / {sizes['layers']} layers do not split over TP {layout.tp} x PP "
                         f"{layout.stages}")
    torch.manual_seed(0)
    full = Decoder(**sizes).eval()
    per = sizes["layers"] // layout.stages
    stage = Stage(sizes, range(layout.pp * per, (layout.pp + 1) * per), pp=layout.pp, stages=layout.stages,
                  tp=layout.tp, tp_rank=layout.tp_rank, group=layout.group, cache_dir=cache_dir, mode=mode,
                  gears=gears, padding_check=padding_check).eval()
    stage.load_shards(full, layout.tp_rank, layout.tp)
    return stage.to(device, dtype), full.to(device, dtype)


def stage_kv(sizes: dict, layout: Layout, batch: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(sizes["layers"] // layout.stages, 2, batch, sizes["heads"] // layout.tp, sizes["tmax"],
                       sizes["d"] // sizes["heads"], device=device, dtype=dtype)


def step(stage: Stage, layout: Layout, method, x: torch.Tensor | None, kv, pos, hidden_shape: tuple) -> tuple:
    """One pipeline step on this rank: receive the previous stage's hidden states (unless first), run ``method``,
    send the result on (unless last); the last stage's greedy tokens come back to every stage. Returns ``(next ids
    [B, 1], new kv)``."""
    if layout.prev is not None:
        x = torch.empty(hidden_shape, dtype=stage.blocks[0].qkv.weight.dtype, device=kv.device)
        dist.recv(x, layout.prev)
    out, kv = method(x, kv, pos)
    if layout.next is not None:
        dist.send(out.contiguous(), layout.next)
    ids = torch.empty(hidden_shape[0], 1, dtype=torch.long, device=kv.device)
    if stage.last:
        ids = out[:, -1:].argmax(-1)
        for r in range(layout.stages - 1):      # to the same TP rank of every earlier stage
            dist.send(ids, r * layout.tp + layout.tp_rank)
    else:
        dist.recv(ids, layout.first_rank_of_last)
    return ids, kv


def generate(stage: Stage, layout: Layout, sizes: dict, prompt, n_new: int, cached: bool, dtype) -> list[list[int]]:
    """Greedy tokens of the split model (cached methods, or the stage's eager ones)."""
    b, t = prompt.shape
    device = prompt.device
    prefill, decode = (stage.cached_prefill, stage.cached_decode) if cached else (stage.prefill, stage.decode)
    kv = stage_kv(sizes, layout, b, device, dtype)
    ids, kv = step(stage, layout, prefill, prompt, kv, torch.arange(t, device=device), (b, t, sizes["d"]))
    tokens = [ids[:, 0].tolist()]
    for pos in range(t, t + n_new - 1):
        ids, kv = step(stage, layout, decode, ids, kv, torch.tensor([pos], device=device), (b, 1, sizes["d"]))
        tokens.append(ids[:, 0].tolist())
    return tokens


def eager_tokens(full: Decoder, sizes: dict, prompt, n_new: int, dtype) -> list[list[int]]:
    """Greedy tokens of the unsplit, unsharded eager model."""
    b, t = prompt.shape
    kv = torch.zeros(sizes["layers"], 2, b, sizes["heads"], sizes["tmax"], sizes["d"] // sizes["heads"],
                     device=prompt.device, dtype=dtype)
    logits, kv = full.run(prompt, kv, torch.arange(t, device=prompt.device))
    ids = logits[:, -1:].argmax(-1)
    tokens = [ids[:, 0].tolist()]
    for pos in range(t, t + n_new - 1):
        logits, kv = full.run(ids, kv, torch.tensor([pos], device=prompt.device))
        ids = logits[:, -1:].argmax(-1)
        tokens.append(ids[:, 0].tolist())
    return tokens


def _profiler():
    """cProfile running, when ``GEARCACHE_BENCH_PROFILE`` names a folder for each rank's stats of its start (else
    None)."""
    if not os.environ.get("GEARCACHE_BENCH_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def warm_start(stage: Stage, layout: Layout, sizes: dict, args, device: str, dtype) -> dict:
    """From a barrier: this stage's first decode call at B=1 (no pipeline traffic: the stage alone), then every gear
    of decode and prefill (loaded or compiled, and captured). Seconds of each, from the barrier."""
    big = max(args.gears)
    x_one = (torch.zeros(1, 1, dtype=torch.long, device=device) if stage.first else
             torch.zeros(1, 1, sizes["d"], device=device, dtype=dtype))
    x_big = x_one.expand(big, *x_one.shape[1:]).contiguous()
    x_prompt = (torch.zeros(big, args.prompt_len, dtype=torch.long, device=device) if stage.first else
                torch.zeros(big, args.prompt_len, sizes["d"], device=device, dtype=dtype))
    pos1, prompt_pos = torch.tensor([args.prompt_len], device=device), torch.arange(args.prompt_len, device=device)
    dist.barrier()
    sync(device)
    profile = _profiler()
    t0 = time.perf_counter()
    stage.cached_decode(x_one, stage_kv(sizes, layout, 1, device, dtype), pos1)
    sync(device)
    first = time.perf_counter() - t0
    stage.cached_decode.warmup(x_big, stage_kv(sizes, layout, big, device, dtype), pos1)
    sync(device)
    decode = time.perf_counter() - t0
    stage.cached_prefill.warmup(x_prompt, stage_kv(sizes, layout, big, device, dtype), prompt_pos)
    sync(device)
    if profile is not None:
        profile.disable()
        os.makedirs(os.environ["GEARCACHE_BENCH_PROFILE"], exist_ok=True)
        profile.dump_stats(os.path.join(os.environ["GEARCACHE_BENCH_PROFILE"], f"rank{dist.get_rank()}.prof"))
    return {"first_call_s": first, "decode_all_gears_s": decode, "all_gears_s": time.perf_counter() - t0,
            "timelines": {"decode": stage.cached_decode.warmup_timeline.summary(),
                          "prefill": stage.cached_prefill.warmup_timeline.summary()}}


def eager_start(stage: Stage, layout: Layout, sizes: dict, args, device: str) -> dict:
    """The floor under a warm start: from a barrier, in a fresh job that has run nothing, the same calls as
    :func:`warm_start` made by the stage's eager methods (its first decode call at B=1, then decode and prefill at
    every gear once): the first uses of the device's libraries and kernels that any process pays. Seconds from the
    barrier."""
    dtype = stage.blocks[0].qkv.weight.dtype
    x_one = (torch.zeros(1, 1, dtype=torch.long, device=device) if stage.first else
             torch.zeros(1, 1, sizes["d"], device=device, dtype=dtype))
    pos1, prompt_pos = torch.tensor([args.prompt_len], device=device), torch.arange(args.prompt_len, device=device)
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    stage.decode(x_one, stage_kv(sizes, layout, 1, device, dtype), pos1)
    sync(device)
    first = time.perf_counter() - t0
    for g in args.gears:
        stage.decode(x_one.expand(g, *x_one.shape[1:]).contiguous(), stage_kv(sizes, layout, g, device, dtype), pos1)
    for g in args.gears:
        x = (torch.zeros(g, args.prompt_len, dtype=torch.long, device=device) if stage.first else
             torch.zeros(g, args.prompt_len, sizes["d"], device=device, dtype=dtype))
        stage.prefill(x, stage_kv(sizes, layout, g, device, dtype), prompt_pos)
    sync(device)
    return {"eager_first_call_s": first, "eager_all_gears_s": time.perf_counter() - t0}


def one_start(args) -> dict:
    from gearcache import counters, release_graphs

    device, dtype = setup(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else dtype
    layout = Layout(args.pp)
    sizes = SIZES["toy" if args.toy else "reference"]
    mode = "reduce-overhead" if device.startswith("cuda") else "default"
    stage, full = build(sizes, layout, cache_dir=args.cache_dir, mode=mode, gears=args.gears, device=device,
                        dtype=dtype, padding_check=args.padding_check)
    if args.eager_start:
        with torch.inference_mode():
            report = {"rank": dist.get_rank(), "pp": layout.pp, "tp": layout.tp_rank, "device": device,
                      **eager_start(stage, layout, sizes, args, device)}
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        dist.barrier()
        dist.destroy_process_group()
        return {"ranks": reports}
    prompt = torch.randint(0, sizes["vocab"], (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        timing = warm_start(stage, layout, sizes, args, device, dtype)
        before = counters.compiles + counters.traces
        tokens = generate(stage, layout, sizes, prompt, args.new_tokens, cached=True, dtype=dtype)
        compiles_in_generate = counters.compiles + counters.traces - before
        want = eager_tokens(full, sizes, prompt, args.new_tokens, dtype)
        split_eager = generate(stage, layout, sizes, prompt, args.new_tokens, cached=False, dtype=dtype)
    report = {"rank": dist.get_rank(), "pp": layout.pp, "tp": layout.tp_rank, "device": device, **timing,
              "tokens": tokens, "tokens_equal_eager": tokens == want, "split_eager_equals_unsplit": split_eager == want,
              "tokens_equal_split_eager": tokens == split_eager,
              "compiles_in_generate": compiles_in_generate, "topology": stage.cached_decode.topology.folder,
              "compiler_imported": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
              "counters": dict(vars(counters))}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    del stage
    release_graphs()                # CUDA graphs that captured NCCL collectives keep NCCL busy at its teardown
    dist.barrier()
    dist.destroy_process_group()
    return {"ranks": reports}


# ------------------------------------------------------------------------------------------------------ the parent
def run_torchrun(args, label: str) -> dict:
    from fresh_process import run_fresh

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--child", *child_flags(args)]
    r = run_fresh(cmd, label)
    ranks = r["ranks"]
    print(f"\n{label}, {args.nproc} ranks (PP {args.pp} x TP {args.nproc // args.pp}) on "
          f"{ranks[0]['device'].split(':')[0]}, fresh torchrun: first call (max over ranks) "
          f"{max(x['first_call_s'] for x in ranks):.3f} s, every gear ready {max(x['all_gears_s'] for x in ranks):.3f}"
          f" s, {sum(x['counters']['compiles'] for x in ranks)} compiles; tokens equal the unsplit eager model on "
          f"every rank: {all(x['tokens_equal_eager'] for x in ranks)}")
    return r


def child_flags(args) -> list[str]:
    flags = ["--cache-dir", args.cache_dir, "--device", args.device, "--pp", str(args.pp),
             "--gears", ",".join(map(str, args.gears)), "--batch", str(args.batch), "--prompt-len",
             str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    flags += ["--toy"] if args.toy else []
    flags += ["--padding-check", args.padding_check] if args.padding_check else []
    flags += ["--dtype", args.dtype] if args.dtype else []
    return flags


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="ranks: pipeline stages x tensor-parallel degree")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--toy", action="store_true", help="tiny sizes (hidden 32, 4 heads, 2 layers)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-dir", default=None, help="the store (default: a temporary one, removed afterwards)")
    ap.add_argument("--gears", type=lambda s: [int(g) for g in s.split(",")], default=GEARS)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--padding-check", choices=["verify", "refuse", "off"], default="off",
                    help="inference_config.padding_check (default off: the batch rows of this decoder never meet, "
                         "and the tokens are checked against eager)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="the model's dtype (default: bf16 on GPU, fp32 on CPU; in bf16 the sharded sums round "
                         "differently from the unsplit model's, which can flip a near-tied greedy token)")
    ap.add_argument("--child", action="store_true", help="one start, under torchrun")
    ap.add_argument("--eager-start", action="store_true",
                    help="with --child: time the stage's eager methods' first calls instead (the floor of a start)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        out = one_start(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(out))
        return
    from fresh_process import cold_then_warm

    cold, warm = cold_then_warm(run_torchrun, args, "pp-decoder",
                                f"gearcache pipeline-parallel decoder, PP {args.pp} x TP {args.nproc // args.pp}")
    ok = all(x["tokens_equal_eager"] and x["split_eager_equals_unsplit"] for r in (cold, warm) for x in r["ranks"])
    summary = {"example": "pp_decoder", "ok": ok, "nproc": args.nproc, "pp": args.pp, "toy": args.toy,
               "tokens_equal_eager": ok}
    for name, r in (("cold", cold), ("warm", warm)):
        c = [x["counters"] for x in r["ranks"]]
        summary[name] = {"first_call_s_max": max(x["first_call_s"] for x in r["ranks"]),
                         "all_gears_s_max": max(x["all_gears_s"] for x in r["ranks"]),
                         "compiles": sum(x["compiles"] for x in c), "traces": sum(x["traces"] for x in c),
                         "loads": sum(x["loads"] for x in c), "direct_loads": sum(x["direct_loads"] for x in c)}
    print(json.dumps(summary))
    if not ok:
        raise SystemExit("pp_decoder: tokens differ from the unsplit eager model")


if __name__ == "__main__":
    main()
