"""Arguments sharing memory with the module tensors an entry reads or writes (gearcache/call/state_alias.py): the
rules an entry derives from its run plan's writes, the refusal, the shortcut's matcher, and rules that follow the
module's tensors. No compile here: entries over hand-written run plans (tests/test_cached_function.py runs compiled
ones against eager, in the compiling process, a fresh one and with gears)."""
import importlib.util
import pathlib

import pytest
import torch

import gearcache
from gearcache.call import signature, state_alias
from gearcache.call.entry import Entry
from gearcache.runplan import PlanRunner

# graph inputs: x, y (the call's leaves 0 and 1), then the module's count, table and w
MANIFEST = {"inputs": [["leaf", 0], ["leaf", 1], ["state", "count"], ["state", "table"], ["state", "w"]],
            "outputs": {"leaves": [["out", 0]], "structure": ["leaf"]}}
COUNT, TABLE, W = 2, 3, 4


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.arange(8.)[:4])     # its storage holds 8 floats
        self.register_buffer("table", torch.arange(4.) + 10)
        self.w = torch.nn.Parameter(torch.ones(4))

    def step(self, x, y):
        return x + y


def entry_for(net, mutated):
    """An entry whose run plan says it writes the graph inputs ``mutated`` (None: a plan that does not say)."""
    plan = {"num_inputs": 5, "num_outputs": 1, "inputs_to_check": []}
    if mutated is not None:
        plan["mutated_inputs"] = mutated

    def call(args):
        x, y, *_ = args
        args.clear()
        return [x + y]
    return Entry(PlanRunner(call, plan), net, MANIFEST)


def beyond_count(net):
    """A tensor on ``count``'s storage past its elements: another view of the same storage."""
    return torch.empty(0).set_(net.count.untyped_storage(), 4, (2,), (1,))


def forbidden(entry):
    """Each leaf's forbidden module tensors, as "buffer count" (their names without "the module's ")."""
    return {i: sorted(name.removeprefix("the module's ") for name in ranges.names)
            for i, ranges in entry.state_aliases}


def test_an_entry_that_writes_nothing_has_no_rules_and_serves_read_only_sharing():
    net = Net()
    entry = entry_for(net, [])
    assert entry.state_aliases == ()
    with torch.no_grad():
        torch.testing.assert_close(entry((net.count[:2], net.table[1:3])), net.count[:2] + net.table[1:3])


def test_a_written_module_tensor_forbids_its_storage_to_every_argument_the_graph_reads():
    net = Net()
    entry = entry_for(net, [COUNT])
    assert forbidden(entry) == {0: ["buffer count"], 1: ["buffer count"]}
    one = torch.ones(2)
    for x in (net.count, net.count[:2], net.count[2:4], beyond_count(net), net.count.view(2, 2)):
        assert state_alias.first_alias(entry.state_aliases, (x, one)) == (0, "the module's buffer count")
    for x in (net.table[:2], net.w[:2].detach(), net.count[:2].clone(), torch.arange(8.)[:2]):
        assert state_alias.first_alias(entry.state_aliases, (x, one)) is None     # read-only sharing, or none


def test_a_written_argument_must_share_no_module_tensor_the_graph_reads():
    net = Net()
    entry = entry_for(net, [1])                                     # writes y
    assert forbidden(entry) == {1: ["buffer count", "buffer table", "parameter w"]}
    one = torch.ones(2)
    assert state_alias.first_alias(entry.state_aliases, (one, net.w[1:3].detach())) == (1, "the module's parameter w")
    assert state_alias.first_alias(entry.state_aliases, (one, net.table[:2])) == (1, "the module's buffer table")
    assert state_alias.first_alias(entry.state_aliases, (net.table[:2], one)) is None    # x only read


def test_an_entry_whose_writes_are_unknown_is_taken_to_write_every_input():
    entry = entry_for(Net(), None)
    assert forbidden(entry) == {i: ["buffer count", "buffer table", "parameter w"] for i in (0, 1)}


