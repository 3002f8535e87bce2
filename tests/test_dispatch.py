"""The dispatcher every call enters first (gearcache/call/dispatch.py): the C one (gearcache/call/_callpath.c) and the
Python one serve a call like the last one through the shortcut and hand every other call to ``_call``."""
import gc
import types
import weakref

import pytest
import torch

from gearcache.call import dispatch
from gearcache.call.signature import call_key, matcher

KINDS = [pytest.param(dispatch._NativeDispatcher, id="native"), pytest.param(dispatch.PyDispatcher, id="python")]


def make(base):
    class Fn(base):
        def __init__(self):
            self.slow = []

        def _call(self, *args, **kwargs):
            self.slow.append((args, kwargs))
            return "slow"
    return Fn()


class FakeEntry:
    """The two methods the shortcut calls on an entry, and its hit count."""

    def __init__(self):
        self.hits = 0
        self.run = lambda args: [a * 2 for a in args]

    def build(self, outs, args):
        return ("built", outs, args)


def shortcut_for(fn, *tensors, entry=None):
    with torch.no_grad():
        m = matcher(*call_key(tensors, {}))
    entry, counters = entry or FakeEntry(), types.SimpleNamespace(hits=0)
    fn._set_shortcut(m, entry, counters)
    return entry, counters


def test_the_native_dispatcher_is_the_one_in_use():
    assert dispatch._NativeDispatcher is not None and dispatch.Dispatcher is dispatch._NativeDispatcher


@pytest.mark.parametrize("base", KINDS)
def test_a_call_like_the_shortcuts_is_served_by_it_and_counted(base):
    fn = make(base)
    x = torch.ones(2, 3)
    assert fn(x) == "slow"                                  # no shortcut yet
    entry, counters = shortcut_for(fn, x)
    with torch.no_grad():
        kind, outs, args = fn(torch.zeros(2, 3))
    assert kind == "built" and torch.equal(outs[0], torch.zeros(2, 3)) and len(args) == 1
    assert (fn.shortcut_calls, entry.hits, counters.hits, len(fn.slow)) == (1, 1, 1, 1)
    entry.run = lambda args: ["replaced"]                   # read at every call (entry.compiled = ... changes it)
    with torch.no_grad():
        assert fn(x)[1] == ["replaced"]


@pytest.mark.parametrize("base", KINDS)
def test_every_other_call_goes_to_call(base):
    fn = make(base)
    x = torch.ones(2, 3)
    entry, _ = shortcut_for(fn, x)
    assert fn(x) == "slow"                                  # grad on
    with torch.no_grad():
        assert fn(x, scale=2) == "slow"                     # keywords
        assert fn(x, x) == "slow"                           # count
        assert fn() == "slow"
        assert fn(torch.ones(3, 2)) == "slow"               # shape
        assert fn(torch.ones(2, 3, dtype=torch.float64)) == "slow"
        assert fn(1.0) == "slow"                            # not a tensor
    with torch.inference_mode():
        assert fn(x) == "slow"                              # another inference mode
    assert fn.slow[1] == ((x,), {"scale": 2})
    assert entry.hits == 0 and fn.shortcut_calls == 0
    fn._set_shortcut(None)
    with torch.no_grad():
        assert fn(x) == "slow"


@pytest.mark.parametrize("base", KINDS)
def test_a_failing_entry_raises_and_counts_nothing(base):
    fn = make(base)
    x = torch.ones(2)
    entry, counters = shortcut_for(fn, x)

    def fail(args):
        raise RuntimeError("kernel failed")
    entry.run = fail
    with torch.no_grad(), pytest.raises(RuntimeError, match="kernel failed"):
        fn(x)
    assert (entry.hits, counters.hits, fn.shortcut_calls) == (0, 0, 0)


@pytest.mark.parametrize("base", KINDS)
def test_a_matcher_without_its_entry_is_refused(base):
    fn = make(base)
    with torch.no_grad():
        m = matcher(*call_key((torch.ones(1),), {}))
    with pytest.raises(TypeError, match="entry"):
        fn._set_shortcut(m)


