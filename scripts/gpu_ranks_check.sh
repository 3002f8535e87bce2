#!/usr/bin/env bash
# Issue #38's runs on a 4-GPU machine (nvidia-h100-x4), in one device call, results under $OUT (or
# ./gpu_ranks_out): TP=4 of benchmarks/tp_decoder.py (all 7 gears, every target row, and the eager floor: the same
# first calls by the eager methods in a fresh job), a cold, a warm and an eager start-only job of the same with
# cuDNN's attention off (--no-cudnn-attention: what cuDNN's per-shape plans cost a warm start; NOCUDNN=0 leaves them
# out), and PP=2 x TP=2 of benchmarks/pp_decoder.py (with its eager floor). Each benchmark prints its own PASS/FAIL
# rows; the TP=4 warm job's rank-0 warm-up timelines are printed last.
# usage (device prefix of ../shared/device/README.md first): bash scripts/gpu_ranks_check.sh
set -uo pipefail
out=${OUT:-gpu_ranks_out}
mkdir -p "$out"
python3 setup.py build_ext --inplace -q >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
cache=/tmp/gc-tp4        # outside $OUT: artifacts do not travel back
rm -rf "$cache" "$cache-nocudnn"
timeout 330 python3 benchmarks/tp_decoder.py --nproc 4 --device cuda --cache-dir "$cache" --out-dir "$out/tp4" \
    >"$out/tp4.log" 2>&1
echo "tp4 rc=$?" >>"$out/tp4.log"
if [[ ${NOCUDNN:-1} != 0 ]]; then
    for p in cold warm eager; do
        mkdir -p "$out/tp4_nocudnn_$p"
        GEARCACHE_BENCH_START_ONLY=1 timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
            benchmarks/tp_decoder.py --phase "$p" --cache-dir "$cache-nocudnn" --device cuda --no-cudnn-attention \
            --out-dir "$out/tp4_nocudnn_$p" >"$out/tp4_nocudnn_$p.log" 2>&1
        echo "tp4 no-cudnn $p rc=$?" >>"$out/tp4_nocudnn_$p.log"
    done
    python3 - "$out" <<'PY'
import glob, json, sys
for p in ("cold", "warm", "eager"):
    rs = [json.load(open(f)) for f in glob.glob(f"{sys.argv[1]}/tp4_nocudnn_{p}/*-rank*.json")]
    if rs:
        print(f"no-cudnn {p}: first call {max(r['first_call_s'] for r in rs):.3f} s, decode gears "
              f"{max(r['decode_all_gears_s'] for r in rs):.3f} s, every gear {max(r['all_gears_s'] for r in rs):.3f} s, "
              f"compiles {sum(r['counters_after_warmup']['compiles'] for r in rs)}, destroy returned "
              f"{[r['destroy_process_group_returned'] for r in rs]}")
PY
fi
timeout 200 python3 benchmarks/pp_decoder.py --device cuda --gears 1,2,4,8 --dtype float32 --out-dir "$out/pp" \
    >"$out/pp.log" 2>&1
echo "pp rc=$?" >>"$out/pp.log"
for f in tp4 pp; do echo "== $f"; grep -v '^{' "$out/$f.log" | grep -v '^\[rank' | tail -25; done
python3 - "$out" <<'PY'
import json, sys
try:
    r = json.load(open(f"{sys.argv[1]}/tp4/warm-rank0.json"))
    print("== TP=4 warm, rank 0 timelines"); print(r["timelines"]["decode"][-1800:]); print(r["timelines"]["prefill"][-1800:])
except (OSError, KeyError) as exc:
    print("no TP=4 warm timelines:", exc)
PY
