"""A warm start's look-ups and loads (gearcache/warmup/driver.py ``find_all``, one after another or side by side):
the stored entries are served as the serial path served them (nothing compiled in a fresh process, outputs equal
to eager), and a gear whose load fails is named in the error."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import run_script
from gearcache import CompilerConfig, counters
from gearcache.compiling.entry_life import EntryLife
from gear_models import Flip


def _copy(gears_cache: tuple[Path, dict], tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(gears_cache[0], cache, ignore=shutil.ignore_patterns("locks", "leases"))
    return cache


@pytest.mark.parametrize("threads", [None, pytest.param("3", marks=pytest.mark.slow)])
def test_a_warm_starts_gears_are_looked_up_and_serve_the_stored_entries(gears_cache, tmp_path, empty_torch_caches,
                                                                        threads):
    """By default the look-ups run one after another in the calling thread (on a local store a look-up is Python
    holding the GIL: ``driver.lookup_threads``); ``GEARCACHE_LOAD_THREADS=3`` runs the others side by side in load
    threads. Either way every gear's stored entry is served, and the gears' one guard set is parsed and watched
    once, and checked once for the look-ups and once after its watch is built."""
    env = {**empty_torch_caches, **({"GEARCACHE_LOAD_THREADS": threads} if threads else {})}
    warm = run_script("run_gear_loads.py", str(_copy(gears_cache, tmp_path)), env=env)
    assert "error" not in warm and warm["gears"] == 3 and warm["equal"]
    c = warm["counters"]
    assert c["compiles"] == 0 and c["traces"] == 0 and warm["compiles_after_warmup"] == 0
    assert c["loads"] == 3 and c["direct_loads"] == 3 and c["misses"] == 3, "each gear looked up and loaded once"
    assert warm["hooks"]["dynamo_frames"] == 0 and warm["hooks"]["inductor_compiles"] == 0
    assert warm["hooks"]["cpp_builds"] == 0
    where = dict((batch, thread) for thread, batch in warm["finds"])
    assert len(warm["finds"]) == 3 and sorted(where) == [2, 4, 8]
    assert sorted(where.values())[0] == "MainThread", "the first look-up runs alone in the calling thread"
    loading = sum(t.startswith("gearcache-load") for t in where.values())
    assert loading == (2 if threads else 0), where
    assert warm["guards"]["entries_sharing_a_set"] == 3, "the gears' equal guards are one parsed set"
    assert c["guard_parses"] <= 2, "the entries' one set, and the gear plan's if it differs"
    assert c["guard_checks"] <= 5, ("the gear plan's set at its two look-ups, the entries' once for the three gears, "
                                    "then each new watch's sets once it is built (CachedFunction._rewatch: the "
                                    "plan's, then the entries' and the plan's where they differ)")
    assert c["guard_watches"] <= 2, "one watch for the gear plan, then one for the entries: none rebuilt per gear"


def test_a_gear_whose_load_fails_is_named_in_the_error(gears_cache, tmp_path):
    cache = _copy(gears_cache, tmp_path)
    broken = 0
    for path in cache.glob("entries/*/*/*.json"):
        manifest = json.loads(path.read_text())
        if manifest["signature"]["leaves"][0]["shape"] == [4, 4]:   # gear 4's entry: a dependency without its file
            manifest["dependencies"] = [{"name": "PairMLP.fwd"}]
            path.write_text(json.dumps(manifest))
            broken += 1
    assert broken == 1
    out = run_script("run_gear_loads.py", str(cache))
    error = out["error"]
    assert error["gear"] == [4, 4] and error["cause"] == "KeyError", error      # (x's and y's batch dims)
    assert "gear [4, 4]" in error["message"] and error["method"] in error["message"]
    assert out["counters"]["compiles"] == 0, "the other gears' look-ups ended; nothing compiled instead"


@pytest.mark.slow
def test_a_warm_start_under_autocast_never_serves_the_entries_stored_without_it(gears_cache, tmp_path):
    """The look-up threads key each gear under the caller's autocast (a thread starts without it): the gears stored
    without autocast are not served to calls under it, whose outputs keep eager's dtype and values."""
    warm = run_script("run_gear_loads.py", str(_copy(gears_cache, tmp_path)), "--autocast")
    assert "error" not in warm and warm["gears"] == 3
    assert all(dtype == ["torch.bfloat16", "torch.bfloat16"] for dtype in warm["dtypes"]), warm["dtypes"]
    assert warm["equal"]
    assert warm["counters"]["loads"] == 0, "no gear's entry stored without autocast is loaded"


