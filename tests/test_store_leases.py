"""The lease lock across processes (issue #38, a warm start's look-ups): loaders hold ``locks/<akey>.lease.lock``
shared, so the ranks of a job that load the same artifacts never queue on it; an evictor holds it exclusively, so it
waits for every loader inside and every loader waits for it; a leased artifact is never evicted.

Every holder here is a real process (its lock is a flock of its own open file, as another rank's is), and
each "at once" is proved by a barrier the processes pass while they hold the lock, never by timing.
"""
from __future__ import annotations

import multiprocessing
import os
import pathlib
import threading

import pytest

from gearcache import LockTimeoutError
from gearcache.store import HOST, Store, StoreConfig

AKEY = "a" * 40
FORK = multiprocessing.get_context("forkserver")    # forked from a server that imported the store once
FORK.set_forkserver_preload(["gearcache.store"])
WAIT_S = 20.0                                   # how long anything here waits before it counts as a hang


class Builder:
    def __call__(self, folder: pathlib.Path) -> None:
        (folder / "k").mkdir(parents=True)
        (folder / "k" / "module.py").write_bytes(b"def call(args):\n    return args\n")


def _store(root: str) -> Store:
    store = Store(root, StoreConfig(lock_timeout_s=WAIT_S))
    store.first_use.ensure()
    return store


def _lease_inside_the_lock(root: str, barrier, out: str) -> None:
    """A loader: ``Leases.take`` of AKEY, which waits inside the lease lock (while writing its lease) until every
    loader is inside too; writes "ok" to ``out`` when the barrier was passed."""
    store = _store(root)
    write = store.leases._write

    def write_when_all_are_inside(path: pathlib.Path) -> None:
        barrier.wait(WAIT_S)                    # BrokenBarrierError (a child's exit 1) if they cannot all be inside
        write(path)

    store.leases._write = write_when_all_are_inside
    store.leases.take(AKEY)
    pathlib.Path(out).write_text("ok" if store.leases.live_holders(AKEY) else "no lease")


def _hold(root: str, shared: bool, held, release, note: str | None = None) -> None:
    """Hold AKEY's lease lock (``shared`` or exclusively, as an evictor does) until ``release`` is set; ``note``: a
    file written just before letting go."""
    store = _store(root)
    if not shared:
        os.environ["RANK"] = "3"                # named by the holder note a waiter reads
    with store.locks.held(store.locks.path(AKEY, "lease"), WAIT_S, shared=shared):
        held.set()
        assert release.wait(WAIT_S)
        if note:
            pathlib.Path(note).write_text("released")


def _start(target, *args):
    proc = FORK.Process(target=target, args=args)
    proc.start()
    return proc