def test_the_refusal_names_the_argument_the_module_tensor_and_the_fix():
    net = Net()
    entry = entry_for(net, [COUNT])
    one = torch.ones(2)
    leaves, key = signature.call_key((one, net.count[1:3]), {})
    with pytest.raises(gearcache.UnsupportedInputError,
                       match=r"Net.step: argument y shares memory with the module's buffer count.*\.clone\(\)"):
        state_alias.refuse("Net.step", net.step, entry.state_aliases, leaves, key)
    state_alias.refuse("Net.step", net.step, entry.state_aliases, (one, one.clone()), key)     # others pass


@pytest.mark.parametrize("distinct", [False, True], ids=["reads-arguments", "writes-an-argument"])
def test_the_shortcut_matcher_passes_a_call_sharing_a_module_tensor_to_the_key_path(distinct, checks):
    """The matcher answers False for such a call (the key's path refuses it), True for a plain one; the rules'
    leaf indices are renumbered among the tensors where a scalar sits between them."""
    net = Net()
    entry = entry_for(net, [COUNT])
    rules = ((2, entry.state_aliases[0][1]),)                       # the tensor after the scalar
    with torch.no_grad():
        leaves, key = signature.call_key((torch.ones(2), 3, torch.ones(2)), {})
        matcher = signature.matcher(leaves, key, distinct_storages=distinct, state_rules=rules)
        assert matcher is not None
        assert matcher((torch.ones(2), 3, torch.ones(2)))
        assert not matcher((torch.ones(2), 3, net.count[2:4]))
        assert not matcher((torch.ones(2), 3, beyond_count(net)))
        assert matcher((net.count[2:4], 3, torch.ones(2)))                 # leaf 0 has no rule here
        assert matcher((torch.ones(2), 3, net.count[2:4].clone()))
        shared = torch.ones(4)
        assert matcher((shared[:2], 3, shared[2:])) is not distinct     # two arguments on one storage
        empty = torch.ones(0)
        assert matcher((torch.ones(2), 3, empty.new_ones(2)))


@pytest.mark.parametrize("distinct", [False, True], ids=["reads-arguments", "writes-an-argument"])
def test_the_native_storage_check_answers_as_the_python_one(distinct, checks):
    """Tensors only: the C++ check (native) or the Python one around Dynamo's, on calls with a forbidden storage
    at each place, two tensors on one storage, and none."""
    net = Net()
    entry = entry_for(net, [1])                                     # writes y: y must not be on any module tensor
    with torch.no_grad():
        leaves, key = signature.call_key((torch.ones(2), torch.ones(2)), {})
        matcher = signature.matcher(leaves, key, distinct_storages=distinct, state_rules=entry.state_aliases)
        assert (type(matcher.check).__name__ == "TensorMatch") is (checks == "native")
        one = torch.ones(2)
        assert matcher((one, torch.ones(2)))
        assert matcher((net.table[:2], torch.ones(2)))                  # x only read
        for on in (net.table[2:], net.w[:2].detach(), net.count[:2], beyond_count(net)):
            assert not matcher((one, on))
        shared = torch.ones(4)
        assert matcher((shared[:2], shared[2:])) is not distinct


def test_a_rebound_entry_has_the_rules_of_the_module_tensors_where_they_are_now():
    """A buffer replaced, or a tensor's ``.data`` swapped, moves the entry (``state_moved``: the method's watch sends
    the next call to ``_revalidate``, which rebinds it): the rebound entry forbids the new storages."""
    net = Net()
    entry = entry_for(net, [COUNT])
    old = net.count
    net.count = torch.zeros(4)
    assert entry.state_moved(net)
    entry = entry.rebound(net)
    one = torch.ones(2)
    assert state_alias.first_alias(entry.state_aliases, (net.count[:2], one)) == (0, "the module's buffer count")
    assert state_alias.first_alias(entry.state_aliases, (old[:2], one)) is None
    assert not entry.state_moved(net)
    with torch.no_grad():
        net.count.data = torch.zeros(4)
    assert entry.state_moved(net)
    entry = entry.rebound(net)
    assert state_alias.first_alias(entry.state_aliases, (net.count[:2], one)) == (0, "the module's buffer count")


