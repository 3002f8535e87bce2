"""Per-call overhead above Inductor's generated ``call()``, measured end to end and piece by piece.

    PYTHONPATH=$PWD python3 benchmarks/call_overhead.py [--device cuda|cpu] [--calls 5000] [--cache-dir DIR]

The reference decoder's decode at B=1 (CUDA: hidden 1024, 8 layers, bf16; CPU: hidden 64, 2 layers, fp32, so the
compute between calls stays small and the pairs less noisy). Its entry is compiled into ``--cache-dir`` if that is
empty (run the script twice with the same folder to time a warm process's load), then:

1. paired end to end: the loaded entry ``fn(x, kv, pos)`` and Inductor's ``call(list(args))`` on the same inputs,
   interleaved (the order alternates every pair), p50 of each and the median of the paired differences; for the C
   per-call path (``gearcache.call._callpath``, when built) and the Python one gearcache runs without it
   (``dispatch.PyDispatcher`` and the Python ``entry.run``), in alternating blocks of the same run; then the entry's
   ``run(leaves)`` alone paired with ``call()`` the same way (the dispatcher's share is the rest);
2. the pieces, isolated (tight loops, p50): signature key, table lookup, gathering the graph inputs, the run plan's
   per-call function around a ``call()`` that does nothing, building the result (the Python path's pieces); the
   entry's ``run`` (gathering and run plan, on the path in use) around that null ``call()``; and the whole hot path
   with it;
3. the same null-``call()`` hot path, but each one right after a real ``call()`` (as in 1): caches, branch predictors
   and the allocator are in the state a real call leaves them in;
4. Inductor's ``call()`` itself timed inside the loaded entry and alone (interleaved): the glue leaves caches in a
   state that slows the ``call()`` after it. 1 is accounted for when 3 + (4's difference) matches it.
The numbers are host time (CUDA kernels are queued asynchronously; the device is synchronised before and after).
The shortcut's checks are gearcache's native ones where they are built (``python -m gearcache.native.build``), else
Dynamo's; ``GEARCACHE_NATIVE=0`` runs with Dynamo's, to compare. The first line says which.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import p50_us  # noqa: E402

CPU_SIZES = {"A_D": "64", "A_H": "2", "A_L": "2", "A_V": "128", "A_TMAX": "32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--cache-dir", default=None, help="gearcache folder (default: a new temporary one)")
    ap.add_argument("--json", help="also write the results as JSON here")
    opts = ap.parse_args()
    import torch

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        for k, v in CPU_SIZES.items():
            os.environ.setdefault(k, v)
    import reference_decoder as ref
    from gearcache import cache_compile, counters, native
    from gearcache.call.signature import call_key

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="gearcache-overhead-")

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir)

    torch.manual_seed(0)
    model = CachedGPT().to(device, dtype).eval()
    fn = model.cached_decode
    x, kv, pos = ref.inputs(1, device, dtype)
    n = opts.calls
    r = {}
    with torch.inference_mode():
        fn(x, kv, pos)
        sync()
        leaves, key = call_key((x, kv, pos), {})
        entry = fn._table[key]
        run = entry.compiled
        call = getattr(run, "wrapper_call", None)
        if call is None:
            raise SystemExit("the entry did not load through a run plan: no Inductor call() to compare with")
        args = entry.gather(leaves)
        outs = run(*args)

        # 1. paired end to end, the C per-call path and the Python one in alternating blocks
        paths = ["native", "python"] if entry.native else ["python"]
        callers = {"native": fn, "python": _python_path(fn, key, entry)}
        pairs = {p: ([], [], []) for p in paths}
        blocks = 10
        for b in range(blocks * len(paths)):
            path = paths[b % len(paths)]
            _use_path(entry, path)
            e_t, c_t, diffs = pairs[path]
            f = callers[path]
            for i in range(n // blocks + 20):
                if i % 2:
                    t0 = time.perf_counter_ns()
                    f(x, kv, pos)
                    t1 = time.perf_counter_ns()
                    call(list(args))
                    t2 = time.perf_counter_ns()
                    e, c = t1 - t0, t2 - t1
                else:
                    t0 = time.perf_counter_ns()
                    call(list(args))
                    t1 = time.perf_counter_ns()
                    f(x, kv, pos)
                    t2 = time.perf_counter_ns()
                    c, e = t1 - t0, t2 - t1
                if i >= 20:
                    e_t.append(e)
                    c_t.append(c)
                    diffs.append(e - c)
        # 1b. the same pairing with the entry's run alone (gathering, checks, call()) instead of the whole call:
        # what the dispatcher adds (matcher, result, hit counts) is the rest of 1's difference
        _use_path(entry, paths[0])
        run_diffs = []
        run_leaves = entry.run
        for i in range(n + 20):
            if i % 2:
                t0 = time.perf_counter_ns()
                run_leaves(leaves)
                t1 = time.perf_counter_ns()
                call(list(args))
                t2 = time.perf_counter_ns()
                d = (t1 - t0) - (t2 - t1)
            else:
                t0 = time.perf_counter_ns()
                call(list(args))
                t1 = time.perf_counter_ns()
                run_leaves(leaves)
                t2 = time.perf_counter_ns()
                d = (t2 - t1) - (t1 - t0)
            if i >= 20:
                run_diffs.append(d)
        r["paired_run_diff_p50_us"] = statistics.median(run_diffs) / 1e3
        sync()
        for path, (e_t, c_t, diffs) in pairs.items():
            suffix = "" if path == paths[0] else "_python"
            r["entry_p50_us" + suffix] = statistics.median(e_t) / 1e3
            r["call_p50_us" + suffix] = statistics.median(c_t) / 1e3
            r["paired_diff_p50_us" + suffix] = statistics.median(diffs) / 1e3
        r["call_path"] = paths[0]

        # 2. pieces, isolated
        def p50(f):
            return p50_us(f, n, sync)

        base = p50(lambda: None)
        null_run = _null_run(run, outs)
        r["piece_key_us"] = p50(lambda: call_key((x, kv, pos), {})) - base
        table = fn._table
        r["piece_lookup_us"] = p50(lambda: table.get(key)) - base
        r["piece_gather_us"] = p50(lambda: entry.gather(leaves)) - base
        r["piece_run_plan_us"] = p50(lambda: null_run(*args)) - p50(lambda: list(args))
        build = entry.build
        r["piece_build_us"] = p50(lambda: build(outs, leaves)) - base
        r["pieces_sum_us"] = sum(v for k, v in r.items() if k.startswith("piece_"))
        entry.compiled = null_run
        try:
            r["run_null_call_us"] = p50(lambda: entry.run(leaves)) - base
            r["glue_isolated_us"] = p50(lambda: fn(x, kv, pos)) - base
            # 3. the same glue, each right after a real call()
            glue = []
            for i in range(n + 200):
                call(list(args))
                t0 = time.perf_counter_ns()
                fn(x, kv, pos)
                t1 = time.perf_counter_ns()
                if i >= 200:
                    glue.append(t1 - t0)
            sync()
            r["glue_after_call_us"] = statistics.median(glue) / 1e3 - base
            # 4. call() itself, timed inside the loaded entry and alone, interleaved: does the glue slow it down?
            inner, alone = [], []
            pc = time.perf_counter_ns

            def timed_call(a):
                t = pc()
                o = call(a)
                inner.append(pc() - t)
                return o

            entry.compiled = _null_run(run, None, timed_call)
            for _ in range(n + 200):
                fn(x, kv, pos)
                t0 = pc()
                call(list(args))
                alone.append(pc() - t0)
            sync()
            r["call_inside_entry_p50_us"] = statistics.median(inner[200:]) / 1e3
            r["call_alone_p50_us"] = statistics.median(alone[200:]) / 1e3
        finally:
            entry.compiled = run
    r["counters"] = {"loads": counters.loads, "direct_loads": counters.direct_loads, "compiles": counters.compiles}
    r["checks"] = "native" if native.guards(build_if_missing=False) is not None else "dynamo"
    print(f"per-call overhead, {device}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {n} calls, decode B=1, "
          f"shortcut checks: {r['checks']}")
    print(f"1. paired end to end ({r['call_path']} per-call path): loaded entry p50 {r['entry_p50_us']:.1f} us, "
          f"Inductor's call() p50 {r['call_p50_us']:.1f} us; median of paired differences "
          f"{r['paired_diff_p50_us']:.2f} us")
    print(f"   of which the entry's run alone (gather, checks, call()), paired the same way: "
          f"{r['paired_run_diff_p50_us']:.2f} us; the dispatcher the rest")
    if "paired_diff_p50_us_python" in r:
        print(f"   same run, Python per-call path (alternating blocks): loaded entry p50 "
              f"{r['entry_p50_us_python']:.1f} us, call() p50 {r['call_p50_us_python']:.1f} us; median of paired "
              f"differences {r['paired_diff_p50_us_python']:.2f} us")
    print("2. pieces, isolated (p50, us): " + ", ".join(
        f"{k[6:-3]} {v:.2f}" for k, v in r.items() if k.startswith("piece_")) +
        f"; sum {r['pieces_sum_us']:.2f}; entry.run ({r['call_path']}) {r['run_null_call_us']:.2f}; "
        f"whole hot path with a null call() {r['glue_isolated_us']:.2f}")
    print(f"3. whole hot path with a null call(), each right after a real call(): {r['glue_after_call_us']:.2f} us")
    print(f"4. Inductor's call() itself, p50: inside the loaded entry {r['call_inside_entry_p50_us']:.1f} us, alone "
          f"{r['call_alone_p50_us']:.1f} us (interleaved): "
          f"{r['call_inside_entry_p50_us'] - r['call_alone_p50_us']:.2f} us "
          f"of the paired difference is call() running slower after the glue")
    print(f"counters: {r['counters']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(r, f, indent=1)


def _python_path(fn, key, entry):
    """``fn`` as it runs where gearcache.call._callpath is not built: dispatch.PyDispatcher's shortcut (Python) to the
    same entry; with ``_use_path(entry, "python")`` its ``run`` is Python too."""
    from gearcache import counters
    from gearcache.call import dispatch

    class PythonPath(dispatch.PyDispatcher):
        _call = staticmethod(fn._call)

    caller = PythonPath()
    made = fn._matchers.get(key)                # (the entry it was made for, the matcher)
    matcher = made[1] if made is not None else None
    if matcher is not None:
        caller._set_shortcut(matcher, entry, counters)
    return caller


def _use_path(entry, path):
    """Switch a loaded entry between the C per-call path ("native") and the Python one."""
    entry.native = path == "native"
    entry.compiled = entry.compiled        # rebuilds entry.run


def _null_run(run, outs, call=None):
    """The run plan's own per-call function around a ``call()`` that returns the real outputs at once (or ``call``)."""
    from gearcache.runplan import PlanRunner

    null = PlanRunner(call or (lambda a: outs), run.plan)
    null.set_stable_inputs(run.stable_inputs)
    return null


if __name__ == "__main__":
    main()
