"""gearcache/keys/guard_watch.py and the C GuardWatch (gearcache/call/_callpath.c): a change of an object on a guard's
path is noticed at the next valid(); other changes are not (they would cost a re-check per call)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from gearcache.keys import guard_watch
from gearcache.keys import guard_paths
from gearcache.keys import guard_sets
from gearcache.keys import value_guard

try:
    from gearcache.call import _callpath
except ImportError:             # pragma: no cover - the extension is built by pip install
    _callpath = None

IMPLEMENTATIONS = [guard_watch.PyGuardWatch] + ([_callpath.GuardWatch] if _callpath else [])


class Plain:
    klass_value = 1


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda c: c.__module__)
def make(request):
    def build(dicts=(), types=(), checked=()):
        return request.param(list(dicts), list(types), list(checked), guard_watch.ABSENT)
    return build


def test_a_watched_key_changing_is_noticed_and_stays_noticed(make):
    d = {"SCALE": 3.0, "other": 1}
    w = make(dicts=[(d, "SCALE", d["SCALE"])])
    assert w.valid()
    d["SCALE"] = 4.0
    assert not w.valid()
    d["SCALE"] = 3.0
    assert not w.valid() or isinstance(w, guard_watch.PyGuardWatch)    # C: once seen, stays changed


def test_other_keys_of_a_watched_dict_do_not_count(make):
    """A script's loop variable in the same globals must not make every call re-check."""
    d = {"SCALE": 3.0, "i": 0}
    w = make(dicts=[(d, "SCALE", d["SCALE"])])
    for i in range(5):
        d["i"] = i
    d["new"] = 1
    assert w.valid()


def test_a_change_another_watch_sees_leaves_this_one_valid(make):
    """Python 3.12+ watches dicts and types through one process-wide generation: an event on another watch's dict
    moves it for every watch, which then reads its own rows once instead of counting as changed (under CUDA graphs a
    watch counting as changed recaptures the graph: a new gear's entry recaptured the other gears' graphs)."""
    mine, theirs = {"weight": object()}, {"bias": object()}
    w = make(dicts=[(mine, "weight", mine["weight"])])
    other = make(dicts=[(theirs, "bias", theirs["bias"])])
    assert w.valid() and other.valid()
    theirs["bias"] = object()
    assert not other.valid()
    assert w.valid() and w.valid()
    mine["weight"] = object()
    assert not w.valid()


def test_an_absent_key_appearing_counts(make):
    obj = Plain()
    w = make(dicts=[(obj.__dict__, "forward", guard_watch.ABSENT)])
    assert w.valid()
    obj.forward = lambda: None
    assert not w.valid()


def test_a_whole_dict_watch_counts_any_change(make):
    d = {"a": 1}
    w = make(dicts=[(d, None, None)])
    assert w.valid()
    d["b"] = 2
    assert not w.valid()


def test_a_class_attribute_set_counts(make):
    class K:
        value = 1
    w = make(types=[K])
    assert w.valid()
    K.value = 2
    assert not w.valid()


def test_checked_items_and_attributes_are_re_read(make):
    lst, cell_holder = [1, 2], Plain()
    cell_holder.x = 5
    w = make(checked=[("item", lst, 1, lst[1])])
    assert w.valid()
    lst[1] = 7
    assert not w.valid()
    slots = type("Slots", (), {"__slots__": ("v",)})()
    slots.v = 1.5
    w2 = make(checked=[("attr", slots, "v", slots.v)])
    assert w2.valid()
    slots.v = 2.5
    assert not w2.valid()


@pytest.mark.skipif(_callpath is None, reason="the C extension is not built")
def test_the_c_watch_uses_the_interpreters_watchers_where_it_has_them():
    d = {"k": 1}
    w = _callpath.GuardWatch([(d, "k", 1)], [Plain], [], guard_watch.ABSENT)
    assert w.watched == (sys.version_info >= (3, 12))
    assert w.counts == {"dicts": 1, "types": 1, "checked": 0, "meta": None}
    before = _callpath.guard_generation()
    d["k"] = 2
    assert (_callpath.guard_generation() > before) == (sys.version_info >= (3, 12))
    assert not w.valid()


