"""Which tensors share memory (gearcache/call/memory.py): groups by storage object and clusters by bytes, the call
key's marks, the shortcut's check of an entry that writes an argument, and the entry's refusal of a call whose
written argument overlaps another on another storage object (torch compiles those as apart). No compile in the fast
tier: tests/scripts/run_memory.py and run_state_alias.py run compiled entries against eager (slow tier)."""
import numpy
import pytest
import torch

import gearcache
from gearcache.call import memory, state_alias
from gearcache.call.entry import Entry
from gearcache.call.signature import call_key, describe, matcher
from gearcache.runplan import PlanRunner


def numpy_views(*rows):
    """``torch.from_numpy`` views of one array: one storage object each, over shared bytes."""
    array = numpy.arange(8, dtype=numpy.float32)
    return tuple(torch.from_numpy(array[r]) for r in rows)


def test_torch_keeps_one_python_object_per_storage():
    """The identity memory_groups tells storage objects apart by (on every torch gearcache runs with)."""
    t = torch.arange(8.)
    assert t.untyped_storage() is t[2:].untyped_storage() is t.view(2, 4).untyped_storage()
    a, b = numpy_views(slice(0, 2), slice(0, 2))
    assert a.untyped_storage() is not b.untyped_storage()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_memory_groups_by_object_and_by_bytes():
    t = torch.arange(8.)
    assert memory.memory_groups((torch.ones(2), torch.ones(2), 3)) == {}
    assert memory.memory_groups((t[:2], t[4:6])) == {0: (0, None), 1: (0, None)}     # one object: its views
    assert memory.memory_groups(numpy_views(slice(0, 2), slice(1, 3))) == {0: (0, 0), 1: (1, 0)}
    assert memory.memory_groups(numpy_views(slice(0, 2), slice(0, 2))) == {0: (0, 0), 1: (1, 0)}
    assert memory.memory_groups(numpy_views(slice(0, 2), slice(2, 4))) == {}           # apart in memory
    # a chain: 0 overlaps 2, 2 overlaps 1 (0 and 1 apart): one cluster; 3 on 0's object; 4 elsewhere
    x, y, z = numpy_views(slice(0, 2), slice(3, 5), slice(1, 4))
    groups = memory.memory_groups((x, y, z, x[1:], torch.ones(2)))
    assert groups == {0: (0, 0), 1: (1, 0), 2: (2, 0), 3: (0, 0)}
    assert memory.memory_groups((t, t)) == {}                   # one object twice: the key's ("same", i)
    assert memory.memory_groups((torch.empty(0), torch.empty(0))) == {}


def test_ranges_apart_tells_overlap_by_bytes():
    t = torch.arange(8.)
    assert memory.ranges_apart((torch.ones(2), torch.ones(2), torch.empty(0), torch.empty(0)))
    assert not memory.ranges_apart((t[:2], t[4:6]))             # one storage: its bytes overlap themselves
    assert not memory.ranges_apart(numpy_views(slice(0, 2), slice(1, 3)))
    assert memory.ranges_apart(numpy_views(slice(0, 2), slice(2, 4)))


def test_arguments_over_one_memory_on_two_objects_have_a_key_of_their_own():
    """Before, from_numpy views starting at one address were keyed as views of one storage object (compiled so by
    gearcache's key, apart by torch), and overlapping ones from other starts as apart tensors."""
    with torch.no_grad():
        apart = call_key((torch.ones(2), torch.ones(2)), {})[1]
        overlapping = call_key(numpy_views(slice(0, 2), slice(1, 3)), {})
        one_start = call_key(numpy_views(slice(0, 2), slice(0, 2)), {})[1]
        t = torch.arange(8.)
        one_object = call_key((t[:2], t[:2]), {})[1]
    assert len({apart, overlapping[1], one_start, one_object}) == 3 and overlapping[1] == one_start
    assert overlapping[1][3][-1] == ("storage", 1, 0, 8, 0) and one_object[3][-1] == ("storage", 0, 0, ((8,), (1,), 0))
    assert describe(*overlapping)["leaves"][1]["overlaps"] == 0
    assert "overlaps" not in describe((t[:2], t[:2]), one_object)["leaves"][1]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_shortcut_of_an_entry_writing_an_argument_passes_on_calls_over_shared_bytes(native, monkeypatch):
    """``distinct_storages``: by bytes, in the native TensorMatch and in the Python check around Dynamo's."""
    if not native:
        monkeypatch.setattr(gearcache.native, "guards", lambda: None)
    with torch.no_grad():
        leaves, key = call_key((torch.ones(2), torch.ones(2)), {})
        writes = matcher(leaves, key, distinct_storages=True)
        reads = matcher(leaves, key)
        assert writes((torch.ones(2), torch.ones(2)))
        assert not writes(numpy_views(slice(0, 2), slice(1, 3)))
        assert not writes(numpy_views(slice(0, 2), slice(0, 2)))
        assert writes(numpy_views(slice(0, 2), slice(2, 4)))
        assert reads(numpy_views(slice(0, 2), slice(1, 3)))     # reads only: served as apart tensors


