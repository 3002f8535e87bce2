"""What a call does when the cache folder fails under it: ``config.on_cache_error``.

Faults outside gearcache — a read-only folder, a full disk (``ENOSPC``), the folder vanishing mid-run, a lock held
too long, a folder that is not trusted — must not turn a call into an error by default:

* ``"memory"`` (default): compile as usual but into a private temporary folder, load from there, persist nothing;
* ``"eager"``: run the method uncompiled (:class:`EagerEntry`; warned, counted in ``counters.eager_calls``);
* ``"raise"``: raise the error.

Either way a warning naming the error and the fix is logged once per process (per folder and kind of fault).
Loading from a read-only folder works without a fallback: torch's loader writes into the folder it loads from, so
:func:`load_artifact` loads a verified private copy instead. See docs/RELIABILITY.md.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import pathlib
import shutil
import tempfile
import threading
import warnings
from typing import Any, Callable

from . import runplan, signature
from .counters import counters
from .errors import CacheCorruptionError, LockTimeoutError, UntrustedArtifactError, UntrustedCacheError
from .store import Store, storage_fix
from .store.trust import first_untrusted_warning

log = logging.getLogger("gearcache.faults")

POLICIES = ("memory", "eager", "raise")
# errno values that mean "the store's filesystem failed", also when raised inside ``build`` (which writes there)
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO,
                  getattr(errno, "ESTALE", -1)}

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _kind(exc: BaseException) -> str:
    if isinstance(exc, LockTimeoutError):
        return "lock timeout"
    if isinstance(exc, UntrustedCacheError):
        return "untrusted folder"
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, type(exc).__name__) if code is not None else type(exc).__name__


def warn_once(store: Store, exc: BaseException, consequence: str) -> None:
    """Log one warning per process, folder and kind of fault, naming the error and the fix."""
    key = (str(store.root), _kind(exc))
    untrusted = isinstance(exc, UntrustedCacheError) and not isinstance(exc, UntrustedArtifactError)
    if untrusted and not first_untrusted_warning(store.root):
        return                          # warned already (the store's trust check, gearcache/store/trust.py)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("gearcache cannot use the cache folder %s (%s: %s); %s. Fix: %s (warned once per process)",
                store.root, type(exc).__name__, exc, consequence, storage_fix(exc, store.root))


class _Build:
    """``build`` run into a private folder, then copied into the store's work folder (``build`` writes
    ``<artifact>/inductor`` and may write siblings such as ``<artifact>/runplan``): an error of the compile is
    told from one of the store, and when the store fails after the compile, the compiled folder is still there
    (policy "memory" loads it instead of compiling twice)."""

    def __init__(self, build: Callable[[pathlib.Path], None], akey: str):
        self.build, self.akey = build, akey
        self.raised = False
        self.private: pathlib.Path | None = None

    def __call__(self, folder: pathlib.Path) -> None:
        private = private_folder(self.akey)
        try:
            self.build(private / "inductor")
        except BaseException:
            self.raised = True
            shutil.rmtree(private, ignore_errors=True)
            raise
        self.private = private
        for part in sorted(private.iterdir()):          # inductor/ and runplan/
            shutil.copytree(part, folder.parent / part.name, symlinks=True)


def publish_or_fallback(store: Store, akey: str, build: Callable[[pathlib.Path], None],
                        policy: str) -> tuple[pathlib.Path | None, bool]:
    """``store.publish_artifact(akey, build)``, with ``config.on_cache_error`` applied when the store fails.

    Returns ``(folder, built)``: load ``folder / "inductor"``. The folder is the store's artifact, or — policy
    ``"memory"`` after a store fault, or a read-only store's artifact copied out to be loadable — a private temporary
    folder (:func:`persisted` tells which: persist the entry manifest only for the store's). ``(None, False)``:
    policy ``"eager"`` after a fault; run the method uncompiled (:class:`EagerEntry`). Errors of the compile itself
    (anything but a storage ``OSError``) are raised whatever the policy; a compile never runs twice."""
    if policy not in POLICIES:
        raise ValueError(f"on_cache_error={policy!r}: expected one of {POLICIES}")
    wrapped = _Build(build, akey)
    try:
        folder, built = store.publish_artifact(akey, wrapped)
    except OSError as exc:              # LockTimeoutError and UntrustedCacheError are OSErrors too
        if policy == "raise":
            raise
        if wrapped.raised and getattr(exc, "errno", None) not in STORAGE_ERRNOS:
            raise                       # the compiler failed, not the store
        if policy == "eager":
            warn_once(store, exc, "the method runs uncompiled (on_cache_error='eager'; counted in "
                                  "gearcache.counters.eager_calls)")
            return None, False
        warn_once(store, exc, "compiled entries are kept in memory only (on_cache_error='memory')")
        if wrapped.private is not None:
            return wrapped.private, True                # compiled before the store failed: not compiled again
        folder = private_folder(akey)
        build(folder / "inductor")
        return folder, True
    if wrapped.private is not None:
        shutil.rmtree(wrapped.private, ignore_errors=True)     # published: the store's copy is the one loaded
    if not built and not _writable(folder):
        try:
            return private_copy(store, akey), False
        except (CacheCorruptionError, OSError) as exc:     # changed or removed since it was checked
            if policy == "raise":
                raise
            if policy == "eager":
                warn_once(store, exc, "the method runs uncompiled (on_cache_error='eager')")
                return None, False
            warn_once(store, exc, "compiled entries are kept in memory only (on_cache_error='memory')")
            folder = private_folder(akey)
            build(folder / "inductor")
            return folder, True
    return folder, built


def persisted(store: Store, akey: str, folder: pathlib.Path | None) -> bool:
    """Whether ``folder`` (from :func:`publish_or_fallback`) is the store's artifact, so that an entry manifest
    pointing at it may be written."""
    return folder is not None and pathlib.Path(folder) == store.artifact_dir(akey)


def load_artifact(store: Store, akey: str, device_index: int | None = None) -> Callable[..., Any] | None:
    """Load the store's artifact ``akey`` for CUDA device ``device_index`` (runplan.load_artifact: raises
    ``runplan.WrongDevice`` when it runs only on another GPU); None when it vanished or changed since it was verified.
    The caller has verified at least what its run plan reads (``runplan.files_read``); the whole artifact is verified
    here before torch's loader would read it.

    A folder this process cannot write (a read-only mount, another user's files) is loaded through a verified
    private copy, because torch's loader writes into the folder it loads from."""
    folder = store.artifact_dir(akey)
    try:
        if not _writable(folder):
            folder = private_copy(store, akey)      # verified whole
            return runplan.load_artifact(folder, device_index)
        return runplan.load_artifact(folder, device_index, lambda: store.verify_artifact(akey))
    except Exception as exc:
        if store.artifact_dir(akey).is_dir() and not isinstance(exc, CacheCorruptionError) or \
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
    shutil.copytree(store.artifact_dir(akey), folder, dirs_exist_ok=True, symlinks=True,
                    ignore=shutil.ignore_patterns("locks"))
    store.verify_artifact(akey, folder)
    log.info("artifact %s is in a folder this process cannot write; loading a verified copy from %s", akey, folder)
    return folder


def _writable(folder: pathlib.Path) -> bool:
    """Whether torch can write where it loads from: the artifact's folders (the root user is refused too on a
    read-only mount, where ``access`` answers EROFS)."""
    try:
        dirs = [folder / "inductor", *[p for p in (folder / "inductor").rglob("*") if p.is_dir()]]
    except OSError:
        return True                     # let the load say what is wrong
    return all(os.access(d, os.W_OK) for d in dirs)


class EagerEntry:
    """Stands in for a compiled ``Entry`` under ``on_cache_error="eager"``: runs the method uncompiled.

    Same interface as ``Entry`` (``run``, ``gather``, ``compiled``, ``build``, ``manifest``, ``hits``,
    ``__call__``) so gears and the plain call path use it unchanged. Every call counts in ``counters.eager_calls``."""

    __slots__ = ("method", "structure", "manifest", "hits", "real_elements", "padded_elements", "out_structure",
                 "__weakref__")

    def __init__(self, method: Callable, args: tuple, kwargs: dict, manifest: dict[str, Any]):
        self.method = method
        self.structure = signature.call_key(args, kwargs)[1][0]
        # the compiled graph's output recipe does not apply: here the "graph outputs" are the method's output leaves
        self.manifest = {k: v for k, v in manifest.items() if k != "outputs"}
        self.manifest["eager"] = True
        self.hits = self.real_elements = self.padded_elements = 0
        self.out_structure = None
        warnings.warn(f"gearcache: {manifest.get('method', 'a cached method')} runs uncompiled for this input "
                      f"signature: the cache folder failed (see the log) and config.on_cache_error='eager'",
                      stacklevel=4)

    def gather(self, leaves: tuple) -> list:
        return list(leaves)

    def compiled(self, *flat: Any) -> list:
        counters.eager_calls += 1
        args, kwargs = signature.unflatten(self.structure, flat)
        outs: list = []
        self.out_structure = signature._flatten(self.method(*args, **kwargs), outs)
        if "outputs" not in self.manifest:
            self.manifest["outputs"] = {"leaves": [["out", i] for i in range(len(outs))]}
        return outs

    def build(self, outs: list, leaves: tuple) -> Any:
        return signature.rebuild(self.out_structure, iter(outs))

    def run(self, leaves: tuple) -> list:
        return self.compiled(*self.gather(leaves))

    def __call__(self, leaves: tuple) -> Any:
        return self.build(self.run(leaves), leaves)
