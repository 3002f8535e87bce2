"""Stamps (issue #38, a warm start's look-ups): an artifact is hashed once, at publish or at its first full check, and
a later load of the unchanged artifact skips the digests, without weakening the trust boundary: a file changed in
place (its size and mtime restored), a file renamed in, an unlisted file, a stamp edited by hand or not trusted, each
still ends in a full check (and a refusal where the artifact is bad). The digests are counted, not timed."""
from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from gearcache import CacheCorruptionError, counters
from gearcache.store import Store, StoreConfig
from gearcache.store import artifacts as artifacts_module
from gearcache.store import stamps as stamps_module

AKEY = "a" * 40
FILES = {"module.py": b"def call(args):\n    return args\n", "kernels/k.so": b"\x7fELF\x00\x01",
         "kernels/other.so": b"\x7fELF\x00\x02"}
N_FILES = len(FILES)
KEY = "stamp-test-key"


class Builder:
    def __call__(self, folder: pathlib.Path) -> None:
        for rel, data in FILES.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)


@pytest.fixture
def digests(monkeypatch) -> list[str]:
    """The files whose sha256 an artifact check computes, in order."""
    hashed: list[str] = []
    real = artifacts_module._sha256_file

    def counted(path):
        hashed.append(pathlib.Path(path).name)
        return real(path)

    monkeypatch.setattr(artifacts_module, "_sha256_file", counted)
    return hashed


def published(tmp_path, **config) -> Store:
    store = Store(tmp_path / "cache", StoreConfig(**config))
    assert store.artifacts.publish(AKEY, Builder())[1]
    return store


def fresh(store: Store) -> Store:
    """Another process's Store of the same folder."""
    return Store(store.root, store.config)


def after_the_clock_tick() -> None:
    """Let the kernel's clock tick (a few ms) of the stamp pass: a change within the tick of the publisher's last
    write could keep its ctime, which is why a check writes no stamp for files younger than ``RACY_S``; a publisher
    stamps what it has just written itself (stamps.py)."""
    time.sleep(0.05)


def change_in_place(path: pathlib.Path) -> None:
    """Flip a byte of ``path``, keeping its size, and restore its atime and mtime to the nanosecond."""
    after_the_clock_tick()
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_publish_stamps_the_artifact_and_a_load_then_hashes_nothing(tmp_path, digests):
    store = published(tmp_path)
    stamp = json.loads(store.layout.stamp(AKEY).read_text())
    assert stamp["akey"] == AKEY and stamp["parts"] is None and "sig" not in stamp
    assert {"", "inductor", "inductor/module.py", "inductor/kernels", "inductor/kernels/k.so"} <= set(stamp["paths"])
    assert not list(store.layout.artifact(AKEY).rglob("*stamp*")), "nothing is added to the artifact folder"
    digests.clear()
    fresh(store).artifacts.verify_for_load(AKEY, None)
    fresh(store).artifacts.verify_for_load(AKEY, ["inductor/kernels/", "inductor/module.py"])
    assert digests == []
    fresh(store).artifacts.verify(AKEY)                    # gearcache verify: every digest, always
    assert len(digests) == N_FILES


def test_a_full_check_stamps_an_unstamped_artifact_once_its_files_are_old_enough(tmp_path, digests, monkeypatch):
    """An artifact without a stamp (published by an older gearcache) is hashed, then stamped, and the next load
    hashes nothing; a check right after its files changed writes no stamp (a change in the same clock tick would
    keep their ctime), so the next load hashes again."""
    store = published(tmp_path)
    store.layout.stamp(AKEY).unlink()
    digests.clear()
    fresh(store).artifacts.verify_for_load(AKEY, None)
    assert len(digests) == N_FILES and not store.layout.stamp(AKEY).exists(), "just written: no stamp yet"
    fresh(store).artifacts.verify_for_load(AKEY, None)
    assert len(digests) == 2 * N_FILES
    monkeypatch.setattr(stamps_module, "RACY_S", 0.0)      # as if the files were written long ago
    fresh(store).artifacts.verify_for_load(AKEY, None)
    assert len(digests) == 3 * N_FILES and store.layout.stamp(AKEY).exists()
    fresh(store).artifacts.verify_for_load(AKEY, None)
    assert len(digests) == 3 * N_FILES


