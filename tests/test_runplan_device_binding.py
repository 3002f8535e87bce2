"""Device binding (gearcache/runplan/device_binding.py): the CUDA wrapper's index literals become a name bound at
load, and anything it does not understand is refused; the loader's choice between binding and WrongDevice
(gearcache/runplan/loader.py). The wrapper sample (tests/data/cuda_wrapper.py.txt) is Inductor's Python wrapper
for a CUDA graph as torch 2.13's codegen (torch/_inductor/codegen/wrapper.py, cuda/device_op_overrides.py) writes it.
"""
import ast
import json
from pathlib import Path

import pytest
import torch

from gearcache import runplan
from gearcache.runplan.device_binding import BOUND_NAME, unbind_device_index
from gearcache.errors import NoPlan

SAMPLE = (Path(__file__).parent / "data" / "cuda_wrapper.py.txt").read_text()


def _on(index: int) -> str:
    """The sample as Inductor writes it for cuda:<index> (kernel sources and the benchmark block included)."""
    return SAMPLE.replace("index=0", f"index={index}").replace("cuda:0", f"cuda:{index}") \
        .replace("(0):", f"({index}):").replace("set_device(0)", f"set_device({index})") \
        .replace("get_raw_stream(0)", f"get_raw_stream({index})")


def _live(text: str) -> str:
    """The part of the wrapper that runs at load and call time."""
    return text.split("def benchmark_compiled_module")[0].split("async_compile.wait(globals())")[1]


def test_wrappers_for_different_gpus_become_one_text():
    texts = {i: unbind_device_index(_on(i), i) for i in (0, 1, 3)}
    live = {i: _live(t) for i, t in texts.items()}
    assert live[0] == live[1] == live[3]
    for needle in (f"_DeviceGuard({BOUND_NAME})", f"set_device({BOUND_NAME})", f"get_raw_stream({BOUND_NAME})",
                   f"device(type='cuda', index={BOUND_NAME})", f"f'cuda:{{{BOUND_NAME}}}'"):
        assert needle in live[0], needle
    assert "cuda:3" not in live[3] and "index=3" not in live[3] and "(3)" not in live[3]
    ast.parse(texts[3])                                  # still Python


def test_kernel_sources_and_benchmark_block_are_left_alone():
    text = unbind_device_index(_on(2), 2)
    assert "DeviceProperties(type='cuda', index=2," in text      # the kernel's metadata: its cubin is what loads
    assert "device='cuda:2'" in text                              # benchmark_compiled_module never runs at load
    assert text.count(BOUND_NAME) == 5


def test_the_docstring_torch_2_11_opens_the_wrapper_with_is_left_alone():
    """torch 2.11 (H200, 2026-11-22) starts the CUDA wrapper with a docstring quoting its compile-time auto-tuning
    code, device strings included: a bare string runs nothing, so it neither blocks the rewrite nor is rewritten."""
    docstring = '''r"""
Compile-time auto-tuning block:

with torch.cuda._DeviceGuard(1):
    stream1 = get_raw_stream(1)
buf1 = generate_example_value((8, 32), (32, 1), 'cuda:1', torch.float32, 0, (8, 32))
"""
'''
    text = unbind_device_index(docstring + _on(1), 1)
    assert text.startswith(docstring)
    assert _live(text) == _live(unbind_device_index(_on(1), 1))


def test_rewritten_call_runs_with_the_bound_index():
    """The rewritten device lines, executed with the name bound, do what Inductor's lines do for that index."""
    snippet = ("def call():\n    d = device(type='cuda', index=1)\n    s = 'cuda:1'\n"
               "    return d, torch.device(s)\n")
    scope = {"device": torch.device, "torch": torch}
    exec(unbind_device_index(snippet, 1), {**scope, BOUND_NAME: 5}, scope)
    assert scope["call"]() == (torch.device("cuda", 5), torch.device("cuda:5"))


