"""Shared code of the reliability tests (tests/test_reliability*.py): a tiny model, a store prebuilt once per session,
a fake compile that copies a prebuilt artifact, and the functions child processes run (kill rounds, the checker,
stress workers, lease holders).

Children are forked from a ``multiprocessing`` forkserver that imported torch and gearcache once, so a child starts
in milliseconds instead of the ~2 s a fresh interpreter needs; each child is still a process of its own, with
gearcache state, counters and Dynamo caches of its own, killed with SIGKILL for real.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import re
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import filelock
import torch

import gearcache.compiling.entry_life as entry_life_module
from gearcache import CompilerConfig, cache_compile, counters, runplan
from gearcache.compiling import pipeline
from gearcache.store import files as store_module
from gearcache.store import Store
from gearcache.store.artifacts import Artifacts
from gearcache.store.entries import Entries
from gearcache.store.index import Index
from gearcache.store.leases import Leases

# Warm what a capture, a compile and a load import lazily, so forked children do not each pay for it.
import torch._dynamo  # noqa: E402,F401
import torch._inductor.compile_fx  # noqa: E402,F401
import torch._inductor.standalone_compile  # noqa: E402,F401

ROWS = (2, 5, 7)                 # the distinct input shapes: x is float32[rows, 4]
METHOD = "reliability_child.Tiny.fwd"
TOPOLOGY = "world1_rank0_tp0_pp0"


class Tiny(torch.nn.Module):
    def __init__(self, cache_dir, config: CompilerConfig | None = None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.cached = cache_compile(self.fwd, cache_dir=str(cache_dir), config=config)

    def fwd(self, x):
        return torch.relu(self.lin(x)) * 2 - 1


def read_by_load(folder: pathlib.Path, rel: str) -> bool:
    """Whether loading the artifact ``folder`` through its run plan reads its file ``rel`` (what a load verifies
    before anything runs: the manifest, its signature and ``runplan.files_read``)."""
    parts = runplan.files_read(runplan.read_plan(folder))
    return rel in {"MANIFEST.json", "MANIFEST.sig"} or any(
        rel == part or (part.endswith("/") and rel.startswith(part)) for part in parts)


def make(cache_dir, config: CompilerConfig | None = None, seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(cache_dir, config).eval()


def example(rows: int) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))


def check_call(model: Tiny, rows: int) -> bool:
    """Call the cached method on ``rows`` rows; True when the answer equals eager."""
    x = example(rows)
    with torch.inference_mode():
        out = model.cached(x)
        ref = model.fwd(x)
    return bool(out.shape == ref.shape and torch.allclose(out, ref, atol=1e-6))


# ------------------------------------------------------------------------------------------------ prebuilt store
def prebuilt_store(base: pathlib.Path) -> pathlib.Path:
    """A store holding one real (Inductor-compiled) entry per shape in ``ROWS``, built once under ``base``."""
    root = base / "reliability_prebuilt"
    done = root / "DONE"
    with filelock.FileLock(str(base / "reliability_prebuilt.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            model = make(root)
            for rows in ROWS:
                assert check_call(model, rows)
            done.write_text(json.dumps(artifact_keys(root)))
    return root


def artifact_keys(root: pathlib.Path) -> dict[str, str]:
    """``{rows: akey}`` of a store's entries for Tiny."""
    out = {}
    for path in (root / "entries" / TOPOLOGY / METHOD).glob("*.json"):
        data = json.loads(path.read_text())
        out[str(data["signature"]["leaves"][0]["shape"][0])] = data["akey"]
    return out


def copy_store(src: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("DONE", "index", "locks", "leases", "misses"))
    dest.chmod(0o700)
    return dest


def fake_compile(prebuilt: pathlib.Path, before_copy=None, halfway=None, fallback: str | None = None):
    """A ``pipeline.compile_artifact`` that copies the prebuilt artifact of the same key instead of compiling (the key
    comes from the work folder's name: ``tmp/<akey>.<pid>.<tag>`` or a private ``gearcache-<akey[:12]>-*``);
    ``fallback``: the prebuilt artifact to copy for a key it does not have (the same graph under other key factors)."""
    def compile_artifact(gm, example_inputs, folder, *, config_patches):
        folder = pathlib.Path(folder)           # <artifact>/inductor; the run plan goes to <artifact>/runplan
        name = folder.parent.name
        prefix = name.split("-")[1] if name.startswith("gearcache-") else name.split(".")[0]
        found = [p for p in (prebuilt / "artifacts").iterdir() if p.name.startswith(prefix)]
        src = found[0] if found else prebuilt / "artifacts" / fallback
        if before_copy:
            before_copy()
        files = sorted(p for p in src.rglob("*") if p.is_file() and "locks" not in p.parts
                       and p.relative_to(src).parts[0] in ("inductor", "runplan"))
        for i, path in enumerate(files):
            if halfway and i == len(files) // 2:
                halfway()
            dest = folder.parent / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    return compile_artifact


