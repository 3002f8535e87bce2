"""Tensor-parallel decoder benchmark on N GPUs: cold start, warm start of all ranks, decode step, batch sweep.

    python benchmarks/tp_decoder.py --nproc 4                 # both phases below; prints a JSON summary last

Each phase is one fresh ``torchrun`` job with empty Inductor and Triton caches of its own (the parent runs them as)::

    torchrun --standalone --nproc-per-node 4 benchmarks/tp_decoder.py --phase cold --cache-dir DIR
    torchrun --standalone --nproc-per-node 4 benchmarks/tp_decoder.py --phase warm --cache-dir DIR

The model is examples/tp_decoder.py's: the reference decoder (hidden 1024, 16 heads, 8 layers, bf16) sharded
Megatron-style over the ranks, all-reduces inside the cached ``prefill`` and ``decode``, batch gears 1, 2, 4, ... 64,
``mode="reduce-overhead"`` (one CUDA graph per gear, NCCL's all-reduce captured inside).

- cold: every gear of decode and prefill (prompt length ``--prompt-len``) compiled and captured; wall and compiles
  (over all ranks, against the distinct graphs: the artifacts in the store afterwards).
- warm: first decode call at B=1 (per rank, from the barrier to the output on the host); then every gear of both
  methods loaded and captured (time from the same barrier); whether torch's compiler got imported; then the batch
  sweep 1..64 of decode against the sharded eager model on every rank (bf16 tolerance) with the compiles and traces
  it caused (0 expected); then the decode step at B=1 in the same job, same graphs: gearcache's CUDA graphs with
  copied outputs (the default) and with reduce-overhead's output contract (``graph_outputs="view-checked"``),
  against ``torch.compile(mode="reduce-overhead")`` of the same sharded method, in ``--step-rounds`` alternating
  rounds (per step = median over 10 repeats of (CUDA-event time of 20 back-to-back steps) / 20; the median round per
  rank, the max over ranks), and eager.
- eager: the floor under the warm start, a third fresh job: the same first calls (B=1, then every gear of decode
  and prefill) made by the sharded model's eager methods: the first uses of cuBLAS, cuDNN's per-shape attention plans
  and every kernel, which any process pays.
- teardown of the jobs: every CUDA graph released (``gearcache.release_graphs()``, ``torch._dynamo.reset()``), a
  barrier, then ``destroy_process_group`` bounded to 30 s, per rank (``--teardown gearcache|none``: less released,
  to see what held NCCL: the warm job's torch.compile comparison, or gearcache's graphs).

Every target of issue #38 is printed per rank and as PASS/FAIL. ``--out-dir`` keeps each rank's report of each
phase, ``summary.json`` and, for a rank still in a phase after ``--stack-dump-s`` seconds (a hang), its threads'
stacks (``stacks-<phase>-rank<r>.txt``); a rank waiting at warm-up's fence for longer than ``--rank-timeout-s``
raises an error naming the ranks it waited for and what they report (gearcache/ranks/phases.py).

``--device cpu --toy`` runs the same on gloo at toy size (no CUDA graphs; a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
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
    device, dtype = ex.setup(args.device)
    _dump_stacks_after(args)
    if args.no_cudnn_attention:     # the SDPA backends are a key factor: entries of their own
        torch.backends.cuda.enable_cudnn_sdp(False)
    sizes = ex.SIZES["toy" if args.toy else "reference"]
    mode = "reduce-overhead" if device.startswith("cuda") else "default"
    model, _ = ex.build(sizes, cache_dir=args.cache_dir, mode=mode, gears=args.gears, device=device, dtype=dtype,
                        padding_check=args.padding_check, warmup_workers=args.warmup_workers)
    for cached in (model.cached_decode, model.cached_prefill):
        cached.config.rank_timeout_s = args.rank_timeout_s
    out: dict = {"rank": dist.get_rank(), "device": device,
                 "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    with torch.inference_mode():
        one = decode_inputs(ex, sizes, 1, device, dtype)
        out.update((eager_start if args.phase == "eager" else start)(ex, model, sizes, device, dtype, one, args))
        if args.phase == "warm" and not os.environ.get("GEARCACHE_BENCH_START_ONLY"):
            out.update(sweep(ex, model, sizes, device, dtype, args))
            _progress(f"sweep: failures {out['sweep_failures']}, compiles {out['sweep_compiles']}")
            out["step_us_b1"] = steps(model, one, device, args)
            _progress(f"decode step B=1 (us): {out['step_us_b1']}")
    del model, one                      # the entries, their CUDA graphs (with captured collectives) go first
    out["teardown"] = _teardown(device, args.teardown)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, out)
    ended, seconds = _destroy_process_group()
    if not ended:
        _native_stacks(args)
    _progress(f"{args.phase}: destroy_process_group " + (f"returned in {seconds:.2f} s" if ended else
                                                         "did not return in 30 s"))
    _no_hang()
    mine = {**out, "destroy_process_group_returned": ended, "destroy_process_group_s": seconds}
    _write(args, f"{args.phase}-rank{out['rank']}.json", json.dumps(mine))
    return {"phase": args.phase, "ranks": reports, "destroy_process_group_returned": ended}


def eager_start(ex, model, sizes, device: str, dtype, one, args) -> dict:
    """The floor under a warm start (phase ``eager``, a fresh job that has run nothing): from a barrier, the same calls
    as :func:`start` made by the model's eager methods: the first decode call at B=1, then decode and prefill at every
    gear once (the first uses of cuBLAS, cuDNN's per-shape attention plans and every kernel, which any process pays)."""
    import torch.distributed as dist

    from gearcache import counters

    inputs = [decode_inputs(ex, sizes, g, device, dtype) for g in args.gears]
    prompts = [prefill_inputs(ex, sizes, g, args.prompt_len, device, dtype) for g in args.gears]
    dist.barrier()
    ex.sync(device)
    t0 = time.perf_counter()
    model.decode(*one)
    ex.sync(device)
    out = {"first_call_s": time.perf_counter() - t0}
    for args_g in inputs:
        model.decode(*args_g)
    ex.sync(device)
    out["decode_all_gears_s"] = time.perf_counter() - t0
    for args_g in prompts:
        model.prefill(*args_g)
    ex.sync(device)
    out["all_gears_s"] = time.perf_counter() - t0
    _progress(f"eager: first call {out['first_call_s']:.3f} s, every gear {out['all_gears_s']:.2f} s")
    out["counters_after_warmup"] = dict(vars(counters))
    return out


def start(ex, model, sizes, device: str, dtype, one, args) -> dict:
    """One start's clock: from a barrier, the first decode call at B=1, then every gear of decode, then of prefill
    (loaded or compiled, and captured); the counters and compiler imports after it."""
    import torch.distributed as dist

    from gearcache import counters

    big = max(args.gears)
    largest = decode_inputs(ex, sizes, big, device, dtype)             # made before the clock starts
    prompts = prefill_inputs(ex, sizes, big, args.prompt_len, device, dtype)
    out: dict = {}
    dist.barrier()
    ex.sync(device)
    threads_profile = _threads_profiled(f"rank{dist.get_rank()}")
    t0 = time.perf_counter()
    model.cached_decode(*one)
    ex.sync(device)
    out["first_call_s"] = time.perf_counter() - t0
    _progress(f"{args.phase}: first call {out['first_call_s']:.3f} s")
    with _profiled(f"decode-warmup-rank{dist.get_rank()}"):
        model.cached_decode.warmup(*largest)
        ex.sync(device)
    out["decode_all_gears_s"] = time.perf_counter() - t0
    _progress(f"{args.phase}: decode gears {out['decode_all_gears_s']:.2f} s")
    model.cached_prefill.warmup(*prompts)
    ex.sync(device)
    out["all_gears_s"] = time.perf_counter() - t0
    _progress(f"{args.phase}: all gears {out['all_gears_s']:.2f} s")
    threads_profile()
    out["timelines"] = {"decode": model.cached_decode.warmup_timeline.summary(),
                        "prefill": model.cached_prefill.warmup_timeline.summary()}
    out["compiler_imported"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    out["counters_after_warmup"] = dict(vars(counters))
    return out


def _threads_profiled(name: str):
    """Every thread's profile (yappi, wall and CPU clocks) from now until the returned function is called, when
    ``GEARCACHE_BENCH_THREADS`` names a folder: ``<name>-wall.txt`` / ``<name>-cpu.txt`` there list each thread's
    functions by inclusive time (else nothing is recorded). Wall against CPU time per thread tells waiting from work."""
    folder = os.environ.get("GEARCACHE_BENCH_THREADS")
    if not folder:
        return lambda: None
    import io

    import yappi

    yappi.set_clock_type(os.environ.get("GEARCACHE_BENCH_THREADS_CLOCK", "wall"))
    yappi.start(builtins=True, profile_threads=True)

    def stop() -> None:
        yappi.stop()
        os.makedirs(folder, exist_ok=True)
        clock = yappi.get_clock_type()
        with open(os.path.join(folder, f"{name}-{clock}.txt"), "w") as f:
            threads = yappi.get_thread_stats()
            buf = io.StringIO()
            threads.print_all(out=buf)
            f.write(buf.getvalue())
            for t in threads:
                stats = yappi.get_func_stats(filter_callback=lambda s, i=t.id: s.ctx_id == i).sort("ttot", "desc")
                f.write(f"\n===== thread {t.name} id {t.id} ttot {t.ttot:.3f} s\n")
                for st in list(stats)[:45]:
                    f.write(f"{st.ttot:8.3f} {st.tsub:8.3f} {st.ncall:6d}  {st.module}:{st.lineno} {st.name}\n")
        yappi.clear_stats()
    return stop


def _profiled(name: str):
    """``torch.profiler`` around a block when ``GEARCACHE_BENCH_PROFILE`` names a folder: its table of ops by CPU
    time and the Chrome trace go there as ``<name>.txt`` / ``<name>.json`` (else nothing is recorded)."""
    import contextlib

    folder = os.environ.get("GEARCACHE_BENCH_PROFILE")
    if not folder:
        return contextlib.nullcontext()
    import torch

    @contextlib.contextmanager
    def run():
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            yield
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name + ".txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60))
        prof.export_chrome_trace(os.path.join(folder, name + ".json"))
    return run()


def _teardown(device: str, how: str) -> dict:
    """What gearcache and torch.compile hold before ``destroy_process_group``, released as ``how`` says: ``"full"``
    drops torch.compile's CUDA-graph trees (``torch._dynamo.reset()``: the reduce-overhead comparison captured the
    same collectives) and every gearcache graph (``gearcache.release_graphs()``); ``"gearcache"`` only the latter;
    ``"none"`` neither (the teardown before issue #38). Then a barrier, so no rank tears its communicator down while
    a peer still uses it. Returns what was dropped and how long each step took."""
    import gc

    import torch
    import torch.distributed as dist

    import gearcache

    out: dict = {"how": how}
    t0 = time.perf_counter()
    if how == "full" and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    if how != "none":
        out["graphs_dropped"] = gearcache.release_graphs()
    elif device.startswith("cuda"):
        torch.cuda.synchronize()
    out["release_s"] = time.perf_counter() - t0
    gc.collect()
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)] if device.startswith("cuda") else []
    out["cuda_graph_objects_alive"] = len(graphs)       # Python objects still referenced (destroyed or not)
    t0 = time.perf_counter()
    dist.barrier()
    out["barrier_s"] = time.perf_counter() - t0
    return out


