"""Reliability and trust, in one process (issue "Reliability and trust"): corruption of every file of a real artifact,
garbage entry manifests, incompatible entries, signatures, trust checks, the cache-fault policy (full disk,
read-only, vanished folder, lock timeout, untrusted folder), size-capped eviction, soft locks, cleanup of what killed
processes leave, and bad inputs. Multi-process checks (SIGKILL, live readers, stress) are in
test_reliability_processes.py; docs/RELIABILITY.md maps every fault to its test.

The real artifacts come from a store compiled once per session (tests/reliability_child.py); a "compile" here copies
the prebuilt artifact of the same key (``fake_compile``), so a rebuild costs milliseconds, not seconds.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import time

import pydantic
import pytest
import torch

import reliability_child as rc
from gearcache import (CacheCorruptionError, CompilerConfig, LockTimeoutError, SignatureMismatchError,
                       UntrustedCacheError, cache_compile, counters)
from gearcache._torch import versions as torch_versions
from gearcache.compiling import pipeline
from gearcache import runplan
from gearcache.compiling import faults
from gearcache.runplan import loader as runplan_loader
from gearcache.store import files as store_module
from gearcache.errors import UntrustedArtifactError
from gearcache.keys.key import FORMAT_VERSION
from gearcache.store import HOST, HOST_TAG, Store, StoreConfig, _start_token
from gearcache.store.maintenance import Maintenance

KEY = "reliability-test-key"


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> pathlib.Path:
    return rc.prebuilt_store(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def akeys(prebuilt) -> dict[str, str]:
    return rc.artifact_keys(prebuilt)


@pytest.fixture
def cache(prebuilt, tmp_path) -> pathlib.Path:
    """A private copy of the prebuilt store (one entry per shape in ``rc.ROWS``)."""
    return rc.copy_store(prebuilt, tmp_path / "cache")


@pytest.fixture
def fake_compile(prebuilt, monkeypatch):
    monkeypatch.setattr(pipeline, "compile_artifact", rc.fake_compile(prebuilt))


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    """faults warns once per process and folder kind (and the store once per untrusted folder); every test starts
    afresh."""
    from gearcache.store import trust

    monkeypatch.setattr(faults, "_warned", set())
    monkeypatch.setattr(trust, "_warned_untrusted", set())


def entry_of(root: pathlib.Path, akey: str) -> pathlib.Path:
    (path,) = [p for p in (root / "entries").glob("*/*/*.json") if json.loads(p.read_text())["akey"] == akey]
    return path


def artifact_files(folder: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and "locks" not in p.parts)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class Builder:
    """A ``build`` for Store-level tests: ``size`` bytes of a fake kernel and a wrapper."""

    def __init__(self, size: int = 1000):
        self.size, self.calls = size, 0

    def __call__(self, folder: pathlib.Path) -> None:
        self.calls += 1
        folder.mkdir(parents=True)
        (folder / "module.py").write_text("def call(args):\n    return args\n")
        (folder / "k.so").write_bytes(b"\x7fELF" + b"\0" * (self.size - 4 - 34))


# ================================================================================================= corruption
def damage(path: pathlib.Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_every_file_of_a_real_artifact_damaged_is_quarantined_and_rebuilt(prebuilt, akeys, tmp_path, fake_compile,
                                                                         caplog, how):
    """Every file a load reads is verified before anything runs: damaged, the artifact is quarantined and rebuilt.
    A damaged file of torch's own artifact, which the run plan never reads, does not stop the plan (what runs is
    verified); ``verify_artifact`` (``gearcache verify``) finds it, and a load that needs torch's loader verifies
    the whole artifact first (next test)."""
    akey = akeys["2"]
    folder = prebuilt / "artifacts" / akey
    files = artifact_files(folder)
    assert len(files) >= 5 and "MANIFEST.json" in files and any(f.endswith(".so") for f in files)
    read = [rel for rel in files if rc.read_by_load(folder, rel)]
    assert "runplan/plan.json" in read and any(f.endswith(".so") for f in read) and len(read) < len(files)
    for i, rel in enumerate(files):
        root = rc.copy_store(prebuilt, tmp_path / f"c{i}")
        damage(root / "artifacts" / akey / rel, how)
        caplog.clear()
        if rel == "MANIFEST.json" and how == "flip":
            # one flipped byte of the (unsigned) manifest: caught where it breaks the JSON or the digest of a file the
            # plan reads; elsewhere (another file's digest) the load is right and the full verification catches it
            before = counters.snapshot()
            assert rc.check_call(rc.make(root), 2), f"{how} {rel}: wrong answer"
            delta = counters.delta(before)
            assert ((delta["quarantined"], delta["compiles"]) == (1, 1)
                    or (delta["loads"], delta["quarantined"]) == (1, 0))
            if delta["loads"]:
                with pytest.raises(CacheCorruptionError):
                    Store(root).artifacts.verify(akey)
            continue
        if not rc.read_by_load(folder, rel):
            with counters.expect(quarantined=0, compiles=0, loads=1, direct_loads=1):
                assert rc.check_call(rc.make(root), 2), f"{how} {rel}: wrong answer"
            with pytest.raises(CacheCorruptionError):
                Store(root).artifacts.verify(akey)
            continue
        with caplog.at_level(logging.WARNING, logger="gearcache"), \
                counters.expect(quarantined=1, compiles=1, loads=0):
            assert rc.check_call(rc.make(root), 2), f"{how} {rel}: wrong answer"
        assert f"quarantined artifact {root / 'artifacts' / akey}" in caplog.text, f"{how} {rel}: no warning"
        (moved,) = list((root / "quarantine").glob(f"{akey}.*"))
        Store(root).artifacts.verify(akey)                   # rebuilt, and valid
        with counters.expect(loads=1, compiles=0):
            assert rc.check_call(rc.make(root), 2)


def test_damaged_torch_artifact_is_verified_before_torch_loader_reads_it(prebuilt, akeys, tmp_path, fake_compile,
                                                                          monkeypatch, caplog):
    """A plan this process cannot load falls back to torch's loader, which reads the whole folder: the whole
    artifact is verified first, and a damaged file there is quarantined and rebuilt, never loaded."""
    akey = akeys["2"]
    folder = prebuilt / "artifacts" / akey
    rel = next(r for r in artifact_files(folder) if not rc.read_by_load(folder, r) and r.endswith(".py"))
    root = rc.copy_store(prebuilt, tmp_path / "c")
    damage(root / "artifacts" / akey / rel, "flip")

    def unavailable(ops):
        raise runplan.RunPlanUnavailable("operator not registered in this process (test)")
    monkeypatch.setattr(runplan_loader, "_check_ops", unavailable)
    with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(direct_loads=0, compiles=1):
        assert rc.check_call(rc.make(root), 2)
    assert f"quarantined artifact {root / 'artifacts' / akey}" in caplog.text
    Store(root).artifacts.verify(akey)                       # rebuilt, and valid


@pytest.mark.parametrize("content", [b"{garbage", b"", b"\xff\xfe\x00", b"[1, 2]", b'{"format": 1}'])
def test_garbage_entry_manifest_is_a_miss_and_is_rewritten(cache, akeys, fake_compile, content):
    path = entry_of(cache, akeys["2"])
    path.write_bytes(content)
    with counters.expect(loads=1, traces=1, compiles=0):    # a miss; the (valid) artifact is reused: a load
        assert rc.check_call(rc.make(cache), 2)
    assert json.loads(path.read_text())["akey"] == akeys["2"]
    with counters.expect(loads=1, traces=0):
        assert rc.check_call(rc.make(cache), 2)


@pytest.mark.parametrize("factor", ["software", "devices"])
def test_entry_of_another_torch_version_or_isa_is_never_loaded(cache, prebuilt, akeys, monkeypatch, factor):
    """Another torch version or CPU ISA is another key: a new entry is compiled, the old one is left untouched."""
    before = {p: p.read_bytes() for p in (cache / "entries").rglob("*.json")}
    if factor == "software":
        real = torch_versions.software_versions()
        monkeypatch.setattr(torch_versions, "software_versions", lambda: dict(real, torch="2.99.0+other"))
    else:
        monkeypatch.setattr(torch_versions, "device_capability", lambda device: "cpu:x86_64:AVX1024")
    monkeypatch.setattr(pipeline, "compile_artifact", rc.fake_compile(prebuilt, fallback=akeys["2"]))
    with counters.expect(loads=0, compiles=1):
        assert rc.check_call(rc.make(cache), 2)
    after = {p: p.read_bytes() for p in (cache / "entries").rglob("*.json")}
    assert {p: after[p] for p in before} == before, "old entries must be untouched"
    (new,) = [json.loads(after[p]) for p in set(after) - set(before)]
    assert new["akey"] not in akeys.values()
    values = new["factors"]["values"]
    assert (values["software"]["torch"] == "2.99.0+other") if factor == "software" else \
        values["devices"] == ["cpu:x86_64:AVX1024"]


# ================================================================================================= signatures
@pytest.fixture
def signed(tmp_path, fake_compile) -> tuple[pathlib.Path, CompilerConfig]:
    root = tmp_path / "signed"
    config = CompilerConfig(signing_key=KEY)
    model = rc.make(root, config)
    for rows in rc.ROWS:
        assert rc.check_call(model, rows)
    return root, config


def test_signed_store_signs_everything_and_loads(signed):
    root, config = signed
    for folder in (root / "artifacts").iterdir():
        assert (folder / "MANIFEST.sig").is_file()
        Store(root, StoreConfig(signing_key=KEY)).artifacts.verify(folder.name)
    for path in (root / "entries").glob("*/*/*.json"):
        assert "sig" in json.loads(path.read_text())
    with counters.expect(loads=3, compiles=0, quarantined=0):
        model = rc.make(root, config)
        assert all(rc.check_call(model, rows) for rows in rc.ROWS)


def test_tampered_artifact_with_a_valid_digest_is_refused_quarantined_and_rebuilt(signed, caplog):
    """A file rewritten AND its digest updated in MANIFEST.json passes the digest check; the signature refuses it."""
    root, config = signed
    akey = json.loads(next(root.glob("entries/*/*/*.json")).read_text())["akey"]
    folder = root / "artifacts" / akey
    (wrapper,) = [p for p in (folder / "inductor").rglob("*.py")]
    wrapper.write_text(wrapper.read_text() + "\nTAMPERED = True\n")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    rel = wrapper.relative_to(folder).as_posix()
    manifest["files"][rel] = hashlib.sha256(wrapper.read_bytes()).hexdigest()
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    Store(root).artifacts.verify(akey)                       # without the key: digests all match
    with pytest.raises(CacheCorruptionError, match="MANIFEST.sig does not match"):
        Store(root, StoreConfig(signing_key=KEY)).artifacts.verify(akey)
    rows = int(json.loads(next(root.glob("entries/*/*/*.json")).read_text())["signature"]["leaves"][0]["shape"][0])
    with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(quarantined=1, compiles=1, loads=0):
        assert rc.check_call(rc.make(root, config), rows)
    assert f"quarantined artifact {folder}" in caplog.text and "MANIFEST.sig does not match" in caplog.text
    (moved,) = (root / "quarantine").glob(f"{akey}.*")
    assert "TAMPERED" in (moved / rel).read_text()
    Store(root, StoreConfig(signing_key=KEY)).artifacts.verify(akey)
    assert "TAMPERED" not in (folder / rel).read_text()


def test_unsigned_store_under_a_key_is_never_loaded(cache, akeys, fake_compile, caplog):
    with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(loads=0, compiles=1, quarantined=2):
        assert rc.check_call(rc.make(cache, CompilerConfig(signing_key=KEY)), 2)
    assert "is not signed" in caplog.text                   # the entry manifest, then the artifact
    assert (cache / "artifacts" / akeys["2"] / "MANIFEST.sig").is_file()
    assert len(list((cache / "quarantine").iterdir())) == 2     # the artifact, and entries/


def test_another_key_is_never_loaded(signed):
    root, _ = signed
    with counters.expect(loads=0, compiles=1):
        assert rc.check_call(rc.make(root, CompilerConfig(signing_key="another key")), 2)


def test_tampered_entry_manifest_is_refused(signed, caplog):
    root, config = signed
    path = next(root.glob("entries/*/*/*.json"))
    data = json.loads(path.read_text())
    data["inputs"] = list(reversed(data["inputs"]))         # a recipe edit, valid JSON, old signature
    path.write_text(json.dumps(data))
    rows = data["signature"]["leaves"][0]["shape"][0]
    with caplog.at_level(logging.WARNING, logger="gearcache"), \
            counters.expect(loads=1, traces=1, compiles=0, quarantined=1):
        assert rc.check_call(rc.make(root, config), rows)
    assert "signature does not match" in caplog.text
    assert json.loads(path.read_text())["inputs"] != data["inputs"]      # written again, signed


def test_signing_key_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARCACHE_SIGNING_KEY", KEY)
    assert Store(tmp_path).signed and Store(tmp_path, StoreConfig(signing_key="explicit"))._key == b"explicit"
    monkeypatch.delenv("GEARCACHE_SIGNING_KEY")
    assert not Store(tmp_path).signed


def test_signed_gear_plans(tmp_path):
    store = Store(tmp_path / "c", StoreConfig(signing_key=KEY))
    plan = {"format": FORMAT_VERSION, "pkey": "p1", "plan": {"dims": []}}
    store.entries.write_gear_plan("t", "m", "p1", plan)
    assert store.entries.read_gear_plan("t", "m", "p1") == plan
    assert Store(tmp_path / "c", StoreConfig(signing_key="other")).entries.read_gear_plan("t", "m", "p1") is None
    path = store.layout.gear_plan("t", "m", "p1")
    path.write_text(json.dumps(dict(json.loads(path.read_text()), plan={"dims": [1]})))
    assert store.entries.read_gear_plan("t", "m", "p1") is None


# ====================================================================================================== trust
def test_group_writable_file_in_an_artifact_is_quarantined_and_rebuilt(cache, akeys, fake_compile, caplog):
    folder = cache / "artifacts" / akeys["5"]
    so = next((folder / "inductor").rglob("*.so"))
    so.chmod(0o775)
    with pytest.raises(UntrustedArtifactError, match="lets other users write it"):
        Store(cache).artifacts.verify(akeys["5"])
    with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(quarantined=1, compiles=1):
        assert rc.check_call(rc.make(cache), 5)
    assert "lets other users write it" in caplog.text
    Store(cache).artifacts.verify(akeys["5"])


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_artifact_owned_by_another_user_is_quarantined(cache, akeys, fake_compile):
    os.chown(cache / "artifacts" / akeys["7"], 65534, -1)
    with counters.expect(quarantined=1, compiles=1):
        assert rc.check_call(rc.make(cache), 7)


def test_group_writable_entry_manifest_is_not_loaded(cache, akeys, fake_compile, caplog):
    path = entry_of(cache, akeys["2"])
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="gearcache"), \
            counters.expect(loads=1, traces=1, compiles=0, quarantined=1):      # the valid artifact is reused
        assert rc.check_call(rc.make(cache), 2)
    assert "not trusted" in caplog.text
    assert path.stat().st_mode & 0o777 == 0o644


def test_shared_group_folder_needs_a_signing_key_and_trust_shared_folder(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o770)
    for kwargs in ({}, {"trust_shared_folder": True}, {"signing_key": KEY}):
        with pytest.raises(UntrustedCacheError, match="trust_shared_folder") as info:
            Store(root, StoreConfig(**kwargs)).artifacts.publish("a" * 40, Builder())
        assert pickle.loads(pickle.dumps(info.value)).args == info.value.args
    store = Store(root, StoreConfig(trust_shared_folder=True, signing_key=KEY))
    assert store.artifacts.publish("a" * 40, Builder())[1]
    assert (root / "artifacts").stat().st_mode & 0o777 == 0o770        # group members can use it
    root.chmod(0o777)                                                   # every user: never
    with pytest.raises(UntrustedCacheError, match="every user"):
        Store(root, StoreConfig(trust_shared_folder=True, signing_key=KEY)).artifacts.publish("b" * 40, Builder())


def test_untrusted_errors_pickle():
    for error in (UntrustedArtifactError("/c/artifacts/x", 0o40770, "x in the artifact: mode 0o770"),
                  UntrustedCacheError("/c", 0o40777, "mode 0o777 lets every user write it")):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), copy.args, str(copy)) == (type(error), error.args, str(error))
    assert isinstance(copy, PermissionError)
    assert isinstance(UntrustedArtifactError("/x", 0), CacheCorruptionError)


# ================================================================================================ cache faults
def refuse(monkeypatch, code: int, what: str = "_rename", only=lambda *a: True) -> None:
    real = getattr(store_module, what)

    def fail(*args, **kwargs):
        if only(*args):
            raise OSError(code, os.strerror(code), str(args[-1]))
        return real(*args, **kwargs)
    monkeypatch.setattr(store_module, what, fail)


def test_full_disk_memory_policy_runs_compiled_and_persists_nothing(tmp_path, fake_compile, monkeypatch, caplog):
    root = tmp_path / "cache"
    with monkeypatch.context() as m:
        refuse(m, errno.ENOSPC, "_rename")
        refuse(m, errno.ENOSPC, "_replace")
        model = rc.make(root)
        with caplog.at_level(logging.WARNING, logger="gearcache"), \
                counters.expect(compiles=2, loads=0, eager_calls=0):
            assert rc.check_call(model, 2) and rc.check_call(model, 5)     # compiled once each, not twice
        assert caplog.text.count("cannot use the cache folder") == 1, "warned once per process"
        assert "No space left on device" in caplog.text and "free disk space" in caplog.text
        assert not list((root / "artifacts").iterdir()) and not list((root / "entries").rglob("*.json"))
        assert not list((root / "tmp").iterdir())
        with counters.expect(hits=1, compiles=0):
            assert rc.check_call(model, 2)
    with counters.expect(compiles=1):                       # disk space again: the next process persists
        assert rc.check_call(rc.make(root), 2)
    assert list((root / "artifacts").iterdir())


def test_full_disk_eager_policy_runs_uncompiled(tmp_path, fake_compile, monkeypatch, caplog):
    refuse(monkeypatch, errno.ENOSPC, "_rename")
    model = rc.make(tmp_path / "cache", CompilerConfig(on_cache_error="eager"))
    with pytest.warns(UserWarning, match="runs uncompiled"), counters.expect(eager_calls=2, loads=0):
        assert rc.check_call(model, 2) and rc.check_call(model, 2)
    assert "on_cache_error='eager'" in caplog.text


def test_full_disk_raise_policy_raises(tmp_path, fake_compile, monkeypatch):
    refuse(monkeypatch, errno.ENOSPC, "_rename")
    with pytest.raises(OSError) as info:
        rc.check_call(rc.make(tmp_path / "cache", CompilerConfig(on_cache_error="raise")), 2)
    assert info.value.errno == errno.ENOSPC


def test_entry_manifest_on_a_full_disk_is_a_warning(tmp_path, fake_compile, monkeypatch, caplog):
    root = tmp_path / "cache"
    refuse(monkeypatch, errno.ENOSPC, "_replace", only=lambda src, dst: pathlib.Path(dst).parent.name == rc.METHOD)
    with caplog.at_level(logging.WARNING, logger="gearcache"):
        assert rc.check_call(rc.make(root), 2)
    assert "could not write entry manifest" in caplog.text and "free disk space" in caplog.text
    assert list((root / "artifacts").iterdir()) and not list((root / "entries").rglob("*.json"))
    assert not [p for p in (root / "entries").rglob("*") if p.is_file()], "no temp file left behind"


@contextlib.contextmanager
def read_only(root: pathlib.Path):
    """Make ``root`` read-only for real: ``chmod -R a-w`` (as a user), or a read-only bind mount (as root)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if shutil.which("mount") is None or subprocess.run(["mount", "--bind", root, root]).returncode != 0:
        pytest.skip("running as root without mount: a real read-only folder cannot be made")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", root, root]).returncode != 0:
            pytest.skip("cannot remount read-only")
        yield
    finally:
        subprocess.run(["umount", root])