def _join(procs) -> list[int | None]:
    for proc in procs:
        proc.join(WAIT_S * 2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


@pytest.fixture
def root(tmp_path) -> str:
    store = _store(str(tmp_path / "cache"))
    store.artifacts.publish(AKEY, Builder())
    return str(store.root)


def test_loaders_of_one_artifact_hold_the_lease_lock_at_once(root, tmp_path):
    """4 loader processes are inside ``Leases.take``'s lock at the same time (each waits there for the others): none
    waits for another, and each leaves its lease."""
    barrier = FORK.Barrier(4)
    outs = [tmp_path / f"out{i}" for i in range(4)]
    procs = [_start(_lease_inside_the_lock, root, barrier, str(out)) for out in outs]
    assert _join(procs) == [0] * 4
    assert [out.read_text() for out in outs] == ["ok"] * 4
    assert not list((pathlib.Path(root) / "locks").glob("*.lease.lock.holder")), "a shared hold writes no note"


def test_an_evictor_waits_for_the_loaders_inside_and_then_removes_the_unleased_artifact(root):
    """While loader processes hold the lease lock (shared), an evictor cannot take it: ``remove_artifact`` reports
    the lock busy and the artifact stays; once they let go, the evictor takes it."""
    held = [FORK.Event() for _ in range(3)]
    release = FORK.Event()
    procs = [_start(_hold, root, True, h, release) for h in held]
    try:
        assert all(h.wait(WAIT_S) for h in held)
        evictor = _store(root)
        assert evictor.maintenance.remove_artifact(AKEY) == "lease lock busy"
        assert evictor.layout.artifact(AKEY).is_dir()
        with pytest.raises(LockTimeoutError):
            with evictor.locks.held(evictor.locks.path(AKEY, "lease"), 0.2):
                pass
    finally:
        release.set()
    assert _join(procs) == [0] * 3
    assert _store(root).maintenance.remove_artifact(AKEY) == "removed"


def test_a_loader_waits_for_an_evictor_and_goes_on_once_it_let_go(root, tmp_path):
    """An evictor process holds the lease lock exclusively: a loader's shared hold times out naming it (its holder
    note), and a loader that waits longer takes the lock only after the evictor let go."""
    held, release = FORK.Event(), FORK.Event()
    note = tmp_path / "released"
    evictor = _start(_hold, root, False, held, release, str(note))
    try:
        assert held.wait(WAIT_S)
        loader = _store(root)
        lock = loader.locks.path(AKEY, "lease")
        with pytest.raises(LockTimeoutError) as info:
            with loader.locks.held(lock, 0.2, shared=True):
                pass
        assert info.value.holder.startswith(f"rank 3, pid {evictor.pid} on host ")
        got: list[str] = []

        def wait_and_take() -> None:
            with loader.locks.held(lock, WAIT_S, shared=True):
                got.append(note.read_text() if note.exists() else "taken while the evictor held it")

        thread = threading.Thread(target=wait_and_take)
        thread.start()
    finally:
        release.set()
    thread.join(WAIT_S)
    assert _join([evictor]) == [0]
    assert got == ["released"]


def _take_then_hold(root: str, taken, release) -> None:
    """A loader process: leases AKEY (under the shared lease lock), then keeps it while ``release`` is unset."""
    store = _store(root)
    store.leases.take(AKEY)
    taken.set()
    assert release.wait(WAIT_S)


def test_eviction_spares_an_artifact_leased_by_a_loader_process(root, tmp_path):
    """A loader process leased the artifact; an evictor over max_size (the lease lock free again) keeps it, and
    evicts it once the loader is gone."""
    taken, release = FORK.Event(), FORK.Event()
    loader = _start(_take_then_hold, root, taken, release)
    try:
        assert taken.wait(WAIT_S)
        evictor = Store(root, StoreConfig(max_size=1))
        assert evictor.maintenance.evict() == []
        assert evictor.maintenance.remove_artifact(AKEY) == f"in use by {loader.pid}@{HOST}"
        assert evictor.layout.artifact(AKEY).is_dir()
    finally:
        release.set()
    assert _join([loader]) == [0]
    after = Store(root, StoreConfig(max_size=1))
    after.maintenance.evict()                   # (its first use's cleanup may be the one that evicts)
    assert not after.layout.artifact(AKEY).exists()


def test_a_soft_lock_store_still_excludes_loaders_from_each_other(tmp_path):
    """``lock_mode="soft"`` (network filesystems) is unchanged: a shared hold is an exclusive soft lock there."""
    store = Store(tmp_path / "cache", StoreConfig(lock_mode="soft", lock_timeout_s=0.2))
    store.first_use.ensure()
    lock = store.locks.path(AKEY, "lease")
    with store.locks.held(lock, 0.2, shared=True):
        assert lock.exists()
        other = Store(tmp_path / "cache", StoreConfig(lock_mode="soft", lock_timeout_s=0.2))
        with pytest.raises(LockTimeoutError):
            with other.locks.held(lock, 0.2, shared=True):
                pass
    assert not lock.exists()


def test_a_dead_lease_is_removed_under_the_lease_lock_never_while_a_loader_writes_one(tmp_path):
    """Cleanup removes a dead process's lease under the artifact's lease lock, held exclusively: a process that took
    the dead one's pid writes its lease at the same path under that lock (shared), so while a loader holds it the
    dead lease stays (left for the next cleanup), and once it is free the dead lease goes."""
    root = str(tmp_path / "store")
    store = _store(root)
    held, release = FORK.Event(), FORK.Event()
    loader = _start(_hold, root, True, held, release)
    dead = store.layout.lease(AKEY, 2 ** 22 + 12345)        # a pid no live process has
    try:
        assert held.wait(WAIT_S)
        store.layout.mkdir(dead.parent.parent)
        store.layout.mkdir(dead.parent)
        dead.write_text("0\n")                              # (after the loader's own store cleaned up at its start)
        assert not store.leases.is_live(dead)
        assert store.maintenance.cleanup()["leases"] == 0 and dead.exists(), "removed while a loader held the lock"
    finally:
        release.set()
        assert _join([loader]) == [0]
    assert store.maintenance.cleanup()["leases"] == 1 and not dead.exists()