MANIFEST = {"inputs": [["leaf", 0], ["leaf", 1]], "outputs": {"leaves": [["out", 0]], "structure": ["leaf"]}}


def entry_for(signature_of, mutated):
    """An entry over a hand-written run plan for ``x + y``, its manifest's signature that of the call
    ``signature_of``; its plan says it writes the graph inputs ``mutated``."""
    plan = {"num_inputs": 2, "num_outputs": 1, "inputs_to_check": [], "mutated_inputs": mutated}

    def call(args):
        x, y = args
        args.clear()
        return [x + y]
    with torch.no_grad():
        sig = describe(*call_key(signature_of, {}))
    return Entry(PlanRunner(call, plan), torch.nn.Module(), {**MANIFEST, "signature": sig})


def test_an_entry_writing_an_argument_that_overlaps_another_object_refuses_every_call():
    overlapping = numpy_views(slice(0, 2), slice(1, 3))
    written = entry_for(overlapping, [1])
    assert [i for i, _ in written.state_aliases] == [1]
    with pytest.raises(gearcache.UnsupportedInputError,
                       match=r"f: argument y shares memory with the arguments at flattened positions \[0\] .*"
                             r"other storage objects.*\.clone\(\)"):
        state_alias.refuse("f", lambda x, y: x, written.state_aliases, overlapping, call_key(overlapping, {})[1])
    for reads_only in (entry_for(overlapping, []), entry_for((torch.ones(2), torch.ones(2)), [1])):
        assert reads_only.state_aliases == ()
        state_alias.refuse("f", None, reads_only.state_aliases, overlapping, None)      # no rule: served
        torch.testing.assert_close(reads_only(overlapping), overlapping[0] + overlapping[1])


@pytest.mark.slow
def test_compiled_over_shared_bytes_reads_are_served_and_writes_refused_cold_and_warm(tmp_path):
    """tests/scripts/run_memory.py, a compiling process then a fresh one loading its entries: two arguments over one
    array's bytes read equal eager (an entry of their own); written, refused (before: eager [2, 6], gearcache
    [2, 5]), also right after apart calls served by the shortcut; buffers over one array's bytes on two storage
    objects: read, equal; one written between reads of the other, refused (before: eager [32, 32], gearcache
    [29, 29]); nothing written by a refused call. With ``check_signature=False`` (the first entry serves unkeyed
    calls) arguments over one memory take the key's path where the entry writes one (before: eager [5, 10],
    gearcache [5, 8])."""
    from conftest import Script

    expected = {"reads": True, "writes apart 0": True, "writes apart 1": True, "writes": "refused",
                "state writes": "refused", "state reads": True, "unchecked apart": True,
                "unchecked: one tensor's views": True, "unchecked: numpy views": "refused"}
    cold = Script("run_memory.py", str(tmp_path)).result()
    warm = Script("run_memory.py", str(tmp_path)).result()
    for report in (cold, warm):
        assert report["calls"] == expected and report["shortcut_served_apart"], report
    # 6 signatures compiled (the unchecked method loads the two its checked twin compiled); warm: all 8 loaded
    assert cold["compiles"] == 6 and warm["compiles"] == 0 and warm["loads"] == 8, (cold, warm)


