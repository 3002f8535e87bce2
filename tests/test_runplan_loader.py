"""The run plan's loader (gearcache/runplan/loader.py, stand_ins.py): running a plan, the per-call wrapper, and
the fallback to torch's loader for a plan this process cannot run."""
import json

import pytest
import torch

from gearcache import runplan
from gearcache.runplan import PlanRunner
from gearcache.runplan.loader import load_plan


def test_plan_without_a_registered_operator_is_not_used(tmp_path):
    (tmp_path / "runplan").mkdir()
    (tmp_path / "runplan" / "wrapper.py").write_text("def call(args):\n    return (args[0] + 1,)\n")
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "device_type": "cpu",
            "device_index": 0, "num_inputs": 1, "num_outputs": 1, "ops": [["aten", "add"]]}
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    fn = load_plan(tmp_path)
    assert fn is not None and torch.equal(fn(torch.ones(2))[0], torch.full((2,), 2.0))
    plan["ops"].append(["gearcache_no_such_namespace", "op"])
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    assert load_plan(tmp_path) is None                   # the caller falls back to torch's loader


def _write_plan(folder, wrapper: str) -> dict:
    """A one-input, one-output run plan in ``folder`` whose wrapper's source is ``wrapper``; returns the plan."""
    (folder / "runplan").mkdir(exist_ok=True)
    (folder / "runplan" / "wrapper.py").write_text(wrapper)
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "num_inputs": 1, "num_outputs": 1}
    (folder / "runplan" / "plan.json").write_text(json.dumps(plan))
    return plan


def test_wrapper_importing_more_of_torchs_compiler_is_not_used(tmp_path):
    plan = _write_plan(tmp_path,
                       "from torch._inductor.hooks import run_intermediate_hooks\n"
                       "from torch._inductor.codegen.memory_planning import _align as align\n"
                       "import triton\nimport triton.language as tl\n"
                       "def call(args):\n    return (args[0] * align(3),)\n")
    fn = load_plan(tmp_path)
    assert fn is not None and torch.equal(fn(torch.ones(1))[0], torch.full((1,), 64.0))
    (tmp_path / "runplan" / "wrapper.py").write_text(
        "from torch._inductor.graph import GraphLowering\ndef call(args):\n    return args\n")
    assert load_plan(tmp_path) is None
    plan["supported"], plan["reason"] = False, "outputs aliasing inputs or others"
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    assert load_plan(tmp_path) is None


def test_wrapper_checking_an_output_with_torch_215s_assert_tensor_metadata_loads_and_checks(tmp_path):
    """torch 2.15's wrappers check an extern kernel's output with runtime_utils.assert_tensor_metadata (dtype, sizes,
    strides): the loader serves it without importing that module, and it still refuses a wrong output."""
    _write_plan(tmp_path,
                "import torch\n"
                "from torch._inductor.runtime.runtime_utils import assert_tensor_metadata\n"
                "def call(args):\n"
                "    out = args[0] * 2\n"
                "    assert_tensor_metadata(out, (2, 3), (3, 1), torch.float32, 'aten.mm')\n"
                "    assert_tensor_metadata(None, (2, 3), (3, 1), torch.float32)\n"
                "    return (out,)\n")
    fn = load_plan(tmp_path)
    assert fn is not None and torch.equal(fn(torch.ones(2, 3))[0], torch.full((2, 3), 2.0))
    with pytest.raises(RuntimeError, match="expected dtype torch.float32 but got torch.float64\nError in op: aten.mm"):
        fn(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(AssertionError, match="size"):
        fn(torch.ones(3, 2))


def test_misaligned_input_is_cloned_and_its_update_written_back():
    seen = {}

    def call(args):
        seen["aligned"] = args[0].data_ptr() % runplan.ALIGNMENT == 0
        seen["grad"] = torch.is_grad_enabled()
        args[0].add_(1.0)
        return (args[0] * 2,)

    run = PlanRunner(call, {"num_inputs": 1, "num_outputs": 1, "inputs_to_check": [0],
                                   "mutated_inputs": [0]})
    base = torch.zeros(9)
    x = base[1:]                                            # 4 bytes past an aligned allocation
    assert x.data_ptr() % runplan.ALIGNMENT
    with torch.enable_grad():
        out = run(x)[0]
    assert seen == {"aligned": True, "grad": False}         # like torch's wrappers: aligned copy, grad off
    assert torch.equal(x, torch.ones(8)) and torch.equal(out, torch.full((8,), 2.0))
    assert torch.is_grad_enabled() is True
    with pytest.raises(TypeError, match="takes 1 inputs"):
        run(x, x)


def test_stable_input_replaced_by_a_misaligned_tensor_is_realigned():
    seen = []
    run = PlanRunner(lambda args: seen.append([a.data_ptr() % runplan.ALIGNMENT for a in args]) or (),
                            {"num_inputs": 2, "num_outputs": 0, "inputs_to_check": [0, 1], "mutated_inputs": []})
    run.set_stable_inputs([1])                              # input 1 is a parameter: checked when it changes
    weight = torch.zeros(8)
    run(torch.zeros(4), weight)
    run(torch.zeros(4), weight)
    run(torch.zeros(4), torch.zeros(9)[1:])                 # a new, misaligned parameter tensor
    run(torch.zeros(9)[1:], weight)                         # a misaligned call input
    assert seen == [[0, 0]] * 4


def test_wrapper_failing_to_load_falls_back_instead_of_failing_the_call(tmp_path):
    (tmp_path / "runplan").mkdir()
    (tmp_path / "runplan" / "wrapper.py").write_text(
        "import torch\nlimit = torch._C.no_such_thing\ndef call(args):\n    return args\n")
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "num_inputs": 1, "num_outputs": 1}
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    assert load_plan(tmp_path) is None