def test_hops_follow_a_modules_paths():
    """The paths of a module's guards become watched dicts (instance dicts, _modules), watched classes and re-read
    steps (a list item)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    model.sizes = [1, 2]
    scope = guard_paths.Scope(model, {"SCALE": 1.0})
    gs = guard_sets.GuardSet([
        value_guard.ValueGuard("value", ("self", ("attr", "_modules"), ("item", "1"), ("attr", "eps")), None, None),
        value_guard.ValueGuard("value", (("global", "SCALE"),), None, None),
        value_guard.ValueGuard("value", ("self", ("attr", "sizes"), ("item", 1)), None, None),
    ])
    hops = guard_watch.hops_for([gs], scope)
    watched = {(id(d), k) for d, k, _ in hops.dicts}
    assert (id(model.__dict__), "_modules") in watched
    assert (id(model._modules), "1") in watched
    assert (id(model[1].__dict__), "eps") in watched
    assert (id(scope.globals), "SCALE") in watched
    assert type(model) in hops.types and torch.nn.LayerNorm in hops.types
    assert [(op, key) for op, _, key, _ in hops.checked if op not in ("class", "code")] == [("item", 1)]
    assert {(id(parent), expected) for op, parent, _, expected in hops.checked if op == "class"} >= {
        (id(model), torch.nn.Sequential), (id(model[1]), torch.nn.LayerNorm)}, "each module's class is re-read"
    w = guard_watch.watch([gs], scope)
    assert w.valid()
    model[1].eps = 0.5
    assert not w.valid()


def _eps_guards(*names):
    return guard_sets.GuardSet([value_guard.ValueGuard("value", ("self", ("attr", "_modules"), ("item", n),
                                                                 ("attr", "eps")), None, None) for n in names])


def test_a_watcher_grows_its_watch_and_each_watch_covers_every_set():
    """Adding a guard set extends the previous hops: the new watch notices a change on either set's paths."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guard_paths.Scope(model, {}))
    first, second = _eps_guards("0"), _eps_guards("1")
    assert watcher.watch([first, None]).valid()
    both = watcher.watch([first, second])
    model[1].eps = 0.5
    assert not both.valid()
    both = watcher.watch([first, second])          # the previous watch is invalid: every hop read again
    assert both.valid()
    model[0].eps = 0.5
    assert not both.valid()


