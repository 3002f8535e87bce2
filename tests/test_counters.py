import dataclasses

import pytest
import torch

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


class _Twin(torch.nn.Module):
    """Two of these classes (below) capture the same graph: one artifact, two entries."""

    def __init__(self, cache_dir):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return torch.relu(self.lin(x))


class _OtherTwin(_Twin):
    def fwd(self, x):
        return torch.relu(self.lin(x))


def test_an_entry_whose_artifact_another_built_counts_a_load_not_a_compile(tmp_path):
    """An artifact this process did not build (another entry of the same graph built it here; another process that
    compiled it while this one waited is the same path, tests/test_ranks.py's race) is a load."""
    x = torch.randn(2, 4)
    with torch.inference_mode():
        first = _Twin(str(tmp_path))
        with gearcache.counters.expect(traces=1, compiles=1, loads=0):
            torch.testing.assert_close(first.cached(x), first.fwd(x))
        second = _OtherTwin(str(tmp_path))
        with gearcache.counters.expect(traces=1, compiles=0, loads=1):
            torch.testing.assert_close(second.cached(x), second.fwd(x))
    assert len(list((tmp_path / "artifacts").iterdir())) == 1
