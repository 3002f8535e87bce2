"""``Locks``: per-artifact locks, ``locks/<akey>.lock`` (flock) or ``.softlock`` (lock files, for network
filesystems)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import threading
import time
from typing import Callable, Iterator

import filelock

from ..errors import LockTimeoutError
from .files import HOST
from .layout import Layout
from .processes import pid_alive

log = logging.getLogger("gearcache.store")


POLL_FIRST_S = 0.001
"""The first wait between tries of a held flock; doubled after each try, up to ``POLL_MAX_S``: most locks are held
for a few milliseconds (a lease written, a manifest renamed), where filelock's fixed 50 ms poll would make the ranks
of a job that load the same artifact wait 50 ms each, while a lock held through a compile is still polled rarely."""
POLL_MAX_S = 0.05


def _acquired_with_backoff(try_once: Callable[[], bool], timeout: float, on_wait: Callable[[], None] | None) -> bool:
    """Take a lock within ``timeout`` seconds (a negative one: wait forever) by calling ``try_once()`` (True: taken),
    polling at ``POLL_FIRST_S`` doubled up to ``POLL_MAX_S``; ``on_wait()`` runs once if the first try fails. False
    when the time ran out."""
    deadline = None if timeout < 0 else time.monotonic() + timeout
    pause = POLL_FIRST_S
    while True:
        if try_once():
            return True
        if on_wait is not None:
            on_wait()
            on_wait = None
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 2, POLL_MAX_S)


def _try_filelock(lock: filelock.BaseFileLock) -> Callable[[], bool]:
    def try_once() -> bool:
        try:
            lock.acquire(timeout=0)
            return True
        except filelock.Timeout:
            return False
    return try_once


class SharedFlock:
    """A shared ``flock`` (``LOCK_SH``) of the lock file at ``path``: any number of holders at once, none while a
    process holds it exclusively (filelock's ``FileLock`` takes ``LOCK_EX`` of the same file, which stays in place
    after use). Taken with :meth:`try_once`, given back with :meth:`release`."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.fd: int | None = None

    def try_once(self) -> bool:
        """Take it now unless someone holds it exclusively (then False)."""
        for _ in range(3):              # a lock file replaced meanwhile: the new one
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)                # a file no longer at ``path``: its lock excludes no one
        return False

    def _open(self) -> int:
        flags = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(self.path, flags | os.O_RDWR | os.O_CREAT, 0o666)     # as filelock creates it
        except PermissionError:
            return os.open(self.path, flags | os.O_RDONLY)     # another user's lock file: flock needs no write

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