def test_read_only_folder_serves_its_entries_and_compiles_new_ones_in_memory(cache, akeys, fake_compile, caplog):
    shutil.rmtree(cache / "artifacts" / akeys["7"])
    entry_of(cache, akeys["7"]).unlink()
    with read_only(cache):
        with pytest.raises(OSError):
            (cache / "probe").write_text("x")
        model = rc.make(cache)
        with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(loads=2, compiles=1):
            assert all(rc.check_call(model, rows) for rows in rc.ROWS)
        assert "cannot use the cache folder" in caplog.text
    assert not (cache / "artifacts" / akeys["7"]).exists()


def test_folder_vanishing_mid_run(cache, fake_compile, caplog):
    model = rc.make(cache)
    assert rc.check_call(model, 2)
    shutil.rmtree(cache)
    with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(compiles=1, hits=1):
        assert rc.check_call(model, 2) and rc.check_call(model, 5)
    assert "vanished" in caplog.text
    assert not cache.exists(), "a folder deleted under a running process is not recreated by it"


def test_lock_timeout_compiles_in_memory(tmp_path, prebuilt, akeys, fake_compile, caplog):
    import filelock

    root = tmp_path / "cache"
    store = Store(root)
    store.first_use.ensure()
    model = rc.make(root, CompilerConfig(lock_timeout_s=0.2))
    with filelock.FileLock(str(store.locks.path(akeys["2"]))):
        with caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(compiles=1):
            assert rc.check_call(model, 2)
    assert "waited 0.2 s" in caplog.text and "lock_timeout_s" in caplog.text


