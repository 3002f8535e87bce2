"""A loaded entry's per-call path (gearcache/call/entry.py): the C runner (gearcache/call/_callpath.c) and the Python
one do the same work: gather the graph inputs (module tensors read at every call), check alignment and grad mode, and
hand anything unusual to the run plan's Python ``run_list``."""
import collections
import gc
import sys
import weakref

import pytest
import torch

from gearcache._torch import state as torch_state, tensor_checks as torch_tensor_checks
from gearcache.call import entry as entry_mod
from gearcache import runplan
from gearcache.call.entry import Entry
from gearcache.runplan import PlanRunner

PATHS = [pytest.param(True, id="native"), pytest.param(False, id="python")]
MANIFEST = {"inputs": [["leaf", 0], ["state", "lin.weight"], ["state", "lin.bias"], ["state", "scale"]],
            "outputs": {"leaves": [["out", 0], ["leaf", 1]], "structure": ["tuple", [["leaf"], ["leaf"]]]}}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))


def reference(net, x):
    return torch.nn.functional.linear(x, net.lin.weight, net.lin.bias) * net.scale


def make_entry(net, native, plan_extra=None, seen=None):
    """An Entry over a hand-written run plan whose call() records what it was given (like Inductor's, it empties
    the list)."""
    seen = [] if seen is None else seen

    def call(args):
        seen.append({"aligned": [a.data_ptr() % runplan.ALIGNMENT == 0 for a in args],
                     "grad": torch.is_grad_enabled(), "autocast": torch_state.any_autocast_enabled(),
                     "ids": [id(a) for a in args]})
        x, w, b, s = args
        args.clear()
        if plan.get("mutated_inputs"):
            x.add_(1.0)
        return [torch.nn.functional.linear(x, w, b) * s]

    plan = {"num_inputs": 4, "num_outputs": 1, "inputs_to_check": [0, 1, 2, 3], "mutated_inputs": [],
            **(plan_extra or {})}
    return Entry(PlanRunner(call, plan), net, MANIFEST, native=native), seen


def test_the_c_extension_is_built():
    # The README's install builds it (setup.py); without it every call takes the slower Python path.
    assert entry_mod.NATIVE, "gearcache.call._callpath is not built: pip install -e . needs a C compiler"


@pytest.mark.parametrize("native", PATHS)
def test_a_call_gathers_inputs_and_module_tensors_and_builds_the_result(native):
    net = Net()
    entry, seen = make_entry(net, native)
    assert isinstance(entry.run, entry_mod._NativeRunner) is native
    x = torch.randn(3, 8)
    with torch.no_grad():
        out, leaf = entry((x, "passed through"))
    torch.testing.assert_close(out, reference(net, x))
    assert leaf == "passed through"
    assert seen[-1]["ids"] == [id(x), id(net.lin.weight), id(net.lin.bias), id(net.scale)]
    assert seen[-1]["grad"] is False and all(seen[-1]["aligned"])


@pytest.mark.parametrize("native", PATHS)
def test_a_replaced_or_updated_weight_is_used_at_the_next_call(native):
    net = Net()
    entry, seen = make_entry(net, native)
    x = torch.randn(3, 8)
    with torch.no_grad():
        entry((x, None))
        net.lin.weight = torch.nn.Parameter(torch.zeros(8, 8))      # a new object in the module's dict
        torch.testing.assert_close(entry((x, None))[0], reference(net, x))
        net.scale.fill_(3.0)                                       # an in-place update of a buffer
        torch.testing.assert_close(entry((x, None))[0], reference(net, x))
    assert seen[1]["ids"][1] == id(net.lin.weight)


def test_module_dicts_are_read_again_only_after_one_of_them_changed():
    # Python 3.12+: the runner watches the module's dicts and skips reading them while none changed; before 3.12
    # (no dict watchers) every call reads them. Either way a replaced weight is used at the next call.
    net = Net()
    entry, seen = make_entry(net, True)
    runner = entry.run
    assert runner.watched is (sys.version_info >= (3, 12))
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            entry((x, None))
        assert runner.state_reads == (1 if runner.watched else 3)
        net.lin.weight = torch.nn.Parameter(torch.zeros(8, 8))
        torch.testing.assert_close(entry((x, None))[0], reference(net, x))
        entry((x, None))
        assert runner.state_reads == (2 if runner.watched else 5)
        del net.scale                               # a deleted buffer is noticed too
        with pytest.raises(KeyError, match="scale"):
            entry((x, None))
    assert seen[3]["ids"][1] == id(net.lin.weight) and runner.fast_calls == 5