def install_fake_compile(prebuilt: pathlib.Path, **kw) -> None:
    pipeline.compile_artifact = fake_compile(prebuilt, **kw)


# ---------------------------------------------------------------------------------------------------- kill rounds
KILL_STEPS = ["capture", "build", "build-mid", "manifest", "replace-manifest", "sign", "rename", "after-rename",
              "index", "evict", "write-entry", "replace-entry", "lease", "quarantine", "timer"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(step: str, delay: float) -> None:
    """Make this process SIGKILL itself when it reaches ``step`` (after ``delay`` seconds, the process running on)."""
    def fire():
        if delay <= 0:
            _die()
        threading.Timer(delay, _die).start()

    def wrap(owner, name, when=lambda *a, **k: True, after=False):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            if not after and when(*args, **kwargs):
                fire()
            out = original(*args, **kwargs)
            if after and when(*args, **kwargs):
                fire()
            return out
        setattr(owner, name, hooked)

    def named(name):
        return lambda src, dst: pathlib.Path(dst).name == name

    if step == "capture":
        wrap(entry_life_module, "capture")
    elif step == "build":
        wrap(pipeline, "compile_artifact")
    elif step == "manifest":
        wrap(Artifacts, "_write_manifest")
    elif step == "replace-manifest":
        wrap(store_module, "_replace", named("MANIFEST.json"))
    elif step == "sign":
        wrap(store_module, "_replace", named("MANIFEST.sig"))
    elif step in ("rename", "after-rename"):
        wrap(store_module, "_rename", lambda src, dst: pathlib.Path(dst).parent.name == "artifacts",
             after=step == "after-rename")
    elif step == "index":
        wrap(Index, "put", lambda self, key, value: key.startswith("artifact:"))
    elif step == "evict":
        wrap(store_module, "_rename", lambda src, dst: pathlib.Path(src).parent.name == "artifacts"
             and pathlib.Path(dst).parent.name == "tmp")
    elif step == "write-entry":
        wrap(Entries, "write")
    elif step == "replace-entry":
        wrap(store_module, "_replace", lambda src, dst: pathlib.Path(dst).parent.name == METHOD)
    elif step == "lease":
        wrap(Leases, "take")
    elif step == "quarantine":
        wrap(store_module, "_rename", lambda src, dst: pathlib.Path(dst).parent.name == "quarantine")
    elif step == "timer":
        fire()
    elif step != "compile-real":
        raise ValueError(step)


def kill_round(root: str, prebuilt: str, step: str, delay: float, rows: int, config: dict, out: str) -> None:
    """Child: call Tiny on ``rows`` on the store at ``root`` (which must publish it), armed to die at ``step``."""
    root_p, prebuilt_p = pathlib.Path(root), pathlib.Path(prebuilt)
    if step == "compile-real":
        original = pipeline.compile_artifact

        def compile_then_die(*args, **kwargs):
            threading.Timer(delay, _die).start()
            return original(*args, **kwargs)
        pipeline.compile_artifact = compile_then_die
    else:
        install_fake_compile(prebuilt_p, halfway=(lambda: _arm("timer", delay)) if step == "build-mid" else None)
        if step != "build-mid":
            _arm(step, delay)
    model = make(root_p, CompilerConfig(**config))
    ok = check_call(model, rows)
    time.sleep(delay + 0.3)         # a pending timer still fires: a kill after the call is a kill too
    pathlib.Path(out).write_text(json.dumps({"finished": True, "equal": ok}))


_TMP_FILE = re.compile(r"^\..+\.\d+\.[0-9a-f]+\.tmp$")


def check_store(root: str, prebuilt: str, config: dict, out: str, corrupted: str | None = None) -> None:
    """Child: a fresh process on a folder a killed process left. Its Store cleans up; then every artifact must be
    valid (but ``corrupted``, which the test damaged on purpose), nothing half published may remain, and every shape
    must give the eager answer."""
    report: dict[str, Any] = {"problems": []}
    try:
        root_p = pathlib.Path(root)
        install_fake_compile(pathlib.Path(prebuilt))
        store = Store.from_config(root_p, CompilerConfig(**config))
        before = sorted(p.name for p in (root_p / "tmp").iterdir()) if (root_p / "tmp").is_dir() else []
        store.first_use.ensure()                                    # runs Store.maintenance.cleanup() once
        report["cleaned_tmp"] = before
        problems = report["problems"]
        left = sorted(p.name for p in (root_p / "tmp").iterdir())
        if left:
            problems.append(f"tmp/ not cleaned: {left}")
        for sub in ("entries", "misses"):
            for dirpath, _, names in os.walk(root_p / sub):
                problems += [f"partial file {dirpath}/{n}" for n in names if _TMP_FILE.match(n)]
        for folder in (root_p / "leases").glob("*"):
            problems += [f"stale lease {p}" for p in folder.iterdir() if not store.leases.is_live(p)]
        for folder in (root_p / "artifacts").iterdir():
            try:
                store.artifacts.verify(folder.name)
            except Exception as exc:
                if folder.name != corrupted:
                    problems.append(f"half-published or corrupt artifact {folder.name}: {exc}")
        for path in (root_p / "entries").glob("*/*/*.json"):
            data = store.entries.read(path.parent.parent.name, path.parent.name, path.stem)
            if data is None:
                problems.append(f"unreadable entry manifest {path}")
        model = make(root_p, CompilerConfig(**config))
        report["equal"] = {rows: check_call(model, rows) for rows in ROWS}
        for folder in (root_p / "artifacts").iterdir():
            try:
                store.artifacts.verify(folder.name)
            except Exception as exc:
                problems.append(f"after the calls, artifact {folder.name} is still bad: {exc}")
        report["counters"] = {k: v for k, v in vars(counters).items()}
    except Exception:
        report["problems"].append(traceback.format_exc())
    pathlib.Path(out).write_text(json.dumps(report))


# ----------------------------------------------------------------------------------------------------- stress
class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def stress_worker(root: str, prebuilt: str, config: dict, calls: int, generation: int, seed: int, out: str,
                  phase: int = 4) -> None:
    """Child: ``calls`` calls; every ``generation`` calls the model is dropped (its Stores, and so its leases, are
    garbage collected), the worker idles a moment holding nothing, and a new model is made. Every ``phase``
    generations the worker moves on to the next shape, as all workers do at about the same time (so the shape they
    left can be evicted, and is published again when they come back to it, while laggards still use the one before);
    1% of the calls take a random shape."""
    report: dict[str, Any] = {"errors": [], "wrong": 0, "warnings": []}
    handler = _Collect(report["warnings"])
    logging.getLogger("gearcache").addHandler(handler)
    try:
        install_fake_compile(pathlib.Path(prebuilt))
        rng = random.Random(seed)
        model = None
        for i in range(calls):
            if i % generation == 0:
                if model is not None:
                    model.cached = None     # frees the CachedFunction and its Store: the leases go with it
                model = None
                time.sleep(rng.uniform(0.0, 0.05))
                model = make(root, CompilerConfig(**config))
                rows = ROWS[(i // generation // phase) % len(ROWS)]
            try:
                if not check_call(model, rows if rng.random() < 0.99 else rng.choice(ROWS)):
                    report["wrong"] += 1
            except Exception:
                report["errors"].append(traceback.format_exc())
        report["counters"] = {k: v for k, v in vars(counters).items()}
    except Exception:
        report["errors"].append(traceback.format_exc())
    pathlib.Path(out).write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------------ leases
def hold_lease(root: str, akey: str, ready: str) -> None:
    """Child: lease ``akey`` like a process that loaded it, say so, and wait (until killed)."""
    store = Store(root)
    store.leases.take(akey)
    pathlib.Path(ready).write_text(str(os.getpid()))
    time.sleep(600)


def load_and_wait(root: str, rows: int, ready: str) -> None:
    """Child: load Tiny's entry for ``rows`` from the store (a real load, no compile), say so, and wait."""
    model = make(root)
    ok = check_call(model, rows)
    pathlib.Path(ready).write_text(json.dumps({"pid": os.getpid(), "equal": ok,
                                               "compiles": counters.compiles, "loads": counters.loads}))
    time.sleep(600)
