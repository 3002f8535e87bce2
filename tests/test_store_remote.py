"""The remote store behind the local folder (gearcache/store/remote.py, fleet.py) against a real redis-server.

End to end (fresh processes, tests/scripts/fleet_node.py, counters): a warm remote fills an empty local folder with
no compile; a cold fleet compiles once, also when its compiler is killed; tampered remote entries and artifacts are
refused and rebuilt; a dead remote never changes an answer. Store level (fake builds, no compiler): each remote
fault (down, killed mid-transfer, truncated or corrupted value, missing chunk, full, slow) ends with the artifact
built or fetched once, valid, and nothing partial visible locally or remotely.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import FLEET_KEY, TESTS, fleet_config
from gearcache import counters
from gearcache.errors import CacheCorruptionError, ConfigError
from gearcache.store import Store, StoreConfig
from gearcache.store.fleet import flush_fetched_entries
from redis_server import free_port

KEY = FLEET_KEY
AKEY = "a" * 40
FILES = {"module.py": b"def call(args):\n    return args\n", "kernels/k.so": b"\x7fELF" + bytes(range(256)) * 40}


def config(redis_url: str | None, **extra) -> str:
    return fleet_config(redis_url, **extra)


def push_seed(seed, url) -> None:
    done = Store(seed, StoreConfig(signing_key=KEY, remote=url, remote_chunk_bytes=4096)).sync.push()
    assert done == {"entries": 1, "artifacts": 1, "skipped": 0}


def start_nodes(folders, cfg: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(TESTS / "scripts" / "fleet_node.py"), str(f), cfg],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in folders]


def reports(procs, timeout=240) -> list[tuple[dict, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-3000:]
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def remote_keys(redis, kind: str) -> list[bytes]:
    return sorted(redis.client().scan_iter(match=f"gearcache:*:{kind}:*"))


# ------------------------------------------------------------------------------------------------- end to end
def test_warm_remote_fills_empty_local_folders_without_compiling(redis, seed, tmp_path):
    push_seed(seed, redis.url)
    (first, _), = reports(start_nodes([tmp_path / "node"], config(redis.url)))
    assert (first["compiles"], first["traces"], first["remote_loads"], first["equal"]) == (0, 0, 1, True)
    assert not first["redis_py_imported"]                        # the fetch path reads without redis-py
    (again, _), = reports(start_nodes([tmp_path / "node"], config(redis.url)))     # now from the local folder
    assert (again["compiles"], again["remote_loads"], again["loads"], again["equal"]) == (0, 0, 1, True)


@pytest.mark.slow
def test_cold_fleet_compiles_once_even_when_its_compiler_is_killed(redis, tmp_path):
    """4 nodes start cold against an empty Redis; the one that claims the compile is SIGKILLed while compiling; one
    survivor takes over once the claim expires, the others wait for it and load: one compile among the survivors."""
    procs = start_nodes([tmp_path / f"n{i}" for i in range(4)], config(redis.url, remote_claim_ttl_s=2))
    deadline = time.monotonic() + 120
    while not remote_keys(redis, "claim"):
        assert time.monotonic() < deadline, "no node claimed the compile"
        time.sleep(0.05)
    claim = redis.client().get(remote_keys(redis, "claim")[0]).decode()
    victim = next(p for p in procs if claim.endswith(f"/{p.pid}"))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    survivors = reports([p for p in procs if p is not victim])
    assert [r["equal"] for r, _ in survivors] == [True] * 3
    assert sum(r["compiles"] for r, _ in survivors) == 1
    assert any(f"waiting for {claim}" in err for _, err in survivors)          # the log line names the claimer
    assert len(remote_keys(redis, "artifact")) == 1 and len(remote_keys(redis, "entry")) == 1
    assert not remote_keys(redis, "claim")


def test_tampered_remote_entry_is_refused_and_rebuilt(redis, seed, tmp_path):
    push_seed(seed, redis.url)
    client = redis.client()
    ekey, = remote_keys(redis, "entry")
    entry = json.loads(client.get(ekey))
    entry["outputs"]["leaves"][0] = ["leaf", 0]      # "return the input": a wrong answer, if it were loaded
    client.set(ekey, json.dumps(entry))
    (r, err), = reports(start_nodes([tmp_path / "node"], config(redis.url)))
    assert r["remote_refused"] == 1 and "refused entry" in err and "signature does not match" in err
    assert (r["compiles"], r["traces"], r["remote_loads"], r["equal"]) == (0, 1, 1, True)  # the artifact was fine
    rebuilt = json.loads(client.get(ekey))
    assert rebuilt["outputs"] == json.loads((next((seed / "entries").glob("*/*/*.json"))).read_text())["outputs"]


@pytest.mark.slow
def test_tampered_remote_artifact_is_never_executed(redis, seed, tmp_path):
    """A file rewritten with its digest and the bundle's sha256 updated to match (only the signature can tell):
    refused, compiled here, and the rebuilt artifact replaces it remotely."""
    push_seed(seed, redis.url)
    client = redis.client()
    hkey, = remote_keys(redis, "artifact")
    head = json.loads(client.get(hkey))
    chunk_keys = sorted(remote_keys(redis, "chunk"), key=lambda k: int(k.rsplit(b":", 1)[1]))
    bundle = b"".join(client.get(k) for k in chunk_keys)
    manifest = json.loads(head["manifest"])
    offset, rows = 0, []
    for rel, size, mode in head["files"]:
        data = bundle[offset:offset + size]
        offset += size
        has_wrapper = any(r[0].endswith("wrapper.py") for r in head["files"])
        if rel.endswith("wrapper.py") or (rel.endswith(".py") and not has_wrapper):
            data = b"raise SystemExit('tampered code ran')\n" + data
        rows.append((rel, data, mode))
    import hashlib

    new_bundle = b"".join(d for _, d, _ in rows)
    manifest["files"] = {rel: hashlib.sha256(d).hexdigest() for rel, d, _ in rows}
    head.update(manifest=json.dumps(manifest), files=[[rel, len(d), m] for rel, d, m in rows], chunks=1,
                bundle=hashlib.sha256(new_bundle).hexdigest(), bytes=len(new_bundle))
    client.set(f"{hkey.decode().replace(':artifact:', ':chunk:')}:{head['bundle'][:16]}:0", new_bundle)
    client.set(hkey, json.dumps(head))
    (r, err), = reports(start_nodes([tmp_path / "node"], config(redis.url)))
    assert r["remote_refused"] >= 1 and "MANIFEST.sig does not match" in err
    assert (r["compiles"], r["equal"], r["remote_pushes"]) == (1, True, 1)
    (again, _), = reports(start_nodes([tmp_path / "other"], config(redis.url)))   # the rebuilt one is served
    assert (again["compiles"], again["remote_loads"], again["remote_refused"], again["equal"]) == (0, 1, 0, True)


@pytest.mark.slow
def test_dead_remote_never_changes_an_answer(tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    (r, err), = reports(start_nodes([tmp_path / "node"], config(dead, remote_timeout_s=1)))
    assert (r["compiles"], r["equal"]) == (1, True) and r["remote_errors"] >= 1 and "Connection" in err
    assert r["remote_errors"] <= 2               # then left alone for DOWN_BACKOFF_S: one timeout, not one per step
    assert time.monotonic() - t0 < 120


# -------------------------------------------------------------------------------------------------- trust
def test_remote_needs_a_signing_key_or_an_explicit_opt_out(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("GEARCACHE_SIGNING_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"remote='redis://h:1/0' without a signing key.*remote_trust='unsigned-ok'"):
        Store(tmp_path, StoreConfig(remote="redis://h:1/0"))
    monkeypatch.setenv("GEARCACHE_REMOTE", "redis://h:2/0")
    with pytest.raises(ConfigError, match="redis://h:2/0"):
        Store(tmp_path)
    with caplog.at_level(logging.WARNING, "gearcache.store"):
        store = Store(tmp_path, StoreConfig(remote_trust="unsigned-ok"))
    assert store.remote.url == "redis://h:2/0" and "without a signing key" in caplog.text
    with pytest.raises(ConfigError, match="remote_trust='maybe'"):
        Store(tmp_path, StoreConfig(signing_key="k", remote="redis://h:1/0", remote_trust="maybe"))


def test_unknown_remote_scheme_is_a_config_error_when_the_store_is_made(tmp_path):
    with pytest.raises(ConfigError, match=r"remote='memcached://h:1'.*unknown scheme"):
        Store(tmp_path, StoreConfig(signing_key=KEY, remote="memcached://h:1"))   # not at the first miss, inside a call


def test_unsigned_remote_artifact_and_entry_are_refused_under_a_key(redis, tmp_path):
    plain = store_at(tmp_path / "a", redis, signing_key=None, remote_trust="unsigned-ok")
    plain.artifacts.publish(AKEY, Builder())
    plain.entries.write("t", "m", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY})
    keyed = store_at(tmp_path / "b", redis)
    before = counters.remote_refused
    assert keyed.entries.read_for_load("t", "m", "e1") is None                       # the entry: not signed
    builder = Builder()
    assert keyed.artifacts.publish(AKEY, builder)[1] and builder.calls == 1  # the artifact: not signed, rebuilt
    keyed.artifacts.verify(AKEY)
    assert counters.remote_refused - before == 2


# ------------------------------------------------------------------------------------- store-level faults
from gearcache.keys.key import FORMAT_VERSION  # noqa: E402


class Builder:
    """A ``build`` that writes ``FILES`` (no compiler) and counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, folder):
        self.calls += 1
        for rel, data in FILES.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)