@pytest.mark.slow
def test_a_warm_start_hashes_its_artifacts_once_then_loads_them_by_their_stamps(gears_cache, tmp_path,
                                                                                  empty_torch_caches):
    """Issue #38: the look-ups' store work is counted, not timed. A copied store (every file a new inode and ctime:
    no stamp matches) is hashed by the first warm process, which stamps each artifact once its files are older than
    ``RACY_S``; the next warm process computes no digest (every check passed by its stamp, nothing the loads or the
    leases wrote in between disturbed one) and never waits for a lease lock."""
    from gearcache.store import stamps

    cache = _copy(gears_cache, tmp_path)
    time.sleep(stamps.RACY_S + 0.1)                 # the copied files' ctimes old enough to be stamped at a check
    first = run_script("run_gear_loads.py", str(cache), env=empty_torch_caches)
    assert "error" not in first and first["equal"]
    c = first["counters"]
    assert c["loads"] == 3 and c["digests"] > 0 and c["stamped_checks"] == 0, c
    assert len(list((cache / "stamps").glob("*.json"))) == 3, "each artifact stamped by its full check"
    second = run_script("run_gear_loads.py", str(cache), env=empty_torch_caches)
    assert "error" not in second and second["equal"]
    c = second["counters"]
    assert c["loads"] == 3 and c["direct_loads"] == 3 and c["compiles"] == 0, c
    assert c["digests"] == 0 and c["stamped_checks"] == 3 and c["lease_waits"] == 0, c


def test_look_ups_run_side_by_side_only_after_a_first_one_that_mostly_waited(monkeypatch):
    """``driver.lookup_threads``: what the first look-up spent decides. Mostly on the CPU (Python holding the GIL):
    one after another. Mostly off it, blocked (a remote store, a lock held elsewhere): the load threads; off it
    because other processes had the cores (preempted more often than blocked): one after another.
    ``GEARCACHE_LOAD_THREADS`` decides instead where set."""
    from gearcache.warmup import driver

    monkeypatch.delenv("GEARCACHE_LOAD_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert driver.lookup_threads(wall=0.020, cpu=0.019) == 1
    assert driver.lookup_threads(wall=0.020, cpu=0.011, blocks=30, preemptions=0) == 1
    assert driver.lookup_threads(wall=0.200, cpu=0.020) == driver.load_threads()
    assert driver.lookup_threads(wall=0.200, cpu=0.020, blocks=12, preemptions=3) == driver.load_threads()
    assert driver.lookup_threads(wall=0.200, cpu=0.020, blocks=2, preemptions=9) == 1
    spent = driver._spent_since(driver._thread_clock())
    assert spent.wall >= 0 and spent.cpu >= 0 and spent.preemptions >= 0
    monkeypatch.setenv("GEARCACHE_LOAD_THREADS", "4")
    assert driver.lookup_threads(wall=0.020, cpu=0.019) == 4
    monkeypatch.setenv("GEARCACHE_LOAD_THREADS", "1")
    assert driver.lookup_threads(wall=0.200, cpu=0.020) == 1


def test_the_look_up_threads_can_be_set_to_compare(monkeypatch):
    """``GEARCACHE_LOAD_THREADS`` sets the look-up threads (at most ``LOAD_THREADS``); anything but a positive integer
    leaves the default (the cores over torchrun's local ranks)."""
    from gearcache.warmup import driver

    monkeypatch.delenv("GEARCACHE_LOAD_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    default = driver.load_threads()
    for value, want in [("1", 1), ("3", 3), ("64", driver.LOAD_THREADS), ("0", default), ("x", default)]:
        monkeypatch.setenv("GEARCACHE_LOAD_THREADS", value)
        assert driver.load_threads() == want, value


def _flip(cache_dir) -> Flip:
    config = CompilerConfig()
    config.inference_config.dim_gears = {"x": {0: [2, 4]}}
    config.inference_config.warmup_workers = 1
    torch.manual_seed(0)
    return Flip(cache_dir, config).eval()


@pytest.fixture(scope="module")
def flip_cache(tmp_path_factory) -> Path:
    """Flip's two gears (2, 4) stored with ``flip=False`` (compiled in this process)."""
    cache = tmp_path_factory.mktemp("flip")
    with torch.inference_mode():
        assert _flip(cache).cached.warmup(torch.zeros(4, 4)) == 2
    shutil.copytree(cache, _pristine(cache), ignore=shutil.ignore_patterns("locks", "leases"))
    return cache


def _pristine(flip_cache: Path) -> Path:
    """A copy of ``flip_cache`` as its fixture left it (tests add entries for ``flip=True`` to the cache itself)."""
    return flip_cache.parent / f"{flip_cache.name}_pristine"


def test_a_value_changed_between_a_warm_ups_look_ups_is_never_served_from_the_old_graph(flip_cache, monkeypatch):
    """Another thread sets ``model.flip = True`` while a warm-up looks its gears up (here: right after the first
    look-up). The gears' one guard set was checked, for the pass, on ``flip=False``; the watch is built after the
    look-ups, on ``flip=True``: the entries loaded for False must not serve the calls after the warm-up."""
    model = _flip(flip_cache)
    real_find = EntryLife.find

    def find(self, leaves, key, *rest):
        found = real_find(self, leaves, key, *rest)
        model.flip = True                       # as another thread would, mid-pass
        return found

    monkeypatch.setattr(EntryLife, "find", find)
    with torch.inference_mode():
        model.cached.warmup(torch.zeros(4, 4))
        monkeypatch.setattr(EntryLife, "find", real_find)
        for n in (1, 2, 3, 4):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model.cached(x), model.fwd(x))


def _flip_on(m: Flip) -> None:
    m.flip = True


@pytest.mark.parametrize("when", ["after warm-up", "between calls"])
def test_a_value_changed_after_a_warm_up_is_never_served_from_the_old_graph(flip_cache, when):
    """The gears' shared guard set was checked and watched at the warm-up: ``flip = True`` set after it (before the
    first call, or between two calls) is seen at the next call, which compiles for it; every output equals eager."""
    model = _flip(flip_cache)
    with torch.inference_mode():
        with counters.expect(compiles=0, loads=2):
            model.cached.warmup(torch.zeros(4, 4))
        x = torch.randn(3, 4)
        if when == "between calls":
            torch.testing.assert_close(model.cached(x), model.fwd(x))
        _flip_on(model)
        for n in (3, 1, 4):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model.cached(x), model.fwd(x))


