"""The differential tester's fresh warm process: run many generated cases against a store other processes filled.

usage: difftest_warm.py BATCH_JSON RESULTS_JSON
BATCH_JSON: ``{"src": folder of the program files, "cache_dir": the shared store, "cases": [case, ...]}`` (cases as
tests/difftest/runner.py describes them; the program files are imported from ``src`` as they are now, which may be
an edited version of what the compiling process imported). Each case runs against its eager twin, call by call;
RESULTS_JSON gets one result per case, in order. The last stdout line is a JSON summary (outcomes, counters).
"""
import gc
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from difftest import runner  # noqa: E402 - after the path above


def main() -> None:
    batch = json.loads(open(sys.argv[1]).read())
    results = []
    for case in batch["cases"]:
        result = runner.run_case(case, batch["src"], batch["cache_dir"])
        result["id"] = case["id"]
        results.append(result)
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    print(json.dumps({"cases": len(results), "outcomes": collections.Counter(r["outcome"] for r in results),
                      "compiles": sum(r["counters"]["compiles"] for r in results),
                      "loads": sum(r["counters"]["loads"] for r in results)}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