@pytest.mark.parametrize("native", PATHS)
def test_misaligned_call_input_is_realigned_and_its_update_written_back(native):
    net = Net()
    entry, seen = make_entry(net, native, {"mutated_inputs": [0]})
    x = torch.zeros(3 * 8 + 1)[1:].view(3, 8)                       # 4 bytes past an aligned allocation
    assert x.data_ptr() % runplan.ALIGNMENT
    with torch.no_grad():
        out = entry((x, None))[0]
    assert all(seen[-1]["aligned"])
    assert torch.equal(x, torch.ones(3, 8))                          # the graph's in-place update reached the caller
    torch.testing.assert_close(out, reference(net, x))
    if native:
        assert (entry.run.fast_calls, entry.run.fallback_calls) == (0, 1)


@pytest.mark.parametrize("native", PATHS)
def test_a_module_tensor_replaced_by_a_misaligned_one_is_realigned_every_call_until_it_is_aligned(native):
    net = Net()
    entry, seen = make_entry(net, native)
    x = torch.randn(3, 8)
    with torch.no_grad():
        entry((x, None))
        net.lin.bias = torch.nn.Parameter(torch.zeros(9)[1:])      # misaligned view
        entry((x, None))
        entry((x, None))
        net.lin.bias = torch.nn.Parameter(torch.zeros(8))
        entry((x, None))
        entry((x, None))
    assert [all(s["aligned"]) for s in seen] == [True] * 5
    if native:
        assert (entry.run.fast_calls, entry.run.fallback_calls) == (3, 2)


@pytest.mark.parametrize("native", PATHS)
def test_grad_enabled_runs_with_grad_off_and_restores_it(native):
    net = Net().requires_grad_(False)
    entry, seen = make_entry(net, native)
    with torch.enable_grad():
        entry((torch.randn(3, 8), None))
        assert torch.is_grad_enabled()
    assert seen[-1]["grad"] is False
    if native:
        assert entry.run.fallback_calls == 1


@pytest.mark.parametrize("native", PATHS)
def test_compiled_code_runs_with_autocast_off_and_autocast_is_restored(native):
    # A graph's casts are in the graph: autocast around its extern kernels would cast them again (AOTAutograd's
    # runtime wrapper turns it off too).
    net = Net()
    entry, seen = make_entry(net, native)
    x = torch.randn(3, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = entry((x, None))
        assert torch.is_autocast_enabled("cpu")
    assert seen[-1]["autocast"] is False
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(net, x))
    if native:
        assert (entry.run.fast_calls, entry.run.fallback_calls) == (0, 1)
    with torch.no_grad():
        entry((x, None))
    assert seen[-1]["autocast"] is False
    if native:
        assert (entry.run.fast_calls, entry.run.fallback_calls) == (1, 1)


def test_a_graph_that_bumps_version_counters_always_takes_the_python_path():
    net = Net()
    entry, _ = make_entry(net, True, {"version_bumped_inputs": [0]})
    x = torch.randn(3, 8)
    before = x._version
    with torch.no_grad():
        entry((x, None))
        entry((x, None))
    assert x._version == before + 2
    assert (entry.run.fast_calls, entry.run.fallback_calls) == (0, 2)


@pytest.mark.parametrize("native", PATHS)
def test_a_deleted_module_tensor_is_a_clear_error(native):
    net = Net()
    entry, _ = make_entry(net, native)
    del net.lin._parameters["bias"]
    with torch.no_grad(), pytest.raises(KeyError, match="bias"):
        entry((torch.randn(3, 8), None))


