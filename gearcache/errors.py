"""Exceptions raised by gearcache.

Every exception carries the context a user needs to fix the problem (the argument, the value, the fix) in its
message, and pickles across processes: each one stores its constructor arguments in ``args`` so that
``pickle.loads(pickle.dumps(e))`` rebuilds an equal exception (see filelock's exceptions for the pattern).
"""
from __future__ import annotations

import errno
from urllib.parse import urlsplit, urlunsplit


class GearcacheError(Exception):
    """Base class of every error gearcache raises on purpose."""


class ConfigError(GearcacheError, ValueError):
    """A bad argument or configuration value: names the argument, the value and the fix."""


class GraphBreakError(GearcacheError):
    """The method cannot be captured as one graph.

    ``breaks`` is a list of ``(reason, user_source_line)`` pairs, one per graph break Dynamo reported.
    """

    def __init__(self, method: str, breaks: list[tuple[str, str]]):
        super().__init__(method, breaks)
        self.method = method
        self.breaks = breaks

    def __str__(self) -> str:
        lines = [f"cache_compile could not capture {self.method} as one graph; {len(self.breaks)} graph break(s):"]
        for i, (reason, where) in enumerate(self.breaks, 1):
            lines.append(f"  {i}. {where}\n     reason: {reason}")
        lines.append(
            "How to fix the common ones:\n"
            "  - a Python `if` on a tensor value: compute both branches and select with torch.where(cond, a, b);\n"
            "  - .item(), .tolist(), print() or logging in the method: return the tensor and use it outside;\n"
            "  - a loop whose trip count depends on tensor data: loop a fixed number of times and mask the extra "
            "steps;\n"
            "  - a call into a library Dynamo cannot trace: move it outside the cached method."
        )
        return "\n".join(lines)


class SignatureMismatchError(GearcacheError):
    """A call's inputs match no compiled entry and the config forbids compiling a new one."""

    def __init__(self, method: str, signature: str, known: list[str], fix: str):
        super().__init__(method, signature, known, fix)
        self.method, self.signature, self.known, self.fix = method, signature, known, fix

    def __str__(self) -> str:
        known = "\n".join(f"    {k}" for k in self.known[:8]) or "    (none)"
        return (f"{self.method}: no compiled entry matches the call's inputs\n  call:  {self.signature}\n"
                f"  known entries:\n{known}\n  fix: {self.fix}")


class GradModeError(GearcacheError):
    """A cached method was called with autograd recording: gearcache entries are inference only."""


class DispatchModeError(GearcacheError, RuntimeError):
    """A cached method was called under a ``TorchDispatchMode`` (``FlopCounterMode``, a mode that changes results):
    eager runs every op through the mode, a compiled entry runs its kernels without it, so the call is refused (as
    torch.compile runs such a call eagerly, its answer would be eager's); or under a ``TorchFunctionMode`` other than
    ``torch.device``'s, which Dynamo traces into the graph and an entry does not follow (its state, another mode of
    the same depth)."""


class PaddingUnsafeError(GearcacheError):
    """Padding a call up to its gear could change the method's results or state: the padding analysis found a write
    that would spread padding into state, or an op that mixes padded rows into real ones and, verified against eager,
    does (gearcache/gears/padding.py, gearcache/gears/padding_check.py). The message names the op, its source line and
    the fix."""


class UnsupportedInputError(GearcacheError, TypeError):
    """An argument of a kind gearcache cannot key or feed to a compiled graph."""


class CacheCorruptionError(GearcacheError):
    """An artifact failed its digest or signature check; it is quarantined and never executed."""

    def __init__(self, path: str, reason: str):
        super().__init__(path, reason)
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return f"cache artifact {self.path} is not usable: {self.reason}"


class UntrustedCacheError(GearcacheError, PermissionError):
    """The cache folder or a file in it can be written by another user, so loading from it could run their code."""

    def __init__(self, path: str, mode: int, why: str = ""):
        super().__init__(path, mode, why)
        self.path, self.mode, self.why = path, mode, why

    def __str__(self) -> str:
        why = self.why or f"mode {oct(self.mode & 0o777)} lets other users write it"
        return (f"refusing to load from {self.path}: {why}, and loading an artifact executes its code. "
                f"Fix: `chmod go-w {self.path}` and make sure you own it, or use a private cache_dir; for a folder "
                f"shared by a group on purpose, set a signing key (config.signing_key or $GEARCACHE_SIGNING_KEY) "
                f"and config.trust_shared_folder=True, so that only signed artifacts are ever loaded.")


