"""The per-call guard watch and matcher of the reference decoder's decode, split row kind by row kind: what each costs.

usage: PYTHONPATH=$PWD python3 scripts/watch_split.py [--device cuda] [--json FILE]

Works on this tree and on older ones (bee0dfe: ``gearcache/guard_watch.py``, ``_matchers[key]`` the matcher itself),
so that ``scripts/overhead_old_new.sh``'s ``.old`` tree can be timed the same way in the same run. Times (p50 of
blocks of 2,000 calls, ns): the watch's ``valid()``, the matcher's argument check, and a watch rebuilt from each kind
of row alone: dict items and types, each ``checked`` op, the tensors' metadata.
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))


def p50_ns(f, n=2000, blocks=25):
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        times.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(times)


def first_module(*names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        for k, v in {"A_D": "64", "A_H": "2", "A_L": "2", "A_V": "128", "A_TMAX": "32"}.items():
            os.environ.setdefault(k, v)
    import torch

    import reference_decoder as ref
    from gearcache import cache_compile
    guard_watch = first_module("gearcache.keys.guard_watch", "gearcache.guard_watch")
    signature = first_module("gearcache.call.signature", "gearcache.signature")

    class CachedGPT(ref.GPT):
        def __init__(self, cache_dir):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir)

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = CachedGPT(args.cache_dir or tempfile.mkdtemp()).to(args.device, dtype).eval()
    inputs = ref.inputs(1, args.device, dtype)
    r = {}
    with torch.inference_mode():
        model.cached_decode(*inputs)
        model.cached_decode(*inputs)
        cf = model.cached_decode
        cf = getattr(cf, "__self__", cf) if not hasattr(cf, "_watch") else cf
        watch = cf._watch
        _, key = signature.call_key(inputs, {})
        made = cf._matchers.get(key)
        matcher = made[1] if isinstance(made, tuple) and len(made) == 2 else made     # new: (entry, matcher)
        r["valid_ns"] = p50_ns(watch.valid)
        if matcher is not None:
            check = matcher[0]
            r["matcher_check_ns"] = p50_ns(lambda: check(*inputs))
        r["empty_lambda_ns"] = p50_ns(lambda: None)
        callpath = first_module("gearcache.call._callpath", "gearcache._callpath")
        if hasattr(callpath, "guard_generation"):       # does a served call move the watchers' generation?
            before = callpath.guard_generation()
            for _ in range(100):
                model.cached_decode(*inputs)
            r["generation_moves_per_100_calls"] = callpath.guard_generation() - before
            r["valid_after_calls"] = watch.valid() and cf._watch is watch
        hops = cf._watcher._hops
        r["rows"] = {"dicts": len(hops.dicts), "types": len(hops.types), "tensors": len(hops.tensors),
                     "checked": {}}
        for op, *_ in hops.checked:
            r["rows"]["checked"][op] = r["rows"]["checked"].get(op, 0) + 1
        r["split_ns"] = split(guard_watch, hops)
    r["python"] = sys.version.split()[0]
    r["torch"] = torch.__version__
    r["watch_type"] = type(watch).__name__
    r["watched"] = getattr(watch, "watched", None)     # 3.12+: dicts and types watched, not compared per call
    print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


def split(guard_watch, hops):
    """valid() of a watch over one kind of row at a time."""
    make = guard_watch.make_watch
    out = {}

    def part(name, **fields):
        sub = type(hops)()
        for field in ("dicts", "types", "checked", "tensors"):
            setattr(sub, field, fields.get(field, []))
        w = make(sub)
        if w is not None:
            out[name] = p50_ns(w.valid)

    part("dicts_types", dicts=list(hops.dicts), types=list(hops.types))
    for op in sorted({row[0] for row in hops.checked}):
        part("checked_" + op, checked=[row for row in hops.checked if row[0] == op])
    part("checked_all", checked=list(hops.checked))
    part("tensors", tensors=list(hops.tensors))
    return out


if __name__ == "__main__":
    main()
