import hashlib
import logging
import json
import os
import pickle
import stat
import threading

import filelock
import pytest

from gearcache import (CacheCorruptionError, GraphBreakError, LockTimeoutError, SignatureMismatchError,
                       UntrustedCacheError)
from gearcache.keys.key import FORMAT_VERSION
from gearcache.store import Store, StoreConfig, write_json_atomic

AKEY = "a" * 40
# what ``build`` writes into its folder, which is published as ``<artifact>/inductor``
FILES = {"module.py": b"def call(args):\n    return args\n", "kernels/k.so": b"\x7fELF\x00\x01"}


class Builder:
    """A ``build`` callback that writes ``FILES`` and counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, folder):
        self.calls += 1
        for rel, data in FILES.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "cache")


@pytest.fixture
def published(store):
    folder, built = store.artifacts.publish(AKEY, Builder())
    assert built
    return folder


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "x.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    write_json_atomic(path, {"c": 3})
    assert json.loads(path.read_text()) == {"c": 3}
    assert os.listdir(path.parent) == ["x.json"]


def test_publish_writes_manifest(store, published):
    assert published == store.layout.artifact(AKEY)
    manifest = json.loads((published / "MANIFEST.json").read_text())
    assert manifest["format"] == FORMAT_VERSION and manifest["akey"] == AKEY
    assert manifest["files"] == {f"inductor/{rel}": hashlib.sha256(data).hexdigest() for rel, data in FILES.items()}
    assert manifest["bytes"] == sum(len(d) for d in FILES.values())
    for rel, data in FILES.items():
        assert (published / "inductor" / rel).read_bytes() == data
    store.artifacts.verify(AKEY)
    assert os.listdir(store.root / "tmp") == []


def test_publish_again_does_not_build(store, published):
    builder = Builder()
    folder, built = store.artifacts.publish(AKEY, builder)
    assert (folder, built, builder.calls) == (published, False, 0)
    # nor does another Store on the same folder (another process)
    assert Store(store.root).artifacts.publish(AKEY, builder)[1:] == (False,) and builder.calls == 0


def test_verify_missing_artifact(store):
    with pytest.raises(FileNotFoundError):
        store.artifacts.verify("b" * 40)


def flip_byte(folder):
    path = folder / "inductor/module.py"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))


def truncate(folder):
    (folder / "inductor/kernels/k.so").write_bytes(b"\x7fEL")


def delete(folder):
    (folder / "inductor/module.py").unlink()


def add_unlisted(folder):
    (folder / "inductor/evil.py").write_text("import os\n")


def bad_manifest(folder):
    (folder / "MANIFEST.json").write_text("{not json")


def other_key_manifest(folder):
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    (folder / "MANIFEST.json").write_text(json.dumps(dict(manifest, akey="c" * 40)))


@pytest.mark.parametrize("corrupt, reason", [
    (flip_byte, "does not match its sha256"), (truncate, "does not match its sha256"), (delete, "is missing"),
    (add_unlisted, "unlisted file"), (bad_manifest, "unreadable"), (other_key_manifest, "another format or key"),
])
def test_corruption_detected_quarantined_and_rebuilt(store, published, corrupt, reason):
    corrupt(published)
    with pytest.raises(CacheCorruptionError, match=reason) as info:
        store.artifacts.verify(AKEY)
    assert info.value.path == str(published)

    builder = Builder()
    folder, built = store.artifacts.publish(AKEY, builder)
    assert (folder, built, builder.calls) == (published, True, 1)
    store.artifacts.verify(AKEY)
    quarantined = os.listdir(store.root / "quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith(AKEY + ".")


def test_verify_only_the_parts_a_load_reads(store, published):
    """``only``: a folder part is checked whole (digests, unlisted files, trust), a file part must be listed; the
    manifest is always read; damage elsewhere is left to a full verification."""
    store.artifacts.verify(AKEY, only=["inductor/kernels/", "inductor/module.py"])
    flip_byte(published)                                            # inductor/module.py
    store.artifacts.verify(AKEY, only=["inductor/kernels/"])         # not read by such a load
    with pytest.raises(CacheCorruptionError, match="module.py does not match"):
        store.artifacts.verify(AKEY, only=["inductor/kernels/", "inductor/module.py"])
    with pytest.raises(CacheCorruptionError, match="module.py does not match"):
        store.artifacts.verify(AKEY)
    (published / "inductor/kernels/evil.so").write_bytes(b"\x7fELF")
    with pytest.raises(CacheCorruptionError, match="unlisted file"):
        store.artifacts.verify(AKEY, only=["inductor/kernels/"])
    with pytest.raises(CacheCorruptionError, match="not listed in MANIFEST.json"):
        store.artifacts.verify(AKEY, only=["inductor/kernels/evil.so"])
    (published / "inductor/kernels/evil.so").unlink()
    os.chmod(published / "inductor/kernels", 0o777)
    with pytest.raises(CacheCorruptionError, match="lets every user write it"):
        store.artifacts.verify(AKEY, only=["inductor/kernels/"])
    os.chmod(published / "inductor/kernels", 0o755)
    bad_manifest(published)
    with pytest.raises(CacheCorruptionError, match="unreadable"):
        store.artifacts.verify(AKEY, only=["inductor/kernels/"])


def test_torch_lock_files_are_ignored(store, published):
    (published / "inductor" / "locks").mkdir()
    (published / "inductor" / "locks" / "x.lock").write_text("")
    store.artifacts.verify(AKEY)


def test_failed_build_leaves_nothing(store):
    def build(folder):
        Builder()(folder)
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        store.artifacts.publish(AKEY, build)
    assert os.listdir(store.root / "tmp") == []
    assert not store.layout.artifact(AKEY).exists()
    assert store.artifacts.publish(AKEY, Builder())[1] is True      # and the lock was released


def test_root_created_private(tmp_path):
    store = Store(tmp_path / "a" / "cache")
    store.artifacts.publish(AKEY, Builder())
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.layout.artifact(AKEY).stat().st_mode) == 0o700


def test_group_writable_root_untrusted(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    builder = Builder()
    with pytest.raises(UntrustedCacheError, match="chmod go-w") as info:
        Store(root).artifacts.publish(AKEY, builder)
    assert info.value.path == str(root.resolve()) and builder.calls == 0
    assert isinstance(info.value, PermissionError)


def test_sticky_root_trusted(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    assert Store(root).artifacts.publish(AKEY, Builder())[1] is True


def test_group_writable_artifact_untrusted(store, published):
    published.chmod(0o770)
    with pytest.raises(UntrustedCacheError):
        store.artifacts.verify(AKEY)


def test_lock_timeout(tmp_path):
    store = Store(tmp_path / "cache", StoreConfig(lock_timeout_s=0.2))
    lock_path = store.root / "locks" / f"{AKEY}.lock"
    lock_path.parent.mkdir(parents=True)
    builder = Builder()
    with filelock.FileLock(str(lock_path)):
        with pytest.raises(LockTimeoutError, match=r"waited 0.2 s for .*\.lock") as info:
            store.artifacts.publish(AKEY, builder)
    assert info.value.lock_path == str(lock_path) and builder.calls == 0
    assert isinstance(info.value, TimeoutError)
    assert store.artifacts.publish(AKEY, builder)[1] is True        # lock free again


def test_a_lock_wait_names_the_holder(tmp_path, monkeypatch, caplog):
    """Whoever holds an artifact's lock says who it is (pid, host, torchrun's rank): a process waiting for it names
    it in its log line and, when it gives up, in LockTimeoutError; nothing is left once the lock is released."""
    store = Store(tmp_path / "cache", StoreConfig(lock_timeout_s=0.3))
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        monkeypatch.setenv("RANK", "5")
        store.artifacts.publish(AKEY, lambda folder: (held.set(), release.wait(10), folder.mkdir()))

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    other = Store(tmp_path / "cache", StoreConfig(lock_timeout_s=0.3))
    with caplog.at_level(logging.INFO, logger="gearcache.store"):
        with pytest.raises(LockTimeoutError) as info:
            other.artifacts.publish(AKEY, Builder())
    release.set()
    thread.join()
    assert info.value.holder.startswith(f"rank 5, pid {os.getpid()} on host ")
    assert f"(held by rank 5, pid {os.getpid()}" in str(info.value)
    assert any("compiling it: rank 5, pid" in r.getMessage() for r in caplog.records)
    assert not list((store.root / "locks").glob("*.holder")), "the holder's note goes with the lock"
    assert pickle.loads(pickle.dumps(info.value)).holder == info.value.holder


def test_a_waiter_takes_a_lock_released_while_it_waits_and_says_once_that_it_waits(tmp_path):
    """``Locks.held`` polls a held flock (backing off from 1 ms): the waiter's ``on_wait`` runs once, and it takes the
    lock as soon as the holder lets go, well before its timeout."""
    store = Store(tmp_path / "cache", StoreConfig(lock_timeout_s=30))
    path = store.locks.path(AKEY, "lease")
    path.parent.mkdir(parents=True)
    held, waiting = threading.Event(), threading.Event()
    waits: list[int] = []

    def holder() -> None:
        with filelock.FileLock(str(path)):
            held.set()
            assert waiting.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    with store.locks.held(path, 30, on_wait=lambda: (waits.append(1), waiting.set())):
        thread.join(10)
        assert not thread.is_alive(), "the holder let go before the waiter got the lock"
    assert waits == [1]


def test_read_entry(store):
    path = store.layout.entry("world1_rank0_tp0_pp0", "m.run", "e1")
    assert store.entries.read_for_load("world1_rank0_tp0_pp0", "m.run", "e1") is None           # missing
    store.entries.write("world1_rank0_tp0_pp0", "m.run", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY})
    assert store.entries.read_for_load("world1_rank0_tp0_pp0", "m.run", "e1")["akey"] == AKEY
    assert [e["ekey"] for e in store.entries.in_method("world1_rank0_tp0_pp0", "m.run")] == ["e1"]
    for content in ["garbage{", "", json.dumps({"format": FORMAT_VERSION + 1, "ekey": "e1", "akey": AKEY}),
                    json.dumps({"format": FORMAT_VERSION, "ekey": "e2", "akey": AKEY}),
                    json.dumps({"ekey": "e1", "akey": AKEY})]:
        path.write_text(content)
        assert store.entries.read_for_load("world1_rank0_tp0_pp0", "m.run", "e1") is None, content
    path.write_bytes(b"\xff\xfe\x00")
    assert store.entries.read_for_load("world1_rank0_tp0_pp0", "m.run", "e1") is None


@pytest.mark.parametrize("error", [
    CacheCorruptionError("/c/artifacts/x", "module.py does not match its sha256 digest"),
    LockTimeoutError("/c/locks/x.lock", 0.5),
    UntrustedCacheError("/c", 0o40777),
    GraphBreakError("m.Net.run", [("call to print", "net.py:12"), ("Tensor.item()", "net.py:14")]),
    SignatureMismatchError("m.Net.run", "(float32[2] cpu) grad=off", ["(float32[4] cpu) grad=off"], "pad it"),
], ids=lambda e: type(e).__name__)
def test_errors_pickle(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args


def _damage_index(db, how: str) -> None:
    if how == "not a database":
        db.write_bytes(b"this is no SQLite file " * 200)
    else:                               # the header is intact, every page after the first is overwritten
        data = bytearray(db.read_bytes())
        assert len(data) > 4096
        data[4096:] = b"\xa5" * (len(data) - 4096)
        db.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["malformed", "not a database"])
def test_an_unreadable_index_is_moved_aside_and_rebuilt_from_the_manifests(store, published, how, caplog):
    import logging

    topology = "world1_rank0_tp0_pp0"
    for ekey in ("e1", "e2"):
        store.entries.write(topology, "m.Net.run", ekey, {"format": FORMAT_VERSION, "ekey": ekey, "akey": AKEY,
                                                        "created": 1000.0})
        store.index.record_load(ekey)
    assert store.index.db["e1"]["loads"] == 1
    store.index.db.cache.close()
    _damage_index(store.root / "index" / "cache.db", how)
    with caplog.at_level(logging.WARNING, logger="gearcache"):
        rows = dict(Store(store.root).index.db.items())
        Store(store.root).index.record_load("e1")                                  # the repaired index is used
        assert dict(Store(store.root).index.read().items())["e1"]["loads"] == 1
    assert set(rows) == {"e1", "e2", f"artifact:{AKEY}"}
    assert {k: v for k, v in rows["e1"].items() if k != "last_used"} == {
        "method": "m.Net.run", "topology": topology, "akey": AKEY, "created": 1000.0}
    assert rows[f"artifact:{AKEY}"]["bytes"] == sum(len(d) for d in FILES.values())
    warned = [r.getMessage() for r in caplog.records if "index" in r.getMessage()]
    assert len(warned) == 1, warned                                    # once, though three Stores opened it
    assert "unreadable" in warned[0] and "rebuilt it from 2 entry manifest(s)" in warned[0], warned[0]
    aside = list((store.root / "quarantine").glob("index.*"))
    assert len(aside) == 1 and (aside[0] / "cache.db").is_file() and str(aside[0]) in warned[0]


# ================================================================================================ the store's shape
def test_store_is_its_parts_and_forwards_nothing(tmp_path):
    """``Store`` names its parts; each job is a method of one part (``store.artifacts.publish``), never a forward."""
    public = {name for name in vars(Store) if not name.startswith("_")}
    assert public == {"from_config", "signed"}
    store = Store(tmp_path / "cache")
    for part in ("layout", "locks", "trust", "first_use", "index", "leases", "maintenance", "artifacts", "entries",
                 "sync"):
        assert getattr(store, part) is not None, part
    assert store.config == StoreConfig() and store.remote is None and store.fleet is None


def test_store_config_of_a_compiler_config_takes_every_store_option():
    from gearcache import CompilerConfig

    cfg = CompilerConfig(lock_timeout_s=3, lock_mode="soft", max_size=123, signing_key="k", trust_shared_folder=True,
                         remote="redis://h:1/0", remote_trust="unsigned-ok", remote_timeout_s=2,
                         remote_chunk_bytes=4096, remote_claim_ttl_s=7)
    assert StoreConfig.of(cfg) == StoreConfig(lock_timeout_s=3, lock_mode="soft", max_size=123, signing_key="k",
                                              trust_shared_folder=True, remote="redis://h:1/0",
                                              remote_trust="unsigned-ok", remote_timeout_s=2,
                                              remote_chunk_bytes=4096, remote_claim_ttl_s=7)
    assert "s3cr3t" not in repr(StoreConfig(signing_key="s3cr3t"))  # the key is never logged


def test_push_and_pull_without_a_remote_store_are_config_errors(tmp_path, monkeypatch):
    from gearcache.errors import ConfigError

    monkeypatch.delenv("GEARCACHE_REMOTE", raising=False)
    store = Store(tmp_path / "cache")
    for run in (store.sync.push, store.sync.pull):
        with pytest.raises(ConfigError, match="has no remote store"):
            run()


def test_a_part_kept_after_its_store_is_gone_still_runs_the_first_use_cleanup(tmp_path):
    """The first-use hook (``Maintenance.cleanup``) does not depend on the Store object staying alive."""
    root = tmp_path / "cache"
    Store(root).artifacts.publish(AKEY, Builder())
    leftover = root / "tmp" / f"{AKEY}.999999999.deadbeef"
    leftover.mkdir()
    os.utime(leftover, (0, 0))                               # another host's, and old: a leftover
    entries = Store(root).entries
    entries.read_for_load("t", "m", "e1")                   # the folder's first use by this Store: cleaned
    assert not leftover.exists()