class BumpsBuffer(torch.nn.Module):
    """docs/CONCEPTS.md's case: the method writes a buffer and reads its argument."""

    def __init__(self, cache_dir=None, config=None):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4))
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir, config=config)

    def step(self, x):
        self.buf.add_(1)
        return x * 3


def test_a_view_of_a_buffer_the_entry_writes_is_refused_through_the_shortcut_and_a_clone_is_served(tmp_path):
    """Captured with a plain tensor, then called with ``m.buf[:2]``: the compiled graph read ``x`` before its write
    to ``buf`` (gearcache gave 3, 6, 9 where eager gives 6, 9, 12). Refused now, after calls that set the shortcut,
    with nothing written; a ``.clone()`` equals eager; an instance with ``check_signature=False`` (its unchecked
    calls) loading the same entry refuses it too."""
    m, e = BumpsBuffer(tmp_path), BumpsBuffer()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(m.cached(torch.ones(2)), e.step(torch.ones(2)))
        assert m.cached.shortcut_calls == 1
        for shared in (m.buf[:2], m.buf[2:4], m.buf.view(2, 2)[1]):
            before = m.buf.clone()
            with pytest.raises(gearcache.UnsupportedInputError, match="argument x shares memory with the module's "
                                                                      "buffer buf"):
                m.cached(shared)
            assert torch.equal(m.buf, before)
        for _ in range(2):
            torch.testing.assert_close(m.cached(m.buf[:2].clone()), e.step(e.buf[:2].clone()))
            torch.testing.assert_close(m.buf, e.buf)
        unchecked = BumpsBuffer(tmp_path, gearcache.CompilerConfig(check_signature=False))
        unchecked.cached(torch.ones(2))
        with pytest.raises(gearcache.UnsupportedInputError, match="buffer buf"):
            unchecked.cached(unchecked.buf[:2])


@pytest.mark.slow
def test_module_tensors_passed_as_arguments_are_refused_cold_warm_and_geared(tmp_path):
    """tests/scripts/run_state_alias.py: a method writing the buffer ``count`` and the argument ``y``, reading ``x``
    and the buffer ``table``, captured with plain tensors. Every call passing an argument on ``count``'s storage (the
    buffer, a view with an offset, another view past its elements), or ``y`` on ``table``'s, is refused with nothing
    written, after a plain call that set the shortcut; also after ``count`` is replaced and ``table``'s ``.data``
    swapped. ``x`` on ``table`` (both only read) and clones equal eager. The same in a fresh process loading the entry
    (which compiles nothing), and with gears (padded copies are copied back: no safer; a call past the largest gear
    served by an entry of its own, ``past_largest_gear="compile"``, too). Before, ``y=table`` gave
    [69, 71] where eager gives [90, 92], and with gears ``x=count`` [51, 54] for [54, 57]. Arguments over one memory
    on two storage objects (``torch.from_numpy`` views of one array, overlapping or from one start) are refused
    where ``y`` is written (before: [2, 5] for eager's [2, 6]); views of one tensor are served (compiled as views of
    one base), unpadded."""
    from conftest import Script

    served = {"x=table", "clones", "after: clones", "x, y: one tensor's views"}
    cold = Script("run_state_alias.py", str(tmp_path / "cache"))
    geared = Script("run_state_alias.py", str(tmp_path / "geared"), "gears").result()
    cold = cold.result()
    for report in (cold, geared, warm := Script("run_state_alias.py", str(tmp_path / "cache")).result()):
        calls = report["calls"]
        serves = served - ({"x, y: one tensor's views"} if report is geared else set())   # padded copies: refused
        assert {k: v for k, v in calls.items() if k.endswith(": plain") or k in serves} == \
            {k: True for k in calls if k.endswith(": plain") or k in serves}, report
        assert all(v == "refused" for k, v in calls.items() if not (k.endswith(": plain") or k in serves)), report
    # the plain signature, the numpy views (one key: compiled as apart, then refused), the one tensor's views
    assert cold["compiles"] == 3 and all(cold["shortcut_served_plain"][1:]), cold
    assert warm["compiles"] == 0 and warm["loads"] == 3 and all(warm["shortcut_served_plain"][1:]), warm


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