def store_at(folder, redis, **kw) -> Store:
    kw.setdefault("signing_key", KEY)
    url = kw.pop("url", None) or redis.url
    return Store(folder, StoreConfig(remote=url, remote_chunk_bytes=1024, remote_timeout_s=kw.pop("timeout", 2), **kw))


def nothing_partial(store: Store, redis=None) -> None:
    """No work folder left locally; every local artifact verifies; every remote chunk is committed or expiring."""
    assert os.listdir(store.root / "tmp") == []
    for folder in (store.root / "artifacts").iterdir():
        store.artifacts.verify(folder.name)
    if redis is not None and redis.proc.poll() is None:
        client = redis.client()
        heads = {json.loads(client.get(h))["bundle"][:16] for h in remote_keys(redis, "artifact")}
        for chunk in remote_keys(redis, "chunk"):
            assert chunk.split(b":")[-2].decode() in heads or client.pttl(chunk) > 0, chunk


def test_fetched_artifact_is_published_locally_and_verified(redis, tmp_path):
    a = store_at(tmp_path / "a", redis)
    assert a.artifacts.publish(AKEY, Builder())[1]
    assert len(remote_keys(redis, "chunk")) > 5                               # chunked (1 KiB chunks)
    b = store_at(tmp_path / "b", redis)
    builder = Builder()
    assert b.artifacts.publish(AKEY, builder) == (b.layout.artifact(AKEY), False) and builder.calls == 0
    assert (b.layout.artifact(AKEY) / "inductor" / "kernels" / "k.so").read_bytes() == FILES["kernels/k.so"]
    nothing_partial(b, redis)


