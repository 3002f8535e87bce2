"""gearcache's own loader (gearcache/runplan.py): plans written at compile time, their checks, and the fallback to
torch's loader for graphs a plan cannot run exactly like torch."""
import json
import pathlib
import shutil

import pytest
import torch

from conftest import run_script
from gearcache import CacheCorruptionError, runplan
from gearcache.store import Store


def _plans(cache: pathlib.Path) -> dict[str, dict]:
    return {p.parent.parent.name: json.loads(p.read_text()) for p in cache.glob("artifacts/*/runplan/plan.json")}


def test_every_tiny_lm_artifact_has_a_supported_plan(tiny_lm_cache):
    cache, _ = tiny_lm_cache
    plans = _plans(cache)
    assert len(plans) == 2                                  # prefill and decode
    for akey, plan in plans.items():
        assert plan["supported"], plan.get("reason")
        assert plan["format"] == runplan.FORMAT and plan["num_outputs"] >= 1
        wrapper = cache / "artifacts" / akey / "runplan" / plan["wrapper"]
        assert "def call(" in wrapper.read_text()
        for lib in plan["cpp"].values():                    # C++ kernels: libraries inside the artifact
            assert (cache / "artifacts" / akey / lib).is_file()
        if plan["device_type"] == "cuda":
            for spec in plan["triton"].values():
                assert (cache / "artifacts" / akey / spec["cubin"]).is_file()


def test_plan_files_are_covered_by_the_artifact_digests(tiny_lm_cache, tmp_path):
    cache, _ = tiny_lm_cache
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, ignore=shutil.ignore_patterns("locks", "index", "leases"))
    akey = next(iter(_plans(copy)))
    store = Store(copy)
    store.verify_artifact(akey)
    wrapper = copy / "artifacts" / akey / "runplan" / "wrapper.py"
    wrapper.chmod(0o600)
    wrapper.write_text(wrapper.read_text() + "\nimport os  # tampered\n")
    with pytest.raises(CacheCorruptionError, match="runplan/wrapper.py"):
        store.verify_artifact(akey)


def test_plan_without_a_registered_operator_is_not_used(tmp_path):
    (tmp_path / "runplan").mkdir()
    (tmp_path / "runplan" / "wrapper.py").write_text("def call(args):\n    return (args[0] + 1,)\n")
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "device_type": "cpu",
            "device_index": 0, "num_inputs": 1, "num_outputs": 1, "ops": [["aten", "add"]]}
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    fn = runplan.load(tmp_path)
    assert fn is not None and torch.equal(fn(torch.ones(2))[0], torch.full((2,), 2.0))
    plan["ops"].append(["gearcache_no_such_namespace", "op"])
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    assert runplan.load(tmp_path) is None                   # the caller falls back to torch's loader


def test_wrapper_importing_more_of_torchs_compiler_is_not_used(tmp_path):
    (tmp_path / "runplan").mkdir()
    (tmp_path / "runplan" / "wrapper.py").write_text(
        "from torch._inductor.hooks import run_intermediate_hooks\n"
        "from torch._inductor.codegen.memory_planning import _align as align\n"
        "import triton\nimport triton.language as tl\n"
        "def call(args):\n    return (args[0] * align(3),)\n")
    plan = {"format": runplan.FORMAT, "supported": True, "wrapper": "wrapper.py", "num_inputs": 1, "num_outputs": 1}
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    fn = runplan.load(tmp_path)
    assert fn is not None and torch.equal(fn(torch.ones(1))[0], torch.full((1,), 64.0))
    (tmp_path / "runplan" / "wrapper.py").write_text(
        "from torch._inductor.graph import GraphLowering\ndef call(args):\n    return args\n")
    assert runplan.load(tmp_path) is None
    plan["supported"], plan["reason"] = False, "outputs aliasing inputs or others"
    (tmp_path / "runplan" / "plan.json").write_text(json.dumps(plan))
    assert runplan.load(tmp_path) is None


def test_misaligned_input_is_cloned_and_its_update_written_back():
    seen = {}

    def call(args):
        seen["aligned"] = args[0].data_ptr() % runplan.ALIGNMENT == 0
        seen["grad"] = torch.is_grad_enabled()
        args[0].add_(1.0)
        return (args[0] * 2,)

    run = runplan._make_run(call, {"num_inputs": 1, "num_outputs": 1, "inputs_to_check": [0],
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


def test_graph_returning_a_view_of_its_input_falls_back_to_torchs_loader(tmp_path, empty_torch_caches):
    """An output aliasing an input needs torch's AOTAutograd wrapper: no plan, torch's loader, same answers."""
    cache = tmp_path / "cache"
    cold = run_script("run_alias.py", str(cache))
    assert cold["equal"] and cold["counters"]["compiles"] == 1
    (plan,) = _plans(cache).values()
    assert plan["supported"] is False and "alias" in plan["reason"]
    warm = run_script("run_alias.py", str(cache), env=empty_torch_caches)
    assert warm["equal"] and warm["aliases_input"]
    assert warm["counters"]["loads"] == 1 and warm["counters"]["direct_loads"] == 0
    assert warm["counters"]["compiles"] == 0


def test_triton_launcher_computes_the_grid_and_passes_the_cubin_arguments(tmp_path, monkeypatch):
    """The launcher built from a launch record (the GPU path, checked here with torch's launcher stubbed)."""
    launches = []
    monkeypatch.setattr(runplan.compat, "load_cubin", lambda path, fn, shared, device: ("handle", path, fn, device))
    monkeypatch.setattr(runplan.compat, "cubin_launcher", lambda: lambda *a: launches.append(a))
    spec = {"cubin": "runplan/kernels/K.cubin", "function": "triton_poi_0", "shared": 0, "num_warps": 4,
            "arg_types": "OOiOO", "scratch_args": 2, "def_args": ["in_ptr0", "out_ptr0", "xnumel"],
            "call_args": ["in_ptr0", "out_ptr0", "xnumel"], "grid_prefix": [],
            "grid": ["-((xnumel) // -(512))", "1", "1"]}
    kernel = runplan._TritonKernel("triton_poi_0", spec, tmp_path, 1)
    kernel.run("a", "b", 1025, stream=7)
    handle = ("handle", str(tmp_path / "runplan/kernels/K.cubin"), "triton_poi_0", 1)
    assert launches == [(handle, 3, 1, 1, 4, 0, "OOiOO", ("a", "b", 1025, None, None), 7)]


def test_stable_input_replaced_by_a_misaligned_tensor_is_realigned():
    seen = []
    run = runplan._make_run(lambda args: seen.append([a.data_ptr() % runplan.ALIGNMENT for a in args]) or (),
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
    assert runplan.load(tmp_path) is None
