"""Reliability across processes (issue "Reliability and trust"): SIGKILL at every step of publishing, eviction with
a live reader, kernel-released locks, and a multi-process stress run with eviction on.

Children are real processes forked from a forkserver that imported torch once (see tests/reliability_child.py);
most "compiles" copy a prebuilt artifact (a real Inductor compile costs seconds here), three kill rounds compile for
real. ``GEARCACHE_KILL_SEED=<n>`` replays a run's random choices (the seed is in every failure message).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import random
import shutil
import signal
import time

import diskcache
import filelock
import pytest

import reliability_child as rc
from gearcache import counters
from gearcache.store import Store, StoreConfig

pytestmark = pytest.mark.slow      # the slow tier (pytest -m slow): CI runs it after the README's line

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.standalone_compile",
           "torch._inductor.codecache", "gearcache", "gearcache.compiling.faults"]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> pathlib.Path:
    return rc.prebuilt_store(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def fork():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_child(fork, target, *args, timeout: float = 120) -> int:
    proc = fork.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{target.__name__}{args} did not finish in {timeout} s")
    return proc.exitcode


def artifact_bytes(prebuilt: pathlib.Path) -> int:
    akey = rc.artifact_keys(prebuilt)["2"]
    return json.loads((prebuilt / "artifacts" / akey / "MANIFEST.json").read_text())["bytes"]


def check(fork, root, prebuilt, config, out, corrupted=None) -> dict:
    code = run_child(fork, rc.check_store, str(root), str(prebuilt), config, str(out), corrupted)
    assert code == 0, f"checker exited {code}"
    return json.loads(pathlib.Path(out).read_text())


def flip_a_byte(folder: pathlib.Path, rng: random.Random) -> None:
    """Flip a byte of a file a load reads (``runplan.files_read``: the run plan and the libraries it names), so
    that the next load finds the artifact corrupt."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in ("MANIFEST.json", "MANIFEST.sig")
                   and rc.read_by_load(folder, p.relative_to(folder).as_posix()))
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 0x10
    path.write_bytes(bytes(data))