@pytest.mark.parametrize("line, why", [
    ("    with torch.cuda._DeviceGuard(1):\n        pass\n", "more than one GPU"),
    ("    stream1 = get_raw_stream(1)\n", "more than one GPU"),
    ("    x = torch.ops.aten.full.default([4], 0, device=device(type='cuda', index=1))\n", "more than one GPU"),
    ("    x = y.to('cuda:1')\n", "device string 'cuda:1'"),
    ("    print('on cuda:0 now')\n", "device string"),
    ("    s = torch.cuda.Stream(0)\n", "integer argument of Stream()"),
    ("    torch.cuda.current_stream(device=0)\n", "integer argument of current_stream()"),
    ("    x = torch.ops.aten.empty.memory_format([4], device=0)\n", "integer argument of memory_format()"),
    ("    x = device('cuda')\n", "without an index"),
    ("    with torch.cuda._DeviceGuard(i):\n        pass\n", "computed argument"),
])
def test_literals_it_does_not_understand_are_refused(line, why):
    source = f"def call(args):\n    with torch.cuda._DeviceGuard(0):\n        pass\n{line}"
    with pytest.raises(NoPlan, match="device index not bindable") as info:
        unbind_device_index(source, 0)
    assert why in str(info.value) and "line 4" in str(info.value)


def test_integers_that_are_not_device_indexes_are_kept():
    source = ("def call(args):\n    buf = empty_strided_cuda((4, ), (1, ), torch.float32)\n"
              "    v = reinterpret_tensor(buf, (2, ), (1, ), 0)\n"
              "    w = torch.ops.aten.full.default([4], 0, device=device(type='cuda', index=0))\n")
    out = unbind_device_index(source, 0)
    assert "(1, ), 0)" in out and "[4], 0, device=" in out and out.count(BOUND_NAME) == 1


def _plan_folder(tmp_path: Path, **fields) -> Path:
    (tmp_path / "runplan").mkdir()
    (tmp_path / "runplan" / "wrapper.py").write_text(
        f"def call(args):\n    return (args[0] + {BOUND_NAME},)\n")
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "device_type": "cuda",
            "num_inputs": 1, "num_outputs": 1, **fields}
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    return tmp_path


def test_loader_binds_a_device_free_plan_to_the_callers_gpu(tmp_path):
    folder = _plan_folder(tmp_path, device_index=0, device_free=True)
    assert runplan.load_artifact(folder, 3)(torch.zeros(1))[0].item() == 3
    assert runplan.load_artifact(folder)(torch.zeros(1))[0].item() == 0        # None: the compile GPU


def test_loader_refuses_a_bound_plan_on_another_gpu(tmp_path):
    folder = _plan_folder(tmp_path, device_index=1, device_free=False, device_reason="a literal")
    with pytest.raises(runplan.WrongDevice, match="bound to cuda:1"):
        runplan.load_artifact(folder, 0)
    assert runplan.load_artifact(folder, 1)(torch.zeros(1))[0].item() == 1


def test_loader_refuses_torchs_loader_on_another_gpu(tmp_path):
    """A device-free plan this process cannot load must not fall back to torch's loader, which would run the graph
    on the GPU it was compiled on; nor may an artifact without a plan."""
    folder = _plan_folder(tmp_path, device_index=0, device_free=True, ops=[["gearcache_no_such_namespace", "op"]])
    with pytest.raises(runplan.WrongDevice, match="torch's loader would run it on cuda:0"):
        runplan.load_artifact(folder, 2)
    plan = {"format": runplan.FORMAT, "supported": False, "reason": "collectives", "device_index": 0,
            "device_free": False}
    (folder / "runplan" / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(runplan.WrongDevice, match="collectives"):
        runplan.load_artifact(folder, 1)


def test_only_collectives_without_a_stand_in_are_known_bound_before_compiling():
    """torch's functional collectives get device-free plans (runplan/collectives.py); process-group ops of other
    namespaces get no plan, so their artifacts keep the GPU index in their key from the start."""
    import torch.distributed  # noqa: F401 - registers torch.ops.c10d

    def graph_with(op, args):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(torch.ops.aten.sin.default, (x,))
        graph.output(graph.call_function(op, (y, *args)))
        return torch.fx.GraphModule({}, graph)

    functional = graph_with(torch.ops._c10d_functional.all_reduce.default, ("sum", "0"))
    assert runplan.device_bound_reason(functional) is None
    other = graph_with(torch.ops.c10d.allreduce_.default, ())
    assert runplan.device_bound_reason(other) == "collectives without a stand-in (c10d)"
    plain = torch.fx.symbolic_trace(lambda x: torch.ops.aten.sin.default(x) + 1)
    assert runplan.device_bound_reason(plain) is None
