"""A geared module whose method updates a buffer in place, under ``on_new_signature="background"``, called beside
an eager twin. ``run_background.py STORE cold|kill|warm``: cold exits right after its calls (the exit settles the
compiles in flight); kill too, after killing the worker (SIGKILL: the exit compiles them in this process); warm
installs the compiler hooks first. Prints a JSON report."""
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if sys.argv[2] == "warm":
    import compile_hooks

    compile_hooks.install()
import torch

from gearcache import CompilerConfig, InferenceConfig, cache_compile, counters, set_dim_gears


class Stepper(torch.nn.Module):
    def __init__(self, store=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(8))
        if store is not None:
            config = CompilerConfig(on_new_signature="background", inference_config=InferenceConfig(
                warmup_workers=1))
            self.cached = cache_compile(self.fwd, config=config, cache_dir=store)

    def fwd(self, x):
        self.steps.add_(x.sum(0))
        return torch.relu(self.lin(x)) + self.steps


torch.manual_seed(0)
model, twin = Stepper(sys.argv[1]), Stepper()
twin.load_state_dict(model.state_dict())
equal = True
with torch.inference_mode():
    for rows in (3, 5, 3, 8, 4):
        x = torch.randn(rows, 8)
        set_dim_gears(x, {0: [4, 8]})
        out, want = model.cached(x), twin.fwd(x)
        equal &= out.shape == want.shape and bool(torch.allclose(out, want, atol=1e-5))
        equal &= bool(torch.allclose(model.steps, twin.steps, atol=1e-5))
if sys.argv[2] == "kill":
    import signal

    from gearcache.compiling import background

    for pid in background.worker_pids():
        os.kill(pid, signal.SIGKILL)
hooks = compile_hooks.COUNTS if sys.argv[2] == "warm" else {}
print(json.dumps({"equal": equal, "hooks": hooks, "counters": {k: getattr(counters, k) for k in (
    "traces", "compiles", "loads", "eager_calls", "hits")}}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
