"""What a new shape costs scaled-dot-product attention on its first call, per backend, serially and in threads.

    python benchmarks/sdpa_new_shapes.py cudnn|efficient serial|threads     # one fresh process per line

The reference decoder's decode attention (q [B, 16, 1, 64], k/v [B, 16, 256, 64], bf16, a boolean mask) at the 7 batch
gears 64 .. 1, in a fresh process whose CUDA context and cuBLAS are already up: the first call at each shape, one
after another (``serial``) or each in a thread of its own, all at once (``threads``); then a second call of every
shape in the main thread. cuDNN builds an execution plan for each new shape and keeps it per thread (PyTorch's
``MHA.cpp`` graph cache is ``thread_local``); this shows whether those builds overlap across threads. It bounds a
warm process's "every gear captured": each gear's warm-up run pays its shape's first call.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import wall_s  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
SIZES = [64, 32, 16, 8, 4, 2, 1]


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in BACKENDS or sys.argv[2] not in ("serial", "threads"):
        raise SystemExit(__doc__.split("\n\n")[1])
    backend, mode = BACKENDS[sys.argv[1]], sys.argv[2]
    dev, dt = "cuda", torch.bfloat16
    a = torch.randn(64, 64, device=dev, dtype=dt)
    (a @ a).sum().item()                                   # CUDA and cuBLAS up, as in a model's first run
    data = {}
    for b in SIZES:
        q = torch.randn(b, 16, 1, 64, device=dev, dtype=dt)
        k, v = (torch.randn(b, 16, 256, 64, device=dev, dtype=dt) for _ in range(2))
        data[b] = (q, k, v, (torch.arange(256, device=dev) <= 17)[None, :])
    torch.cuda.synchronize()
    times: dict[int, float] = {}

    def first(b: int) -> None:
        t = time.perf_counter()
        with sdpa_kernel([backend]):
            q, k, v, mask = data[b]
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.synchronize()
        times[b] = time.perf_counter() - t

    wall = wall_s(first, SIZES, mode)
    t = time.perf_counter()
    with sdpa_kernel([backend]):
        for b in SIZES:
            q, k, v, mask = data[b]
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    again = time.perf_counter() - t
    print(f"{sys.argv[1]:9s} {mode:7s} {torch.cuda.get_device_name()}, torch {torch.__version__}: first calls of "
          f"{len(SIZES)} shapes {wall * 1e3:.1f} ms wall; each " +
          " ".join(f"B{b}:{times[b] * 1e3:.1f}" for b in SIZES) + f" ms; then all {len(SIZES)} again in the main "
          f"thread {again * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
