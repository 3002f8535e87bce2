"""Shows why a CUDA graph's output views hold only until the method's next call, whatever its gear (GPU).

    python scripts/graph_views_shared_pool.py [CACHE_DIR]

The reference decoder with gears 1, 2, 4 under ``graph_outputs="view"`` (views into the graphs' static outputs,
unchecked). The gears' graphs are recorded largest first into one memory pool, so a smaller gear may keep its
static outputs in blocks a larger gear's graph uses for intermediates. For pairs of gears (a, b): call gear a, keep
its outputs' values, call gear b on other inputs, and report whether gear a's views changed. Any "changed True"
means a replay of another gear overwrote them: what ``view-checked`` (every earlier view raises after any call of
the method) and ``copy`` (the default) protect against.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch  # noqa: E402

import reference_decoder as ref  # noqa: E402
from gearcache import CompilerConfig, cache_compile  # noqa: E402

GEARS = [1, 2, 4]


def main() -> None:
    config = CompilerConfig(mode="reduce-overhead")
    config.inference_config.dim_gears = {"x": {0: GEARS}, "kv": {2: GEARS}}
    config.inference_config.graph_outputs = "view"
    cache_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="gearcache-views-")

    class CachedGPT(ref.GPT):
        def __init__(self):
            super().__init__()
            self.cached_decode = cache_compile(self.decode, config=config, cache_dir=cache_dir)

    torch.manual_seed(0)
    model = CachedGPT().to("cuda", torch.bfloat16).eval()
    with torch.inference_mode():
        model.cached_decode.warmup(*ref.inputs(GEARS[-1], "cuda", torch.bfloat16))
        for a, b in ((1, 4), (2, 4), (1, 2), (4, 1)):
            logits, kv = model.cached_decode(*ref.inputs(a, "cuda", torch.bfloat16))
            kept_logits, kept_kv = logits.clone(), kv.clone()
            x, kv_b, pos = ref.inputs(b, "cuda", torch.bfloat16)
            model.cached_decode(x * 0 + 7, kv_b * 3, pos)
            torch.cuda.synchronize()
            print(f"views of gear {a} after a call of gear {b}: logits changed {not torch.equal(logits, kept_logits)}, "
                  f"KV cache changed {not torch.equal(kv, kept_kv)}")


if __name__ == "__main__":
    main()