class UntrustedArtifactError(UntrustedCacheError, CacheCorruptionError):
    """One artifact folder (or a file in it) is writable by others or owned by another user, inside a store that is
    itself trusted: it is treated like a corrupt artifact (never executed, quarantined, rebuilt)."""

    def __init__(self, path: str, mode: int, why: str = ""):
        PermissionError.__init__(self, path, mode, why)     # CacheCorruptionError's __init__ takes other arguments
        self.path, self.mode, self.why = path, mode, why
        self.reason = why or f"mode {oct(mode & 0o777)} lets other users write it"


class LockTimeoutError(GearcacheError, TimeoutError):
    """Another process held an artifact's lock longer than ``config.lock_timeout_s``."""

    def __init__(self, lock_path: str, timeout: float, holder: str = "unknown holder"):
        super().__init__(lock_path, timeout, holder)
        self.lock_path, self.timeout, self.holder = lock_path, timeout, holder

    def __str__(self) -> str:
        return (f"waited {self.timeout:g} s for {self.lock_path} (held by {self.holder}): another process is still "
                f"compiling this artifact "
                f"(or a lock_mode='soft' holder on another host died). Fix: raise config.lock_timeout_s, or delete "
                f"the lock file if no gearcache process is running (a soft lock whose holder died on this host, or "
                f"older than lock_timeout_s, is removed by the next process that waits on it).")


class ProcessGroupMismatchError(GearcacheError):
    """A run plan names a process group that this process lacks, or has with other ranks or another backend: its
    collectives would run on another group (gearcache/runplan/collectives.py)."""


class GearLoadError(GearcacheError):
    """A gear's stored entry could not be looked up or loaded during a warm-up (``warmup.driver.find_all``: the
    gears' look-ups run side by side). ``method``, ``gear`` (its sizes) and the original error as ``__cause__``."""

    def __init__(self, method: str, gear: list[int], error: BaseException):
        super().__init__(method, gear, error)
        self.method, self.gear, self.error = method, gear, error

    def __str__(self) -> str:
        return (f"{self.method}: warm-up of gear {self.gear}: looking up or loading its stored entry failed: "
                f"{type(self.error).__name__}: {self.error}")


# ------------------------------------------------------------------- gears, guards, workers, native checks (#29)
class PastLargestGearError(GearcacheError, ValueError):
    """A call is larger than the largest gear and ``past_largest_gear == "error"``; the message names the argument,
    the dim, the call's size and the gears (``gears.GearPlan.past_largest_message``)."""


class UnguardableError(GearcacheError, TypeError):
    """A captured method reads a value whose guard gearcache can neither re-check in another process nor watch in this
    one (an iterator's position, a weak reference, a tensor subclass's metadata, ...): no entry can be proven valid
    for a later call, so none is served. Names the method, Dynamo's guard and the fix."""

    def __init__(self, method: str, kind: str, source: str, fix: str):
        super().__init__(method, kind, source, fix)
        self.method, self.kind, self.source, self.fix = method, kind, source, fix

    def __str__(self) -> str:
        return (f"{self.method}: the captured graph depends on {self.source or 'a value'} (Dynamo's {self.kind} "
                f"guard), which gearcache cannot check for a later call, so it serves no entry of it. Fix: "
                f"{self.fix}")


class Unpersistable(GearcacheError):
    """A guarded value has no fingerprint that means the same in another process (keys/guard_fingerprints.py): the guard
    is kept for this process only. ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class WorkerError(GearcacheError, RuntimeError):
    """A compile worker (gearcache/compiling/workers.py) could not compile a job, or died; the caller compiles
    in-process.
    ``pid`` is the worker's process id; ``detail`` says what happened (the worker's traceback when it failed)."""

    def __init__(self, detail: str, pid: int | None = None):
        super().__init__(detail, pid)
        self.detail, self.pid = detail, pid

    def __str__(self) -> str:
        return self.detail


class NativeBuildError(GearcacheError, RuntimeError):
    """The native checks (gearcache/native/) could not be built: ``reason`` is the last line of the compiler's
    output (or why there was no compiler), ``log_path`` the file holding all of it."""

    def __init__(self, reason: str, log_path: str):
        super().__init__(reason, log_path)
        self.reason, self.log_path = reason, log_path

    def __str__(self) -> str:
        return (f"building gearcache's native checks failed: {self.reason} (full output: {self.log_path}). "
                f"gearcache works without them, with Dynamo's checks.")
class CliError(GearcacheError):
    """A ``gearcache`` command cannot do what it was asked: the message for stderr and the exit status, ``code``
    (2: a usage error, a missing cache folder or an unknown entry; 1: a check or an operation failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message, code)
        self.message, self.code = message, code

    def __str__(self) -> str:
        return self.message