def _native_stacks(args) -> None:
    """``py-spy dump --native`` of this process into ``<out-dir>/native-<phase>-rank<r>.txt`` (when py-spy is on the
    PATH and may trace its parent): where a hung ``destroy_process_group`` waits."""
    import ctypes
    import shutil
    import subprocess

    spy = shutil.which("py-spy")
    if not spy or not args.out_dir:
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER_ANY
    path = os.path.join(args.out_dir, f"native-{args.phase}-rank{os.environ.get('RANK', 0)}.txt")
    with open(path, "w") as f:
        subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], stdout=f, stderr=subprocess.STDOUT,
                       timeout=60, check=False)


def _destroy_process_group() -> tuple[bool, float]:
    """``dist.destroy_process_group()`` bounded to 30 s: on 2 GPUs (torch 2.11) it once waited forever after
    collectives had been captured in CUDA graphs (``_teardown`` releases them first). ``(returned, seconds)``; the
    caller leaves with ``os._exit`` when it did not return."""
    import threading

    import torch.distributed as dist

    t0 = time.perf_counter()
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(30)
    return not worker.is_alive(), time.perf_counter() - t0


def _dump_stacks_after(args) -> None:
    """If this rank is still running after ``--stack-dump-s`` seconds (a hang), write every thread's Python stack
    to ``<out-dir>/stacks-<phase>-rank<r>.txt``, and again every that many seconds (faulthandler; no debugger)."""
    if not args.out_dir or not args.stack_dump_s:
        return
    import faulthandler

    path = os.path.join(args.out_dir, f"stacks-{args.phase}-rank{os.environ.get('RANK', 0)}.txt")
    _dump_stacks_after.file = open(path, "w")       # kept open for the life of the process
    faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True, file=_dump_stacks_after.file)