def test_two_modules_sharing_a_parsed_guard_set_are_each_checked_on_their_own_values(flip_cache):
    """Two instances warm up from the same stored gears: their manifests' guards are byte-equal, one parsed set
    shared by both. Changing one instance's value is checked against that instance only: it compiles for its value,
    the other keeps serving its loaded gears; each equals its own eager."""
    a, b = _flip(flip_cache), _flip(flip_cache)
    with torch.inference_mode():
        a.cached.warmup(torch.zeros(4, 4))
        b.cached.warmup(torch.zeros(4, 4))
        entries = [e for m in (a, b) for e in m.cached.life.table.values()]
        assert len({id(e.guards) for e in entries}) == 1, "one parsed set for both instances' gears"
        b.flip = True
        for n in (2, 3):
            x = torch.randn(n, 4)
            torch.testing.assert_close(b.cached(x), b.fwd(x))
            with counters.expect(compiles=0, loads=0):
                torch.testing.assert_close(a.cached(x), a.fwd(x))


def test_a_manifest_whose_guards_are_edited_on_disk_is_checked_on_its_own_guards(flip_cache, tmp_path):
    """This process parsed the gears' guard set already; one manifest edited on disk to claim ``flip=True`` is a set
    of its own, checked on the live ``flip=False``: refused (its gear compiled again), never served because an equal
    set was parsed before."""
    first = _flip(flip_cache)
    with torch.inference_mode():
        first.cached.warmup(torch.zeros(4, 4))          # the stored set parsed, and held (by first's entries)
    cache = tmp_path / "cache"
    shutil.copytree(_pristine(flip_cache), cache)
    edited = 0
    for path in cache.glob("entries/*/*/*.json"):
        manifest = json.loads(path.read_text())
        if manifest["signature"]["leaves"][0]["shape"] == [2, 4]:
            for guard in manifest["guards"]:
                if guard[1][-1] == ["attr", "flip"] and guard[3] == ["bool", False]:
                    guard[3] = ["bool", True]
                    edited += 1
            path.write_text(json.dumps(manifest))
    assert edited == 1
    model = _flip(cache)
    with torch.inference_mode():
        with counters.expect(traces=1):                  # the edited set is one of its own: its gear traced again
            model.cached.warmup(torch.zeros(4, 4))
        scope = model.cached.life.scope
        assert all(e.guards.mismatch(scope) is None for e in model.cached.life.table.values())
        for n in (1, 2, 3, 4):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model.cached(x), model.fwd(x))