def test_elements_may_overlap_by_sizes_and_strides():
    assert not memory.elements_may_overlap((3, 2), (2, 1))
    assert not memory.elements_may_overlap((2, 3, 4, 5), (60, 1, 15, 3))          # channels-last
    assert not memory.elements_may_overlap((4, 2), (1, 8))                      # a transpose of a slice
    assert not memory.elements_may_overlap((0, 3), (0, 0)) and not memory.elements_may_overlap((1, 3), (0, 1))
    assert memory.elements_may_overlap((3, 2), (1, 1))                          # as_strided windows
    assert memory.elements_may_overlap((4,), (0,))                              # expand
    assert memory.elements_may_overlap((2, 2, 2), (2, 1, 1))


def test_an_entry_writing_an_argument_whose_elements_overlap_refuses_every_call():
    """Its graph writes each element of y once, from values read before; eager's in-place op writes them one after
    another, each seen by the next where they share memory."""
    windows = torch.arange(6.).as_strided((3, 2), (1, 1))
    written = entry_for((torch.ones(3, 2), windows), [1])
    assert [i for i, _ in written.state_aliases] == [1]
    with pytest.raises(gearcache.UnsupportedInputError, match=r"argument y shares memory with itself.*\.clone\(\)"):
        state_alias.refuse("f", lambda x, y: x, written.state_aliases, (torch.ones(3, 2), windows),
                           call_key((torch.ones(3, 2), windows), {})[1])
    for served in (entry_for((torch.ones(3, 2), windows), []), entry_for((windows, torch.ones(3, 2)), [1])):
        assert served.state_aliases == ()               # only read, or the written one is apart


@pytest.mark.slow
def test_a_written_argument_over_its_own_memory_is_refused_cold_and_warm(tmp_path):
    """tests/scripts/run_self_overlap.py: ``x.add_(1); return x * 2`` with ``x`` windows over one tensor
    (``as_strided((3, 2), (1, 1))``) returned [2, 4, 6, 6, 8, 8] where eager returns [2, 6, 6, 8, 8, 8], in the
    compiling process and in a fresh one; with gears (x padded to 4 rows: a copy, its rows copied back into the
    windows) [2, 4, 4, 6, 6, 8]. Refused now, nothing written; contiguous and transposed calls equal eager."""
    from conftest import Script

    for gears in ([], ["gears"]):
        cache = str(tmp_path / "-".join(["cache", *gears]))
        for report in (Script("run_self_overlap.py", cache, *gears).result(),
                       warm := Script("run_self_overlap.py", cache, *gears).result()):
            assert report["calls"] == [["plain", True], ["plain", True], ["windows", "refused"],
                                       ["windows", "refused"], ["transposed", True]], (gears, report)
        assert warm["compiles"] == 0, warm


class Unchecked(torch.nn.Module):
    """Cached methods under ``check_signature=False``: every call by the first entry, without a key."""

    def __init__(self, cache_dir=None):
        super().__init__()
        if cache_dir is not None:
            config = gearcache.CompilerConfig(check_signature=False)
            for name in ("scale_add", "keyword", "listed"):
                setattr(self, f"c_{name}", gearcache.cache_compile(getattr(self, name), cache_dir=cache_dir,
                                                                   config=config))

    def scale_add(self, x, y):
        y.mul_(2)
        return x + y

    def keyword(self, x, *, y):
        return x * y

    def listed(self, xs):
        return xs[0] * xs[1]


@pytest.mark.slow
def test_unchecked_calls_sharing_memory_or_with_keywords_are_served_as_eager(tmp_path):
    """``check_signature=False`` ran the first entry on every call's positional arguments: views of one tensor after
    an apart first call gave [5, 8] where eager gives [5, 10] (numpy views alike), one tensor passed twice after
    apart ones gave [3, 6] for eager's [4, 8], apart ones after one passed twice raised AssertionError (Inductor's
    size check), and a call with keyword or list arguments raised IndexError from its second call. Such calls take
    the checked path now: served as eager, or refused as there (numpy views of one array written)."""
    m, e = Unchecked(str(tmp_path)), Unchecked()

    def pair(kind):
        base = torch.arange(1., 5.)
        if kind == "apart":
            return base[:2].clone(), base[1:3].clone()
        if kind == "views":
            return base[:2], base[1:3]
        if kind == "same":
            return base[:2], base[:2]
        return tuple(torch.from_numpy(v) for v in (base.numpy()[:2], base.numpy()[1:3]))

    def same_as_eager(kind, cached=None):
        (x, y), (ex, ey) = pair(kind), pair(kind)
        out = (cached or m.c_scale_add)(x, y)
        return torch.equal(out, e.scale_add(ex, ey)) and torch.equal(x, ex) and torch.equal(y, ey)

    with torch.no_grad():
        assert [same_as_eager(kind) for kind in ("apart", "apart", "views", "apart", "same", "apart")] == [True] * 6
        x, y = pair("numpy")
        with pytest.raises(gearcache.UnsupportedInputError, match="argument y shares memory"):
            m.c_scale_add(x, y)
        assert torch.equal(y, torch.tensor([2., 3.]))
        first_same = Unchecked(str(tmp_path)).c_scale_add
        assert [same_as_eager(kind, first_same) for kind in ("same", "same", "apart", "apart")] == [True] * 4
        for _ in range(2):
            torch.testing.assert_close(m.c_keyword(torch.ones(2), y=torch.full((2,), 3.)), torch.full((2,), 3.))
            torch.testing.assert_close(m.c_listed([torch.ones(2), torch.full((2,), 3.)]), torch.full((2,), 3.))


