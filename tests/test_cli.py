"""The ``gearcache`` command, run for real (``python -m gearcache.cli`` in a subprocess) on a real cache folder.

The folder is built once per module: a cold process compiles one tiny method at two input shapes (two entries,
and a recorded miss whose nearest entry differs in the ``signature`` factor), then ``gearcache warmup`` loads an
entry in a warm process (so the index has loads and hits). Tests that change the folder work on a copy.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ahead
from gearcache.cli.checks import parse_size
from gearcache.cli.folder import StoreView
from gearcache.cli.output import fmt_gears, format_table
from gearcache.keys.key import FORMAT_VERSION
from gearcache.log import parse_level
from gearcache.store import Store

MODEL = '''
import torch
from gearcache import cache_compile


class Tiny(torch.nn.Module):
    def __init__(self, cache_dir=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return torch.relu(self.lin(x))
'''

POPULATE = '''
import sys
import torch
import cli_model

torch.manual_seed(0)
model = cli_model.Tiny(sys.argv[1]).eval()
with torch.inference_mode():
    for rows in map(int, sys.argv[2:]):
        model.cached(torch.randn(rows, 4))
'''

FACTORY = '''
import torch
import cli_model


def make():
    torch.manual_seed(0)
    return cli_model.Tiny().eval(), (torch.randn(2, 4),)
'''

METHOD = "cli_model.Tiny.fwd"
FACTORS = {"format", "method", "signature", "module_state", "config", "decompositions", "global_state", "software",
           "devices", "process_groups"}


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GEARCACHE_HOME", "GEARCACHE_LOG")}
    env.update(extra)
    return env


def _cmd(args, exe: list[str] | None = None) -> list[str]:
    return (exe or [sys.executable, "-m", "gearcache.cli"]) + [str(a) for a in args]


def gc(*args, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real command; returns the CompletedProcess (text)."""
    return subprocess.run(_cmd(args), capture_output=True, text=True, cwd=cwd, env=env or _env(), timeout=120)


