"""gearcache/guard_watch.py and the C GuardWatch (gearcache/_callpath.c): a change of an object on a guard's path is
noticed at the next valid(); other changes are not (they would cost a re-check per call)."""
from __future__ import annotations

import sys

import pytest
import torch

from gearcache import guard_watch, guards

try:
    from gearcache import _callpath
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
    scope = guards.Scope(model, {"SCALE": 1.0})
    gs = guards.GuardSet([
        guards.ValueGuard("value", ("self", ("attr", "_modules"), ("item", "1"), ("attr", "eps")), None, None),
        guards.ValueGuard("value", (("global", "SCALE"),), None, None),
        guards.ValueGuard("value", ("self", ("attr", "sizes"), ("item", 1)), None, None),
    ])
    hops = guard_watch.hops_for([gs], scope)
    watched = {(id(d), k) for d, k, _ in hops.dicts}
    assert (id(model.__dict__), "_modules") in watched
    assert (id(model._modules), "1") in watched
    assert (id(model[1].__dict__), "eps") in watched
    assert (id(scope.globals), "SCALE") in watched
    assert type(model) in hops.types and torch.nn.LayerNorm in hops.types
    assert [(op, key) for op, _, key, _ in hops.checked] == [("item", 1)]
    w = guard_watch.watch([gs], scope)
    assert w.valid()
    model[1].eps = 0.5
    assert not w.valid()


def _eps_guards(*names):
    return guards.GuardSet([guards.ValueGuard("value", ("self", ("attr", "_modules"), ("item", n), ("attr", "eps")),
                                              None, None) for n in names])


def test_a_watcher_grows_its_watch_and_each_watch_covers_every_set():
    """Adding a guard set extends the previous hops: the new watch notices a change on either set's paths."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guards.Scope(model, {}))
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
    watcher = guard_watch.Watcher(guards.Scope(model, {}))
    first, second = _eps_guards("0"), _eps_guards("1")
    watched = watcher.watch([first])
    model[0] = torch.nn.LayerNorm(2)                # same eps: the guards still hold, the object is new
    assert not watched.valid()
    watched = watcher.watch([first, second])
    assert watched.valid()
    model[0].eps = 0.25
    assert not watched.valid()


def test_a_watcher_forgets_dropped_sets():
    model = torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.LayerNorm(2))
    watcher = guard_watch.Watcher(guards.Scope(model, {}))
    first, second = _eps_guards("0"), _eps_guards("1")
    watcher.watch([first, second])
    only_second = watcher.watch([second])
    model[0].eps = 0.5
    assert only_second.valid()
    model[1].eps = 0.5
    assert not only_second.valid()
    assert watcher.watch([]) is None