def test_a_watcher_reads_replaced_objects_again_after_a_change():
    """After a watched object was replaced (an equal submodule), the next watch follows the new object, not the
    one its earlier hops read: a change of the new one is noticed."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guard_paths.Scope(model, {}))
    first, second = _eps_guards("0"), _eps_guards("1")
    watched = watcher.watch([first])
    model[0] = torch.nn.LayerNorm(2)                # same eps: the guards still hold, the object is new
    assert not watched.valid()
    watched = watcher.watch([first, second])
    assert watched.valid()
    model[0].eps = 0.25
    assert not watched.valid()


def test_a_watcher_given_no_new_set_keeps_its_watch_which_still_notices_changes():
    """Issue #38: the gears of one method share one parsed guard set, and ``remember`` re-watches at every gear: a
    call that adds no set returns the watch it has (no watch built: ``counters.guard_watches``) while that watch holds;
    the watch kept still notices a change, and the call after it builds one anew over the objects there now."""
    from gearcache.counters import counters

    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guard_paths.Scope(model, {}))
    shared = _eps_guards("0", "1")
    before = counters.guard_watches
    first = watcher.watch([shared, None])
    assert counters.guard_watches == before + 1
    for _ in range(5):                              # five more gears with the same set
        assert watcher.watch([shared, shared, None]) is first
    assert counters.guard_watches == before + 1, "no watch built for a set already watched"
    model[1].eps = 0.5
    assert not first.valid()
    again = watcher.watch([shared, shared])
    assert again is not first and again.valid() and counters.guard_watches == before + 2
    model[0] = torch.nn.LayerNorm(2)                # a replaced object on a path: noticed by the new watch
    assert not again.valid()


def test_a_watcher_forgets_dropped_sets():
    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guard_paths.Scope(model, {}))
    first, second = _eps_guards("0"), _eps_guards("1")
    watcher.watch([first, second])
    only_second = watcher.watch([second])
    model[0].eps = 0.5
    assert only_second.valid()
    model[1].eps = 0.5
    assert not only_second.valid()
    assert watcher.watch([]) is None


def test_a_containers_contents_are_re_read(make):
    """``len``, ``contains`` and ``seq`` hops: a guard on a list's length, a set's members or a list's items sees the
    container change in place (its identity on the path does not)."""
    items, members = [1, 2], {1, 2}
    w = make(checked=[("len", items, None, 2), ("contains", members, 1, True), ("seq", items, None, tuple(items))])
    assert w.valid()
    items[0] = 5                                      # same length, another item
    assert not w.valid()
    items[0] = 1
    w = make(checked=[("len", items, None, 2), ("contains", members, 1, True)])
    members.discard(1)
    assert not w.valid()
    w = make(checked=[("len", items, None, 2)])
    items.append(3)
    assert not w.valid()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_tensors_metadata_is_re_read_where_its_object_stays(make, native, monkeypatch):
    """``.data = t`` keeps the tensor object (and every dict on its path) but changes its dtype, shape, strides or data
    address: the watch's ``meta`` check sees it (gearcache.native's ``MetaMatch``, or the same in Python)."""
    from gearcache import native as gearcache_native
    from gearcache._torch import tensor_checks as torch_tensor_checks

    if not native:
        monkeypatch.setattr(gearcache_native, "guards", lambda **kw: None)
    swaps = {"dtype": lambda t: t.data.double(), "strides": lambda t: t.data.t().contiguous().t(),
             "shape": lambda t: t.data[:, :2], "misaligned": lambda t: torch.zeros(17)[1:].view(4, 4)}
    for name, swap in swaps.items():
        t = torch.randn(4, 4)
        meta, capsule = torch_tensor_checks.tensor_meta_match((t,))
        assert (capsule is not None) == (native and gearcache_native.guards() is not None)
        w = type(make())([], [], [], guard_watch.ABSENT, meta, capsule)
        assert w.valid()
        t.data = swap(t)
        assert not w.valid(), name
    t = torch.randn(4, 4)
    meta, capsule = torch_tensor_checks.tensor_meta_match((t,))
    w = type(make())([], [], [], guard_watch.ABSENT, meta, capsule)
    t.mul_(2)                                          # values change in place: graphs read them live
    assert w.valid()
    t.data = t.data.clone()                            # same metadata, another storage: a CUDA graph holds the old
    assert not w.valid()


def test_hops_cover_what_a_guard_reads_of_its_leaf():
    """Beyond the path: the attribute ``hasattr`` looks for, the class of a ``type`` guard, a dict's contents, the
    metadata of a ``tensor`` guard's tensor; a closure cell of the cached function is re-read."""
    model = torch.nn.Linear(2, 2)
    model.table = {"a": 1}

    def fwd(self, x):
        return x * scale
    scale = 2.0
    scope = guard_paths.Scope(model, {}, fwd)
    gs = guard_sets.GuardSet([
        value_guard.ValueGuard("hasattr", ("self",), "extra", ["extra", False]),
        value_guard.ValueGuard("keys", ("self", ("attr", "table")), None, None),
        value_guard.ValueGuard("tensor", ("self", ("attr", "_parameters"), ("item", "weight")), None, None),
        value_guard.ValueGuard("value", (("closure", "scale"),), None, None),
    ])
    hops = guard_watch.hops_for([gs], scope)
    assert (id(model.table), None) in {(id(d), k) for d, k, _ in hops.dicts}
    assert (id(model.__dict__), "extra") in {(id(d), k) for d, k, _ in hops.dicts}
    assert hops.tensors == [model.weight]
    assert [(op, key) for op, _, key, _ in hops.checked if op != "class"] == [("cell", None)]
    for change in (lambda: setattr(model, "extra", 1), lambda: model.table.__setitem__("b", 2),
                   lambda: setattr(model.weight, "data", model.weight.data.double())):
        w = guard_watch.watch([gs], scope)
        assert w.valid()
        change()
        assert not w.valid()
    w = guard_watch.watch([gs], scope)
    scale = 3.0                                        # noqa: F841 - read through fwd's closure
    assert not w.valid()


