#!/usr/bin/env bash
# The warm first generate() of benchmarks/generate.py, with gearcache's log: cold child, then warm child.
store=$(mktemp -d); work=$(mktemp -d)
for v in gearcache gearcache; do
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) GEARCACHE_LOG=INFO \
    python3 benchmarks/generate.py --child llama $v "$store" "${1:-cuda}" "${2:-bfloat16}" "${3:-gpu}" 2>&1 \
    | grep -E "gearcache|first_generate|Traceback|Error" | cut -c1-240 | tail -${4:-25}
done