def _no_hang() -> None:
    """The phase ended: no stacks to dump (the file stays only where they were written)."""
    f = getattr(_dump_stacks_after, "file", None)
    if f is None:
        return
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    f.close()
    if os.path.getsize(f.name) == 0:
        os.remove(f.name)


def _write(args, name: str, text: str) -> None:
    if args.out_dir:
        with open(os.path.join(args.out_dir, name), "w") as f:
            f.write(text)


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


def steps(model, inputs, device: str, args) -> dict:
    """Decode step at B=1 (µs), same job, same graphs: gearcache with copied outputs (the default), gearcache with
    reduce-overhead's output contract (``graph_outputs="view-checked"``: views into the graph's outputs, no copy),
    ``torch.compile(mode="reduce-overhead")`` of the same sharded method, and eager. The three graph variants are
    measured in ``--step-rounds`` alternating rounds (the median of each is reported, and every round's value)."""
    import statistics

    import torch
    import torch.distributed as dist

    from gearcache import cache_compile

    views_config = model.cached_decode.config.model_copy(deep=True)
    views_config.inference_config.graph_outputs = "view-checked"
    views = cache_compile(model.decode, config=views_config, cache_dir=args.cache_dir, tp_rank=dist.get_rank())
    fn = torch.compile(model.decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
    rows: dict = {}
    dist.barrier()
    t0 = time.perf_counter()
    fn(*inputs)
    rows["torch_compile_first_call_s"] = time.perf_counter() - t0
    variants = {"gearcache": model.cached_decode, "gearcache view-checked": views,
                "torch.compile reduce-overhead": fn}
    rounds: dict = {name: [] for name in variants}
    for _ in range(args.step_rounds):
        for name, call in variants.items():
            dist.barrier()
            rounds[name].append(step_us(call, inputs, device))
    rows.update({name: statistics.median(values) for name, values in rounds.items()})
    rows["rounds"] = rounds
    dist.barrier()
    rows["eager"] = step_us(model.decode, inputs, device)
    return rows


# ------------------------------------------------------------------------------------------------------ the parent
def child_flags(args) -> list[str]:
    """The options a phase's ranks get from the parent."""
    flags = ["--cache-dir", args.cache_dir, "--device", args.device, "--gears", ",".join(map(str, args.gears)),
             "--prompt-len", str(args.prompt_len), "--sweep-max", str(args.sweep_max), "--out-dir", args.out_dir,
             "--stack-dump-s", str(args.stack_dump_s), "--rank-timeout-s", str(args.rank_timeout_s),
             "--step-rounds", str(args.step_rounds)]
    flags += ["--toy"] if args.toy else []
    flags += ["--teardown", args.teardown]
    flags += ["--no-cudnn-attention"] if args.no_cudnn_attention else []
    flags += ["--padding-check", args.padding_check] if args.padding_check else []
    flags += ["--warmup-workers", str(args.warmup_workers)] if args.warmup_workers else []
    return flags


def run_phase(args, name: str) -> dict:
    caches = tempfile.mkdtemp(prefix=f"gearcache-tp-{name}-torch-caches-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--phase", name, *child_flags(args)]
    t0 = time.perf_counter()
    try:        # stderr: the ranks' progress
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=args.phase_timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"phase {name}: still running after {args.phase_timeout_s} s (a hang: every rank's stacks "
                         f"are in {args.out_dir}/stacks-{name}-rank*.txt)") from None
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"phase {name}: torchrun exited {proc.returncode}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["job_wall_s"] = wall
    for r in report["ranks"]:       # each rank's own teardown, written after the reports were gathered
        with open(os.path.join(args.out_dir, f"{name}-rank{r['rank']}.json")) as f:
            mine = json.load(f)
        r.update({k: mine[k] for k in ("destroy_process_group_returned", "destroy_process_group_s")})
    return report