def test_a_rule_refusing_every_call_forbids_every_tensor_in_the_shortcut_check_too(checks):
    """``memory.everywhere``'s range reaches the native TensorMatch whole (its end was 1 << 64, read there as 0: an
    empty range, which let every call through)."""
    with torch.no_grad():
        leaves, key = call_key((torch.ones(2), torch.ones(2)), {})
        check = matcher(leaves, key, state_rules=((1, memory.everywhere("x")),))
        assert (type(check.check).__name__ == "TensorMatch") is (checks == "native")
        assert not check((torch.ones(2), torch.ones(2)))
        assert not check((torch.ones(2), torch.from_numpy(numpy.ones(2, numpy.float32))))
        assert matcher(leaves, key)((torch.ones(2), torch.ones(2)))


def test_views_of_one_tensor_are_keyed_by_the_base_torch_compiles_them_over():
    """AOTAutograd compiles views of one tensor, one written, over their ``_base`` (else the whole storage) as a graph
    input of its own: views alike over another base were keyed alike, and the entry raised AssertionError (Inductor's
    size check of that input, "expected size 10==8")."""
    def views(n, shape=None):
        base = torch.arange(float(n)) if shape is None else torch.arange(float(n)).view(*shape).clone()
        flat = base.view(-1)
        return flat[0:4], flat[2:6]

    with torch.no_grad():
        key = call_key(views(8), {})[1]
        assert call_key(views(8), {})[1] == key
        assert len({key, call_key(views(10), {})[1], call_key(views(8, (2, 4)), {})[1]}) == 3
        storage = torch.arange(8.).untyped_storage()
        no_base = tuple(torch.empty(0).set_(storage, at, (4,), (1,)) for at in (0, 2))
        assert call_key(no_base, {})[1] != key and describe(*call_key(no_base, {}))["leaves"][1]["storage_of"] == 0


class ScaleAdd(torch.nn.Module):
    """``y.mul_(2); return x + y`` (``x + y[0]`` where their shapes differ), cached where a folder is given."""

    def __init__(self, cache_dir=None):
        super().__init__()
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, y):
        y.mul_(2)
        return x + y[0] if x.shape != y.shape else x + y


@pytest.mark.slow
def test_views_of_one_tensor_over_bases_of_other_sizes_are_served(tmp_path):
    """``y.mul_(2); return x + y`` with x, y = b[0:4], b[2:6]: b of 8 elements, then of 10 (AssertionError before),
    then of 8 again; each equals eager."""
    m, e = ScaleAdd(str(tmp_path)), ScaleAdd()
    with torch.no_grad():
        for n in (8, 10, 8, 10):
            b, eager_b = torch.arange(float(n)), torch.arange(float(n))
            assert torch.equal(m.cached(b[0:4], b[2:6]), e.fwd(eager_b[0:4], eager_b[2:6]))
            assert torch.equal(b, eager_b)