def test_fetched_entry_is_loaded_from_memory_and_written_at_exit_after_its_artifact(redis, tmp_path):
    a = store_at(tmp_path / "a", redis)
    a.artifacts.publish(AKEY, Builder())
    manifest = {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY}
    a.entries.write("t", "m", "e1", manifest)                                 # pushed, signed
    b = store_at(tmp_path / "b", redis)
    assert b.entries.read_for_load("t", "m", "e1") == manifest                         # checked, "sig" dropped
    b.artifacts.verify(AKEY)                                                 # published here first
    assert not b.layout.entry("t", "m", "e1").exists()                        # the entry: at exit
    flush_fetched_entries()
    assert b.entries.read("t", "m", "e1") == manifest            # then written, signed
    nothing_partial(b, redis)


def test_fetched_entry_whose_artifact_was_evicted_before_exit_is_not_written(redis, tmp_path):
    a = store_at(tmp_path / "a", redis)
    a.artifacts.publish(AKEY, Builder())
    a.entries.write("t", "m", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY})
    b = store_at(tmp_path / "b", redis)
    assert b.entries.read_for_load("t", "m", "e1")["akey"] == AKEY                     # fetched, published here, queued
    shutil.rmtree(b.layout.artifact(AKEY))                                     # evicted (by another process) since
    flush_fetched_entries()
    assert not b.layout.entry("t", "m", "e1").exists(), "an entry naming an evicted artifact"