class FreshFlags(torch.nn.Module):
    """A property that builds its value anew at every read, as transformers 5.17's ``StaticCache.is_sliding`` does."""

    def __init__(self):
        super().__init__()
        self.flags = [False, True]

    @property
    def sliding(self):
        return list(self.flags)


def test_a_property_building_an_equal_value_at_every_read_keeps_the_watch_valid():
    """Compared by identity, a property returning a fresh list made every call revalidate and rebuild the watch (a
    served transformers decode step went from 0.7 ms to 40 ms on the GPU host); compared by value, the watch holds
    until the value changes, in type too, and a change of the list read earlier is not mistaken for the expected one."""
    model = FreshFlags()
    gs = guard_sets.GuardSet([value_guard.ValueGuard("value", ("self", ("attr", "sliding")), None, None)])
    scope = guard_paths.Scope(model, {})
    assert [(op, key) for op, _, key, _ in guard_watch.hops_for([gs], scope).checked][0] == ("attr_eq", "sliding")
    w = guard_watch.watch([gs], scope)
    assert w.valid() and w.valid()
    model.flags[1] = False
    assert not w.valid()
    model.flags[1] = True
    assert guard_watch.watch([gs], scope).valid()
    w = guard_watch.watch([gs], scope)
    model.flags = [0, 1]                                    # equal to [False, True], other types: a change
    assert not w.valid()


def test_attr_eq_compares_plain_values_with_their_types(make):
    holder = FreshFlags()
    w = make(checked=[("attr_eq", holder, "sliding", [False, True])])
    assert w.valid()
    holder.flags = [False, 1]
    assert not w.valid()
    holder.flags = [False, True, False]
    assert not w.valid()


class _Scaled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("native", [True, False])
def test_changes_that_set_no_dict_or_class_are_seen(native):
    """Three changes that set no watched dict and no class attribute, each seen by the watch (C and Python): a
    module's ``__class__`` assigned, the code of a function of a watched class replaced in place (``f.__code__``), a
    registered submodule shadowed by an instance attribute (``object.__setattr__``: ``_modules`` is unchanged)."""
    def forward(self, x):
        return self.inner(x)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)
    Block.forward = forward
    make = (guard_watch.GuardWatch if native else guard_watch.PyGuardWatch)

    def new_watch(block):
        scope = guard_paths.Scope(block, {})
        gs = guard_sets.GuardSet([
            value_guard.ValueGuard("type", ("self", ("attr", "_modules"), ("item", "inner")), None, None),
            value_guard.ValueGuard("type", ("self",), None, None)])
        hops = guard_watch.hops_for([gs], scope)
        meta = None
        return make(hops.dicts, hops.types, hops.checked, guard_watch.ABSENT, meta)

    def scale(self, x):
        return self.inner(x) * 3

    changes = [lambda b: setattr(b.inner, "__class__", _Scaled),
               lambda b: setattr(Block.forward, "__code__", scale.__code__),
               lambda b: object.__setattr__(b, "inner", torch.nn.Linear(2, 2))]
    for change in changes:
        block = Block()
        Block.forward.__code__ = forward.__code__
        w = new_watch(block)
        assert w.valid()
        change(block)
        assert not w.valid(), change


def _scaled_by(k):
    def scaled(x, bias=0.0, *, shift=0.0):
        return x * k + bias + shift
    return scaled


SCALED = _scaled_by(2.0)


