#!/usr/bin/env bash
# Per-call overhead, the code in .old/ (an older tree: git archive REV | tar -x -C .old) against this tree, in one run:
# each tree fills its own folder once (cold), then warm runs alternate old, new, old, new (ROUNDS pairs, default 2;
# PIN=<cpu>: warm runs pinned to that core with taskset, which steadies the host-time figures). JSON lines under
# ${OUT:-.}, and a last line per tree with the median of its warm runs.
# usage: scripts/overhead_old_new.sh [cuda|cpu] [calls]
set -u
device=${1:-cuda}; calls=${2:-2000}; out=${OUT:-.}; base=${PYTHONPATH:-}
run() {  # run TREE NAME ROUND [pin prefix...]
  local tree=$1 name=$2 round=$3; shift 3
  (cd "$tree" && PYTHONPATH="$PWD:$base" "$@" python3 benchmarks/call_overhead.py --device "$device" --calls "$calls" \
     --cache-dir "/tmp/ovh-$name" --json "$out/ovh-$name-$round.json" > "$out/ovh-$name-$round.log" 2>&1)
  python3 - "$out/ovh-$name-$round.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
flat = {k: v for k, v in d.items() if isinstance(v, (int, float))}
print(sys.argv[2], json.dumps(flat)[:900])
PY
}
pin=()
[[ -n ${PIN:-} ]] && pin=(taskset -c "$PIN")
(cd .old && python3 setup.py build_ext --inplace -q > /dev/null 2>&1)
run .old old cold; run . new cold
for i in $(seq 1 "${ROUNDS:-2}"); do run .old old "$i" "${pin[@]}"; run . new "$i" "${pin[@]}"; done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
keys = ("glue_isolated_us", "glue_after_call_us", "run_null_call_us", "paired_diff_p50_us", "paired_diff_p50_us_python")
for name in ("old", "new"):
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/ovh-{name}-[0-9]*.json"))]
    print(f"median of {len(runs)} warm runs, {name}:", ", ".join(
        f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in keys))
PY
