"""Publishing a compiled artifact into the store, and loading a stored one: the store's side of both paths.

Publish: ``build`` compiles into a private temporary folder (:class:`PrivateBuild`), which is then copied into the
store's work folder and published (:func:`publish`: ``Store.artifacts.publish``'s artifact lock, digests, atomic
rename). A compile error is thus told from a store error, and a compiled folder outlives a store that fails after the
compile. An artifact that another process published into a folder this process cannot write is loaded from a
verified private copy (:func:`loadable_folder`), because torch's loader writes into the folder it loads from.

Load: :func:`verified_run_plan` reads the artifact's run plan once and verifies what loading through it reads;
:func:`load_stored` hands that plan to ``runplan.load_artifact``, the one loader entry point, which runs the plan or
falls back to torch's loader (the rest of the artifact is verified just before).

What a call does when the store fails under either path (``config.on_cache_error``) is gearcache/compiling/faults.py's.
"""
from __future__ import annotations

import atexit
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable

from .. import runplan
from ..errors import CacheCorruptionError, ReadOnlyArtifactFolder
from ..store import Store

log = logging.getLogger("gearcache.compiling.artifact_io")


class PrivateBuild:
    """``build`` run into a private folder, then copied into the store's work folder (``build`` writes
    ``<artifact>/inductor`` and may write siblings such as ``<artifact>/runplan``). ``raised``: the build itself
    raised (an error of the compile, not of the store); ``folder``: the compiled private folder, kept until
    :meth:`discard` (after a store failure, policy "memory" loads it instead of compiling twice)."""

    def __init__(self, build: Callable[[pathlib.Path], None], akey: str):
        self.build, self.akey = build, akey
        self.raised = False
        self.folder: pathlib.Path | None = None

    def __call__(self, folder: pathlib.Path) -> None:
        private = private_folder(self.akey)
        try:
            self.build(private / "inductor")
        except BaseException:
            self.raised = True
            shutil.rmtree(private, ignore_errors=True)
            raise
        self.folder = private
        for part in sorted(private.iterdir()):          # inductor/ and runplan/
            shutil.copytree(part, folder.parent / part.name, symlinks=True)

    def discard(self) -> None:
        """Remove the private folder (published: the store's copy is the one loaded)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def publish(store: Store, akey: str, build: PrivateBuild) -> tuple[pathlib.Path, bool]:
    """``store.artifacts.publish(akey, build)``: ``(the store's artifact folder, built)``; ``built``: the build ran
    here (its private folder is then removed: the store's copy is the one loaded). Raises what the store or the
    build raises (``OSError`` for a store fault)."""
    folder, built = store.artifacts.publish(akey, build)
    build.discard()
    return folder, built


def loadable_folder(store: Store, akey: str, folder: pathlib.Path, built: bool) -> pathlib.Path:
    """The folder to load the published artifact ``akey`` (at ``folder``) from: itself, or, when another process
    published it into a folder this process cannot write, a verified private copy (:func:`private_copy`: torch's
    loader writes into the folder it loads from). Raises ``CacheCorruptionError`` or ``OSError`` when the artifact
    changed or vanished since it was checked."""
    if built or writable(folder):
        return folder
    return private_copy(store, akey)


def persisted(store: Store, akey: str, folder: pathlib.Path | None) -> bool:
    """Whether ``folder`` (from ``faults.publish_or_fallback``) is the store's artifact, so that an entry manifest
    pointing at it may be written."""
    return folder is not None and pathlib.Path(folder) == store.layout.artifact(akey)


def verified_run_plan(store: Store, akey: str) -> dict[str, Any] | None:
    """The stored artifact's run plan (``runplan.read_plan``), read once here, after verifying what loading through
    it reads (``runplan.files_read``; the whole artifact when it has no usable plan). Hand it to
    :func:`load_stored`. None: ``plan.json`` could not be read (yet the artifact verified): :func:`load_stored` reads
    it itself. Raises ``FileNotFoundError`` (no such artifact) or ``CacheCorruptionError`` as
    ``Store.artifacts.verify_for_load``.

    The plan is parsed before it is verified, only to choose what to verify, which includes ``plan.json`` itself."""
    try:
        run_plan: dict[str, Any] | None = runplan.read_plan(store.layout.artifact(akey))
    except (OSError, ValueError):
        run_plan = None                         # unreadable: the whole artifact is verified (and found corrupt)
    store.artifacts.verify_for_load(akey, runplan.files_read(run_plan))
    return run_plan


def load_stored(store: Store, akey: str, device_index: int | None = None,
                run_plan: dict[str, Any] | None = None) -> Callable[..., Any] | None:
    """Load the store's artifact ``akey`` for CUDA device ``device_index`` through ``runplan.load_artifact`` (raises
    ``WrongDevice`` when it runs only on another GPU); None when it vanished or changed since it was verified.
    ``run_plan``: :func:`verified_run_plan`'s (the caller has verified what it reads); the whole artifact is verified
    here before torch's loader would read it.

    A run plan's load only reads the folder. Torch's loader writes into the folder it loads from: an artifact it
    loads from a folder this process cannot write (a read-only mount, another user's files) is loaded through a
    verified private copy (asked only then: the check walks the artifact's folders)."""
    folder = store.layout.artifact(akey)

    def before_torch_loader() -> None:
        if not writable(folder):
            raise ReadOnlyArtifactFolder
        store.artifacts.verify(akey)

    try:
        try:
            return runplan.load_artifact(folder, device_index, before_torch_loader, plan=run_plan)
        except ReadOnlyArtifactFolder:
            return runplan.load_artifact(private_copy(store, akey), device_index, plan=run_plan)   # verified whole
    except Exception as exc:
        if store.layout.artifact(akey).is_dir() and not isinstance(exc, CacheCorruptionError) or \
                isinstance(exc, runplan.WrongDevice):
            raise                       # a real load failure: not ours to hide
        log.warning("artifact %s vanished or changed while it was loaded (%s: %s); compiling it again", akey,
                    type(exc).__name__, exc)
        return None


def private_folder(akey: str) -> pathlib.Path:
    """A new private temporary folder (removed at exit) for an artifact that is not persisted."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"gearcache-{akey[:12]}-"))
    atexit.register(shutil.rmtree, str(folder), True)
    return folder


def private_copy(store: Store, akey: str) -> pathlib.Path:
    """Copy the store's artifact into a private folder and verify the copy (digests, signature) before use."""
    folder = private_folder(akey)
    shutil.copytree(store.layout.artifact(akey), folder, dirs_exist_ok=True, symlinks=True,
                    ignore=shutil.ignore_patterns("locks"))
    store.artifacts.verify(akey, folder)
    log.info("artifact %s is in a folder this process cannot write; loading a verified copy from %s", akey, folder)
    return folder


def writable(folder: pathlib.Path) -> bool:
    """Whether torch can write where it loads from: the artifact's folders (the root user is refused too on a
    read-only mount, where ``access`` answers EROFS)."""
    try:
        dirs = [folder / "inductor", *[p for p in (folder / "inductor").rglob("*") if p.is_dir()]]
    except OSError:
        return True                     # let the load say what is wrong
    return all(os.access(d, os.W_OK) for d in dirs)
