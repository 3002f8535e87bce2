#!/usr/bin/env bash
# gearcache/ranks/phases.py on GPUs (NCCL, mode="reduce-overhead": CUDA graphs with the all-reduce captured): a geared TP MLP
# (tests/scripts/run_tp_gears.py, gears 1, 2, 4, 8) cold on an empty folder, warm, then with the last rank's gears
# diverging (every rank must raise RankDivergenceError at the fence: no hang). Each job is bounded to 300 s.
# usage: bash scripts/ranks_fence_gpu.sh [N] [OUT]     (N GPUs; reports under OUT)
set -uo pipefail
N=${1:-4}
OUT=${2:-$(mktemp -d)}
export GEARCACHE_TEST_DEVICE=cuda
run() {  # label env...
  local label=$1
  shift
  mkdir -p "$OUT/$label"
  timeout 300 env "$@" python3 -m torch.distributed.run --standalone --nproc-per-node "$N" \
    tests/scripts/run_tp_gears.py "$OUT/cache" "$OUT/$label" >"$OUT/$label.log" 2>&1
  echo "$label: exit $? (124: timed out)"
}
run cold GEARS=1,2,4,8
run warm GEARS=1,2,4,8
run diverge GEARS=1,2,4,8 "GEARS_RANK_$((N - 1))=1,2" RANK_TIMEOUT_S=60
python3 - "$OUT" "$N" <<'PY'
import json, pathlib, sys
out, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for label in ("cold", "warm", "diverge"):
    for r in range(n):
        f = out / label / f"rank{r}.json"
        if not f.exists():
            print(f"{label} rank {r}: no report")
            continue
        d = json.loads(f.read_text())
        c = d.get("counters") or d["counters_after_warmup"]
        err = d["error"] and f"{d['error']['type']}: {d['error']['message'].splitlines()[0]}"
        print(f"{label} rank {r}: error {err}, equal {d.get('equal')}, compiles {c['compiles']}, loads {c['loads']}, "
              f"fences {c['rank_fences']}, captures {c['graph_captures']}, warm-up {d.get('warmup_s', 0):.3f} s, "
              f"destroy returned {d.get('destroy_returned')} ({d.get('destroy_s', 0):.2f} s)")
PY