@pytest.mark.parametrize("native", [False, True] if _callpath else [False], ids=["python", "c"][:1 + bool(_callpath)])
def test_a_function_guarded_by_identity_is_watched_in_its_defaults_and_closure(native):
    """A global function guarded by identity (Dynamo's CLOSURE_MATCH): its fingerprint covers its defaults and its
    closure's contents, so must the watch. On torch 2.11 Dynamo emits no guard on ``__defaults__`` of an inlined
    function; the watch looked at the function's code only, and ``f.__defaults__ = (3.0,)`` after the first call was
    served by the old graph in that process (found on the GPU host, 2026-11-28)."""
    globs = {"SCALED": SCALED}
    scope = guard_paths.Scope(torch.nn.Linear(2, 2), globs)
    gs = guard_sets.GuardSet([value_guard.ValueGuard("identity", (("global", "SCALED"),), None, None)])
    make = guard_watch.GuardWatch if native else guard_watch.PyGuardWatch
    saved = (SCALED.__defaults__, SCALED.__kwdefaults__, SCALED.__closure__[0].cell_contents)
    changes = [lambda: setattr(SCALED, "__defaults__", (1.0,)),
               lambda: setattr(SCALED, "__kwdefaults__", {"shift": 1.0}),
               lambda: setattr(SCALED.__closure__[0], "cell_contents", 3.0)]
    for change in changes:
        hops = guard_watch.hops_for([gs], scope)
        w = make(hops.dicts, hops.types, hops.checked, guard_watch.ABSENT, None)
        assert w.valid()
        change()
        try:
            assert not w.valid(), change
        finally:
            SCALED.__defaults__, SCALED.__kwdefaults__ = saved[:2]
            SCALED.__closure__[0].cell_contents = saved[2]
        assert make(hops.dicts, hops.types, hops.checked, guard_watch.ABSENT, None).valid()


def test_a_value_guard_sees_containers_nested_in_its_value_change_in_place():
    """A ``value`` guard's fingerprint holds its value's containers element by element (``self.pair = ([1.0, 2.0],)``
    guarded as a whole): a list, dict or set nested in it changed in place (``m.pair[0].append(5.0)``) is a change.
    The watch saw the outer tuple only (immutable), so the old graph was served: ``sum(self.pair[0])`` 3 where eager
    gave 8 (found 2026-11-27)."""
    model = torch.nn.Linear(2, 2)
    model.pair = ([1.0, 2.0], {"k": [3.0]}, frozenset({1}))
    scope = guard_paths.Scope(model, {})
    gs = guard_sets.GuardSet([value_guard.ValueGuard("value", ("self", ("attr", "pair")), None, None)])
    for change in (lambda: model.pair[0].append(5.0), lambda: model.pair[1].__setitem__("j", 1.0),
                   lambda: model.pair[1]["k"].__setitem__(0, 4.0)):
        w = guard_watch.watch([gs], scope)
        assert w.valid()
        change()
        assert not w.valid()


def test_a_set_changed_in_place_to_other_members_of_the_same_count_is_a_change():
    """A ``value`` guard on a set (``self.opts = {"a", "b"}``, read by iterating it) holds its members; the watch
    re-read its length only, so ``opts.discard("b"); opts.add("a2")`` served the old graph (off by 0.98 from eager,
    found 2026-11-27), nested in a tuple too. Every member is re-read (``contains``) with the length."""
    model = torch.nn.Linear(2, 2)
    model.opts, model.nested = {"a", "b"}, ({"a", "b"},)
    scope = guard_paths.Scope(model, {})
    gs = guard_sets.GuardSet([value_guard.ValueGuard("value", ("self", ("attr", "opts")), None, None),
                              value_guard.ValueGuard("value", ("self", ("attr", "nested")), None, None)])
    for s in (model.opts, model.nested[0]):
        w = guard_watch.watch([gs], scope)
        assert w.valid()
        s.discard("b")
        s.add("a2")
        assert not w.valid()
        s.discard("a2")
        s.add("b")


def _with_defaults_and_a_cell():
    """A fresh function with defaults, keyword-only defaults and a closure cell."""
    k = 3.0

    def f(x, a=1.0, *, b=2.0):
        return x * a + b + k
    return f


