"""Issue #35's wrong answers from value guards, one case each, run through gearcache in this process and compared with
eager: the output and the buffer the method writes in place (``count``). JSON report on the last line:
``{case: {"out_diff", "state_diff", "compiles", "loads", "misses", "akeys" (the artifacts of the entries it
served), "error"}, "hooks": compile hooks}``.

usage: run_guard_cases.py CACHE_DIR PHASE [--graphs] [CASE ...]

On ``$GEARCACHE_TEST_DEVICE`` (default cpu); ``--graphs``: ``mode="reduce-overhead"`` (a CUDA graph per entry).

PHASE ``base``: per case, a fresh model and one call (the entries of the unchanged models); ``after``: per case, a fresh
model, a call, the change, a call (compared); ``before``: per case, a fresh model, the change, then its first call
(compared). A change to a class or a global is undone after its case. Every call runs under inference mode, on a
copy of the input; eager runs on a deep copy of the model taken just before the call.
"""
import gc
import copy
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compile_hooks  # noqa: E402

compile_hooks.install()
import torch  # noqa: E402
from torch import nn  # noqa: E402

from gearcache import CompilerConfig, cache_compile, counters  # noqa: E402


def glob_fn(x, k=2.0):
    return x * k


class Block(nn.Module):
    """Reads a helper method of its class, a submodule, a buffer, an attribute that may be added later, a list's and a
    dict's lengths, a global function with a default; writes a buffer in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.linspace(0.5, 2.0, 4))
        self.register_buffer("count", torch.zeros(1))
        self.items = [1, 2]
        self.table = {"a": 1}

    def helper(self, x):
        return x + 1

    def forward(self, x):
        self.count.add_(1)
        y = self.helper(self.lin(x)) * getattr(self, "extra", 1.0) + self.b
        return glob_fn(y) * len(self.items) + len(self.table) + self.count


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return self.conv(x).relu() + self.count


def scaled_class(scale):
    """A model class built by a factory: its forward reads the closure variable ``scale``; ``set_scale`` rebinds it."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            return self.lin(x) * scale + self.count

    def set_scale(value):
        nonlocal scale
        scale = value

    return Scaled, set_scale


def patched_helper(self, x):
    return x * 3 - 34


def no_defaults(x, *extra):
    return x * 3


def _set(obj, name, value):
    """Set ``obj.name`` and return the undo."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _global_hook(model):
    handle = nn.modules.module.register_module_forward_hook(lambda mod, inputs, out: out * 10)
    return handle.remove


def _replace_lin(model):
    torch.manual_seed(7)
    model.lin = nn.Linear(4, 4).to(model.lin.weight.device)


def _swap_strides(model):
    w = model.lin.weight.data
    model.lin.weight.data = (w * 2).t().contiguous().t()        # other values, transposed strides, same object


def _scale_setter(model):
    model.set_scale(5.0)


# name -> (model class or factory, the change: returns an undo or None)
CASES = {
    "class_patch": ("block", lambda m: _set(Block, "helper", patched_helper)),
    "closure": ("scaled", _scale_setter),
    "submodule": ("block", _replace_lin),
    "instance_patch": ("block", lambda m: setattr(m, "helper", types.MethodType(patched_helper, m))),
    "attr_added": ("block", lambda m: setattr(m, "extra", 3.0)),
    "hook": ("block", lambda m: m.lin.register_forward_hook(lambda mod, inputs, out: out * 10) and None),
    "global_hook": ("block", _global_hook),
    "list_append": ("block", lambda m: m.items.append(3)),
    "dict_add": ("block", lambda m: m.table.__setitem__("b", 2)),
    "buffer_dtype": ("block", lambda m: setattr(m, "b", m.b.double())),
    "buffer_shape": ("block", lambda m: setattr(m, "b", torch.full((1,), 0.25, device=m.b.device))),
    "param_stride": ("block", _swap_strides),
    "channels_last": ("conv", lambda m: m.to(memory_format=torch.channels_last) and None),
    "glob_fn_no_defaults": ("block", lambda m: _set(sys.modules[__name__], "glob_fn", no_defaults)),
    "data_swap": ("block", lambda m: setattr(m.b, "data", m.b.data * 3)),
}


DEVICE = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")


def make(kind, phase):
    torch.manual_seed(0)
    if kind == "conv":
        return ConvBlock().eval().to(DEVICE), torch.randn(2, 3, 5, 5, device=DEVICE)
    if kind == "scaled":
        cls, setter = scaled_class(5.0 if phase == "before" else 2.0)     # another process: the other closure
        model = cls().eval().to(DEVICE)
        model.set_scale = setter
        return model, torch.randn(2, 4, device=DEVICE)
    return Block().eval().to(DEVICE), torch.randn(2, 4, device=DEVICE)


def compared(cached, model, x):
    """Call the cached method and eager on a deep copy of the model; the differences of output and ``count``."""
    twin = copy.deepcopy(model)
    got = cached(x.clone())
    want = twin.forward(x.clone())
    out_diff = float((got.double() - want.double()).abs().max()) if got.shape == want.shape else float("inf")
    return out_diff, float((model.count - twin.count).abs().max()), got.dtype == want.dtype


def run_case(name, cache_dir, phase, config):
    kind, change = CASES[name]
    if kind == "scaled" and phase == "before":
        change = None                       # this process's factory made the scale 5 from the start
    model, x = make(kind, phase)
    cached = cache_compile(model.forward, cache_dir=cache_dir, config=config)
    before = dict(vars(counters))
    undo = None
    report = {}
    try:
        with torch.inference_mode():
            if phase == "base":
                cached(x.clone())
            elif phase == "after":
                cached(x.clone())
                undo = change(model)
                report["out_diff"], report["state_diff"], report["same_dtype"] = compared(cached, model, x)
            else:
                undo = change(model) if change is not None else None
                report["out_diff"], report["state_diff"], report["same_dtype"] = compared(cached, model, x)
        report["error"] = None
    except Exception as exc:                # noqa: BLE001 - reported, the test says which case
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if undo is not None:
            undo()
    report.update({k: getattr(counters, k) - before[k] for k in ("compiles", "loads", "misses")})
    report["akeys"] = sorted(e.manifest["akey"] for e in cached.life.table.values() if hasattr(e, "manifest"))
    return report


def main():
    cache_dir, phase, *names = sys.argv[1:]
    config = CompilerConfig(mode="reduce-overhead") if "--graphs" in names else None
    names = [n for n in names if n != "--graphs"]
    report = {name: run_case(name, cache_dir, phase, config) for name in names or CASES}
    report["hooks"] = dict(compile_hooks.COUNTS)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