def per_rank(args, cold: dict, warm: dict, artifacts: int) -> list[dict]:
    """Every target of issue #38's item 2, per rank (warm job unless named cold)."""
    rows = []
    for c, w in zip(cold["ranks"], warm["ranks"]):
        rows.append({
            "rank": w["rank"], "warm_first_call_s": w["first_call_s"], "warm_all_gears_s": w["all_gears_s"],
            "warm first call <= 0.3 s": w["first_call_s"] <= TARGETS["warm_first_call_s"],
            "every gear loaded and captured <= 1.0 s": w["all_gears_s"] <= TARGETS["warm_all_gears_s"],
            "sweep equal to eager": not w["sweep_failures"], "0 compiles in the sweep": w["sweep_compiles"] == 0,
            "0 compiles in the warm start": w["counters_after_warmup"]["compiles"] == 0,
            "destroy_process_group returned (cold, warm)": [c["destroy_process_group_returned"],
                                                            w["destroy_process_group_returned"]],
            "compiles in the cold start": c["counters_after_warmup"]["compiles"],
            "decode B=1 (us)": {k: v for k, v in w["step_us_b1"].items() if k != "rounds"},
        })
    return rows


def summarize(args, cold: dict, warm: dict, artifacts: int) -> dict:
    def mx(r, k):
        return max(x[k] for x in r["ranks"])

    def total(r, k):
        return sum(x["counters_after_warmup"][k] for x in r["ranks"])

    w = warm["ranks"]
    keys = [k for k in w[0]["step_us_b1"] if k != "rounds"]
    step = {k: max(x["step_us_b1"][k] for x in w) for k in keys}
    import torch

    summary = {
        "benchmark": "tp_decoder", "nproc": args.nproc, "device": w[0]["device_name"], "torch": torch.__version__,
        "toy": args.toy, "gears": args.gears, "prompt_len": args.prompt_len, "padding_check": args.padding_check,
        "cold": {"job_wall_s": cold["job_wall_s"], "first_call_s_max": mx(cold, "first_call_s"),
                 "all_gears_s_max": mx(cold, "all_gears_s"), "compiles": total(cold, "compiles"),
                 "distinct_graphs": artifacts, "traces": total(cold, "traces"),
                 "direct_loads": total(cold, "direct_loads")},
        "warm": {"job_wall_s": warm["job_wall_s"], "first_call_s_max": mx(warm, "first_call_s"),
                 "decode_all_gears_s_max": mx(warm, "decode_all_gears_s"), "all_gears_s_max": mx(warm, "all_gears_s"),
                 "compiles": total(warm, "compiles"), "traces": total(warm, "traces"), "loads": total(warm, "loads"),
                 "direct_loads": total(warm, "direct_loads"), "graph_captures": total(warm, "graph_captures"),
                 "compiler_imported": sorted({m for x in w for m in x["compiler_imported"]})},
        "decode_step_b1_us_max_over_ranks": step,
        "sweep": {"batches": f"1..{args.sweep_max}", "failures_by_rank": [x["sweep_failures"] for x in w],
                  "max_abs_diff": max(x["sweep_max_abs_diff"] for x in w),
                  "compiles_and_traces": sum(x["sweep_compiles"] for x in w)},
        "destroy_process_group_returned": {"cold": [x["destroy_process_group_returned"] for x in cold["ranks"]],
                                           "warm": [x["destroy_process_group_returned"] for x in w]},
        "teardown": {"cold": [x["teardown"] for x in cold["ranks"]], "warm": [x["teardown"] for x in w]},
        "per_rank": per_rank(args, cold, warm, artifacts),
    }
    summary["targets"] = {
        "warm first call <= 0.3 s on every rank": summary["warm"]["first_call_s_max"] <= TARGETS["warm_first_call_s"],
        "every gear loaded and captured <= 1.0 s on every rank":
            summary["warm"]["all_gears_s_max"] <= TARGETS["warm_all_gears_s"],
        "decode B=1 <= torch.compile reduce-overhead": step["gearcache"] <= step["torch.compile reduce-overhead"],
        "decode B=1 (view-checked) <= torch.compile reduce-overhead":
            step["gearcache view-checked"] <= step["torch.compile reduce-overhead"],
        "sweep equal to eager on every rank": not any(x["sweep_failures"] for x in w),
        "0 compiles in the sweep": summary["sweep"]["compiles_and_traces"] == 0,
        "0 compiles in the warm start": summary["warm"]["compiles"] == 0,
        "cold compiles over all ranks = distinct graphs": summary["cold"]["compiles"] == artifacts,
        "warm start imports no compiler": not summary["warm"]["compiler_imported"],
        "destroy_process_group returned on every rank, both jobs":
            all(summary["destroy_process_group_returned"]["cold"] + summary["destroy_process_group_returned"]["warm"]),
    }
    return summary


