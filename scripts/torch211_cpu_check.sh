#!/usr/bin/env bash
# The fast tier on torch 2.11.0 (the GPU machine's torch) on this CPU machine, in a throw-away venv and clone: the
# device's torch differs from CI's (2.13, 2.14.1) in private APIs gearcache reads (gearcache/_torch/), and a GPU
# session has too little device time to run the CPU suites there. Only a CUDA build of 2.11 exists (+cu130: ~0.5 GB,
# and its CUDA libraries' wheels, a few GB, from the registry); it runs on CPU. Not part of .ci/run (CI never pulls a
# CUDA build). About 8 min on 2 cores.
# usage: bash scripts/torch211_cpu_check.sh [pytest args, default: the fast tier]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${WORK:-/tmp/gearcache-torch211}
[[ -x $work/venv/bin/python ]] || {
    python3 -m venv "$work/venv"
    PIP_CONFIG_FILE=/dev/null "$work/venv/bin/pip" install -q "torch==2.11.0"
}
export PATH="$work/venv/bin:$PATH"      # the venv's console scripts (tests run `gearcache` itself)
rm -rf "$work/tree" && git clone -q "$root" "$work/tree"
cd "$work/tree"
"$work/venv/bin/pip" install -q -e ".[test]"
"$work/venv/bin/python" -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__'
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore "${@:--m not slow}"