def _step_with_state() -> type:
    """tests/scripts/run_state_alias.py's ``StepWithState``: writes the buffer ``count`` and the argument ``y``; reads
    ``x``, ``y`` and the buffer ``table``."""
    path = pathlib.Path(__file__).parent / "scripts" / "run_state_alias.py"
    spec = importlib.util.spec_from_file_location("run_state_alias", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StepWithState


@needs_cuda
@pytest.mark.parametrize("geared", [False, True], ids=["graph-shortcut", "gears"])
def test_under_cuda_graphs_a_module_tensor_argument_is_refused_before_a_replay_or_a_capture(tmp_path, geared):
    """mode="reduce-overhead": a graph reads and writes the module's tensors in place and copies its inputs in before
    and back after a replay, so a call passing a view of ``count`` (or ``y`` on ``table``) is refused like on CPU:
    after plain calls that replay through the shortcut (its matcher passes the call on), and, with gears, on the
    first call of a gear whose entry and graph do not exist yet (before the capture's warm-up run). Nothing written;
    plain calls equal eager before and after."""
    cfg = gearcache.CompilerConfig(mode="reduce-overhead")
    if geared:
        cfg.inference_config.dim_gears = {"x": {0: [2, 4]}, "y": {0: [2, 4]}}
    step_with_state = _step_with_state()
    m, e = step_with_state(tmp_path, cfg).cuda(), step_with_state().cuda()

    def plain(rows):
        args = [torch.randn(rows, device="cuda") for _ in range(2)]
        torch.testing.assert_close(m.cached(*[a.clone() for a in args]), e.step(*args))
        torch.testing.assert_close(m.count, e.count)
        torch.testing.assert_close(m.table, e.table)

    with torch.inference_mode():
        for _ in range(3):
            plain(2)
        assert geared or m.cached.shortcut_calls == 2
        rows = 3 if geared else 2                   # gears: 3 rows pad to the gear 4, not captured yet
        for x, y in ((m.count[:rows], torch.ones(rows, device="cuda")),
                     (torch.ones(rows, device="cuda"), m.table[:rows])):
            before = [t.clone() for t in (m.count, m.table, x, y)]
            with pytest.raises(gearcache.UnsupportedInputError, match="shares memory with the module's buffer"):
                m.cached(x, y)
            assert all(torch.equal(a, b) for a, b in zip(before, (m.count, m.table, x, y)))
        plain(rows)
        plain(2)


class NumpyBacked(torch.nn.Module):
    """A buffer made with ``torch.from_numpy`` over part of an array: another ``from_numpy`` view of the same array
    is a tensor on a storage of its own (another start address) over the buffer's memory."""

    def __init__(self, cache_dir=None):
        super().__init__()
        import numpy
        self.array = numpy.arange(8, dtype=numpy.float32)
        self.register_buffer("count", torch.from_numpy(self.array[:4]))
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.step, cache_dir=cache_dir)

    def step(self, x):
        self.count.add_(1)
        return x * 3


