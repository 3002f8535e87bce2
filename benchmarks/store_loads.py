"""The store's share of one artifact load (issue #38): ``Leases.take`` and ``Artifacts.verify_for_load``, per load.

    python benchmarks/store_loads.py --cache-dir DIR [--rounds 20] [--procs 1,4] [--threads 1]

``DIR``: a filled store (``benchmarks/warm_loads.py --cache-dir DIR`` makes one). Each round, each process opens a
new ``Store`` of ``DIR`` (so every lease is taken again, as in a new process) and, for every artifact in it, takes
its lease and checks what a load through its run plan reads (``runplan.files_read``), as a warm start's look-up does
(``Entries.read_for_load``, then ``artifact_io.verified_run_plan``); ``--threads`` look-ups side by side, as
``warmup.driver.find_all``'s. ``--procs 4``: four processes at once from a barrier, as the ranks of a TP=4 job load the
same artifacts. Prints the median microseconds per load of each step over the rounds (the first round apart: it may
be the one that stamps the artifacts) and a JSON line last.
"""
import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _round(root: str, akeys: list[str], plans: dict, threads: int) -> tuple[float, float, float]:
    """One round: (seconds in take, seconds in verify_for_load, wall seconds) over all artifacts."""
    from gearcache.store import Store

    store = Store(root)
    store.first_use.ensure()
    spent = [0.0, 0.0]

    def load(akey: str) -> None:
        t0 = time.perf_counter()
        store.leases.take(akey)
        t1 = time.perf_counter()
        store.artifacts.verify_for_load(akey, plans[akey])
        t2 = time.perf_counter()
        spent[0] += t1 - t0
        spent[1] += t2 - t1

    t0 = time.perf_counter()
    if threads <= 1:
        for akey in akeys:
            load(akey)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(load, akeys))
    return spent[0], spent[1], time.perf_counter() - t0


def _worker(root: str, rounds: int, threads: int, barrier, out) -> None:
    from gearcache import runplan
    from gearcache.store import Store

    layout = Store(root).layout
    akeys = layout.artifact_keys()
    plans = {a: runplan.files_read(runplan.read_plan(layout.artifact(a))) for a in akeys}
    rows = []
    for _ in range(rounds):
        barrier.wait(60)
        rows.append(_round(root, akeys, plans, threads))
        gc.collect()                            # the round's Store goes with its leases: the next takes them again
    n = len(akeys)
    first, rest = rows[0], rows[1:] or rows
    out.put({"pid": os.getpid(), "artifacts": n,
             "first_round_us": {"take": first[0] / n * 1e6, "verify": first[1] / n * 1e6},
             "take_us": statistics.median(r[0] for r in rest) / n * 1e6,
             "verify_us": statistics.median(r[1] for r in rest) / n * 1e6,
             "wall_per_load_us": statistics.median(r[2] for r in rest) / n * 1e6})


def measure(root: str, procs: int, rounds: int, threads: int) -> list[dict]:
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(root, rounds, threads, barrier, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--procs", default="1,4")
    ap.add_argument("--threads", type=int, default=1)
    opts = ap.parse_args()
    import gearcache  # noqa: F401  (imported once, before the fork)

    report = []
    for procs in [int(p) for p in opts.procs.split(",")]:
        results = measure(opts.cache_dir, procs, opts.rounds, opts.threads)
        med = {k: statistics.median(r[k] for r in results) for k in ("take_us", "verify_us", "wall_per_load_us")}
        first = statistics.median(r["first_round_us"]["verify"] for r in results)
        print(f"{procs} process(es) x {opts.threads} thread(s), {results[0]['artifacts']} artifacts, "
              f"{opts.rounds} rounds: per load take {med['take_us']:.0f} us, verify_for_load {med['verify_us']:.0f} "
              f"us, wall {med['wall_per_load_us']:.0f} us (first round's verify {first:.0f} us)")
        report.append({"procs": procs, "threads": opts.threads, **med, "first_round_verify_us": first})
    print(json.dumps({"benchmark": "store_loads", "cache_dir": opts.cache_dir, "rounds": opts.rounds,
                      "results": report}))


if __name__ == "__main__":
    main()
