#!/usr/bin/env bash
# Issue #27's cold sweep and warm first generate() on the GPU in one short run (benchmarks/generate.py children,
# GEARCACHE_BENCH_SWEEP_ONLY): gearcache with on_new_signature="background" on an empty store, torch.compile, then
# gearcache warm (that store) and eager. Each child a fresh process with empty Inductor/Triton caches; JSON lines
# in ${OUT:-.}/sweep.jsonl, gearcache's log in ${OUT:-.}/<variant>.log. GRAPHS=1: also the background sweep with
# mode="reduce-overhead" (CUDA graphs). The background children run the sweep twice more once every entry is compiled.
set -u
out=${OUT:-.}; store=$(mktemp -d); size=${1:-gpu}; device=${2:-cuda}; dtype=${3:-bfloat16}
child() {   # child VARIANT TIMEOUT_S
  local t0 line
  t0=$(date +%s.%N)
  line=$(TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) GEARCACHE_LOG=INFO \
         GEARCACHE_BENCH_SWEEP_ONLY=1 timeout "$2" python3 benchmarks/generate.py --child llama "$1" "$store" \
         "$device" "$dtype" "$size" 2>"$out/$1.log" | tail -1)
  echo "{\"variant\": \"$1\", \"process_s\": $(python3 -c "import time; print(round(time.time() - $t0, 2))"), \"out\": ${line:-null}}" \
    | tee -a "$out/sweep.jsonl"
}
child gearcache-background "${BG_TIMEOUT:-110}"
if [ -n "${GRAPHS:-}" ]; then   # the same cold sweep with mode="reduce-overhead" (a store of its own)
  main_store=$store; store=$(mktemp -d)
  child gearcache-background-graphs "${BG_TIMEOUT:-110}"
  store=$main_store
fi
child torch.compile "${TC_TIMEOUT:-75}"
child gearcache "${WARM_TIMEOUT:-30}"
child eager "${EAGER_TIMEOUT:-25}"
