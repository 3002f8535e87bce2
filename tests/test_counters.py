import dataclasses
import logging
import shutil
import threading

import pytest
import torch

import gearcache
from gearcache.counters import Counters
from gearcache.store import Store


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


class _SeesTheWait(logging.Handler):
    """Sets ``waiting`` when the store logs that this process waits for another's artifact lock."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.waiting = threading.Event()

    def emit(self, record):
        if "another process holds its lock" in record.getMessage():
            self.waiting.set()


def test_a_process_that_waited_for_anothers_compile_and_loaded_its_artifact_counts_a_load(tmp_path):
    """Issue #37's edge: the waiter's publish finds the artifact only after the lock it waited on is released (the
    other process published it meanwhile). It loads that artifact: a load, not a compile, and not nothing."""
    x = torch.randn(2, 4)
    built, waiter = tmp_path / "built", tmp_path / "waiter"
    with torch.inference_mode():
        torch.testing.assert_close(_Twin(str(built)).cached(x), _Twin(str(built)).fwd(x))
    [artifact] = (built / "artifacts").iterdir()            # what "another process" compiles, while this one waits
    other = Store(str(waiter))
    other.first_use.ensure()
    other.layout.mkdir(other.layout.locks)
    sees = _SeesTheWait()
    store_log = logging.getLogger("gearcache")
    level = store_log.level
    store_log.addHandler(sees)
    store_log.setLevel(logging.INFO)
    holding = threading.Event()

    def compile_elsewhere():
        with other.locks.held(other.locks.path(artifact.name), 60):
            holding.set()
            sees.waiting.wait(120)
            shutil.copytree(artifact, other.layout.artifact(artifact.name))

    thread = threading.Thread(target=compile_elsewhere)
    thread.start()
    try:
        assert holding.wait(60)
        with torch.inference_mode():
            m = _Twin(str(waiter))
            with gearcache.counters.expect(traces=1, compiles=0, loads=1):
                out = m.cached(x)
            assert sees.waiting.is_set(), "the call waited on the other process's lock"
            torch.testing.assert_close(out, m.fwd(x))
    finally:
        sees.waiting.set()
        thread.join()
        store_log.removeHandler(sees)
        store_log.setLevel(level)
    assert [a.name for a in (waiter / "artifacts").iterdir()] == [artifact.name]