@pytest.mark.slow
def test_gears_stored_for_other_values_are_two_sets_each_served_only_where_it_holds(tmp_path):
    """Gear 2 stored with ``flip=False``, gear 4 with ``flip=True`` (the value changed between the cold process's
    calls): their guards differ in one value, two parsed sets. A warm-up with either value loads the gear stored for
    it and compiles the other; every output equals eager."""
    cold = _flip(tmp_path)
    with torch.inference_mode():
        torch.testing.assert_close(cold.cached(torch.ones(2, 4)), cold.fwd(torch.ones(2, 4)))
        cold.flip = True
        torch.testing.assert_close(cold.cached(torch.ones(4, 4)), cold.fwd(torch.ones(4, 4)))
        for flip in (False, True):
            model = _flip(tmp_path)
            model.flip = flip
            with counters.expect(traces=1):           # the other gear's entry holds for the other value
                model.cached.warmup(torch.zeros(4, 4))
            sets = {id(e.guards) for e in model.cached.life.table.values()}
            assert len(model.cached.life.table) == 2 and len(sets) == 2, "a set per value, never one shared"
            for n in (1, 2, 3, 4):
                x = torch.randn(n, 4)
                torch.testing.assert_close(model.cached(x), model.fwd(x))


@pytest.mark.parametrize("how", [pytest.param("warm", marks=pytest.mark.slow), "mid-pass"])
def test_a_warm_process_with_another_value_re_traces_its_gears(flip_cache, tmp_path, how):
    """Fresh processes on the gears stored for ``flip=False``: one that starts with ``flip=True``, one whose value
    changes after its first gear's look-up. Each traces its gears for True (nothing loaded for False serves it) and
    every output equals eager."""
    cache = tmp_path / "cache"
    shutil.copytree(_pristine(flip_cache), cache)
    out = run_script("run_flip.py", str(cache), "True", *(["--mid-pass"] if how == "mid-pass" else []))
    assert out["gears"] == 2 and out["equal"], out
    assert out["counters"]["traces"] >= 2, "both gears traced for flip=True"


@pytest.mark.parametrize("after", [1, 2])
def test_a_submodule_replaced_between_a_warm_ups_look_ups_is_read_by_every_gear(flip_cache, monkeypatch, after):
    """``model.lin`` replaced by another ``Linear(4, 3)`` (same class and shapes: every value guard still holds) right
    after the warm-up's ``after``-th gear look-up, as another thread would. A gear looked up before holds the old
    submodule's tensors: it must read the new ones (rebound), as eager does, whether the watch is built after the
    change (first gear) or kept from it (a later gear of the same guard set)."""
    model = _flip(flip_cache)
    real_find = EntryLife.find
    looked_up = []

    def find(self, leaves, key, *rest):
        found = real_find(self, leaves, key, *rest)
        looked_up.append(leaves[0].shape[0])
        if len(looked_up) == after:
            model.lin = torch.nn.Linear(4, 3)
        return found

    monkeypatch.setattr(EntryLife, "find", find)
    with torch.inference_mode():
        model.cached.warmup(torch.zeros(4, 4))
        monkeypatch.setattr(EntryLife, "find", real_find)
        assert len(looked_up) == 2
        for n in (1, 2, 3, 4):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model.cached(x), model.fwd(x))


def test_a_value_changed_after_the_warm_ups_plan_look_up_is_looked_up_again(flip_cache, monkeypatch):
    """A warm-up with workers looks the stored gear plan up before starting them and hands that record to the plan's
    load, which checks its guards again: ``flip`` set to True in between (as another thread would) makes the plan
    be looked up anew, and the gears stored for True serve; every output equals eager."""
    from gearcache.compiling.gear_plan_life import GearPlanLife

    with torch.inference_mode():
        other = _flip(flip_cache)
        other.flip = True
        other.cached.warmup(torch.zeros(4, 4))          # the gears and plan for True stored (or loaded) first
    model = _flip(flip_cache)
    model.cached.config.inference_config.warmup_workers = 2
    real_stored = GearPlanLife.stored
    found = []

    def stored(self, call):
        record = real_stored(self, call)
        found.append(record.record is not None)
        model.flip = True
        return record

    monkeypatch.setattr(GearPlanLife, "stored", stored)
    with torch.inference_mode():
        with counters.expect(traces=0, compiles=0):
            model.cached.warmup(torch.zeros(4, 4))
        assert found == [True, True], "the plan looked up for the workers, then again for its value"
        for n in (1, 2, 3, 4):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model.cached(x), model.fwd(x))