def test_an_argument_on_another_storage_over_a_module_tensor_memory_is_refused(checks):
    """Sharing is told by memory, not by storage object: ``from_numpy(array[1:3])`` overlaps the buffer
    ``from_numpy(array[:4])`` from a storage that starts elsewhere (the key's path and the shortcut's matcher); one
    past the buffer's memory is served."""
    import numpy
    net = NumpyBacked()
    entry = Entry(PlanRunner(lambda args: [args[0] * 3], {"num_inputs": 2, "num_outputs": 1, "inputs_to_check": [],
                                                           "mutated_inputs": [1]}), net,
                  {"inputs": [["leaf", 0], ["state", "count"]],
                   "outputs": {"leaves": [["out", 0]], "structure": ["leaf"]}})
    inside, after = torch.from_numpy(net.array[1:3]), torch.from_numpy(net.array[4:6])
    assert state_alias.first_alias(entry.state_aliases, (inside,)) == (0, "the module's buffer count")
    straddling = torch.from_numpy(net.array[3:5])
    assert state_alias.first_alias(entry.state_aliases, (straddling,)) == (0, "the module's buffer count")
    assert state_alias.first_alias(entry.state_aliases, (after,)) is None
    assert state_alias.first_alias(entry.state_aliases, (torch.from_numpy(numpy.ones(2, numpy.float32)),)) is None
    with torch.no_grad():
        leaves, key = signature.call_key((torch.ones(2),), {})
        matcher = signature.matcher(leaves, key, state_rules=entry.state_aliases)
        assert (type(matcher.check).__name__ == "TensorMatch") is (checks == "native")
        assert matcher((torch.ones(2),)) and matcher((after,)) and not matcher((inside,))


def test_a_written_module_tensor_over_another_ones_bytes_on_another_storage_refuses_every_call():
    """Buffers ``from_numpy(array[:4])`` and ``from_numpy(array[1:5])``: torch compiles them as apart, so an entry
    writing one refuses every call (the rule ``CALL``: no shortcut matcher either); reading both is served, and so is
    writing one of two views of one tensor (one storage object: views of one base to torch)."""
    net = NumpyBacked()
    net.register_buffer("shifted", torch.from_numpy(net.array[1:5]))
    manifest = {"inputs": [["leaf", 0], ["state", "count"], ["state", "shifted"]],
                "outputs": {"leaves": [["out", 0]], "structure": ["leaf"]}}

    def entry(mutated):
        plan = {"num_inputs": 3, "num_outputs": 1, "inputs_to_check": [], "mutated_inputs": mutated}
        return Entry(PlanRunner(lambda args: [args[0] * 3], plan), net, manifest)

    writes = entry([1])
    assert [i for i, _ in writes.state_aliases][:1] == [signature.CALL]
    with pytest.raises(gearcache.UnsupportedInputError, match=r"N.step: the module tensor count, which the compiled "
                                                              r"entry writes, shares memory with .*\['shifted'\]"):
        state_alias.refuse("N.step", None, writes.state_aliases, (torch.ones(2),), None)
    with torch.no_grad():
        leaves, key = signature.call_key((torch.ones(2),), {})
        assert signature.matcher(leaves, key, state_rules=writes.state_aliases) is None
    assert entry([]).state_aliases == ()
    base = torch.arange(8.)
    net.count, net.shifted = base[:4], base[1:5]           # one storage object
    assert all(i != signature.CALL for i, _ in entry([1]).state_aliases)


def test_a_numpy_view_over_a_buffer_the_entry_writes_is_refused_compiled(tmp_path):
    """The compiled repro: eager gives [10, 13] (x read after the buffer's write), the entry gave [7, 10]."""
    import numpy
    m, e = NumpyBacked(tmp_path), NumpyBacked()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(m.cached(torch.ones(2)), e.step(torch.ones(2)))
        with pytest.raises(gearcache.UnsupportedInputError, match="argument x shares memory with the module's "
                                                                  "buffer count"):
            m.cached(torch.from_numpy(m.array[1:3]))
        torch.testing.assert_close(m.count, e.count)
        outside = m.cached(torch.from_numpy(m.array[4:6]))
        torch.testing.assert_close(outside, e.step(torch.from_numpy(e.array[4:6])))
        torch.testing.assert_close(torch.from_numpy(numpy.array(m.array)), torch.from_numpy(numpy.array(e.array)))


