"""What a call does when the cache folder fails under it: ``config.on_cache_error``.

Faults outside gearcache — a read-only folder, a full disk (``ENOSPC``), the folder vanishing mid-run, a lock held
too long, a folder that is not trusted — must not turn a call into an error by default:

* ``"memory"`` (default): compile as usual but into a private temporary folder, load from there, persist nothing;
* ``"eager"``: run the method uncompiled (:class:`EagerEntry`; warned, counted in ``counters.eager_calls``);
* ``"raise"``: raise the error.

Either way a warning naming the error and the fix is logged once per process (per folder and kind of fault).
Loading from a read-only folder works without a fallback: torch's loader writes into the folder it loads from, so
a verified private copy is loaded instead (gearcache/compiling/artifact_io.py, which holds the publish and load paths
themselves). See docs/RELIABILITY.md.
"""
from __future__ import annotations

import errno
import logging
import pathlib
import threading
import warnings
from typing import Any, Callable

from . import artifact_io
from ..call import signature
from ..counters import counters
from ..errors import CacheCorruptionError, LockTimeoutError, UntrustedArtifactError, UntrustedCacheError
from ..store import Store, storage_fix
from ..store.trust import first_untrusted_warning

log = logging.getLogger("gearcache.compiling.faults")

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


def publish_or_fallback(store: Store, akey: str, build: Callable[[pathlib.Path], None],
                        policy: str) -> tuple[pathlib.Path | None, bool]:
    """``artifact_io.publish`` (``build`` into a private folder, published into the store), with
    ``config.on_cache_error`` applied when the store fails.

    Returns ``(folder, built)``: load ``folder / "inductor"``. The folder is the store's artifact, or — policy
    ``"memory"`` after a store fault, or a read-only store's artifact copied out to be loadable — a private temporary
    folder (``artifact_io.persisted`` tells which: persist the entry manifest only for the store's). ``(None,
    False)``: policy ``"eager"`` after a fault; run the method uncompiled (:class:`EagerEntry`). Errors of the
    compile itself (anything but a storage ``OSError``) are raised whatever the policy; a compile never runs twice."""
    if policy not in POLICIES:
        raise ValueError(f"on_cache_error={policy!r}: expected one of {POLICIES}")
    private = artifact_io.PrivateBuild(build, akey)
    try:
        folder, built = artifact_io.publish(store, akey, private)
    except OSError as exc:              # LockTimeoutError and UntrustedCacheError are OSErrors too
        if policy == "raise" or private.raised and getattr(exc, "errno", None) not in STORAGE_ERRNOS:
            raise                       # the policy, or the compiler failed, not the store
        return _after_store_fault(store, akey, build, policy, exc, private.folder)
    try:
        return artifact_io.loadable_folder(store, akey, folder, built), built
    except (CacheCorruptionError, OSError) as exc:     # changed or removed since it was checked
        if policy == "raise":
            raise
        return _after_store_fault(store, akey, build, policy, exc, None)


def _after_store_fault(store: Store, akey: str, build: Callable[[pathlib.Path], None], policy: str,
                       exc: BaseException, compiled: pathlib.Path | None) -> tuple[pathlib.Path | None, bool]:
    """What :func:`publish_or_fallback` returns after the store failed with ``exc`` under policy ``"eager"`` or
    ``"memory"`` (warned once); ``compiled``: the private folder compiled before the store failed, if any."""
    if policy == "eager":
        warn_once(store, exc, "the method runs uncompiled (on_cache_error='eager'; counted in "
                              "gearcache.counters.eager_calls)")
        return None, False
    warn_once(store, exc, "compiled entries are kept in memory only (on_cache_error='memory')")
    if compiled is not None:
        return compiled, True                   # compiled before the store failed: not compiled again
    folder = artifact_io.private_folder(akey)
    build(folder / "inductor")
    return folder, True


class EagerEntry:
    """Stands in for a compiled ``Entry`` under ``on_cache_error="eager"``: runs the method uncompiled.

    Same interface as ``Entry`` (``run``, ``gather``, ``compiled``, ``build``, ``manifest``, ``hits``,
    ``__call__``) so gears and the plain call path use it unchanged. Every call counts in ``counters.eager_calls``."""

    __slots__ = ("method", "structure", "manifest", "hits", "real_elements", "padded_elements", "out_structure",
                 "__weakref__")

    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 manifest: dict[str, Any]):
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

    def gather(self, leaves: tuple[Any, ...]) -> list[Any]:
        return list(leaves)

    def compiled(self, *flat: Any) -> list[Any]:
        counters.eager_calls += 1
        args, kwargs = signature.unflatten(self.structure, flat)
        outs: list[Any] = []
        self.out_structure = signature.flatten(self.method(*args, **kwargs), outs)
        if "outputs" not in self.manifest:
            self.manifest["outputs"] = {"leaves": [["out", i] for i in range(len(outs))]}
        return outs

    def build(self, outs: list[Any], leaves: tuple[Any, ...]) -> Any:
        return signature.rebuild(self.out_structure, iter(outs))

    def run(self, leaves: tuple[Any, ...]) -> list[Any]:
        return self.compiled(*self.gather(leaves))

    def __call__(self, leaves: tuple[Any, ...]) -> Any:
        return self.build(self.run(leaves), leaves)
