"""What the per-call watch over value guards costs on the reference decoder: hops watched, valid() time.

usage: PYTHONPATH=$PWD python3 scripts/guard_watch_cost.py [--device cuda]
"""
import argparse
import os
import sys
import tempfile
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.update({"A_D": "64", "A_H": "2", "A_L": "2", "A_V": "128", "A_TMAX": "32"})
    import torch

    import reference_decoder as ref
    from gearcache import cache_compile
    from gearcache.keys import guard_watch

    class CachedGPT(ref.GPT):
        def __init__(self, cache_dir):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir)

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = CachedGPT(tempfile.mkdtemp()).to(args.device, dtype).eval()
    with torch.inference_mode():
        model.cached_decode(*ref.inputs(1, args.device, dtype))
    cf = model.cached_decode
    sets = [e.guards for e in cf._table.values()]
    hops = guard_watch.hops_for(sets, cf._scope)
    print(f"guards {sum(len(s) for s in sets)}; hops: {len(hops.dicts)} dict items, {len(hops.types)} types, "
          f"{len(hops.checked)} re-read per call")
    for op, parent, key, _ in hops.checked[:20]:
        print(f"  re-read: {op} {type(parent).__name__}.{key!r}")
    watch = cf._watch
    n = 200_000
    t = timeit.timeit(watch.valid, number=n) / n * 1e9
    print(f"watch {type(watch).__name__}: valid() {t:.0f} ns, valid now: {watch.valid()}")


if __name__ == "__main__":
    main()
