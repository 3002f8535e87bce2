#!/bin/bash
# Where a TP warm start's time goes (issue #38): one cold job into a kept store, then warm jobs of the start only
# (first call + every gear of both methods; no sweep, no step comparison), with the timeline per gear and, in the
# first, torch.profiler around decode's warm-up (tables under $OUT/profile). Usage: OUT=... bash scripts/tp_warm_start_profile.sh N
N=${1:-4}
STORE=$(mktemp -d)
run() {  # phase, extra env
    mkdir -p $OUT/$1-$RUN
    local phase=$1; shift
    local caches; caches=$(mktemp -d)
    env TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton "$@" \
        python3 -m torch.distributed.run --standalone --nproc-per-node=$N benchmarks/tp_decoder.py --phase $phase \
        --cache-dir $STORE --device cuda --out-dir $OUT/$phase-$RUN
}
RUN=cold run cold > $OUT/cold.txt 2>&1 || { tail -30 $OUT/cold.txt; exit 1; }
for RUN in profiled plain eager_loading; do
    case $RUN in
        profiled) RUN=$RUN run warm GEARCACHE_BENCH_START_ONLY=1 GEARCACHE_BENCH_PROFILE=$OUT/profile ;;
        plain) RUN=$RUN run warm GEARCACHE_BENCH_START_ONLY=1 ;;
        eager_loading) RUN=$RUN run warm GEARCACHE_BENCH_START_ONLY=1 CUDA_MODULE_LOADING=EAGER ;;
    esac > $OUT/warm-$RUN.txt 2>&1
    python3 - "$OUT/warm-$RUN/warm-rank0.json" "$RUN" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"== {sys.argv[2]}: first call {d['first_call_s']:.3f} s, decode gears {d['decode_all_gears_s']:.3f} s, all gears {d['all_gears_s']:.3f} s")
for name, text in d["timelines"].items():
    print(name); print("\n".join(text.splitlines()[-9:]))
PY
done