def test_untrusted_folder_policy(tmp_path, fake_compile, caplog):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="gearcache"):
        assert rc.check_call(rc.make(root), 2)
    assert "chmod go-w" in caplog.text and not list(root.iterdir())
    with pytest.raises(UntrustedCacheError):
        rc.check_call(rc.make(root, CompilerConfig(on_cache_error="raise")), 2)


def test_an_untrusted_folder_is_warned_about_once_per_process(tmp_path, fake_compile, caplog):
    from gearcache.store import diagnostics

    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="gearcache"):
        for model in (rc.make(root), rc.make(root)):            # two cached methods on the folder, two shapes each
            for rows in rc.ROWS[:2]:
                assert rc.check_call(model, rows) and rc.check_call(model, rows)
        diagnostics.flush_hits()                                # what a process does at exit
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "mode 0o777" in warned[0] and "chmod go-w" in warned[0] and "in memory only" in warned[0]
    assert not list(root.iterdir())


def test_eager_entry_stands_in_for_a_compiled_one():
    """Same interface as Entry (gears call gather/compiled/build and read manifest["outputs"]); every call counted."""
    class Two(torch.nn.Module):
        def run(self, x, y):
            return {"sum": x + y, "pair": (y, x * 2)}

    x, y = torch.ones(2), torch.arange(2.0)
    with pytest.warns(UserWarning, match="runs uncompiled"):
        entry = faults.EagerEntry(Two().run, (x, y), {}, {"ekey": "e", "method": "m", "outputs": {
            "leaves": [["out", 2], ["leaf", 0], ["out", 0]]}})          # a compiled graph's recipe: not used
    with counters.expect(eager_calls=2):
        out = entry((x, y))
        flat = entry.compiled(*entry.gather((x, y)))
    assert torch.equal(out["sum"], x + y) and torch.equal(out["pair"][1], x * 2) and isinstance(out["pair"], tuple)
    assert len(flat) == 3 and entry.manifest["outputs"]["leaves"] == [["out", 0], ["out", 1], ["out", 2]]
    assert torch.equal(entry.build(flat, (x, y))["pair"][0], y)