class Locks:
    """The per-artifact publish lock and lease lock, taken in ``mode`` (``"flock"`` or ``"soft"``); a soft lock older
    than ``timeout_s`` is stale."""

    def __init__(self, layout: Layout, mode: str, timeout_s: float):
        self.layout, self.mode, self.timeout_s = layout, mode, timeout_s

    def path(self, akey: str, kind: str = "", mode: str | None = None) -> pathlib.Path:
        """``locks/<akey>[.lease].lock`` (flock) or ``.softlock`` (soft lock files, which are held while they exist,
        so they never share a name with a flock file that stays behind after use). ``mode``: another lock mode's
        path than this store's ``lock_mode``."""
        return self.layout.lock(akey, kind, "lock" if (mode or self.mode) == "flock" else "softlock")

    @contextlib.contextmanager
    def held_in_every_mode(self, akey: str, timeout: float) -> Iterator[None]:
        """Hold artifact ``akey``'s publish lock of both lock modes (``locks/<akey>.lock`` by flock, then
        ``.softlock``): for a process that does not know the writers' ``lock_mode`` (``gearcache prune``), which
        then excludes the writers of either. ``LockTimeoutError`` when one is held."""
        self.layout.mkdir(self.layout.locks)
        with self.held(self.path(akey, mode="flock"), timeout, mode="flock"):
            with self.held(self.path(akey, mode="soft"), timeout, mode="soft"):
                yield

    @contextlib.contextmanager
    def held(self, path: pathlib.Path, timeout: float, mode: str | None = None,
             on_wait: Callable[[], None] | None = None, shared: bool = False) -> Iterator[None]:
        """Hold the lock at ``path`` (flock, or a soft lock file with stale-lock recovery: this store's
        ``lock_mode``, or ``mode``); ``LockTimeoutError``. ``on_wait()`` runs once if another holds it first.
        ``shared`` (flock only: a soft lock is always exclusive): held beside other shared holders, never beside an
        exclusive one; a shared hold writes no holder note (:meth:`holder` names an exclusive holder to its
        waiters)."""
        flock = (mode or self.mode) == "flock"
        if flock and shared:
            shared_lock = SharedFlock(path)
            if not _acquired_with_backoff(shared_lock.try_once, timeout, on_wait):
                raise LockTimeoutError(str(path), timeout, self.holder(path))
            try:
                yield
            finally:
                shared_lock.release()
            return
        if flock:
            lock: filelock.BaseFileLock = filelock.FileLock(str(path), timeout=timeout)
            if not _acquired_with_backoff(_try_filelock(lock), timeout, on_wait):
                raise LockTimeoutError(str(path), timeout, self.holder(path))
        else:
            lock = filelock.SoftFileLock(str(path), timeout=timeout)
            self._soft_acquire(lock, path, timeout, on_wait)
        self._claim(path)
        try:
            yield
        finally:
            self._unclaim(path)
            lock.release()

    def _soft_acquire(self, lock: filelock.BaseFileLock, path: pathlib.Path, timeout: float,
                      on_wait: Callable[[], None] | None) -> None:
        """Take the soft lock ``lock`` (at ``path``), removing a stale one first; ``LockTimeoutError``."""
        deadline = time.monotonic() + timeout
        while True:
            self.break_if_stale(path)
            try:
                lock.acquire(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                return
            except filelock.Timeout:
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(str(path), timeout, self.holder(path)) from None

    # -------------------------------------------------------------------------------------- who holds a lock
    @staticmethod
    def _holder_path(path: pathlib.Path) -> pathlib.Path:
        return path.with_name(path.name + ".holder")

    def _claim(self, path: pathlib.Path) -> None:
        """Say who holds the lock at ``path`` (``<lock>.holder``: pid, host, torchrun's rank, since), for the log
        and errors of processes that wait for it (:meth:`holder`). Best effort: a lock is held without it."""
        info = {"pid": os.getpid(), "host": HOST, "rank": os.environ.get("RANK"), "since": time.time()}
        tmp = path.with_name(f".{path.name}.holder.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(info))
            os.replace(tmp, self._holder_path(path))
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _unclaim(self, path: pathlib.Path) -> None:
        with contextlib.suppress(OSError):
            self._holder_path(path).unlink()

    def holder(self, path: pathlib.Path) -> str:
        """Who holds the lock at ``path``, as its holder said (``"rank 2, pid 123 on host h, for 41 s"``), or
        ``"unknown holder"``."""
        try:
            info = json.loads(self._holder_path(path).read_text())
            who = f"rank {info['rank']}, " if info.get("rank") is not None else ""
            return f"{who}pid {info['pid']} on host {info['host']}, for {time.time() - float(info['since']):.0f} s"
        except (OSError, ValueError, KeyError, TypeError):
            return "unknown holder"

    def break_if_stale(self, path: pathlib.Path) -> int:
        """Remove a soft lock file whose holder (``pid\\nhost`` in the file) died on this host, or that is older than
        ``lock_timeout_s``. Returns 1 when it removed one."""
        try:
            st = path.lstat()
            with open(path, "rb") as f:
                lines = f.read(1024).decode("utf-8", "replace").splitlines()
        except OSError:
            return 0
        why = None
        if len(lines) >= 2 and lines[0].strip().isdigit() and lines[1].strip() == HOST:
            if not pid_alive(int(lines[0])):
                why = f"its holder pid {lines[0].strip()} on this host is dead"
        if why is None and time.time() - st.st_mtime > self.timeout_s:
            why = f"it is older than lock_timeout_s={self.timeout_s:g} s"
        if why is None:
            return 0
        try:
            now = path.lstat()
            if (now.st_ino, now.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
                return 0                        # taken over meanwhile
            path.unlink()
        except OSError:
            return 0
        log.warning("removed stale soft lock %s: %s", path, why)
        return 1