# ------------------------------------------------------------------------ the remote store (gearcache/store/remote.py)
def shown_url(url: str) -> str:
    """``url`` as it may be shown or written anywhere (logs, errors, the index, the CLI): a password in it
    (``redis://user:PASSWORD@host``, Redis's own auth) replaced by ``***``; only the connection reads the real one."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
    except ValueError:                  # not a URL this can read: shown without what follows an "@"
        return "***@" + url.rpartition("@")[2] if "@" in url else url


class RemoteError(OSError):
    """The remote store failed (down, timed out, full, refused a command). Never fails a call: the local folder
    carries on alone (see docs/RELIABILITY.md, "Remote store"). ``url`` is the store's, its password hidden."""

    def __init__(self, url: str, what: str):
        url = shown_url(url)
        super().__init__(errno.EIO, what, url)
        self.url, self.what = url, what

    def __str__(self) -> str:
        return f"remote store {self.url}: {self.what}"


class ReplyError(OSError):
    """The Redis server answered an error (``-ERR ...``), or its reply broke the protocol (gearcache/store/resp.py)."""


# ---------------------------------------------------------------------------------- run plans (gearcache/runplan/)
class RunPlanUnavailable(RuntimeError):
    """This process cannot run an artifact's run plan (its wrapper needs something gearcache's loader does not
    provide: an operator not registered, an import the stand-ins do not serve...). ``runplan.load_artifact`` catches
    it, logs it and loads the artifact through torch's loader instead: it never reaches the user."""


class NoPlan(Exception):
    """The artifact cannot get a run plan: raised while a plan is written (``runplan.writer``), caught there, and
    recorded as the plan's ``reason`` (the artifact then loads through torch's loader)."""


class SideEffects(Exception):
    """Raised by the capture's recording backend (gearcache/compiling/capture.py) before Dynamo replays the Python
    writes of a trace: the sources of the Python state it writes outside its graph; caught there and raised as a
    ``GearcacheError`` naming them."""

    def __init__(self, sources: list[str]):
        super().__init__(sources)
        self.sources = sources


class DataDependentShape(Exception):
    """Raised by the capture's recording backend (gearcache/compiling/capture.py) for a graph with a size computed
    from tensor values (``x[x > 0]``, ``nonzero``): the op and the user's source line that made it; caught there and
    raised as a ``GraphBreakError`` naming them and the fix."""

    def __init__(self, op: str, where: str):
        super().__init__(op, where)
        self.op, self.where = op, where


class ReadOnlyArtifactFolder(Exception):
    """Torch's loader would write into a store folder this process cannot write. Raised just before it would be used
    (``compiling.artifact_io.load_stored``), caught there: the artifact is loaded from a verified private copy."""


class WrongDevice(RuntimeError):
    """The artifact runs only on the GPU it was compiled on, not on the caller's (compile one for this GPU). Raised by
    ``runplan.load_artifact``; the caller compiles the graph again, keyed with its own GPU's index."""


# ------------------------------------------------------------------------ ranks of a job (gearcache/ranks/phases.py)
class RankWaitError(GearcacheError, TimeoutError):
    """A rank waited at a fence (gearcache/ranks/phases.py) longer than ``config.rank_timeout_s`` for other ranks of its
    process groups. ``rank``: this rank; ``fence``: what it waited at; ``missing``: ``{rank: what that rank last
    reported doing}`` for each rank that never arrived."""

    def __init__(self, rank: int, fence: str, waited_s: float, missing: dict[int, str]):
        super().__init__(rank, fence, waited_s, missing)
        self.rank, self.fence, self.waited_s, self.missing = rank, fence, waited_s, missing

    def __str__(self) -> str:
        lines = [f"rank {self.rank} waited {self.waited_s:.0f} s at {self.fence} for rank(s) {sorted(self.missing)}, "
                 f"which never arrived; what each last reported:"]
        lines += [f"  rank {r}: {what}" for r, what in sorted(self.missing.items())]
        lines.append("Fix: every rank of a process group must warm up the same cached methods, with the same gears, "
                     "in the same order; a rank still compiling needs a longer config.rank_timeout_s.")
        return "\n".join(lines)


class RankDivergenceError(GearcacheError, RuntimeError):
    """The ranks of a process group reached a fence (gearcache/ranks/phases.py) about to run different things: their
    collectives would not pair up (a hang, or a wrong result). ``plans``: ``{rank: what that rank was about to
    run}``."""

    def __init__(self, rank: int, fence: str, plans: dict[int, str]):
        super().__init__(rank, fence, plans)
        self.rank, self.fence, self.plans = rank, fence, plans

    def __str__(self) -> str:
        lines = [f"rank {self.rank} at {self.fence}: the ranks of its process group are about to run different "
                 f"things, so their collectives would not pair up:"]
        lines += [f"  rank {r}: {what}" for r, what in sorted(self.plans.items())]
        lines.append("Fix: give every rank of the group the same gears and warm up the same methods in the same "
                     "order (the ranks' configs or the example inputs of warmup() differ).")
        return "\n".join(lines)
