"""The floor under a warm first call: a fresh process's first EAGER decode call of the reference decoder (hidden 1024,
8 layers, bf16, B=1) on CUDA, timed as benchmarks/_first_call.py times gearcache's (from just before the call to the
device synchronising), and its second call. One JSON line.

    PYTHONPATH=$PWD python3 scripts/eager_first_call.py"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import torch  # noqa: E402

import reference_decoder as ref  # noqa: E402

model = ref.make("cuda", torch.bfloat16)
x, kv, pos = ref.inputs(1, "cuda", torch.bfloat16)
torch.cuda.synchronize()
times = []
with torch.inference_mode():
    for _ in range(2):
        t0 = time.perf_counter()
        model.decode(x, kv, pos)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
print(json.dumps({"eager_first_call_s": times[0], "eager_second_call_s": times[1]}))
