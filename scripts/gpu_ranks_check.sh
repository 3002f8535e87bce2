#!/usr/bin/env bash
# Issue #38's runs on a 4-GPU machine (nvidia-h100-x4), in one device call, results under $OUT (or
# ./gpu_ranks_out): TP=4 of benchmarks/tp_decoder.py (all 7 gears, every target row), the same warm job with the
# gears looked up one after another (GEARCACHE_LOAD_THREADS=1, the side-by-side look-ups' A/B), and PP=2 x TP=2 of
# benchmarks/pp_decoder.py. Each benchmark prints its own PASS/FAIL rows.
# usage (device prefix of ../shared/device/README.md first): bash scripts/gpu_ranks_check.sh
set -uo pipefail
out=${OUT:-gpu_ranks_out}
mkdir -p "$out"
python3 setup.py build_ext --inplace -q >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
cache=/tmp/gc-tp4        # outside $OUT: artifacts do not travel back
rm -rf "$cache"
timeout 330 python3 benchmarks/tp_decoder.py --nproc 4 --device cuda --cache-dir "$cache" --out-dir "$out/tp4" \
    >"$out/tp4.log" 2>&1
echo "tp4 rc=$?" >>"$out/tp4.log"
GEARCACHE_LOAD_THREADS=1 GEARCACHE_BENCH_START_ONLY=1 timeout 90 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 4 benchmarks/tp_decoder.py --phase warm --cache-dir "$cache" --device cuda \
    --out-dir "$out/tp4_threads1" >"$out/tp4_threads1.log" 2>&1
echo "tp4 one thread rc=$?" >>"$out/tp4_threads1.log"
timeout 150 python3 benchmarks/pp_decoder.py --device cuda --gears 1,2,4,8 --dtype float32 --out-dir "$out/pp" \
    >"$out/pp.log" 2>&1
echo "pp rc=$?" >>"$out/pp.log"
for f in tp4 tp4_threads1 pp; do echo "== $f"; tail -25 "$out/$f.log"; done