@pytest.mark.parametrize("signed", [False, True])
def test_a_file_changed_in_place_with_its_mtime_restored_is_refused(tmp_path, digests, signed):
    store = published(tmp_path, signing_key=KEY if signed else None)
    change_in_place(store.layout.artifact(AKEY) / "inductor" / "module.py")
    with pytest.raises(CacheCorruptionError, match="module.py does not match its sha256 digest"):
        fresh(store).artifacts.verify_for_load(AKEY, None)
    assert "module.py" in digests


def test_a_replacement_renamed_in_is_refused(tmp_path, digests):
    store = published(tmp_path)
    target = store.layout.artifact(AKEY) / "inductor" / "kernels" / "k.so"
    after_the_clock_tick()
    st = target.stat()
    forged = target.with_name(".forged")
    forged.write_bytes(b"\x7fELF\x00\x09")                 # same size
    os.utime(forged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(forged, target)
    with pytest.raises(CacheCorruptionError, match="k.so does not match its sha256 digest"):
        fresh(store).artifacts.verify_for_load(AKEY, ["inductor/kernels/"])


def test_an_unlisted_file_added_to_a_stamped_folder_is_refused(tmp_path):
    store = published(tmp_path)
    after_the_clock_tick()
    (store.layout.artifact(AKEY) / "inductor" / "kernels" / "evil.so").write_bytes(b"\x7fELF")
    with pytest.raises(CacheCorruptionError, match="unlisted file"):
        fresh(store).artifacts.verify_for_load(AKEY, ["inductor/kernels/"])


def _edit_stamp(store: Store, rel: str) -> None:
    """Record ``rel``'s current lstat in the stamp by hand (its "sig", if any, left as it was)."""
    path = store.layout.stamp(AKEY)
    stamp = json.loads(path.read_text())
    stamp["paths"][rel] = stamps_module.stat_record(os.lstat(store.layout.artifact(AKEY) / rel))
    path.write_text(json.dumps(stamp))


def test_a_stamp_edited_by_hand_is_refused_in_a_signed_store(tmp_path, digests):
    """The stamp is edited to match a file changed after it: the stamp's signature fails, the file is hashed and
    refused."""
    store = published(tmp_path, signing_key=KEY)
    assert "sig" in json.loads(store.layout.stamp(AKEY).read_text())
    change_in_place(store.layout.artifact(AKEY) / "inductor" / "module.py")
    _edit_stamp(store, "inductor/module.py")
    with pytest.raises(CacheCorruptionError, match="module.py does not match"):
        fresh(store).artifacts.verify_for_load(AKEY, None)
    assert "module.py" in digests


@pytest.mark.parametrize("damage", ["garbage", "other record", "other artifact", "writable by all"])
def test_a_damaged_or_foreign_stamp_is_ignored_and_the_artifact_hashed(tmp_path, digests, damage):
    store = published(tmp_path)
    path = store.layout.stamp(AKEY)
    stamp = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "other record":
        stamp["paths"]["inductor/module.py"][4] += 1        # another ctime
        path.write_text(json.dumps(stamp))
    elif damage == "other artifact":
        stamp["akey"] = "b" * 40
        path.write_text(json.dumps(stamp))
    else:
        path.chmod(0o666)
    digests.clear()
    fresh(store).artifacts.verify_for_load(AKEY, None)     # the artifact is fine: hashed and accepted
    assert sorted(digests) == sorted(pathlib.Path(rel).name for rel in FILES)


def test_a_stamp_of_one_signing_key_is_ignored_under_another(tmp_path, digests):
    store = published(tmp_path, signing_key=KEY)
    digests.clear()
    other = Store(store.root, StoreConfig(signing_key=KEY))
    other.artifacts.verify_for_load(AKEY, None)
    assert digests == []
    path = store.layout.stamp(AKEY)
    path.write_text(json.dumps(dict(json.loads(path.read_text()), sig="0" * 64)))
    other.artifacts.verify_for_load(AKEY, None)
    assert len(digests) == N_FILES


def test_a_stamp_of_parts_covers_those_parts_only(tmp_path, digests, monkeypatch):
    """A check of a load's parts stamps those parts; a whole check is not covered by it (a change elsewhere is
    found), a check of the same parts is."""
    monkeypatch.setattr(stamps_module, "RACY_S", 0.0)
    store = published(tmp_path)
    store.layout.stamp(AKEY).unlink()
    digests.clear()
    parts = ["inductor/kernels/"]
    fresh(store).artifacts.verify_for_load(AKEY, parts)
    assert sorted(digests) == ["k.so", "other.so"]
    assert json.loads(store.layout.stamp(AKEY).read_text())["parts"] == parts
    fresh(store).artifacts.verify_for_load(AKEY, parts)
    assert len(digests) == 2
    change_in_place(store.layout.artifact(AKEY) / "inductor" / "module.py")     # not a part: not looked at
    fresh(store).artifacts.verify_for_load(AKEY, parts)
    assert len(digests) == 2
    with pytest.raises(CacheCorruptionError, match="module.py does not match"):
        fresh(store).artifacts.verify_for_load(AKEY, None)


def test_a_corrupt_artifact_is_quarantined_with_its_stamp_and_the_rebuild_stamped(tmp_path, digests):
    store = published(tmp_path)
    first = json.loads(store.layout.stamp(AKEY).read_text())
    change_in_place(store.layout.artifact(AKEY) / "inductor" / "kernels" / "k.so")
    with counters.expect(quarantined=1):
        folder, built = fresh(store).artifacts.publish(AKEY, Builder())
    assert built
    again = json.loads(store.layout.stamp(AKEY).read_text())
    assert again["paths"][""] != first["paths"][""], "the rebuilt folder's own stamp"
    digests.clear()
    fresh(store).artifacts.verify_for_load(AKEY, None)
    assert digests == []


def test_a_stamp_goes_with_its_artifact(tmp_path):
    store = published(tmp_path)
    store.leases.end(AKEY)                                  # (the publisher's lease)
    assert store.maintenance.remove_artifact(AKEY) == "removed"
    assert not store.layout.stamp(AKEY).exists()
    store.artifacts.publish(AKEY, Builder())
    store.leases.end(AKEY)
    assert store.layout.stamp(AKEY).exists()
    assert Store(store.root, StoreConfig(max_size=1)).maintenance.evict() in ([AKEY], [])   # (or its first use's)
    assert not store.layout.artifact(AKEY).exists() and not store.layout.stamp(AKEY).exists()
    orphan = store.layout.stamp("c" * 40)
    orphan.write_text("{}")                                 # an artifact removal cut short before its stamp went
    assert fresh(store).maintenance.cleanup()["stamps"] == 1 and not orphan.exists()


@pytest.mark.parametrize("late", ["unlisted file", "file changed"])
def test_a_file_written_after_the_publishers_digests_is_not_stamped(tmp_path, monkeypatch, late):
    """Something still writing into the work folder after its manifest was written (a file added, or one changed
    after its digest, size and mtime kept): the publish's stamp must not cover it, so the first load checks the
    artifact in full and refuses it (a stamp taken of the folder as it is then accepted what no full check would)."""
    real = artifacts_module.Artifacts._write_manifest

    def then_written(self, work, akey, *rest):
        size = real(self, work, akey, *rest)
        kernels = work / "inductor" / "kernels"
        if late == "unlisted file":
            (kernels / "late.so").write_bytes(b"\x7fELF")
        else:
            os.chmod(kernels / "k.so", 0o644)
            change_in_place(kernels / "k.so")
        return size

    monkeypatch.setattr(artifacts_module.Artifacts, "_write_manifest", then_written)
    store = published(tmp_path)
    match = "unlisted file" if late == "unlisted file" else "k.so does not match"
    with pytest.raises(CacheCorruptionError, match=match):
        fresh(store).artifacts.verify_for_load(AKEY, None)
