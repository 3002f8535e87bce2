"""A model whose graph bakes in Python values from three places, written as source files and run in this process:
a module-level constant (``SCALE``), a constant in another file the method imports (``ALPHA`` in
``values_helper.py``) and module attributes set from constructor defaults (``eps``, ``approximate``). Each process
writes the files with the values it is given, so two processes can disagree on them as two deployments of edited code
would. JSON report on the last line: counters, compile hooks, and whether the cached call equals eager.

usage: run_values.py CACHE_DIR CODE_DIR [--scale S] [--alpha A] [--eps E] [--approximate none|tanh]
"""
import gc
import argparse
import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compile_hooks  # noqa: E402

compile_hooks.install()

parser = argparse.ArgumentParser()
parser.add_argument("cache_dir")
parser.add_argument("code_dir")
parser.add_argument("--scale", default="1.0")
parser.add_argument("--alpha", default="0.1")
parser.add_argument("--eps", default="1e-5")
parser.add_argument("--approximate", default="none")
args = parser.parse_args()

os.makedirs(args.code_dir, exist_ok=True)
with open(os.path.join(args.code_dir, "values_helper.py"), "w") as f:
    f.write(f"ALPHA = {args.alpha}\n")
with open(os.path.join(args.code_dir, "values_model.py"), "w") as f:
    f.write(textwrap.dedent(f"""
        import torch
        import values_helper
        from gearcache import cache_compile

        SCALE = {args.scale}


        class Model(torch.nn.Module):
            def __init__(self, cache_dir, eps={args.eps}, approximate={args.approximate!r}):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)
                self.ln = torch.nn.LayerNorm(8, eps=eps)
                self.approximate = approximate
                self.cached = cache_compile(self.fwd, cache_dir=cache_dir)

            def fwd(self, x):
                h = torch.nn.functional.gelu(self.ln(self.lin(x)), approximate=self.approximate)
                return h * SCALE + values_helper.ALPHA
    """))
sys.path.insert(0, args.code_dir)

import torch  # noqa: E402

import values_model  # noqa: E402
from gearcache import counters  # noqa: E402

torch.manual_seed(0)
model = values_model.Model(args.cache_dir).eval()
x = torch.randn(4, 8)
with torch.inference_mode():
    out = model.cached(x)
    again = model.cached(x)
    ref = model.fwd(x)
report = {"equal": bool(torch.allclose(out, ref, atol=1e-6) and torch.equal(out, again)),
          "max_abs_diff": float((out - ref).abs().max()), "counters": dict(vars(counters)),
          "hooks": compile_hooks.COUNTS}
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
