#!/usr/bin/env bash
# The GPU check of a change to the load, call or capture path, in one device call (one H100 or H200, or several:
# the test groups then run side by side, one per GPU), results under $OUT (or ./gpu_check_out): the GPU tests
# (CUDA graphs, run plans, background compiles, regions, warm-up loads, transformers, hf_prepare, hf_proof) beside
# enable()'s padding proof on a CUDA bf16 tiny Llama and, after both, the per-token benchmark of generate() with and
# without CUDA graphs (benchmarks/generate.py --per-token-only). EXTRA_TESTS: more test files, in the last group.
# SIDE_BY_SIDE=1 runs the groups at once on a single GPU too; PER_TOKEN=0 leaves the benchmark out.
# usage (device prefix of ../shared/device/README.md first): bash scripts/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu_check_out}
mkdir -p "$out"
python3 setup.py build_ext --inplace -q >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' | tee -a "$out/gpu.txt"
export GEARCACHE_TEST_DEVICE=cuda
groups=("tests/test_cuda_graphs.py"
        "tests/test_runplan_gpu.py tests/test_background.py tests/test_warmup_loads.py"
        "tests/test_regions.py tests/test_integrations_transformers.py"
        "tests/test_integrations_hf_prepare.py tests/test_integrations_hf_proof.py ${EXTRA_TESTS:-}")
ngpu=$(nvidia-smi -L | wc -l)
pids=()
for i in "${!groups[@]}"; do
    gpu=$((i % ngpu))
    if (( ngpu == 1 )); then gpu=0; fi
    ( CUDA_VISIBLE_DEVICES=$gpu timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m "not slow" \
        --durations=5 ${groups[$i]} >"$out/tests_$i.log" 2>&1; echo "tests_$i rc=$?" >>"$out/tests_$i.log" ) &
    pids+=($!)
    if (( ngpu == 1 )) && [[ ${SIDE_BY_SIDE:-0} == 0 ]]; then wait "${pids[-1]}"; fi   # one GPU: one after another
                                                          # (SIDE_BY_SIDE=1: all on the one GPU at once)
done
CUDA_VISIBLE_DEVICES=0 timeout 180 python3 - >"$out/proof.log" 2>&1 <<'PY'
import tempfile, torch
from transformers import LlamaConfig, LlamaForCausalLM
from gearcache.integrations.transformers import enable
for impl in ("sdpa", "eager"):
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
    lm = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    found = enable(lm, cache_dir=tempfile.mkdtemp()).prove_padding()
    print(f"proof {impl}: {'PROVED' if found is None else 'REFUSED: ' + found}")
PY
echo "proof rc=$?" >>"$out/proof.log"
wait
if [[ ${PER_TOKEN:-1} != 0 ]]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${PER_TOKEN_TIMEOUT:-300} python3 benchmarks/generate.py --device cuda --size gpu \
        --models llama --graphs --per-token-only --json "$out/per_token.json" >"$out/per_token.log" 2>&1
    echo "per-token rc=$?" >>"$out/per_token.log"
fi
for i in "${!groups[@]}"; do echo "== tests_$i: ${groups[$i]}"; grep -E "passed|failed|error|FAILED|rc=" "$out/tests_$i.log" | tail -8; done
cat "$out/proof.log"; [[ -f $out/per_token.log ]] && tail -15 "$out/per_token.log"