def test_runner_rejects_a_malformed_recipe_with_the_reason():
    Runner = entry_mod._NativeRunner

    def make(recipe, check=()):
        return Runner(call=print, fallback=print, recipe=recipe, check=check, always_fallback=False,
                      is_grad_enabled=torch.is_grad_enabled, is_autocast_enabled=torch_state.any_autocast_enabled)
    with pytest.raises(TypeError, match=r"recipe\[0\]"):
        make(("weight",))
    with pytest.raises(ValueError, match="leaf index must be >= 0"):
        make((-1,))
    with pytest.raises(ValueError, match="out of range"):
        make((0,), check=(1,))
    with pytest.raises(IndexError, match="reads leaf 2"):
        make((2,))((torch.zeros(1),))


@pytest.mark.parametrize("reader", ["native DATA_PTR", "tensor.data_ptr()"])
def test_the_runner_checks_alignment_alike_with_the_native_address_reader_or_without(reader):
    Runner = entry_mod._NativeRunner
    capsule = torch_tensor_checks.native_data_ptr()
    assert capsule is not None                      # the session builds the native module (tests/conftest.py)
    calls = []
    runner = Runner(call=lambda a: calls.append("call") or a.clear(), fallback=lambda a: calls.append("fallback"),
                    recipe=(0, 1), check=(0, 1), always_fallback=False, is_grad_enabled=torch.is_grad_enabled,
                    is_autocast_enabled=torch_state.any_autocast_enabled,
                    data_ptr=capsule if reader == "native DATA_PTR" else None)
    aligned, misaligned = torch.zeros(8), torch.zeros(9)[1:]
    with torch.no_grad():
        for leaves in [(aligned, aligned), (aligned, misaligned), (misaligned, aligned), (aligned, aligned)]:
            runner(leaves)
    assert calls == ["call", "fallback", "fallback", "call"]
    assert (runner.fast_calls, runner.fallback_calls) == (2, 2)


def test_the_runner_takes_only_the_native_address_reader():
    with pytest.raises(TypeError, match="data_ptr: expected None or gearcache.native's DATA_PTR capsule"):
        entry_mod._NativeRunner(call=print, fallback=print, recipe=(0,), check=(), always_fallback=False,
                                   is_grad_enabled=torch.is_grad_enabled,
                                   is_autocast_enabled=torch_state.any_autocast_enabled, data_ptr=print)


def test_an_entry_does_not_keep_its_module_alive():
    net = Net()
    entry, _ = make_entry(net, True)
    with torch.no_grad():
        entry((torch.randn(3, 8), None))
    net.entry = entry                   # a cycle through the runner's references, as CachedFunction makes one
    alive = weakref.ref(net)
    del net, entry
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("outputs, expected", [
    ({"leaves": [["out", 0]], "structure": ["leaf"]}, 0),
    ({"leaves": [["out", 1], ["out", 0]], "structure": ["tuple", [["leaf"], ["leaf"]]]}, (1, 0)),
    ({"leaves": [["out", 0], ["leaf", 1]], "structure": ["tuple", [["leaf"], ["leaf"]]]}, None),    # an input
    ({"leaves": [["out", 0], ["out", 1]], "structure": ["list", [["leaf"], ["leaf"]]]}, None),     # a list
    ({"leaves": [["out", 0]], "structure": ["tuple", [["tuple", [["leaf"]]]]]}, None),             # nested
])
def test_result_outputs_names_only_results_that_are_graph_outputs_or_a_flat_tuple_of_them(outputs, expected):
    assert entry_mod._result_outputs(outputs) == expected


Point = collections.namedtuple("Point", "x y")


def test_a_result_class_is_found_by_name_and_refused_where_its_fields_changed():
    """``record_class``: the class an entry's result holds, found by ``module:qualname`` at load; another field list
    than at the compile (the class was changed) or no such class is an UnsupportedInputError, never a result built
    with the wrong fields."""
    from gearcache.call.entry import record_class
    from gearcache.errors import UnsupportedInputError

    assert record_class("namedtuple", f"{__name__}:Point", ["x", "y"]) is Point
    with pytest.raises(UnsupportedInputError, match=r"with fields \['x', 'y', 'z'\]"):
        record_class("namedtuple", f"{__name__}:Point", ["x", "y", "z"])
    with pytest.raises(UnsupportedInputError, match="cannot find"):
        record_class("dataclass", f"{__name__}:Missing", [])