def test_function_fields_are_read_without_audit_events():
    """A function's defaults and a cell's contents are read from their structs, not through getattr: reading
    ``__defaults__`` raises an audit event (~0.3 µs per read where a hook is installed, as on the GPU host), so the
    watch's reads must raise none; and each row still sees a change."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, TESTS)
        from gearcache.keys import guard_watch
        from test_guard_watch import _with_defaults_and_a_cell

        f = _with_defaults_and_a_cell()
        hops = guard_watch.Hops()
        hops.function_identity(f)
        g = lambda: None
        for name in ("__defaults__", "__kwdefaults__", "__code__"):
            hops.check(*guard_watch._struct_read(g, name, getattr(g, name)))
        print(sorted({op for op, *_ in hops.checked}))
        watch = guard_watch.make_watch(hops)
        events = []
        sys.addaudithook(lambda event, args: events.append(event) if event == "object.__getattr__" else None)
        assert watch.valid()
        print(type(watch).__name__, len(events))
        f.__kwdefaults__ = {"b": 5.0}
        print(watch.valid())
    """)
    code = code.replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "['cell', 'code', 'defaults', 'kwdefaults']"
    kind, n_events = out[1].split()
    if kind == "GuardWatch":                # the C watch (the Python one, without the extension, reads by getattr)
        assert n_events == "0"
    assert out[2] == "False"


@pytest.mark.parametrize("change", ["defaults", "kwdefaults", "cell", "cell_emptied"])
def test_struct_rows_see_each_change(change):
    """``defaults``, ``kwdefaults`` and ``cell`` rows, C and Python alike: valid until the field is replaced."""
    f = _with_defaults_and_a_cell()
    for make in (guard_watch.GuardWatch, guard_watch.PyGuardWatch):
        hops = guard_watch.Hops()
        hops.function_identity(f)
        watch = make([], [], list(hops.checked), guard_watch.ABSENT)
        assert watch.valid()
        saved = (f.__defaults__, f.__kwdefaults__, f.__closure__[0].cell_contents)
        if change == "defaults":
            f.__defaults__ = tuple([1.0])        # equal, but another tuple
        elif change == "kwdefaults":
            f.__kwdefaults__ = None
        elif change == "cell":
            f.__closure__[0].cell_contents = float("3")       # equal, but another float
        else:
            del f.__closure__[0].cell_contents
        assert not watch.valid(), (make, change)
        f.__defaults__, f.__kwdefaults__ = saved[:2]
        f.__closure__[0].cell_contents = saved[2]


@pytest.mark.parametrize("change", ["class", "code", "attr"])
def test_class_and_code_rows_read_first_in_tight_loops_still_see_each_change(change):
    """``make_watch`` lists the ``class`` rows, then the ``code`` rows, before the others (the C watch reads those
    leading rows in loops of pointer compares); a change of any row, first, middle or last, is still seen."""
    class A:
        def f(self):
            return 1

    class B(A):
        pass

    objs = [A() for _ in range(5)]
    holder = type("Holder", (), {})()
    holder.value = 1.5
    hops = guard_watch.Hops()
    hops.check("attr", holder, "value", holder.value)           # an "attr" row listed first
    for obj in objs:
        hops.instance_class(obj)                                 # class rows, and A.f's code row
    watch = guard_watch.make_watch(hops)
    assert [op for op, *_ in hops.checked][:2] == ["attr", "class"]
    assert watch.valid()
    if change == "class":
        objs[-1].__class__ = B
    elif change == "code":
        A.f.__code__ = (lambda self: 2).__code__
    else:
        holder.value = 2.5
    assert not watch.valid()


@pytest.mark.parametrize("where", ["method default", "closure cell"])
def test_a_method_default_or_cell_turned_from_zero_to_minus_zero_is_seen(where):
    """A class function's default and a cell's contents are read by identity (``_struct_read``), not as a property's
    plain value by ``==``: ``0.0 == -0.0``, and a graph computing ``copysign(1, s)`` differs (helper break55: every
    sign wrong, served by the old graph)."""
    def outer():
        s = 0.0

        def sign_of(x, t=0.0):
            return x * s * t
        return sign_of
    func = outer()
    holder = type("Holder", (), {"sign_of": staticmethod(func)})
    hops = guard_watch.Hops()
    parent, name = (func, "__defaults__") if where == "method default" else (func.__closure__[0], "cell_contents")
    guard_watch._add_attr(hops, parent, name, getattr(parent, name))
    assert [op for op, *_ in hops.checked] == (["defaults"] if where == "method default" else ["cell"])
    for make in (guard_watch.GuardWatch, guard_watch.PyGuardWatch):
        watch = make([], [], list(hops.checked), guard_watch.ABSENT)
        assert watch.valid()
        if where == "method default":
            func.__defaults__ = (-0.0,)
        else:
            func.__closure__[0].cell_contents = -0.0
        assert not watch.valid(), make
        func.__defaults__ = (0.0,)
        func.__closure__[0].cell_contents = 0.0
    assert holder.sign_of is func