def test_sigkill_at_every_step_of_publishing_leaves_nothing_loadable(prebuilt, fork, tmp_path):
    """20 rounds: a child publishing an entry kills itself (SIGKILL) at one step of publishing (after a random delay),
    then a fresh process on the same folder finds no half-published artifact or partial file (its Store cleaned up
    tmp/, temp files and leases), every artifact valid, and the eager answer for every shape."""
    seed = int(os.environ.get("GEARCACHE_KILL_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    akeys = rc.artifact_keys(prebuilt)
    config = {"signing_key": "kill-test-key"}       # signed: the signature file is one more step to die at
    first = check(fork, root, prebuilt, config, tmp_path / "check0.json")
    assert first["problems"] == [] and all(first["equal"].values()), first

    steps = [s for s in rc.KILL_STEPS] + ["compile-real"] * 3 + ["timer", "build-mid"]
    rng.shuffle(steps)
    assert len(steps) == 20
    cleaned = 0
    for r, step in enumerate(steps):
        where = f"round {r}, step {step!r} (GEARCACHE_KILL_SEED={seed} replays the run)"
        rows = rng.choice(rc.ROWS)
        folder = root / "artifacts" / akeys[str(rows)]
        if step == "quarantine":
            flip_a_byte(folder, rng)                # the child finds it corrupt and dies moving it aside
        else:
            shutil.rmtree(folder, ignore_errors=True)   # so that the child has to publish it
            if rng.random() < 0.5:
                for path in (root / "entries").glob("*/*/*.json"):
                    if json.loads(path.read_text()).get("akey") == akeys[str(rows)]:
                        path.unlink()
        if step == "timer":
            delay = rng.uniform(0.02, 0.4)
        elif step == "compile-real":
            delay = rng.uniform(0.1, 2.5)           # into a real Inductor compile
        else:
            delay = rng.choice([0.0, 0.0, rng.uniform(0.0, 0.005)])
        cfg = dict(config, max_size=int(artifact_bytes(prebuilt) * 1.5)) if step == "evict" else config
        out = tmp_path / f"kill{r}.json"
        code = run_child(fork, rc.kill_round, str(root), str(prebuilt), step, delay, rows, cfg, str(out))
        assert code == -signal.SIGKILL, f"{where}: the child was not killed (exit {code})"
        report = check(fork, root, prebuilt, config, tmp_path / f"check{r + 1}.json",
                       akeys[str(rows)] if step == "quarantine" else None)
        assert report["problems"] == [], f"{where}: {report['problems']}"
        assert all(report["equal"].values()), f"{where}: answers differ from eager: {report['equal']}"
        cleaned += len(report["cleaned_tmp"])
    assert cleaned >= 3, "kills before the rename must have left work folders for the next Store to clean"


def test_sigkill_releases_the_publish_lock(prebuilt, fork, tmp_path):
    """A process killed while holding an artifact's lock (flock) does not block the next one."""
    store = Store(tmp_path / "store", StoreConfig(lock_timeout_s=5))
    store.first_use.ensure()
    lock = store.locks.path("a" * 40)
    proc = fork.Process(target=_hold_lock, args=(str(lock), str(tmp_path / "ready")))
    proc.start()
    _wait_for(tmp_path / "ready")
    with pytest.raises(filelock.Timeout):
        filelock.FileLock(str(lock), timeout=0.1).acquire()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    t0 = time.monotonic()
    assert store.artifacts.publish("a" * 40, lambda f: (f.mkdir(), (f / "x.py").write_text("x = 1\n")))[1]
    assert time.monotonic() - t0 < 2


def _hold_lock(path: str, ready: str) -> None:
    with filelock.FileLock(path):
        pathlib.Path(ready).write_text("1")
        time.sleep(600)


def _wait_for(path: pathlib.Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def test_eviction_spares_an_artifact_a_live_process_loaded(prebuilt, fork, tmp_path, monkeypatch, caplog):
    """Under a size cap, the least recently used artifact is evicted first, except one that a live process loaded
    (its lease): the next one goes instead. Once that process is killed, its artifact can go too."""
    root = rc.copy_store(prebuilt, tmp_path / "store")
    akeys = rc.artifact_keys(prebuilt)
    a, b, c = (akeys[str(r)] for r in rc.ROWS)
    for age, akey in ((300, a), (200, b), (100, c)):     # a is the least recently used, then b
        t = time.time() - age
        os.utime(root / "artifacts" / akey / "MANIFEST.json", (t, t))
    proc = fork.Process(target=rc.load_and_wait, args=(str(root), rc.ROWS[0], str(tmp_path / "ready")))
    proc.start()
    try:
        child = json.loads(_wait_for(tmp_path / "ready"))
        assert child["equal"] and child["loads"] == 1 and child["compiles"] == 0
        size = artifact_bytes(prebuilt)
        store = Store(root, StoreConfig(max_size=int(size * 2.5)))
        assert [n.split("@")[0] for n in store.leases.live_holders(a)] == [str(proc.pid)]
        assert not store.leases.live_holders(b)
        with caplog.at_level("INFO", logger="gearcache"), counters.expect(evictions=1):
            store.maintenance.evict()                           # (the Store's first cleanup may be the one that evicts)
        assert "evicted artifact " + b in caplog.text and "over max_size" in caplog.text
        assert (root / "artifacts" / a).is_dir() and not (root / "artifacts" / b).exists()
        assert (root / "artifacts" / c).is_dir()
        assert not [p for p in (root / "entries").glob("*/*/*.json") if b in p.read_text()], "b's entry went too"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    with counters.expect(evictions=1):
        # its reader is dead: the lease no longer counts
        Store(root, StoreConfig(max_size=int(size * 1.5))).maintenance.evict()
    assert not (root / "artifacts" / a).exists() and (root / "artifacts" / c).is_dir()
    monkeypatch.setattr(rc.pipeline, "compile_artifact", rc.fake_compile(prebuilt))
    with counters.expect(compiles=1, loads=0):
        assert rc.check_call(rc.make(root), rc.ROWS[0])     # evicted means a miss, compiled again, right


def test_stress_8_processes_200_calls_with_eviction(prebuilt, fork, tmp_path):
    """8 processes x 200 calls on 3 shapes, one folder, a size cap of 1.5 artifacts: models are dropped and made
    again every 5 calls, and the processes move from shape to shape together every 20 calls, so the shape they left is
    evicted and published again when they come back to it, while laggards still load and call it. No process sees
    an error, a warning or a wrong answer, and the index matches the folder: every artifact row's artifact exists
    and vice versa, every entry (manifest or index row) names an artifact that exists, every artifact verifies."""
    root = rc.copy_store(prebuilt, tmp_path / "store")
    akeys = rc.artifact_keys(prebuilt)
    for rows in rc.ROWS[1:]:                          # start with one shape: the rest gets published under the cap
        shutil.rmtree(root / "artifacts" / akeys[str(rows)])
    max_size = int(artifact_bytes(prebuilt) * 1.5)
    config = {"max_size": max_size}
    procs = []
    for i in range(8):
        proc = fork.Process(target=rc.stress_worker,
                            args=(str(root), str(prebuilt), config, 200, 5, 1000 + i, str(tmp_path / f"w{i}.json")))
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.join(300)
        assert not proc.is_alive(), "a stress worker hung"
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(8)]
    assert [p.exitcode for p in procs] == [0] * 8
    for i, rep in enumerate(reports):
        assert rep["errors"] == [] and rep["wrong"] == 0, f"worker {i}: {rep['errors'][:1]} wrong={rep['wrong']}"
        assert rep["warnings"] == [], f"worker {i} logged warnings: {rep['warnings'][:3]}"
    evictions = sum(rep["counters"]["evictions"] for rep in reports)
    print(f"stress: {evictions} evictions, {sum(r['counters']['compiles'] for r in reports)} publishes")
    publishes = sum(rep["counters"]["compiles"] for rep in reports)
    assert evictions >= 3 and publishes >= 3, (evictions, publishes)

    store = Store(root, StoreConfig(max_size=max_size))
    on_disk = {p.name for p in (root / "artifacts").iterdir()}
    index = diskcache.Index(str(root / "index"))
    rows = dict(index.items())
    indexed = {k[len("artifact:"):] for k in rows if k.startswith("artifact:")}
    assert indexed == on_disk, f"index rows {sorted(indexed)} vs artifacts {sorted(on_disk)}"
    for key, row in rows.items():
        if not key.startswith("artifact:") and "akey" in row:
            assert row["akey"] in on_disk, f"index row {key} names evicted artifact {row['akey']}"
    for path in (root / "entries").glob("*/*/*.json"):
        assert json.loads(path.read_text())["akey"] in on_disk, f"entry {path.name} names a missing artifact"
    for akey in on_disk:
        store.artifacts.verify(akey)
    assert not list((root / "tmp").iterdir()), "work folders left behind"
    store.first_use.ensure()                              # a new Store's cleanup removes the leases of exited workers
    assert not [p for p in (root / "leases").rglob("*") if p.is_file()], "leases of exited processes left behind"
    store.maintenance.evict()                                     # nobody holds a lease now: the cap holds again
    assert sum(s for s, _ in store.layout.artifact_sizes().values()) <= max_size
