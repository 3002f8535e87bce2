#!/usr/bin/env bash
# Ranks on GPUs (NCCL): cold start of 1 rank alone, cold start of N ranks together on an empty folder, warm start of
# the N ranks. Prints each rank's report (compiles, loads, first-call seconds, output == eager).
# usage: bash scripts/ranks_gpu.sh [N]     (on a machine with N GPUs)
set -euo pipefail
N=${1:-2}
work=$(mktemp -d)
export GEARCACHE_TEST_DEVICE=cuda
run() {  # nproc cache out
  python3 -m torch.distributed.run --standalone --nproc-per-node "$1" tests/scripts/run_tp.py "$2" "$3" >/dev/null 2>"$3.err" || { tail -30 "$3.err"; exit 1; }
  for f in "$3"/rank*.json; do cat "$f"; echo; done
}
mkdir -p "$work/one" "$work/cold" "$work/warm"
echo "== 1 rank alone, empty folder"; run 1 "$work/c1" "$work/one"
echo "== $N ranks together, empty folder"; run "$N" "$work/cN" "$work/cold"
echo "== $N ranks, warm"; run "$N" "$work/cN" "$work/warm"
python3 - "$work" "$N" <<'PY'
import json, sys, pathlib
w, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
one = json.loads((w / "one" / "rank0.json").read_text())["first_call_s"]
cold = [json.loads((w / "cold" / f"rank{r}.json").read_text()) for r in range(n)]
warm = [json.loads((w / "warm" / f"rank{r}.json").read_text()) for r in range(n)]
print(f"cold first call: 1 rank alone {one:.2f} s; {n} ranks together max {max(r['first_call_s'] for r in cold):.2f} s "
      f"(ratio {max(r['first_call_s'] for r in cold) / one:.2f}x); compiles across ranks "
      f"{sum(r['counters']['compiles'] for r in cold)}; warm compiles {sum(r['counters']['compiles'] for r in warm)}, "
      f"loads {sum(r['counters']['loads'] for r in warm)}; all equal eager: {all(r['equal'] for r in cold + warm)}")
PY
