"""A loaded entry's per-call path (gearcache/call/entry.py): the C runner (gearcache/call/_callpath.c) and the Python
one do the same work: gather the graph inputs (module tensors read at every call), check alignment and grad mode, and
hand anything unusual to the run plan's Python ``run_list``."""
import collections
import dataclasses
import gc
import re
import sys
import typing
import weakref

import pytest
import torch

import gearcache
from gearcache.errors import UnsupportedInputError
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


@dataclasses.dataclass
class OwnInit:
    """@dataclass keeps an ``__init__`` the class defines: eager's ``OwnInit(x + 1)`` holds ``(x + 1) * 2``."""
    t: torch.Tensor

    def __init__(self, t):
        self.t = t * 2


@dataclasses.dataclass
class Plain:
    t: torch.Tensor


class SubInit(Plain):
    """Not a dataclass itself, but ``dataclasses.is_dataclass`` says it is (it inherits the fields)."""
    def __init__(self, t):
        super().__init__(t + 100)


@dataclasses.dataclass
class TakesInitVar:
    t: torch.Tensor
    scale: dataclasses.InitVar[int]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrozenSlots:
    t: torch.Tensor
    n: int = 3
    names: list = dataclasses.field(default_factory=list)


class Typed(typing.NamedTuple):
    t: torch.Tensor
    n: int = 5

    def total(self):
        return self.t.sum() + self.n


class MakesTwice(collections.namedtuple("MakesTwice", "t")):
    @classmethod
    def _make(cls, values):
        return super()._make(v * 2 for v in values)


def test_a_record_class_is_rebuilt_only_where_no_code_of_the_user_runs_again_on_the_values():
    """``build`` rebuilds a result's record from the values eager's constructor already made: a dataclass with an
    ``__init__`` of its own (eager ``(x + 1) * 2``, rebuilt 4x + 4), a subclass's ``__init__`` (+100 twice), an
    ``InitVar`` (a TypeError at every call) or a ``_make`` override are refused; the generated ``__init__`` of a
    frozen, slotted, keyword-only dataclass with a ``default_factory`` and a ``typing.NamedTuple`` with defaults and
    methods are served. No compile."""
    for kind, cls in (("dataclass", Plain), ("dataclass", FrozenSlots), ("namedtuple", Typed)):
        assert entry_mod.rebuild_refusal(kind, cls) is None, cls
    for kind, cls, reason in (("dataclass", OwnInit, r"__init__ \(OwnInit.__init__\) is not the one @dataclass"),
                              ("dataclass", SubInit, r"__init__ \(SubInit.__init__\) is not the one @dataclass"),
                              ("dataclass", TakesInitVar, r"takes \['t', 'scale'\], not exactly its fields"),
                              ("namedtuple", MakesTwice, "overriding _make")):
        assert re.search(reason, entry_mod.rebuild_refusal(kind, cls) or ""), cls
        fields = ["t"] if kind == "namedtuple" else [f.name for f in dataclasses.fields(cls)]
        with pytest.raises(UnsupportedInputError, match=reason):
            entry_mod.record_class(kind, f"{__name__}:{cls.__qualname__}", fields)


class ReturnsRecord(torch.nn.Module):
    def __init__(self, cache_dir=None):
        super().__init__()
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return Rebound(x + 1, OwnInit(x) if x.dim() == 2 else x * 2)


Rebound = collections.namedtuple("Rebound", "t u")


def test_a_result_class_rebound_between_calls_is_the_one_eager_returns_and_a_custom_init_is_refused(
        tmp_path, monkeypatch):
    """The module global a method reads its named tuple from rebound to a new class (same name and fields) between
    calls: eager returns the new class; the entry returned the class bound at its load. Now the rebinding (seen by
    the value guards' watch) drops the entry and its next load binds the class found then: one compile, then a load.
    A record holding a dataclass with its own ``__init__`` (eager ``x * 2``; rebuilt it was ``x * 4``) is refused at
    the capture."""
    m, eager = ReturnsRecord(tmp_path), ReturnsRecord()
    x, counts = torch.ones(3), (gearcache.counters.compiles, gearcache.counters.loads)
    with torch.no_grad():
        first = m.cached(x)
        assert type(first) is Rebound and torch.equal(first.u, eager.fwd(x).u)
        monkeypatch.setattr(sys.modules[__name__], "Rebound", collections.namedtuple("Rebound", "t u"))
        got, want = m.cached(x), eager.fwd(x)
        assert type(got) is type(want) is Rebound and type(first) is not Rebound, (type(got), type(want))
        assert torch.equal(got.t, want.t) and torch.equal(got.u, want.u)
        assert (gearcache.counters.compiles - counts[0], gearcache.counters.loads - counts[1]) == (1, 1)
        with pytest.raises(UnsupportedInputError, match=r"output.u is a OwnInit, a dataclass whose __init__"):
            m.cached(torch.ones(2, 2))
