import dataclasses

import pytest

import gearcache
from gearcache.counters import Counters


def test_expect_passes_on_right_deltas():
    c = Counters()
    with c.expect(compiles=1, hits=2, loads=0):
        c.compiles += 1
        c.hits += 2
    with c.expect():
        c.hits += 5                     # counters not named are not checked
    assert (c.compiles, c.hits, c.loads) == (1, 7, 0)


def test_expect_compares_deltas_not_totals():
    c = Counters(compiles=10, compile_seconds=1.5)
    with c.expect(compiles=1, compile_seconds=0.5):
        c.compiles += 1
        c.compile_seconds += 0.5


def test_expect_wrong_delta_names_counter():
    c = Counters()
    with pytest.raises(AssertionError, match=r"compiles: expected \+1, got \+0") as info:
        with c.expect(compiles=1, hits=1):
            c.hits += 1
    assert "hits" not in str(info.value)
    with pytest.raises(AssertionError, match=r"loads: expected \+0, got \+2"):
        with c.expect(loads=0):
            c.loads += 2


def test_expect_rejects_unknown_names():
    with pytest.raises(TypeError, match="compile_count"):
        with Counters().expect(compiles=0, compile_count=1):
            pass


def test_snapshot_and_delta():
    c = Counters(misses=3)
    before = c.snapshot()
    c.misses += 2
    assert before.misses == 3
    delta = c.delta(before)
    assert delta["misses"] == 2 and set(delta) == {f.name for f in dataclasses.fields(Counters)}
    assert sum(v for k, v in delta.items() if k != "misses") == 0


def test_global_counters_object():
    assert isinstance(gearcache.counters, Counters)
    with gearcache.counters.expect(eager_calls=1):
        gearcache.counters.eager_calls += 1