def test_policy_rejects_unknown(tmp_path):
    with pytest.raises(ValueError, match="on_cache_error"):
        faults.publish_or_fallback(Store(tmp_path), "a" * 40, Builder(), "ignore")


def test_compiler_errors_are_not_cache_faults(tmp_path):
    def build(folder):
        raise RuntimeError("the compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        faults.publish_or_fallback(Store(tmp_path / "c"), "a" * 40, build, "memory")

    def build_oserror(folder):
        raise OSError(errno.EINVAL, "bad compiler flag")

    with pytest.raises(OSError, match="bad compiler flag"):
        faults.publish_or_fallback(Store(tmp_path / "c"), "a" * 40, build_oserror, "memory")


# =================================================================================================== eviction
def publish(root: pathlib.Path, akey: str, *, max_size=None, last_used: float | None = None, size: int = 1000):
    """Publish an artifact (and an entry pointing at it) from a short-lived Store, as another process would."""
    store = Store(root, StoreConfig(max_size=max_size))
    store.artifacts.publish(akey, Builder(size))
    store.entries.write("t", "m", "e" + akey[1:], {"format": FORMAT_VERSION, "ekey": "e" + akey[1:], "akey": akey})
    if last_used is not None:
        store.index.db["e" + akey[1:]] = dict(store.index.db["e" + akey[1:]], last_used=last_used)
        store.index.db[f"artifact:{akey}"] = dict(store.index.db[f"artifact:{akey}"], last_used=last_used)


def test_opening_a_folder_over_max_size_trims_it(tmp_path, caplog):
    """A folder left over the cap (its artifacts were in use when it grew) is trimmed by the next process."""
    root = tmp_path / "cache"
    for c in "ab":
        publish(root, c * 40)
    with caplog.at_level(logging.INFO, logger="gearcache"), counters.expect(evictions=1):
        # any first use of the folder
        Store(root, StoreConfig(max_size=1500)).entries.read_for_load("t", "m", "e" + "b" * 39)
    assert [p.name for p in (root / "artifacts").iterdir()] == ["b" * 40]
    assert "when a process opened it" in caplog.text


def test_publishing_past_max_size_evicts_the_least_recently_used(tmp_path, caplog):
    root = tmp_path / "cache"
    now = time.time()
    publish(root, "a" * 40, last_used=now - 300)
    publish(root, "b" * 40, last_used=now - 100)
    publish(root, "c" * 40, last_used=now - 200)
    assert not list((root / "leases").rglob("*@*")), "short-lived Stores released their leases"
    with caplog.at_level(logging.INFO, logger="gearcache"), counters.expect(evictions=2):
        publish(root, "d" * 40, max_size=2500)
    assert sorted(p.name[0] for p in (root / "artifacts").iterdir()) == ["b", "d"]     # a, then c went
    assert "evicted artifact " + "a" * 40 in caplog.text and "over max_size=2500 after publishing " in caplog.text
    assert sorted(p.stem[1] for p in (root / "entries").rglob("*.json")) == ["b", "d"]
    index = Store(root).index.db
    assert "artifact:" + "a" * 40 not in index and "e" + "a" * 39 not in index
    assert "artifact:" + "b" * 40 in index


def test_an_entry_written_while_eviction_runs_goes_with_its_artifact(tmp_path):
    """The 8-process stress test once ended with an entry (manifest and index row) naming an evicted artifact: a
    process had written it after the evictor listed the entries and let go of its lease before the evictor reached
    that artifact. Here a second entry for the artifact is written at that moment, just before it is evicted."""
    root = tmp_path / "cache"
    publish(root, "a" * 40, last_used=time.time() - 300)
    publish(root, "b" * 40)
    late_ekey = "f" + "a" * 39

    evictor = Store(root, StoreConfig(max_size=1500))
    evict_one = evictor.maintenance._evict_one

    def evict_one_meeting_a_late_writer(akey, *args):
        other = Store(root)                             # another process: it publishes (a no-op: it is
        other.artifacts.publish(akey, Builder())          # there), writes its entry, and ends
        other.entries.write("t", "m", late_ekey, {"format": FORMAT_VERSION, "ekey": late_ekey, "akey": akey})
        del other
        return evict_one(akey, *args)

    evictor.maintenance._evict_one = evict_one_meeting_a_late_writer
    with counters.expect(evictions=1):
        evictor.maintenance.evict()
    assert [p.name for p in (root / "artifacts").iterdir()] == ["b" * 40]
    assert not [p for p in (root / "entries").rglob("*.json") if "a" * 40 in p.read_text()], "entries of a went too"
    index = Store(root).index.db
    assert late_ekey not in index and "e" + "a" * 39 not in index and "e" + "b" * 39 in index


def test_leased_artifact_is_not_evicted_and_lru_falls_back_to_manifest_age(tmp_path):
    root = tmp_path / "cache"
    for i, c in enumerate("abc"):
        Store(root).artifacts.publish(c * 40, Builder())
        t = time.time() - 1000 + i
        os.utime(root / "artifacts" / (c * 40) / "MANIFEST.json", (t, t))
    shutil.rmtree(root / "index")                           # no last_used rows: the manifests' age decides
    holder = Store(root)
    holder.leases.take("a" * 40)                                  # in use by a live process (this one)
    assert Store(root).leases.live_holders("a" * 40) == [f"{os.getpid()}@{HOST}"]
    with counters.expect(evictions=1):
        assert trim(root, 2500) == {"b" * 40}
    del holder                                              # the lease goes with its Store
    assert trim(root, 1500) == {"a" * 40}
    assert trim(root, 1) == {"c" * 40}


def trim(root: pathlib.Path, max_size: int) -> set[str]:
    """What a Store with ``max_size`` evicts from ``root`` (when it opens the folder, or when asked)."""
    before = {p.name for p in (root / "artifacts").iterdir()}
    Store(root, StoreConfig(max_size=max_size)).maintenance.evict()
    return before - {p.name for p in (root / "artifacts").iterdir()}


def test_max_size_reaches_the_store_through_the_config(tmp_path):
    cfg = CompilerConfig(max_size=123, lock_mode="soft", signing_key=KEY, trust_shared_folder=True)
    store = cache_compile(torch.nn.Linear(2, 2).forward, cache_dir=str(tmp_path), config=cfg).store
    assert (store.config.max_size, store.config.lock_mode, store.signed, store.config.trust_shared_folder) == (
        123, "soft", True, True)


# =============================================================================================== soft locks
def test_soft_lock_mode_publishes_and_leaves_no_lock_file(tmp_path):
    store = Store(tmp_path / "cache", StoreConfig(lock_mode="soft"))
    assert store.artifacts.publish("a" * 40, Builder())[1]
    assert not list((store.root / "locks").glob("*.softlock"))


@pytest.mark.parametrize("holder", ["dead", "old"])
def test_stale_soft_lock_is_removed(tmp_path, caplog, holder):
    store = Store(tmp_path / "cache", StoreConfig(lock_mode="soft", lock_timeout_s=2))
    store.first_use.ensure()
    lock = store.locks.path("a" * 40)
    pid = dead_pid() if holder == "dead" else os.getppid()
    lock.write_text(f"{pid}\n{HOST}\n")
    if holder == "old":
        os.utime(lock, (time.time() - 10, time.time() - 10))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gearcache"):
        assert store.artifacts.publish("a" * 40, Builder())[1]
    assert time.monotonic() - t0 < 1.5
    assert "removed stale soft lock" in caplog.text
    assert ("is dead" if holder == "dead" else "older than lock_timeout_s") in caplog.text


def test_live_soft_lock_times_out(tmp_path):
    store = Store(tmp_path / "cache", StoreConfig(lock_mode="soft", lock_timeout_s=0.3))
    store.first_use.ensure()
    store.locks.path("a" * 40).write_text(f"{os.getppid()}\n{HOST}\n")
    with pytest.raises(LockTimeoutError, match="waited 0.3 s"):
        store.artifacts.publish("a" * 40, Builder())


# =================================================================================================== cleanup
def test_cleanup_removes_what_killed_processes_left(tmp_path):
    root = tmp_path / "cache"
    Store(root).first_use.ensure()
    dead, live = dead_pid(), os.getppid()
    ours, other = HOST_TAG + "0" * 8, "f" * 14
    old = time.time() - 2 * 3600

    def tmp(name, age=None):
        (root / "tmp" / name / "inductor").mkdir(parents=True)
        (root / "tmp" / name / "inductor" / "x.py").write_text("x")
        if age:
            os.utime(root / "tmp" / name, (age, age))
        return name

    gone = {tmp(f"{'a' * 40}.{dead}.{ours}"), tmp(f"{'b' * 40}.{dead}.{other}", old), tmp(f"{'c' * 40}.pruned.ab", old)}
    kept = {tmp(f"{'d' * 40}.{live}.{ours}"), tmp(f"{'e' * 40}.{dead}.{other}"), tmp(f"{'f' * 40}.pruned.cd")}
    method = root / "entries" / "t" / "m"
    method.mkdir(parents=True)
    (method / f".e1.json.{dead}.{ours}.tmp").write_text("{")
    (method / f".e2.json.{live}.{ours}.tmp").write_text("{")
    misses = root / "misses" / "t" / "m"
    misses.mkdir(parents=True)
    (misses / f".e3.json.{dead}.{ours}.tmp").write_text("{")
    leases = root / "leases" / ("a" * 40)
    leases.mkdir(parents=True)
    (leases / f"{dead}@{HOST}").write_text("1\n")
    (leases / f"{live}@{HOST}").write_text(_start_token(live) + "\n")
    (leases / f"{live}@{HOST}-other").write_text("1\n")
    (leases / f"{live}@elsewhere").write_text("1\n")
    os.utime(leases / f"{live}@elsewhere", (time.time() - 2 * 86400,) * 2)

    stamps = root / "stamps"
    stamps.mkdir()
    (stamps / f"{'a' * 40}.json").write_text("{}")                  # its artifact is gone
    (stamps / f".{'d' * 40}.json.{dead}.{ours}.tmp").write_text("{")

    done = Store(root).maintenance.cleanup()
    assert {p.name for p in (root / "tmp").iterdir()} == kept
    assert [p.name for p in method.iterdir()] == [f".e2.json.{live}.{ours}.tmp"] and not list(misses.iterdir())
    assert sorted(p.name for p in leases.iterdir()) == [f"{live}@{HOST}", f"{live}@{HOST}-other"]
    assert not list(stamps.iterdir())
    assert done == {"tmp": len(gone), "partial_files": 3, "leases": 2, "soft_locks": 0, "stamps": 1, "evicted": 0}


def test_each_store_cleans_up_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(Maintenance, "cleanup", lambda self: calls.append(self))
    store = Store(tmp_path / "cache")
    store.artifacts.publish("a" * 40, Builder())
    store.artifacts.publish("b" * 40, Builder())
    store.entries.write("t", "m", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": "a" * 40})
    assert calls == [store.maintenance]


# ================================================================================================ bad inputs
def test_input_on_another_device_never_runs_an_entry_of_this_one(cache):
    """An entry compiled for CPU tensors is never used for a tensor on another device (here the meta device; on a
    GPU machine any CUDA tensor is the same case): the device is part of the call's key."""
    model = rc.make(cache, CompilerConfig(on_new_signature="error"))
    assert rc.check_call(model, 2)
    with torch.inference_mode(), pytest.raises(SignatureMismatchError, match=r"float32\[2, 4\] meta") as info:
        model.cached(rc.example(2).to("meta"))
    assert "float32[2, 4] cpu" in str(info.value)


def test_module_moved_to_another_device_never_uses_its_old_entries(cache):
    model = rc.make(cache, CompilerConfig(on_new_signature="error"))
    model.to("meta")
    with torch.inference_mode(), pytest.raises(SignatureMismatchError):
        model.cached(rc.example(2).to("meta"))


def test_rank_change_when_new_entries_are_forbidden(cache):
    """(dtype and shape changes: tests/test_cached_function.py::test_dynamic_false_pins_the_first_signature and
    ::test_new_signature_with_error_policy_raises_and_names_the_known_entries.)"""
    model = rc.make(cache, CompilerConfig(on_new_signature="error"))
    with torch.inference_mode(), pytest.raises(SignatureMismatchError, match=r"float32\[8\] cpu"):
        model.cached(torch.randn(8))


# ===================================================================================================== config
def test_reliability_config_fields():
    cfg = CompilerConfig()
    assert (cfg.lock_mode, cfg.max_size, cfg.signing_key, cfg.trust_shared_folder, cfg.on_cache_error) == \
        ("flock", None, None, False, "memory")
    for field, value in [("lock_mode", "nfs"), ("max_size", 0), ("on_cache_error", "ignore")]:
        with pytest.raises(pydantic.ValidationError, match=field):
            CompilerConfig(**{field: value})
    keyed = CompilerConfig(signing_key="s3cret", max_size=10)
    assert "s3cret" not in repr(keyed) and keyed.compile_factors() == cfg.compile_factors()


def test_torch_compile_route_applies_on_cache_error(tmp_path, monkeypatch, caplog):
    """get_backend() honours on_cache_error like cache_compile: "eager" runs the graph uncompiled when the store
    fails (after its compile), "raise" raises."""
    from gearcache import get_backend

    refuse(monkeypatch, errno.ENOSPC, "_rename")
    model = torch.nn.Linear(4, 3).eval()
    x = torch.randn(2, 4)
    compiled = torch.compile(model, fullgraph=True, backend=get_backend(
        compiler_config=CompilerConfig(on_cache_error="eager"), cache_dir=tmp_path / "cache"))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="gearcache"), counters.expect(eager_calls=2):
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    assert "No space left on device" in caplog.text and "runs uncompiled" in caplog.text
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=get_backend(
        compiler_config=CompilerConfig(on_cache_error="raise"), cache_dir=tmp_path / "cache2"))
    with torch.no_grad(), pytest.raises(Exception) as info:
        compiled(x)
    assert "No space left on device" in str(info.value)