def print_summary(args, s: dict) -> None:
    st = s["decode_step_b1_us_max_over_ranks"]
    print(f"TP={args.nproc} decoder, {s['device']}, torch {s['torch']}")
    print(f"cold: job {s['cold']['job_wall_s']:.1f} s, every gear compiled+captured in "
          f"{s['cold']['all_gears_s_max']:.1f} s, {s['cold']['compiles']} compiles over all ranks for "
          f"{s['cold']['distinct_graphs']} distinct graphs")
    print(f"warm: first call {s['warm']['first_call_s_max']:.3f} s (max over ranks), every gear loaded+captured "
          f"{s['warm']['all_gears_s_max']:.3f} s (decode's {s['warm']['decode_all_gears_s_max']:.3f} s), "
          f"{s['warm']['compiles']} compiles, {s['warm']['direct_loads']}/{s['warm']['loads']} loads by run plan")
    if "eager_start" in s:
        e = s["eager_start"]
        print(f"eager's same first calls in a fresh job (the floor): first call {e['first_call_s_max']:.3f} s, "
              f"every gear {e['all_gears_s_max']:.3f} s (decode's {e['decode_all_gears_s_max']:.3f} s)")
    print(f"decode B=1 (us, max over ranks): gearcache {st['gearcache']:.1f} (copied outputs), "
          f"{st['gearcache view-checked']:.1f} (view-checked), torch.compile reduce-overhead "
          f"{st['torch.compile reduce-overhead']:.1f}, eager {st['eager']:.0f}")
    print(f"sweep {s['sweep']['batches']}: failures {s['sweep']['failures_by_rank']}, max abs diff "
          f"{s['sweep']['max_abs_diff']:.4f}, compiles+traces {s['sweep']['compiles_and_traces']}")
    for row in s["per_rank"]:
        print(f"  rank {row['rank']}: first call {row['warm_first_call_s']:.3f} s, all gears "
              f"{row['warm_all_gears_s']:.3f} s, cold compiles {row['compiles in the cold start']}, destroy returned "
              f"{row['destroy_process_group returned (cold, warm)']}, B=1 {row['decode B=1 (us)']}")
    for name, ok in s["targets"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--phase", choices=["cold", "warm", "eager"], default=None,
                    help="one phase, under torchrun (eager: the same first calls by the eager methods, the floor)")
    ap.add_argument("--cache-dir", default=None, help="the store (default: a temporary one, removed afterwards)")
    ap.add_argument("--out-dir", default=None, help="per-rank reports and hang stacks (default: a temporary folder)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--toy", action="store_true", help="toy sizes (hidden 64, 8 heads, 1 layer)")
    ap.add_argument("--gears", type=lambda s: [int(g) for g in s.split(",")], default=GEARS)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--sweep-max", type=int, default=64)
    ap.add_argument("--padding-check", choices=["verify", "refuse", "off"], default=None,
                    help="inference_config.padding_check (default: the config's)")
    ap.add_argument("--warmup-workers", type=int, default=None,
                    help="inference_config.warmup_workers (default: the config's, half the cores per rank)")
    ap.add_argument("--rank-timeout-s", type=float, default=300.0,
                    help="config.rank_timeout_s: a rank waiting longer for the others at warm-up's fence raises, "
                         "naming them and what they report")
    ap.add_argument("--stack-dump-s", type=float, default=240.0,
                    help="every rank still in a phase after this long writes its threads' stacks to --out-dir")
    ap.add_argument("--phase-timeout-s", type=float, default=900.0, help="the parent stops a phase after this long")
    ap.add_argument("--step-rounds", type=int, default=3, help="alternating rounds of the B=1 step comparison")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="torch.backends.cuda.enable_cudnn_sdp(False) on every rank (SDPA then takes another backend): "
                         "what a warm start costs without cuDNN's per-shape attention plans")
    ap.add_argument("--teardown", choices=["full", "gearcache", "none"], default="full",
                    help="before destroy_process_group, release torch.compile's and gearcache's CUDA graphs (full), "
                         "only gearcache's, or neither (the old teardown), to see which held NCCL")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.phase:
        report = phase(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(report), flush=True)
        if not report["destroy_process_group_returned"]:
            sys.stderr.flush()
            os._exit(0)                 # the hung teardown thread would hold the interpreter's exit
        return
    temp = []
    if args.cache_dir is None:
        args.cache_dir = tempfile.mkdtemp(prefix="gearcache-tp-bench-")
        temp.append(args.cache_dir)
    if args.out_dir is None:
        args.out_dir = tempfile.mkdtemp(prefix="gearcache-tp-bench-out-")
        temp.append(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        cold = run_phase(args, "cold")
        artifacts = len(os.listdir(os.path.join(args.cache_dir, "artifacts")))
        warm = run_phase(args, "warm")
        eager = run_phase(args, "eager")
    finally:
        for folder in temp:
            shutil.rmtree(folder, ignore_errors=True)
    s = summarize(args, cold, warm, artifacts)
    s["eager_start"] = {"first_call_s_max": max(x["first_call_s"] for x in eager["ranks"]),
                        "decode_all_gears_s_max": max(x["decode_all_gears_s"] for x in eager["ranks"]),
                        "all_gears_s_max": max(x["all_gears_s"] for x in eager["ranks"])}
    print_summary(args, s)
    if args.out_dir not in temp:
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(s, f)
    print(json.dumps(s))


if __name__ == "__main__":
    main()
