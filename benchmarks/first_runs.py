"""What the decode gears' first runs cost plain PyTorch (eager) in a fresh process: the floor under any warm start.

    python benchmarks/first_runs.py serial|threads [--sdpa no-cudnn]      # one fresh process per line

The reference decoder (hidden 1024, 8 layers, bf16) in eager mode, decode at the 7 batch gears 64 .. 1, each shape's
first call timed (device synchronised), one after another (``serial``) or each in a thread of its own on its own
stream, all at once (``threads``, as ``CudaGraphs.capture_all`` warms gears up); then every shape's second call.
A first call pays the libraries' per-shape work (cuDNN's attention plan, cuBLAS's choice and first load of a GEMM
kernel) and, for the first shape of the process, their start; a warm gearcache process replays the same library
calls in each gear's warm-up run, so the sum here bounds "every gear loaded and captured" from below. The CUDA
context is up before the clock starts (a tensor is on the device), as it is in ``decode_step.py --child warmup``.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import wall_s  # noqa: E402
GEARS = [64, 32, 16, 8, 4, 2, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("serial", "threads"))
    ap.add_argument("--sdpa", choices=("default", "no-cudnn"), default="default")
    opts = ap.parse_args()
    import torch

    import reference_decoder as ref

    if opts.sdpa == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    model = ref.GPT().to("cuda", torch.bfloat16).eval()
    inputs = {b: ref.inputs(b, "cuda", torch.bfloat16) for b in GEARS}
    torch.cuda.synchronize()
    first: dict[int, float] = {}

    def run(b: int) -> None:
        with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream()):
            t = time.perf_counter()
            model.decode(*inputs[b])
            torch.cuda.current_stream().synchronize()
            first[b] = time.perf_counter() - t

    wall = wall_s(run, GEARS, opts.mode)
    second = {}
    with torch.inference_mode():
        for b in GEARS:
            t = time.perf_counter()
            model.decode(*inputs[b])
            torch.cuda.synchronize()
            second[b] = time.perf_counter() - t
    print(json.dumps({"mode": opts.mode, "sdpa": opts.sdpa, "all_first_runs_s": round(wall, 4),
                      "first_ms": {b: round(first[b] * 1e3, 1) for b in GEARS},
                      "second_ms": {b: round(second[b] * 1e3, 2) for b in GEARS}}))


if __name__ == "__main__":
    main()