class TwoNumpyBuffers(torch.nn.Module):
    """Buffers ``a`` and ``b`` made with ``torch.from_numpy`` of overlapping views of one array (two storage objects
    over shared bytes: torch compiles them as apart), ``c`` and ``d`` views of one tensor (one storage object), ``w``
    windows whose elements overlap."""

    def __init__(self):
        super().__init__()
        import numpy
        self.array = numpy.arange(8, dtype=numpy.float32)
        self.register_buffer("a", torch.from_numpy(self.array[:4]))
        self.register_buffer("b", torch.from_numpy(self.array[2:6]))
        t = torch.arange(8.)
        self.register_buffer("c", t[:4])
        self.register_buffer("d", t[2:6])
        self.register_buffer("w", torch.arange(6.).as_strided((3, 2), (1, 1)))    # windows over 4 floats


def entry_over_state(net, mutated):
    """An entry reading the argument x and the module tensors a, b, c, d, w (graph inputs 1..5), writing
    ``mutated``."""
    plan = {"num_inputs": 6, "num_outputs": 1, "inputs_to_check": [], "mutated_inputs": mutated}
    return Entry(PlanRunner(lambda args: [args[0] * 3], plan), net,
                 {"inputs": [["leaf", 0], ["state", "a"], ["state", "b"], ["state", "c"], ["state", "d"],
                             ["state", "w"]],
                  "outputs": {"leaves": [["out", 0]], "structure": ["leaf"]}})


def test_a_written_module_tensor_over_its_own_or_another_storage_objects_memory_refuses_every_call(checks):
    """``a`` written, ``b`` read over its bytes from another storage object, or ``w`` written, whose own elements
    overlap: every call is refused (``CALL``: the key's path; the shortcut has no matcher), naming the tensor and the
    fix. Only read, or views of one tensor (``c`` written, ``d`` read: torch compiles them as views of one base): no
    such rule."""
    net = TwoNumpyBuffers()
    for written, why in (([1], r"a, which the compiled entry writes, shares memory"),
                         ([5], r"w, which the compiled entry writes, has elements over one memory \(sizes \[3, 2\], "
                               r"strides \[1, 1\]\)")):
        rules = entry_over_state(net, written).state_aliases
        assert state_alias.first_alias(rules, (torch.ones(2),))[0] == signature.CALL
        with pytest.raises(gearcache.UnsupportedInputError, match=rf"Net.step: the module tensor {why}.*\.clone\(\)"):
            state_alias.refuse("Net.step", None, rules, (torch.ones(2),), None)
        with torch.no_grad():
            leaves, key = signature.call_key((torch.ones(2),), {})
            assert signature.matcher(leaves, key, state_rules=rules) is None
    for reads_or_views in ([], [3], [4]):
        rules = entry_over_state(net, reads_or_views).state_aliases
        assert state_alias.first_alias(rules, (torch.ones(2),)) is None


@pytest.mark.slow
def test_module_tensors_over_one_memory_on_two_storage_objects_are_refused_cold_and_warm(tmp_path):
    """tests/scripts/run_shared_state.py: ``b1.mul_(2); return b2.sum() + b1.sum() + x`` with the buffers
    ``from_numpy`` views of one array (overlapping, or from one start) was served in compiled order, ``b2`` read
    before the write (``b1.mul_(2); return b2.sum() + x``: eager 5498501, gearcache 3999001), in the compiling process
    and in a fresh one; so was ``b1`` as windows whose elements overlap (``b1.sum()`` of values eager's ``mul_`` does
    not leave); and views of one tensor with b1 one element further were served by the entry of b1 at 0 (keyed alike),
    which wrote the element before b1. Refused now, nothing written; views of one tensor (from either start) and
    apart buffers equal eager."""
    from conftest import Script

    for report in (Script("run_shared_state.py", str(tmp_path)).result(),
                   warm := Script("run_shared_state.py", str(tmp_path)).result()):
        assert report["calls"] == {"numpy overlap": ["refused"] * 3, "numpy one start": ["refused"] * 3,
                                   "one tensor's views": [True] * 3, "one tensor's views, b1 one further": [True] * 3,
                                   "b1's own elements overlap": ["refused"] * 3,
                                   "apart": [True] * 3}, report
    assert warm["compiles"] == 0, warm