@pytest.mark.slow
def test_views_of_one_storage_with_other_autograd_bases_are_served(tmp_path):
    """``y.mul_(2); return x + y`` with x = b[0:4] and y = b.detach()[2:6]: one storage object, two autograd bases
    (``b``, ``b.detach()``). Its first call raised AOTAutograd's AssertionError ("non-differentiable view input
    mutations") at the compile; views of one base, x = b.detach(), y = b[2:6], and a repeat each equal eager."""
    calls = {"other bases": lambda b: (b[0:4], b.detach()[2:6]), "one base": lambda b: (b[0:4], b[2:6]),
             "no base for x": lambda b: (b.detach(), b[2:6])}
    m, e = ScaleAdd(str(tmp_path)), ScaleAdd()
    with torch.no_grad():
        for name in ("other bases", "one base", "other bases", "no base for x", "no base for x"):
            b, eager_b = torch.arange(8.), torch.arange(8.)
            assert torch.equal(m.cached(*calls[name](b)), e.fwd(*calls[name](eager_b))), name
            assert torch.equal(b, eager_b), name


def test_copies_split_memory_only_where_a_copied_leaf_overlaps_another():
    """Padding copies apart only leaves whose elements no other leaf reaches (``memory.copies_split``)."""
    kv = torch.zeros(2, 3, 4)
    k, v = kv.unbind(0)
    assert memory.element_span(k)[1] == memory.element_span(v)[0] and memory.element_span(k[:0]) == (0, 0)
    assert not memory.copies_split((k, v), (k.clone(), v.clone()), [0, 1])
    flat = torch.zeros(10)
    a, b = flat[0:6], flat[4:10]
    assert memory.copies_split((a, b), (a.clone(), b), [0, 1])
    assert not memory.copies_split((a, b), (a, b), [0, 1])
    assert memory.copies_split((a, a), (a.clone(), a), [0, 1])       # one tensor twice
    cols = torch.zeros(4, 2)
    assert memory.copies_split((cols[:, 0], cols[:, 1]), (cols[:, 0].clone(), cols[:, 1]), [0, 1])   # interleaved


@pytest.mark.slow
def test_buffers_that_are_views_of_one_tensor_over_other_autograd_bases_are_served(tmp_path):
    """Buffers ``k = kv[0]`` and ``v = kv.detach()[1]`` (one storage object, two autograd bases), both written, then
    ``kv`` read: each call equals eager, output and buffers. Was: AssertionError "non-differentiable view input
    mutations" at the first call's compile."""
    class Cache(torch.nn.Module):
        def __init__(self, cache_dir=None):
            super().__init__()
            self.register_buffer("kv", torch.zeros(2, 3))
            self.register_buffer("k", self.kv[0])
            self.register_buffer("v", self.kv.detach()[1])
            if cache_dir is not None:
                self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

        def fwd(self, x):
            self.k.add_(x)
            self.v.mul_(2).add_(x)
            return self.kv.sum(0) * x

    m, e = Cache(str(tmp_path)), Cache()
    with torch.no_grad():
        for step in range(3):
            x = torch.arange(1.0, 4.0) + step
            assert torch.equal(m.cached(x), e.fwd(x)) and torch.equal(m.kv, e.kv), step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")
def test_under_cuda_graphs_inputs_sharing_memory_are_refused_or_equal_eager_cold_and_warm(tmp_path):
    """tests/scripts/run_memory_graphs.py (mode="reduce-overhead"): a graph copies each input into a static buffer and
    back, so overlapping views of one tensor with one written and a written argument whose own elements overlap
    (``as_strided`` windows, before 2026-11-28 served: on CUDA eager's writes to them have no defined order) are
    each refused with nothing written; the others equal eager (outputs and the memory under the arguments). Views of
    one tensor over apart memory (``t[:2]``, ``t[4:6]``; the KV caches ``kv[0]``, ``kv[1]``, padded or not) were
    refused (one storage); each is copied, written and copied back apart, as eager writes it: served now, equal to
    eager. A fresh process compiles nothing."""
    from conftest import Script

    cache = str(tmp_path / "cache")
    cold = Script("run_memory_graphs.py", cache).result()
    for report in (cold, warm := Script("run_memory_graphs.py", cache).result()):
        calls = {(name, arg): [] for name, arg, _ in report["calls"]}
        for name, arg, result in report["calls"]:
            calls[name, arg].append(result)
        assert all(r is True for k in [("views", "apart"), ("windows", "plain"), ("kv", "2"), ("kv", "3")]
                   for r in calls[k]), report
        assert calls["windows", "overlapping"] == ["refused"] and calls["views", "overlapping"] == ["refused"], report
        assert all(r in (True, "refused") for rs in calls.values() for r in rs), report
    assert warm["compiles"] == 0, warm