def gc_many(commands: dict[str, list]) -> dict[str, subprocess.CompletedProcess]:
    """Run several read-only invocations at once (each one's cost is mostly importing torch)."""
    procs = {name: subprocess.Popen(_cmd(args[1:], args[0]) if args and isinstance(args[0], list) else _cmd(args),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for name, args in commands.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def as_json(proc: subprocess.CompletedProcess, rc: int = 0) -> dict:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


def gc_json(*args, rc: int = 0) -> dict:
    return as_json(gc(*args, "--json"), rc)


@ahead("populated")
def _populated(tmp_path_factory, need):
    work = tmp_path_factory.mktemp("cli")
    (work / "cli_model.py").write_text(MODEL)
    (work / "populate.py").write_text(POPULATE)
    (work / "cli_factory.py").write_text(FACTORY)
    cache = work / "cache"
    # rows 2 twice (the second call is a hit), then 3: two compiles, the second one's miss differs in 'signature'
    cold = subprocess.run([sys.executable, "populate.py", str(cache), "2", "2", "3"], cwd=work, capture_output=True,
                          text=True, env=_env(GEARCACHE_LOG="INFO"), timeout=300)
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm = gc("warmup", "cli_factory:make", "--cache-dir", cache, cwd=work, env=_env(GEARCACHE_LOG="INFO"))
    return cache, cold, warm


@pytest.fixture(scope="module")
def populated(ahead_jobs):
    """(cache folder, cold process, warmup process): two entries compiled cold, then one loaded by `warmup`."""
    return ahead_jobs.value("populated")


@ahead("cli_reads", used_by=lambda item: {"listing", "reads"} & set(item.fixturenames))
def _listing_and_reads(tmp_path_factory, need):
    cache = need("populated")[0]
    listing = as_json(gc("ls", "--cache-dir", cache, "--json"))["entries"]
    a, b = listing[0]["ekey"], listing[1]["ekey"]
    commands = {
        "ls": ["ls", "--cache-dir", cache],
        "inspect": ["inspect", a[:8], "--cache-dir", cache],
        "inspect_json": ["inspect", a[:8], "--cache-dir", cache, "--json"],
        "explain": ["explain", a[:10], b, "--cache-dir", cache],
        "explain_method": ["explain", "--method", "Tiny.fwd", "--cache-dir", cache, "--json"],
        "stats": ["stats", "--cache-dir", cache, "--json"],
        "missing": ["ls", "--cache-dir", cache.parent / "nope"],
        "bad_entry": ["inspect", "ffffffffff", "--cache-dir", cache, "--json"],
        "ls_folder": ["ls", cache],
        "stats_folder": ["stats", cache, "--json"],
        "two_folders": ["ls", cache, "--cache-dir", cache.parent / "other"],
        "folder_and_remote": ["ls", cache, "--remote", "redis://127.0.0.1:9/0"],
    }
    exe = shutil.which("gearcache")
    if exe is not None:
        commands["console_script"] = [[exe], "--help"]
    return listing, gc_many(commands)


@pytest.fixture(scope="module")
def listing(ahead_jobs) -> list[dict]:
    """`ls --json` of the populated folder (after warmup)."""
    return ahead_jobs.value("cli_reads")[0]


@pytest.fixture(scope="module")
def reads(ahead_jobs) -> dict[str, subprocess.CompletedProcess]:
    """Every read-only invocation the tests below check, run in parallel (after ``listing``)."""
    return ahead_jobs.value("cli_reads")[1]


# ------------------------------------------------------------------------------------------------ the process side
def test_logging_reports_miss_compile_and_load(populated):
    _, cold, warm = populated
    misses = [line for line in cold.stderr.splitlines() if ": miss for entry" in line]
    assert len(misses) == 2, cold.stderr[-3000:]
    assert sum("compiling artifact" in line for line in cold.stderr.splitlines()) == 2
    assert "no entry of this method on disk yet" in misses[0]
    assert "signature" in misses[1] and "nearest entry" in misses[1]
    assert sum("compiled entry" in line for line in cold.stderr.splitlines()) == 2
    loads = [line for line in warm.stderr.splitlines() if "loaded entry" in line]
    assert len(loads) == 1 and " s" in loads[0], warm.stderr[-3000:]


def test_warmup(populated):
    cache, _, warm = populated
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"gearcache warmup: cached ({METHOD}) ..." in warm.stderr
    assert "1 gear(s)" in warm.stderr                      # the progress line, per method
    row = next(line for line in warm.stdout.splitlines() if METHOD in line).split()
    assert row[:3] == ["cached", METHOD, "1"]              # attribute, method, gears
    assert row[3:5] == ["0", "1"]                          # nothing compiled, one entry loaded
    assert str(cache.resolve()) in warm.stdout             # --cache-dir reached cache_compile(cache_dir=None)


@pytest.mark.slow
def test_two_cold_starts_log_what_each_one_does(tmp_path):
    """Two processes miss the same entry at once: one compiles, the other waits for it and reuses the artifact, and
    says so: it never logs that it compiles."""
    script = Path(__file__).parent / "scripts" / "race_compile.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(GEARCACHE_LOG="INFO")) for _ in range(2)]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        runs.append((json.loads(out.strip().splitlines()[-1]), err))
    (compiler, compiler_log), (waiter, waiter_log) = sorted(runs, key=lambda r: -r[0]["compiles"])
    assert compiler["compiles"] == 1 and waiter["compiles"] == 0 and compiler["equal"] and waiter["equal"]
    assert "miss for entry" in compiler_log and "compiling artifact" in compiler_log
    assert "compiled entry" in compiler_log
    assert "miss for entry" in waiter_log, waiter_log[-3000:]
    assert "compiling artifact" not in waiter_log and "miss, compiling" not in waiter_log, waiter_log[-3000:]
    assert "compiled entry" not in waiter_log, waiter_log[-3000:]
    assert "compiled by another process" in waiter_log, waiter_log[-3000:]


# --------------------------------------------------------------------------------------------------------- reads
def test_ls_human_and_json(reads, listing):
    human = reads["ls"]
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].split() == ["METHOD", "TOPOLOGY", "ENTRY", "SIGNATURE", "GEARS", "SIZE", "LAST", "USED", "LOADS",
                                "HITS"]
    assert sum(METHOD in line for line in lines) == 2
    assert "(float32[2, 4] cpu) grad=off" in human.stdout and "(float32[3, 4] cpu) grad=off" in human.stdout
    assert lines[1].index("world1_rank0_tp0_pp0") == lines[0].index("TOPOLOGY")     # aligned columns
    assert len(listing) == 2 and {e["method"] for e in listing} == {METHOD}
    by_sig = {e["signature"]: e for e in listing}
    two = by_sig["(float32[2, 4] cpu) grad=off"]
    assert two["loads"] == 1 and two["hits"] >= 1          # loaded by warmup; one hit in the cold process
    assert all(e["bytes"] > 10_000 and e["gears"] == [] and e["last_used"] for e in listing)


def test_inspect_by_prefix(reads, listing, populated):
    entry, cache = listing[0], populated[0]
    human = reads["inspect"]
    assert human.returncode == 0, human.stderr
    for word in ["key factors:", "generated code:", "graph inputs (recipe):", "graph outputs (recipe):",
                 "dependencies:", entry["akey"], "module tensor lin.weight", "cli_model.py"]:
        assert word in human.stdout, word
    doc = as_json(reads["inspect_json"])
    assert doc["ekey"] == entry["ekey"] and doc["akey"] == entry["akey"]
    assert {f["name"] for f in doc["factors"]} == FACTORS
    assert all(len(f["hash"]) == 64 for f in doc["factors"])
    assert doc["generated_code"] and all(p.endswith(".py") and Path(p).is_file() for p in doc["generated_code"])
    assert doc["generated_code"][0].startswith(str(cache.resolve() / "artifacts" / entry["akey"] / "inductor"))
    assert [k for k, _ in doc["inputs"]].count("leaf") == 1 and doc["outputs"]["leaves"]
    assert doc["dependencies"][0]["file"].endswith("cli_model.py") and not doc["dependencies"][0]["changed"]
    assert doc["run_plan"].startswith("yes") and "run plan" in human.stdout
    assert "value guards (" in human.stdout and doc["value_guards"], "the values the graph bakes in are listed"
    assert any(g[1][0] == "self" and ["attr", "lin"] in g[1] or "lin" in str(g[1]) for g in doc["value_guards"])


def test_explain_two_entries_names_signature(reads):
    human = reads["explain"]
    assert human.returncode == 1, human.stderr
    assert "1 key factor(s) differ: signature" in human.stdout
    row = next(line for line in human.stdout.splitlines() if line.startswith("signature "))
    assert "float32[2, 4]" in row and "float32[3, 4]" in row            # both values


def test_explain_a_miss_that_has_since_compiled_says_what_it_compiled_to(reads, listing):
    """Both recorded misses compiled: nothing misses now (exit 0); the latest one's entry and why it missed then."""
    doc = as_json(reads["explain_method"], rc=0)
    assert doc["method"] == METHOD
    assert doc["miss"]["signature"] == "(float32[3, 4] cpu) grad=off" and doc["miss"]["compiled_as_entry"]
    three = next(e for e in listing if e["signature"] == "(float32[3, 4] cpu) grad=off")
    assert doc["compiled_to"] == {"ekey": three["ekey"], "akey": three["akey"], "created": three["created"]}
    assert doc["differs"] == [] and doc["missed_because"] == ["signature"]


def test_explain_the_latest_miss_that_is_still_a_miss(cache_copy, listing):
    """The entry of the first miss was pruned: that miss is explained (against the entry there is), not the later
    miss that compiled."""
    two = next(e for e in listing if e["signature"] == "(float32[2, 4] cpu) grad=off")
    three = next(e for e in listing if e["signature"] == "(float32[3, 4] cpu) grad=off")
    next(cache_copy.glob(f"entries/*/*/{two['ekey']}.json")).unlink()
    proc = gc("explain", "--method", "Tiny.fwd", "--cache-dir", cache_copy)
    doc = gc_json("explain", "--method", "Tiny.fwd", "--cache-dir", cache_copy, rc=1)
    assert doc["miss"]["ekey"] == two["ekey"] and not doc["miss"]["compiled_as_entry"]
    assert doc["compiled_to"] is None and doc["nearest"] == three["ekey"]
    assert [d["factor"] for d in doc["differs"]] == ["signature"]
    assert doc["differs"][0]["hash_a"] != doc["differs"][0]["hash_b"]
    assert proc.returncode == 1 and "still a miss" in proc.stdout and "1 key factor(s) differ: signature" in proc.stdout


def test_stats_consistent_with_ls(reads, listing):
    stats = as_json(reads["stats"])
    assert stats["entries"] == len(listing) == 2 and stats["artifacts"] == 2 and stats["methods"] == 1
    assert stats["total_bytes"] == sum(e["bytes"] for e in listing)
    assert stats["loads"] == sum(e["loads"] for e in listing) >= 1
    assert stats["hits"] == sum(e["hits"] for e in listing) >= 1
    assert stats["compile_seconds"] > 0 and stats["load_seconds"] > 0
    assert stats["padding_waste"] is None


def test_errors_exit_2(reads):
    missing = reads["missing"]
    assert missing.returncode == 2 and "no cache folder" in missing.stderr
    assert "no entry" in as_json(reads["bad_entry"], rc=2)["error"]


def test_the_folder_may_be_given_as_the_commands_argument(reads):
    """``gearcache ls DIR`` is ``gearcache ls --cache-dir DIR`` (it was "unrecognized arguments: DIR"); naming two
    folders, or a folder with ``--remote`` (which reads the remote store instead), is a usage error."""
    assert reads["ls_folder"].returncode == 0 and reads["ls_folder"].stdout == reads["ls"].stdout
    assert as_json(reads["stats_folder"])["entries"] == as_json(reads["stats"])["entries"]
    assert reads["two_folders"].returncode == 2 and "name two folders" in reads["two_folders"].stderr
    refused = reads["folder_and_remote"]                # the folder was ignored: the remote was read instead
    assert refused.returncode == 2 and "reads the remote store, not a folder" in refused.stderr


def test_console_script_help(reads):
    if "console_script" not in reads:
        pytest.skip("the gearcache console script is not installed (pip install -e .)")
    proc = reads["console_script"]
    assert proc.returncode == 0, proc.stderr
    for sub in ("ls", "inspect", "explain", "verify", "prune", "warmup", "stats"):
        assert sub in proc.stdout


@pytest.mark.slow
def test_python_m_gearcache_is_the_command(tmp_path):
    """``python -m gearcache VERB`` runs the command (it was "No module named gearcache.__main__")."""
    helped = subprocess.run(_cmd(["--help"], [sys.executable, "-m", "gearcache"]), capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert all(verb in helped.stdout for verb in ("ls", "verify", "prune", "warmup"))
    missing = subprocess.run(_cmd(["ls", "--cache-dir", tmp_path / "none"], [sys.executable, "-m", "gearcache"]),
                             capture_output=True, text=True, env=_env(), timeout=120)
    assert missing.returncode == 2 and "no cache folder" in missing.stderr


# -------------------------------------------------------------------------------------------------------- writes
@pytest.fixture()
def cache_copy(populated, tmp_path) -> Path:
    dest = tmp_path / "cache"
    shutil.copytree(populated[0], dest)
    return dest


@pytest.mark.slow
def test_verify_finds_a_flipped_byte_and_prune_removes_it(cache_copy, listing):
    victim, other = listing
    code = sorted((cache_copy / "artifacts" / victim["akey"] / "inductor").rglob("*.py"))[0]
    data = bytearray(code.read_bytes())
    data[len(data) // 2] ^= 0x01
    code.write_bytes(bytes(data))

    proc = gc("verify", "--cache-dir", cache_copy)
    assert proc.returncode == 1
    rows = {line.split()[2]: line for line in proc.stdout.splitlines()[1:3]}
    assert rows[victim["ekey"][:12]].startswith("corrupt") and code.name in rows[victim["ekey"][:12]]
    assert rows[other["ekey"][:12]].startswith("ok")
    assert "PROBLEMS FOUND" in proc.stdout

    before = sorted(p for p in cache_copy.rglob("*") if "index" not in p.parts)
    dry = gc_json("prune", "--corrupt", "--cache-dir", cache_copy)
    assert dry["dry_run"] and [e["ekey"] for e in dry["entries"]] == [victim["ekey"]]
    assert [a["akey"] for a in dry["artifacts"]] == [victim["akey"]]
    assert sorted(p for p in cache_copy.rglob("*") if "index" not in p.parts) == before     # nothing deleted

    done = gc_json("prune", "--corrupt", "--yes", "--cache-dir", cache_copy)
    assert done["deleted_artifacts"] == [victim["akey"]] and not done["skipped_locked"]
    assert not (cache_copy / "artifacts" / victim["akey"]).exists()
    after = gc_json("verify", "--cache-dir", cache_copy)
    assert after["ok"] and [e["ekey"] for e in after["entries"]] == [other["ekey"]]


def test_prune_older_than_dry_run_then_yes(cache_copy):
    import diskcache

    dry = gc("prune", "--older-than", "0", "--cache-dir", cache_copy)
    assert dry.returncode == 0 and "would delete 2 entries" in dry.stdout and "--yes" in dry.stdout
    assert len(list((cache_copy / "artifacts").iterdir())) == 2
    assert len(list((cache_copy / "entries").rglob("*.json"))) == 2
    done = gc_json("prune", "--older-than", "0", "--yes", "--cache-dir", cache_copy)
    assert not done["dry_run"] and len(done["deleted_artifacts"]) == 2 and done["bytes_freed"] > 0
    assert list((cache_copy / "artifacts").iterdir()) == []
    assert list((cache_copy / "entries").rglob("*.json")) == []
    assert list(diskcache.Index(str(cache_copy / "index")).keys()) == []              # index rows gone too


# ------------------------------------------------------------------------------------------- helpers, in process
def test_table_sizes_gears_levels(tmp_path):
    table = format_table(["NAME", "N"], [["a", 1], ["long name", 22]], right=(1,))
    assert table.splitlines() == ["NAME        N", "a           1", "long name  22"]
    assert parse_size("2K") == 2048 and parse_size("1.5M") == 1572864 and parse_size("100") == 100
    Store(tmp_path).entries.write_gear_plan("world1_rank0_tp0_pp0", "m.M.f", "p", {
        "format": FORMAT_VERSION, "pkey": "p", "plan": {
            "dims": [{"leaf": 0, "dim": 0, "sizes": [1, 2, 4], "name": "x", "pad_value": 0.0}]}})
    plans = StoreView(tmp_path).gears("world1_rank0_tp0_pp0", "m.M.f")
    assert fmt_gears(plans) == "x:0=[1,2,4]"
    assert parse_level("info") == 20 and parse_level("15") == 15 and parse_level("nope") is None


def test_logging_env_configures_only_the_gearcache_logger(monkeypatch):
    import logging

    from gearcache.log import configure_from_env

    logger, root = logging.getLogger("gearcache"), logging.getLogger()
    saved, root_state = (logger.level, list(logger.handlers)), (root.level, list(root.handlers))
    try:
        logger.handlers.clear()
        monkeypatch.setenv("GEARCACHE_LOG", "debug")
        configure_from_env()
        configure_from_env()
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
        assert (root.level, list(root.handlers)) == root_state
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]


def test_prune_leaves_an_artifact_a_live_process_uses(cache_copy):
    from gearcache.store import HOST, _start_token

    akey = sorted(p.name for p in (cache_copy / "artifacts").iterdir())[0]
    lease = cache_copy / "leases" / akey / f"{os.getpid()}@{HOST}"          # this test process: alive
    lease.parent.mkdir(parents=True, exist_ok=True)
    lease.write_text(_start_token(os.getpid()) + "\n")
    done = gc_json("prune", "--older-than", "0", "--yes", "--cache-dir", cache_copy)
    assert done["skipped_locked"] == [akey] and akey not in done["deleted_artifacts"]
    assert [p.name for p in (cache_copy / "artifacts").iterdir()] == [akey]
    assert len(done["deleted_artifacts"]) == 1


# ========================================================================================================== native
@pytest.mark.slow
def test_native_status_says_where_the_native_checks_are_and_build_says_why_it_failed(native_checks, tmp_path):
    built = as_json(gc("native", "--json"))
    assert built["built"] and built["loaded_in_this_process"] and built["enabled"]
    assert Path(built["dir"], built["key"], "gearcache_native_guards.so").samefile(native_checks)
    empty = gc("native", env=_env(GEARCACHE_NATIVE_DIR=str(tmp_path)))
    assert empty.returncode == 0 and "native checks: not built" in empty.stdout and str(tmp_path) in empty.stdout
    failed = gc("native", "build", env=_env(GEARCACHE_NATIVE_DIR=str(tmp_path), CXX="false"))
    assert failed.returncode == 1
    assert "building gearcache's native checks failed" in failed.stderr and "build.log" in failed.stderr
    assert "failed (see build.log)" in gc("native", env=_env(GEARCACHE_NATIVE_DIR=str(tmp_path))).stdout


# ------------------------------------------------------------------------------------ what the runtime refuses
def test_verify_reports_every_mode_the_runtime_refuses_with_the_fix(cache_copy, listing):
    entry = listing[0]
    manifest = next(cache_copy.glob(f"entries/*/*/{entry['ekey']}.json"))
    manifest.chmod(0o664)                                   # group-writable: that entry is never loaded
    try:
        cache_copy.chmod(0o777)                             # world-writable: the whole store is refused
        proc = gc("verify", "--cache-dir", cache_copy)
        doc = gc_json("verify", "--cache-dir", cache_copy, rc=1)
    finally:
        cache_copy.chmod(0o700)
    assert proc.returncode == 1 and "PROBLEMS FOUND" in proc.stdout and "all ok" not in proc.stdout
    assert f"{cache_copy}: mode 0o777 lets every user write it. Fix: `chmod go-w {cache_copy}`" in proc.stdout
    assert doc["untrusted_folders"] == [{"path": str(cache_copy), "why": "mode 0o777 lets every user write it",
                                         "fix": f"`chmod go-w {cache_copy}`"}]
    rows = {r["ekey"]: r for r in doc["entries"]}
    assert rows[entry["ekey"]]["status"] == "untrusted"
    assert f"`chmod go-w {manifest}`" in rows[entry["ekey"]]["problems"][0]["detail"]
    assert [r["status"] for k, r in rows.items() if k != entry["ekey"]] == ["ok"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_verify_reports_a_folder_another_user_owns(cache_copy):
    os.chown(cache_copy / "entries", 12345, -1)
    doc = gc_json("verify", "--cache-dir", cache_copy, rc=1)
    assert doc["untrusted_folders"][0]["path"] == str(cache_copy / "entries")
    assert "owned by uid 12345" in doc["untrusted_folders"][0]["why"]
    assert "chown" in doc["untrusted_folders"][0]["fix"]


def test_with_a_signing_key_unsigned_manifests_are_refused_as_the_runtime_refuses_them(cache_copy, listing):
    """The folder was written without a key: under $GEARCACHE_SIGNING_KEY the CLI reads its manifests with the store's
    signature check, as a process with that key would (every entry refused, none listed)."""
    env = _env(GEARCACHE_SIGNING_KEY="another-key")
    verify = gc("verify", "--cache-dir", cache_copy, "--json", env=env)
    doc = as_json(verify, rc=1)
    assert sorted(r["ekey"] for r in doc["entries"]) == sorted(e["ekey"] for e in listing)
    assert all(r["status"] == "corrupt" and "not signed" in r["problems"][0]["detail"] for r in doc["entries"])
    ls = gc("ls", "--cache-dir", cache_copy, "--json", env=env)
    assert as_json(ls)["entries"] == [] and ls.stderr.count("not signed") == 2


@pytest.mark.slow
def test_prune_excludes_a_writer_holding_the_soft_lock(cache_copy):
    """Writers with lock_mode="soft" lock ``locks/<akey>.softlock``: prune takes the store's locks of both modes."""
    from gearcache.store import Store, StoreConfig

    akey = sorted(p.name for p in (cache_copy / "artifacts").iterdir())[0]
    writer = Store(cache_copy, StoreConfig(lock_mode="soft"))
    with writer.locks.held(writer.locks.path(akey), 5):
        done = gc_json("prune", "--older-than", "0", "--yes", "--cache-dir", cache_copy)
    assert done["skipped_locked"] == [akey] and akey not in done["deleted_artifacts"]
    assert [p.name for p in (cache_copy / "artifacts").iterdir()] == [akey]


@pytest.mark.slow
def test_an_unreadable_index_is_rebuilt_once_and_ls_and_stats_work(cache_copy, listing):
    db = cache_copy / "index" / "cache.db"
    db.write_bytes(b"this is no SQLite file " * 200)
    first = gc("ls", "--cache-dir", cache_copy, "--json")
    second = gc("stats", "--cache-dir", cache_copy, "--json")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "rebuilt it from 2 entry manifest(s)" in first.stderr and "cannot read" not in first.stderr
    assert second.stderr == "", second.stderr                         # repaired: nothing to say any more
    rows = json.loads(first.stdout)["entries"]
    assert sorted(r["ekey"] for r in rows) == sorted(e["ekey"] for e in listing)
    assert all(r["last_used"] and r["loads"] == 0 for r in rows)       # counts restart after a repair
    assert json.loads(second.stdout)["entries"] == 2


@pytest.mark.slow
def test_stats_reports_padding_waste(gears_cache, tmp_path):
    """run_gears.py serves sizes 1..8 of x and y [n, 4] on gears 2, 4, 8: 288 real elements run as 352 (its warm-up
    runs are not calls). Its warm run in test_gears, if any, adds the same calls: the share is the same."""
    cache = tmp_path / "cache"
    shutil.copytree(gears_cache[0], cache, ignore=shutil.ignore_patterns("locks", "leases"))
    stats = gc_json("stats", "--cache-dir", cache)
    assert stats["padding_waste"] == pytest.approx(1 - 288 / 352)
    assert "padding waste    18.2%" in gc("stats", "--cache-dir", cache).stdout

