"""Tensor-parallel decoder benchmark on N GPUs: cold start, warm start of all ranks, decode step, batch sweep.

    python benchmarks/tp_decoder.py --nproc 4                 # both phases below; prints a JSON summary last

Each phase is one fresh ``torchrun`` job with empty Inductor and Triton caches of its own (the parent runs them as)::

    torchrun --standalone --nproc-per-node 4 benchmarks/tp_decoder.py --phase cold --cache-dir DIR
    torchrun --standalone --nproc-per-node 4 benchmarks/tp_decoder.py --phase warm --cache-dir DIR

The model is examples/tp_decoder.py's: the reference decoder (hidden 1024, 16 heads, 8 layers, bf16) sharded
Megatron-style over the ranks, all-reduces inside the cached ``prefill`` and ``decode``, batch gears 1, 2, 4, ... 64,
``mode="reduce-overhead"`` (one CUDA graph per gear, NCCL's all-reduce captured inside).

- cold: every gear of decode and prefill (prompt length ``--prompt-len``) compiled and captured; wall and compiles.
- warm: first decode call at B=1 (max over ranks, from the barrier to the output on the host); then every gear of
  both methods loaded and captured (time from the same barrier); whether torch's compiler got imported; then the batch
  sweep 1..64 of decode against the sharded eager model on every rank (bf16 tolerance) with the compiles and traces
  it caused (0 expected); then the decode step at B=1, gearcache's CUDA graphs against ``torch.compile(mode=
  "reduce-overhead")`` of the same sharded method and eager, same job: per step = median over 10 repeats of (CUDA-event
  time of 20 back-to-back steps) / 20, the max over ranks reported.

``--device cpu --toy`` runs the same on gloo at toy size (no CUDA graphs; a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _timing import step_us

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "tp_decoder.py")
GEARS = [1, 2, 4, 8, 16, 32, 64]
TARGETS = {"warm_first_call_s": 0.3, "warm_all_gears_s": 1.0}


def _example():
    spec = importlib.util.spec_from_file_location("tp_decoder_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_inputs(ex, sizes, batch: int, device: str, dtype):
    """``(ids [B, 1], this rank's kv, pos [1])``, the same on every run for a given batch and rank."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * batch + dist.get_rank())
    ids = torch.randint(0, sizes["vocab"], (batch, 1), generator=g).to(device)
    kv = ex.kv_cache(sizes, batch, "cpu", torch.float32)
    kv.normal_(generator=g)
    return ids, kv.to(device, dtype), torch.tensor([17], device=device)


def prefill_inputs(ex, sizes, batch: int, t: int, device: str, dtype):
    import torch

    ids = torch.randint(0, sizes["vocab"], (batch, t), generator=torch.Generator().manual_seed(batch)).to(device)
    return ids, ex.kv_cache(sizes, batch, device, dtype), torch.arange(t, device=device)


def phase(args) -> dict:
    import torch
    import torch.distributed as dist

    ex = _example()
    from gearcache import counters

    device, dtype = ex.setup(args.device)
    sizes = ex.SIZES["toy" if args.toy else "reference"]
    mode = "reduce-overhead" if device.startswith("cuda") else "default"
    model, _ = ex.build(sizes, cache_dir=args.cache_dir, mode=mode, gears=args.gears, device=device, dtype=dtype,
                        padding_check=args.padding_check, warmup_workers=args.warmup_workers)
    big = max(args.gears)
    out: dict = {"rank": dist.get_rank(), "device": device,
                 "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    with torch.inference_mode():
        one = decode_inputs(ex, sizes, 1, device, dtype)
        largest = decode_inputs(ex, sizes, big, device, dtype)             # made before the clock starts
        prompts = prefill_inputs(ex, sizes, big, args.prompt_len, device, dtype)
        dist.barrier()
        ex.sync(device)
        t0 = time.perf_counter()
        model.cached_decode(*one)
        ex.sync(device)
        out["first_call_s"] = time.perf_counter() - t0
        _progress(f"{args.phase}: first call {out['first_call_s']:.3f} s")
        model.cached_decode.warmup(*largest)
        ex.sync(device)
        out["decode_all_gears_s"] = time.perf_counter() - t0
        _progress(f"{args.phase}: decode gears {out['decode_all_gears_s']:.2f} s")
        model.cached_prefill.warmup(*prompts)
        ex.sync(device)
        out["all_gears_s"] = time.perf_counter() - t0
        _progress(f"{args.phase}: all gears {out['all_gears_s']:.2f} s")
        out["compiler_imported"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
        out["counters_after_warmup"] = dict(vars(counters))
        del largest, prompts
        if args.phase == "warm":
            out.update(sweep(ex, model, sizes, device, dtype, args))
            _progress(f"sweep: failures {out['sweep_failures']}, compiles {out['sweep_compiles']}")
            out["step_us_b1"] = steps(model, one, device)
            _progress(f"decode step B=1 (us): {out['step_us_b1']}")
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, out)
    del model, one                      # the entries, their CUDA graphs (with captured collectives) go first
    ended = _destroy_process_group(device)
    _progress(f"{args.phase}: destroy_process_group {'returned' if ended else 'did not return in 30 s'}")
    return {"phase": args.phase, "ranks": reports, "destroy_process_group_returned": ended}


def _destroy_process_group(device: str) -> bool:
    """``dist.destroy_process_group()`` with the models released first, bounded to 30 s: on 2 H200s (torch 2.11) it
    once waited forever after collectives had been captured in CUDA graphs. False if it did not return (the caller
    then leaves with ``os._exit``)."""
    import gc
    import threading

    import torch
    import torch.distributed as dist

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(30)
    return not worker.is_alive()


def _progress(line: str) -> None:
    """One line on stderr per finished step of a phase (the parent passes stderr through: a long run shows where it
    is)."""
    print(f"[rank {os.environ.get('RANK', 0)}] {line}", file=sys.stderr, flush=True)


def sweep(ex, model, sizes, device: str, dtype, args) -> dict:
    """Decode at every batch 1..sweep_max against the sharded eager model; the compiles and traces it caused."""
    import torch

    from gearcache import counters

    before = counters.compiles + counters.traces
    failures, worst = [], 0.0
    tol = ex.tolerance(dtype)
    for b in range(1, args.sweep_max + 1):
        x, kv, pos = decode_inputs(ex, sizes, b, device, dtype)
        logits, new_kv = model.cached_decode(x, kv, pos)
        want, want_kv = model.decode(x, kv, pos)
        worst = max(worst, (logits.float() - want.float()).abs().max().item())
        if logits.shape != want.shape or not torch.allclose(logits.float(), want.float(), **tol) or \
                not torch.allclose(new_kv.float(), want_kv.float(), **tol):
            failures.append(b)
    return {"sweep_batches": args.sweep_max, "sweep_failures": failures, "sweep_max_abs_diff": worst,
            "sweep_compiles": counters.compiles + counters.traces - before}


def steps(model, inputs, device: str) -> dict:
    """Decode step at B=1: gearcache (CUDA graphs on GPU), torch.compile reduce-overhead, eager (µs)."""
    import torch
    import torch.distributed as dist

    rows = {}
    dist.barrier()
    rows["gearcache"] = step_us(model.cached_decode, inputs, device)
    dist.barrier()
    rows["eager"] = step_us(model.decode, inputs, device)
    fn = torch.compile(model.decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
    dist.barrier()
    t0 = time.perf_counter()
    fn(*inputs)
    rows["torch_compile_first_call_s"] = time.perf_counter() - t0
    dist.barrier()
    rows["torch.compile reduce-overhead"] = step_us(fn, inputs, device)
    return rows


# ------------------------------------------------------------------------------------------------------ the parent
def run_phase(args, name: str) -> dict:
    caches = tempfile.mkdtemp(prefix=f"gearcache-tp-{name}-torch-caches-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--phase", name, "--cache-dir", args.cache_dir, "--device", args.device,
           "--gears", ",".join(map(str, args.gears)), "--prompt-len", str(args.prompt_len),
           "--sweep-max", str(args.sweep_max)] + (["--toy"] if args.toy else []) + \
        (["--padding-check", args.padding_check] if args.padding_check else []) + \
        (["--warmup-workers", str(args.warmup_workers)] if args.warmup_workers else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)      # stderr: the ranks' progress
    wall = time.perf_counter() - t0
    shutil.rmtree(caches, ignore_errors=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"phase {name}: torchrun exited {proc.returncode}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["job_wall_s"] = wall
    return report


def summarize(args, cold: dict, warm: dict) -> dict:
    def mx(r, k):
        return max(x[k] for x in r["ranks"])

    def total(r, k):
        return sum(x["counters_after_warmup"][k] for x in r["ranks"])

    w = warm["ranks"]
    step = {k: max(x["step_us_b1"][k] for x in w) for k in w[0]["step_us_b1"]}
    import torch

    summary = {
        "benchmark": "tp_decoder", "nproc": args.nproc, "device": w[0]["device_name"], "torch": torch.__version__,
        "toy": args.toy, "gears": args.gears, "prompt_len": args.prompt_len,
        "cold": {"job_wall_s": cold["job_wall_s"], "first_call_s_max": mx(cold, "first_call_s"),
                 "all_gears_s_max": mx(cold, "all_gears_s"), "compiles": total(cold, "compiles"),
                 "traces": total(cold, "traces"), "direct_loads": total(cold, "direct_loads")},
        "warm": {"job_wall_s": warm["job_wall_s"], "first_call_s_max": mx(warm, "first_call_s"),
                 "decode_all_gears_s_max": mx(warm, "decode_all_gears_s"), "all_gears_s_max": mx(warm, "all_gears_s"),
                 "compiles": total(warm, "compiles"), "traces": total(warm, "traces"), "loads": total(warm, "loads"),
                 "direct_loads": total(warm, "direct_loads"), "graph_captures": total(warm, "graph_captures"),
                 "compiler_imported": sorted({m for x in w for m in x["compiler_imported"]})},
        "decode_step_b1_us_max_over_ranks": step,
        "sweep": {"batches": f"1..{args.sweep_max}", "failures_by_rank": [x["sweep_failures"] for x in w],
                  "max_abs_diff": max(x["sweep_max_abs_diff"] for x in w),
                  "compiles_and_traces": sum(x["sweep_compiles"] for x in w)},
        "destroy_process_group_returned": {"cold": cold["destroy_process_group_returned"],
                                           "warm": warm["destroy_process_group_returned"]},
    }
    summary["targets"] = {
        "warm first call <= 0.3 s": summary["warm"]["first_call_s_max"] <= TARGETS["warm_first_call_s"],
        "every gear loaded and captured <= 1.0 s": summary["warm"]["all_gears_s_max"] <= TARGETS["warm_all_gears_s"],
        "decode B=1 <= torch.compile reduce-overhead":
            step["gearcache"] <= step["torch.compile reduce-overhead"],
        "sweep equal to eager on every rank": not any(x["sweep_failures"] for x in w),
        "0 compiles in the sweep": summary["sweep"]["compiles_and_traces"] == 0,
        "warm start imports no compiler": not summary["warm"]["compiler_imported"],
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--phase", choices=["cold", "warm"], default=None, help="one phase, under torchrun")
    ap.add_argument("--cache-dir", default=None, help="the store (default: a temporary one, removed afterwards)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--toy", action="store_true", help="toy sizes (hidden 64, 4 heads, 1 layer)")
    ap.add_argument("--gears", type=lambda s: [int(g) for g in s.split(",")], default=GEARS)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--sweep-max", type=int, default=64)
    ap.add_argument("--padding-check", choices=["verify", "refuse", "off"], default=None,
                    help="inference_config.padding_check (default: the config's)")
    ap.add_argument("--warmup-workers", type=int, default=None,
                    help="inference_config.warmup_workers (default: the config's, half the cores per rank)")
    args = ap.parse_args()
    if args.phase:
        report = phase(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(report), flush=True)
        if not report["destroy_process_group_returned"]:
            sys.stderr.flush()
            os._exit(0)                 # the hung teardown thread would hold the interpreter's exit
        return
    temp = None
    if args.cache_dir is None:
        temp = args.cache_dir = tempfile.mkdtemp(prefix="gearcache-tp-bench-")
    try:
        cold = run_phase(args, "cold")
        warm = run_phase(args, "warm")
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    s = summarize(args, cold, warm)
    st = s["decode_step_b1_us_max_over_ranks"]
    print(f"TP={args.nproc} decoder, {s['device']}, torch {s['torch']}")
    print(f"cold: job {s['cold']['job_wall_s']:.1f} s, every gear compiled+captured in "
          f"{s['cold']['all_gears_s_max']:.1f} s, {s['cold']['compiles']} compiles over all ranks")
    print(f"warm: first call {s['warm']['first_call_s_max']:.3f} s (max over ranks), every gear loaded+captured "
          f"{s['warm']['all_gears_s_max']:.3f} s (decode's {s['warm']['decode_all_gears_s_max']:.3f} s), "
          f"{s['warm']['compiles']} compiles, {s['warm']['direct_loads']}/{s['warm']['loads']} loads by run plan")
    print(f"decode B=1 (us, max over ranks): gearcache {st['gearcache']:.0f}, torch.compile reduce-overhead "
          f"{st['torch.compile reduce-overhead']:.0f}, eager {st['eager']:.0f}")
    print(f"sweep {s['sweep']['batches']}: failures {s['sweep']['failures_by_rank']}, max abs diff "
          f"{s['sweep']['max_abs_diff']:.4f}, compiles+traces {s['sweep']['compiles_and_traces']}")
    for name, ok in s["targets"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(json.dumps(s))


if __name__ == "__main__":
    main()
