#!/usr/bin/env bash
# A warm TP start's gear loads, side by side in 4 threads (GEARCACHE_LOAD_THREADS=4) against one after another
# (GEARCACHE_LOAD_THREADS=1), alternated on one store (ROUNDS pairs; DEFAULT_ONLY=1: first a warm job as
# configured), in one device call (nvidia-h100-x4 by default: NPROC=4).
# Prints each warm job's first call, decode gears and all gears (max over ranks). Results under $OUT.
# usage (device prefix of ../shared/device/README.md first): NPROC=4 bash scripts/gpu_tp_loads_ab.sh
set -uo pipefail
out=${OUT:-gpu_tp_ab_out}
n=${NPROC:-4}
device=${DEVICE:-cuda}
extra=${EXTRA:-}
mkdir -p "$out"
python3 setup.py build_ext --inplace -q >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
cache=/tmp/gc-tp-ab
rm -rf "$cache"
run() {   # run NAME PHASE [env...]
    local name=$1 phase=$2; shift 2
    mkdir -p "$out/$name"
    env "$@" timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" benchmarks/tp_decoder.py \
        --phase "$phase" --cache-dir "$cache" --device "$device" $extra --out-dir "$out/$name" >"$out/$name.log" 2>&1
    echo "$name rc=$?"
}
rounds=${ROUNDS:-2}          # alternated pairs of warm jobs; ROUNDS=0 with DEFAULT_ONLY=1: one warm job as configured
run cold cold GEARCACHE_BENCH_START_ONLY=1
if [ -n "${DEFAULT_ONLY:-}" ]; then run default warm GEARCACHE_BENCH_START_ONLY=1; fi
for round in $(seq 1 "$rounds"); do
    run "threads$round" warm GEARCACHE_BENCH_START_ONLY=1 GEARCACHE_LOAD_THREADS=4
    run "one$round" warm GEARCACHE_BENCH_START_ONLY=1 GEARCACHE_LOAD_THREADS=1
done
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for name in ["cold", "default"] + [f"{m}{r}" for r in (1, 2, 3) for m in ("threads", "one")]:
    reports = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, name, "*-rank*.json")))]
    if not reports:
        continue
    row = {k: round(max(r.get(k, 0.0) for r in reports), 3) for k in ("first_call_s", "decode_all_gears_s", "all_gears_s")}
    c = [r.get("counters_after_warmup", {}) for r in reports]
    print(name, row, "compiles", sum(x.get("compiles", 0) for x in c), "loads", sum(x.get("loads", 0) for x in c))
PY
