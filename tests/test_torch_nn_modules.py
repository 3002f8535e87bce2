"""gearcache/_torch/nn_modules.py: the submodule watch behind enable()'s padding proof (a submodule set after the
proof is refused at the next call) and what a traced graph sees of it."""
import gc
import json
import subprocess
import sys
import weakref

import torch
from torch.nn.modules import module as nn_module

from gearcache._torch import nn_modules


def test_the_registration_hook_has_one_key_whatever_hooks_came_before():
    """torch keys a global hook by a counter every hook handle of the process shares, and Dynamo guards on the key: a
    warm process that registered another number of hooks first would miss every entry (found 2026-11-27)."""
    others = [torch.nn.Identity().register_forward_hook(lambda *a: None) for _ in range(3)]
    nn_modules.install_registration_hook()
    nn_modules.install_registration_hook()
    hooks = nn_module._global_module_registration_hooks
    mine = [k for k, v in hooks.items() if v is nn_modules._on_module_registration]
    assert mine == [nn_modules.HOOK_KEY], hooks
    assert others


def test_a_watch_flags_a_submodule_set_on_its_modules_only_and_stops_when_removed():
    watched, other, flag = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(), [False]
    watch = nn_modules.watch_submodules(list(watched.modules()), flag)
    other.add_module("x", torch.nn.ReLU())
    assert flag == [False]
    watched[0] = torch.nn.Linear(2, 2)
    assert flag == [True]
    flag[0] = False
    watch.remove()
    watched[0] = torch.nn.ReLU()
    assert flag == [False]


def test_a_watch_holds_its_modules_weakly():
    module, flag = torch.nn.Sequential(torch.nn.ReLU()), [False]
    nn_modules.watch_submodules([module], flag)

    ref = weakref.ref(module)
    del module
    gc.collect()
    assert ref() is None


def test_a_traced_modulelist_slice_runs_the_hook_as_a_no_op():
    """transformers slices ``self.layers[:n]`` inside the traced forward: a new ModuleList registers the layers. The
    hook returns at once under Dynamo (its graph guards on the hook's code alone) and flags nothing."""
    layers, flag = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]), [False]
    nn_modules.watch_submodules(list(layers.modules()), flag)

    def forward(x):
        for layer in layers[:2]:
            x = layer(x)
        return x

    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    x = torch.randn(1, 2)
    torch.testing.assert_close(compiled(x), forward(x))
    assert flag == [False]



FX_PROBE = """
import json, torch
from gearcache._torch import nn_modules
torch.compile(lambda x: x * 2, backend=lambda gm, example: gm)(torch.ones(2))   # Dynamo wraps fx.Tracer.trace
own = {name: torch.nn.Module.__dict__[name] for name in ("__call__", "__getattr__")}
seen = []

class Probe(torch.nn.Module):
    def forward(self, x):
        for name, method in own.items():
            patched = torch.nn.Module.__dict__[name]
            seen.append([patched is not method,
                         nn_modules.unpatched_class_attribute(torch.nn.Module, name, patched) is method])
        return x

torch.fx.symbolic_trace(Probe())
print(json.dumps([seen, all(torch.nn.Module.__dict__[name] is method for name, method in own.items())]))
"""


def test_torch_fx_wrappers_of_nn_module_read_as_torchs_own_methods():
    """``torch.fx``'s tracer (``symbolic_trace``, and ``make_fx`` under every AOTAutograd compile and Inductor pattern
    pass) sets wrappers of ``nn.Module.__call__`` and ``__getattr__`` on the class for the length of a trace, seen by
    every thread: ``unpatched_class_attribute`` answers the methods they wrap, torch's own; in a fresh process that
    compiled first, as a warm-up's does (Dynamo then wraps ``Tracer.trace``, which the wrappers are found in: once,
    told from a process that had not compiled, they were not found)."""
    out = subprocess.run([sys.executable, "-c", FX_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen, restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == [[True, True], [True, True]]      # (patched while tracing, read as torch's own)
    assert restored