@pytest.mark.parametrize("value, other, equal", [(0.0, -0.0, False), (float("nan"), float("nan"), True),
                                                 ([1.0, -0.0], [1.0, 0.0], False), (2.5, 2.5, True)])
def test_a_property_s_plain_value_compares_floats_by_value_and_sign(value, other, equal):
    """``attr_eq`` rows (a property building its value anew): -0.0 is not 0.0, a NaN is a NaN (else every call
    would revalidate), in C and in Python alike."""
    class Holder:
        current = value

        @property
        def p(self):
            return Holder.current
    h = Holder()
    for make in (guard_watch.GuardWatch, guard_watch.PyGuardWatch):
        Holder.current = value
        watch = make([], [], [("attr_eq", h, "p", value)], guard_watch.ABSENT)
        assert watch.valid()
        Holder.current = other
        assert watch.valid() is equal, make


def test_a_class_functions_defaults_are_watched_with_its_code():
    """``instance_class`` watches the object's class functions' code and defaults: ``Cls.f.__defaults__ = ...`` sets
    no class attribute, and torch 2.11's Dynamo guards no defaults (a method's default changed after the first call
    was served the old graph there: x * 2 for eager's x * 3)."""
    class Scaled:
        def scaled(self, x, s=2.0, *, t=1.0):
            return x * s * t

    for change in ("__defaults__", "__kwdefaults__"):
        hops = guard_watch.Hops()
        hops.instance_class(Scaled())
        assert {op for op, *_ in hops.checked} == {"class", "code", "defaults", "kwdefaults"}
        for make in (guard_watch.GuardWatch, guard_watch.PyGuardWatch):
            saved = getattr(Scaled.scaled, change)
            watch = make([], [], list(hops.checked), guard_watch.ABSENT)
            assert watch.valid()
            setattr(Scaled.scaled, change, (3.0,) if change == "__defaults__" else {"t": 2.0})
            assert not watch.valid(), (make, change)
            setattr(Scaled.scaled, change, saved)


_LIST_DEFAULT = [2.0]


def _scaled_by_list(x, s=_LIST_DEFAULT, *, t={"k": [1.0]}):     # noqa: B006 (mutable defaults, on purpose)
    return x * s[0] * t["k"][0]


@pytest.mark.parametrize("change", ["list default", "dict in kwdefaults", "cell list"])
def test_containers_in_defaults_and_cells_changed_in_place_are_seen(change):
    """A list in a function's defaults, a dict in its keyword-only defaults or a list in a closure cell changed in
    place keeps every identity (torch 2.11's Dynamo guards no defaults: ``helper.__defaults__[0][0] = 5.0`` after
    the first call was served the old graph, helper break55b); the watch reads their contents, and the function's
    digest is not cached across such a change."""
    from gearcache.keys import fingerprints
    box = [1.0]

    def cell_reader(x):
        return x * box[0]
    func = cell_reader if change == "cell list" else _scaled_by_list
    hops = guard_watch.Hops()
    hops.function_identity(func)
    digest = fingerprints.function_digest(func)
    for make in (guard_watch.GuardWatch, guard_watch.PyGuardWatch):
        watch = make(list(hops.dicts), [], list(hops.checked), guard_watch.ABSENT)
        assert watch.valid()
        target, saved = {"list default": (_LIST_DEFAULT, 2.0), "dict in kwdefaults": (_scaled_by_list.__kwdefaults__
                         ["t"]["k"], 1.0), "cell list": (box, 1.0)}[change]
        target[0] = 3.0
        assert not watch.valid(), (make, change)
        assert fingerprints.function_digest(func) != digest
        target[0] = saved
    assert fingerprints.function_digest(func) == digest
