#!/usr/bin/env bash
# Per-call overhead, the code in .old/ (an older tree: git archive REV | tar -x -C .old) against this tree, in one run:
# each tree fills its own folder once (cold), then warm runs alternate old, new, old, new. JSON lines under ${OUT:-.}.
# usage: scripts/overhead_old_new.sh [cuda|cpu] [calls]
set -u
device=${1:-cuda}; calls=${2:-2000}; out=${OUT:-.}; base=${PYTHONPATH:-}
run() {  # run TREE NAME
  (cd "$1" && PYTHONPATH="$PWD:$base" python3 benchmarks/call_overhead.py --device "$device" --calls "$calls" \
     --cache-dir "/tmp/ovh-$2" --json "$out/ovh-$2-$3.json" > "$out/ovh-$2-$3.log" 2>&1)
  python3 - "$out/ovh-$2-$3.json" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
flat = {k: v for k, v in d.items() if isinstance(v, (int, float))}
print(sys.argv[2], json.dumps(flat)[:900])
PY
}
(cd .old && python3 setup.py build_ext --inplace -q > /dev/null 2>&1)
run .old old cold; run . new cold
for i in 1 2; do run .old old $i; run . new $i; done