@pytest.mark.parametrize("base", KINDS)
def test_a_dispatcher_in_a_cycle_with_its_entry_is_collected(base):
    fn = make(base)
    entry, _ = shortcut_for(fn, torch.ones(1))
    entry.owner = fn                                        # CachedFunction -> entry -> module -> CachedFunction
    alive = weakref.ref(fn)
    del fn, entry
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("base", KINDS)
@pytest.mark.parametrize("result_outputs", [None, 1, (1, 0)])
def test_a_result_of_graph_outputs_is_the_same_built_either_way(base, result_outputs):
    # Entry.result_outputs lets the C dispatcher pick the outputs itself instead of calling entry.build
    expected = {None: ("built",), 1: "b", (1, 0): ("b", "a")}[result_outputs]
    entry = FakeEntry()
    entry.run = lambda args: ["a", "b"]
    entry.build = lambda outs, args: expected
    entry.result_outputs = result_outputs
    fn = make(base)
    x = torch.ones(2)
    shortcut_for(fn, x, entry=entry)
    entry.build = lambda outs, args: "build was called"
    with torch.no_grad():
        result = fn(x)
    assert result == (expected if base is dispatch._NativeDispatcher and result_outputs is not None
                      else "build was called")


@pytest.mark.parametrize("base", KINDS)
def test_a_call_that_drops_the_shortcut_it_runs_through_is_safe(base):
    # The shortcut's matcher, entry and counters are held for the whole call: here the entry's run drops the
    # shortcut (as a call of another signature from inside would), and nothing else refers to them.
    class Counters:
        hits = 0

    fn = make(base)
    x = torch.ones(2)
    entry, counters = FakeEntry(), Counters()

    def run(args):
        fn._set_shortcut(None)
        gc.collect()
        return [args[0] + 1]
    entry.run = run
    entry.result_outputs = (0,)
    with torch.no_grad():
        fn._set_shortcut(matcher(*call_key((x,), {})), entry, counters)
    entry_alive, counters_alive = weakref.ref(entry), weakref.ref(counters)
    del entry, counters
    with torch.no_grad():
        result = fn(x)
    picked = result[0] if base is dispatch._NativeDispatcher else result[1][0]     # C picks; Python builds
    assert torch.equal(picked, torch.full((2,), 2.0))
    assert entry_alive() is None and counters_alive() is None                      # released after the call
    with torch.no_grad():
        assert fn(x) == "slow"


class SlotEntry:
    """An entry whose hit count is a __slots__ member, as gearcache.call.entry.Entry's is."""
    __slots__ = ("hits", "run", "build", "result_outputs")

    def __init__(self):
        self.hits, self.run, self.result_outputs = 0, (lambda args: [args[0]]), 0
        self.build = lambda outs, args: outs[0]


class PropertyCounters:
    """Counters whose hits is a property: the C dispatcher must go through setattr."""

    def __init__(self):
        self.seen = []

    @property
    def hits(self):
        return len(self.seen)

    @hits.setter
    def hits(self, value):
        self.seen.append(value)


@pytest.mark.parametrize("base", KINDS)
@pytest.mark.parametrize("entry_kind", [SlotEntry, FakeEntry])
@pytest.mark.parametrize("counters_kind", [lambda: types.SimpleNamespace(hits=0), PropertyCounters])
def test_hits_are_counted_on_every_kind_of_entry_and_counters(base, entry_kind, counters_kind):
    fn = make(base)
    x = torch.ones(2)
    entry, counters = entry_kind(), counters_kind()
    with torch.no_grad():
        fn._set_shortcut(matcher(*call_key((x,), {})), entry, counters)
        fn(x)
        fn(x)
        entry.hits = 10                                      # set from Python: the next count starts from it
        counters.hits = 20 if isinstance(counters, types.SimpleNamespace) else counters.hits
        fn(x)
    assert entry.hits == 11 and counters.hits == (21 if isinstance(counters, types.SimpleNamespace) else 4)
    assert fn.shortcut_calls == 3


def test_the_native_runner_skips_its_state_checks_only_for_a_plain_matcher():
    # A matcher made with autocast off is "plain": the C dispatcher then tells the runner that grad and autocast
    # are off. Under autocast the runner reads the state itself and hands the call to its fallback (which turns
    # autocast off around call(), as AOTAutograd does).
    from gearcache._torch import state as torch_state
    from gearcache.call import _callpath

    calls = []
    runner = _callpath.Runner(call=lambda a: calls.append("call") or [a[0]],
                              fallback=lambda a: calls.append("fallback") or [a[0]], recipe=(0,), check=(),
                              always_fallback=False, is_grad_enabled=torch.is_grad_enabled,
                              is_autocast_enabled=torch_state.any_autocast_enabled)
    entry = SlotEntry()
    entry.run = runner
    x = torch.ones(2)
    for autocast, expected in ((False, "call"), (True, "fallback")):
        fn = make(dispatch._NativeDispatcher)
        with torch.no_grad(), torch.autocast("cpu", enabled=autocast):
            m = matcher(*call_key((x,), {}))
            assert m.plain is (not autocast)
            fn._set_shortcut(m, entry, types.SimpleNamespace(hits=0))
            assert torch.equal(fn(x), x) and fn.shortcut_calls == 1
        assert calls[-1] == expected