def test_fetched_entry_whose_artifact_is_refused_is_not_written(redis, tmp_path):
    a = store_at(tmp_path / "a", redis)
    a.artifacts.publish(AKEY, Builder())
    a.entries.write("t", "m", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY})
    damage_chunk(redis, "flip")
    b = store_at(tmp_path / "b", redis)
    assert b.entries.read_for_load("t", "m", "e1")["akey"] == AKEY              # the caller finds no artifact: compiles
    flush_fetched_entries()
    assert not b.layout.artifact(AKEY).exists() and not b.layout.entry("t", "m", "e1").exists()
    nothing_partial(b, redis)


def damage_chunk(redis, how: str) -> None:
    client = redis.client()
    chunk = remote_keys(redis, "chunk")[0]
    value = client.get(chunk)
    if how == "truncate":
        client.set(chunk, value[: len(value) // 2])
    elif how == "flip":
        client.set(chunk, bytes([value[0] ^ 1]) + value[1:])
    elif how == "flip-and-fix-sha":            # the bundle's sha256 matches: only the file digests can tell
        import hashlib

        hkey, = remote_keys(redis, "artifact")
        head = json.loads(client.get(hkey))
        chunk_prefix = hkey.decode().replace(':artifact:', ':chunk:')
        keys = [f"{chunk_prefix}:{head['bundle'][:16]}:{i}" for i in range(head["chunks"])]
        parts = [client.get(k) for k in keys]
        parts[-1] = parts[-1][:-1] + bytes([parts[-1][-1] ^ 1])
        head["bundle"] = hashlib.sha256(b"".join(parts)).hexdigest()
        new_keys = [f"{chunk_prefix}:{head['bundle'][:16]}:{i}" for i in range(head["chunks"])]
        client.delete(*keys)
        for k, v in zip(new_keys, parts):
            client.set(k, v)
        client.set(hkey, json.dumps(head))
    elif how == "delete":                      # evicted, or never written: a miss, not a refusal
        client.delete(chunk)
    elif how == "uncommitted":                 # a writer killed between its chunks and its head
        client.delete(*remote_keys(redis, "artifact"))


@pytest.mark.parametrize("how", ["truncate", "flip", "flip-and-fix-sha", "delete", "uncommitted"])
def test_damaged_remote_value_is_never_loaded(redis, tmp_path, how):
    store_at(tmp_path / "a", redis).artifacts.publish(AKEY, Builder())
    damage_chunk(redis, how)
    before = counters.snapshot()
    b = store_at(tmp_path / "b", redis)
    builder = Builder()
    assert b.artifacts.publish(AKEY, builder)[1] and builder.calls == 1       # built here, never loaded from remote
    delta = counters.delta(before)
    assert delta["remote_refused"] == (0 if how in ("delete", "uncommitted") else 1)
    assert delta["remote_pushes"] == 1                                       # the rebuilt one replaces it
    nothing_partial(b, redis)
    c = store_at(tmp_path / "c", redis)
    assert c.artifacts.publish(AKEY, Builder())[1] is False                  # and serves the fleet again


@pytest.mark.parametrize("change", ["extra file", "unsafe path", "missing file"])
def test_remote_head_listing_other_files_than_its_manifest_is_refused_before_anything_is_written(redis, tmp_path,
                                                                                                change):
    """A fetch checks the bundle in memory against the signed manifest before it writes a byte: a head that lists a
    file the manifest does not (or a path outside the artifact), or leaves one out, is refused and rebuilt."""
    store_at(tmp_path / "a", redis).artifacts.publish(AKEY, Builder())
    client = redis.client()
    hkey, = remote_keys(redis, "artifact")
    head = json.loads(client.get(hkey))
    if change == "missing file":
        size = head["files"][-1][1]
        head["files"] = head["files"][:-2] + [[head["files"][-2][0], head["files"][-2][1] + size, 0o644]]
    else:
        first = head["files"][0]
        name = "inductor/extra.py" if change == "extra file" else "../../outside.py"
        head["files"] = [[name, 1, 0o755], [first[0], first[1] - 1, first[2]]] + head["files"][1:]
    client.set(hkey, json.dumps(head))
    before = counters.snapshot()
    b = store_at(tmp_path / "b", redis)
    builder = Builder()
    assert b.artifacts.publish(AKEY, builder)[1] and builder.calls == 1
    assert counters.delta(before)["remote_refused"] == 1
    assert not (tmp_path / "outside.py").exists() and not (tmp_path / "b" / "outside.py").exists()
    nothing_partial(b, redis)


def test_a_fetched_artifact_skips_only_the_next_load_check(redis, tmp_path):
    """Right after a fetch, the load's check would read back what was just checked in memory: it is skipped once;
    the next load checks the folder again (a file damaged meanwhile is found)."""
    store_at(tmp_path / "a", redis).artifacts.publish(AKEY, Builder())
    b = store_at(tmp_path / "b", redis)
    assert b.artifacts.publish(AKEY, Builder())[1] is False                 # fetched
    kernel = b.layout.artifact(AKEY) / "inductor" / "kernels" / "k.so"
    os.chmod(kernel, 0o644)
    kernel.write_bytes(b"damaged")
    b.artifacts.verify_for_load(AKEY, None)                       # skipped: the fetch checked these bytes
    with pytest.raises(CacheCorruptionError, match="k.so does not match"):
        b.artifacts.verify_for_load(AKEY, None)


def test_redis_down_at_start_costs_one_timeout(tmp_path):
    store = Store(tmp_path / "a", StoreConfig(signing_key=KEY, remote=f"redis://127.0.0.1:{free_port()}/0",
                                              remote_timeout_s=1))
    before = counters.snapshot()
    t0 = time.monotonic()
    builder = Builder()
    assert store.entries.read_for_load("t", "m", "e1") is None
    assert store.artifacts.publish(AKEY, builder)[1] and builder.calls == 1
    store.entries.write("t", "m", "e1", {"format": FORMAT_VERSION, "ekey": "e1", "akey": AKEY})
    assert store.artifacts.publish("b" * 40, Builder())[1]
    assert time.monotonic() - t0 < 2 and counters.delta(before)["remote_errors"] == 1   # then left alone
    assert store.entries.read_for_load("t", "m", "e1")["akey"] == AKEY
    nothing_partial(store)


def test_redis_killed_mid_transfer(redis, tmp_path):
    """The server stops answering mid-command (CLIENT PAUSE) and is then killed: the fetch fails within the timeout,
    the artifact is built here, nothing partial is left."""
    store_at(tmp_path / "a", redis).artifacts.publish(AKEY, Builder())
    redis.client().execute_command("CLIENT", "PAUSE", 5000, "ALL")
    threading.Timer(0.3, redis.kill).start()
    b = store_at(tmp_path / "b", redis, timeout=1)
    t0 = time.monotonic()
    builder = Builder()
    assert b.artifacts.publish(AKEY, builder)[1] and builder.calls == 1
    assert time.monotonic() - t0 < 2.5
    nothing_partial(b)


def test_full_redis_keeps_the_artifact_local_and_nothing_partial_remote(redis, tmp_path):
    client = redis.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 4000)   # room for a few chunks only
    store = store_at(tmp_path / "a", redis)
    before = counters.snapshot()
    builder = Builder()
    assert store.artifacts.publish(AKEY, builder)[1] and builder.calls == 1
    assert counters.delta(before)["remote_errors"] == 1 and not remote_keys(redis, "artifact")
    nothing_partial(store, redis)                                           # chunks written before OOM expire
    client.config_set("maxmemory", 0)


@pytest.mark.slow      # test_store_redis_backend: test_slow_server_times_out_within_the_bound, fast
def test_slow_redis_is_bounded_by_the_timeout(redis, tmp_path):
    store_at(tmp_path / "a", redis).artifacts.publish(AKEY, Builder())
    b = store_at(tmp_path / "b", redis, timeout=0.5)
    b.remote.backend.get("warm-up")                                          # connected before the server stalls
    sleeper = threading.Thread(target=lambda: redis.client(socket_timeout=10).execute_command("DEBUG", "SLEEP", 3))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    builder = Builder()
    assert b.artifacts.publish(AKEY, builder)[1] and builder.calls == 1
    assert time.monotonic() - t0 < 1.5
    sleeper.join()
    nothing_partial(b, redis)


# ----------------------------------------------------------- two torchrun jobs as two nodes of one fleet (issue #38)
def _node(folder, out, redis_url: str, **env: str) -> subprocess.Popen:
    """One "node": a torchrun job of 2 ranks (tests/scripts/run_tp_gears.py: a TP MLP, all-reduce inside, gears
    1 and 2) with its own local cache folder and MASTER_PORT, the fleet store at ``redis_url``, signed; its compiles
    counted by gearcache's counters and by hooks on torch's compiler (tests/compile_hooks.py). Its own session, so
    the test can end the whole job."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(TESTS / "scripts" / "run_tp_gears.py"),
           str(folder), str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "GEARS": "1,2", "COMPILE_HOOKS": "1",
                                 "GEARCACHE_REMOTE": redis_url, "GEARCACHE_SIGNING_KEY": KEY, **env})


def _node_reports(proc: subprocess.Popen, out, timeout: float = 600) -> list[dict]:
    _, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _kill_node(proc: subprocess.Popen, out) -> None:
    """SIGKILL a node: each rank (torchrun starts them in sessions of their own; each wrote its pid), then torchrun."""
    for r in range(2):
        pid_file = out / f"rank{r}.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@pytest.mark.slow
def test_second_node_of_a_fleet_compiles_nothing_the_first_compiled(redis, tmp_path):
    """Node A (2 ranks, its own folder) starts cold against an empty Redis and compiles each gear's graph once; node
    B (2 ranks, another folder, another MASTER_PORT) then starts cold too: it fetches every entry and artifact, and
    Inductor never runs in it (hooks: 0 compiles, 0 code generations, 0 C++ builds); both equal eager."""
    a = _node_reports(_node(tmp_path / "a", tmp_path / "a_out", redis.url), tmp_path / "a_out")
    assert all(r["error"] is None and r["equal"] for r in a)
    assert sum(r["counters"]["compiles"] for r in a) == 2 and sum(r["counters"]["remote_pushes"] for r in a) == 2
    assert sum(r["compile_hooks"]["inductor_compiles"] for r in a) > 0
    assert len(remote_keys(redis, "artifact")) == 2 and len(remote_keys(redis, "entry")) == 4   # 2 gears x 2 ranks
    b = _node_reports(_node(tmp_path / "b", tmp_path / "b_out", redis.url), tmp_path / "b_out")
    assert all(r["error"] is None and r["equal"] for r in b)
    for r in b:
        assert r["counters"]["compiles"] == 0 and r["counters"]["loads"] == 2, r["counters"]
        hooks = r["compile_hooks"]
        assert (hooks["inductor_compiles"], hooks["inductor_codegen"], hooks["cpp_builds"]) == (0, 0, 0), hooks
        assert r["counters"]["traces"] == 1, "only the gear plan's trace (plans stay local): no gear captured"
    assert sum(r["counters"]["remote_loads"] for r in b) == 2, "each artifact fetched once for the node's folder"
    assert all(r["destroy_returned"] for r in a + b)


@pytest.mark.slow
def test_a_node_killed_mid_compile_leaves_no_half_entry(redis, tmp_path):
    """Node A is killed (every process of the job, SIGKILL) while it compiles its first artifact: Redis holds no
    entry and no artifact head (only expiring chunks, if any), and A's folder no artifact without its manifest and
    no entry. Node B then starts cold: it waits out A's claim (2 s), compiles, and serves equal to eager; node A
    restarted on its folder fetches everything and compiles nothing."""
    a = _node(tmp_path / "a", tmp_path / "a_out", redis.url, REMOTE_CLAIM_TTL_S="2")
    deadline = time.monotonic() + 300
    while not remote_keys(redis, "claim"):
        assert a.poll() is None, a.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "node A never claimed a compile"
        time.sleep(0.05)
    _kill_node(a, tmp_path / "a_out")
    assert remote_keys(redis, "entry") == [] and remote_keys(redis, "artifact") == []
    client = redis.client()
    assert all(client.ttl(k) > 0 for k in remote_keys(redis, "chunk")), "chunks of an unfinished push expire"
    folder = tmp_path / "a"
    assert list((folder / "entries").glob("*/*/*.json")) == [], "no entry manifest (the gear plans may be there)"
    for artifact in (folder / "artifacts").iterdir() if (folder / "artifacts").exists() else []:
        assert (artifact / "MANIFEST.json").is_file(), f"half artifact {artifact}"
    b = _node_reports(_node(tmp_path / "b", tmp_path / "b_out", redis.url, REMOTE_CLAIM_TTL_S="2"),
                      tmp_path / "b_out")
    assert all(r["error"] is None and r["equal"] for r in b)
    assert sum(r["counters"]["compiles"] for r in b) == 2 and not any(r["counters"]["remote_refused"] for r in b)
    again = _node_reports(_node(folder, tmp_path / "a_again", redis.url), tmp_path / "a_again")
    assert all(r["equal"] and r["counters"]["compiles"] == 0 for r in again)
    assert sum(r["compile_hooks"]["inductor_compiles"] for r in again) == 0


def test_a_password_in_the_remote_url_is_never_shown_or_written(tmp_path, caplog):
    """``redis://:PASSWORD@host`` (Redis's own auth, beside the signing key): the password reaches the server and
    nothing else: not the store's repr, its log lines (push, fetch), its errors, the index rows ``gearcache ls``
    prints (where an artifact came from)."""
    from redis_server import RedisServer

    from gearcache.store.remote import RemoteError

    server = RedisServer(args=("--requirepass", "pw-s3cret-1")).start()
    try:
        url = f"redis://:pw-s3cret-1@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.INFO, "gearcache"):
            a = store_at(tmp_path / "a", server, url=url)
            assert a.artifacts.publish(AKEY, Builder())[1]
            b = store_at(tmp_path / "b", server, url=url)
            builder = Builder()
            assert b.artifacts.publish(AKEY, builder)[1] is False and builder.calls == 0     # fetched, with auth
        from gearcache.store.index import flush_index_updates

        flush_index_updates()
        shown = [repr(a.remote), caplog.text, json.dumps(dict(b.index.db.items()), default=str)]
        assert "fetched artifact" in caplog.text and "127.0.0.1" in shown[2]
        server.kill()
        with pytest.raises(RemoteError) as failed:
            b.remote.backend.get_many(["x"])
        shown.append(str(failed.value))
        for text in shown:
            assert "pw-s3cret-1" not in text, text
        assert f"redis://:***@127.0.0.1:{server.port}/0" in shown[0]
    finally:
        server.stop()
