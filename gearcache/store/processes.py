"""Is a process of this host alive? (leases, work folders and soft locks name their pid)."""
from __future__ import annotations

import os


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from /proc (None where there is no /proc or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode(), rest[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def _start_token(pid: int) -> str:
    info = _proc_stat(pid)
    return info[1] if info else ""


def pid_alive(pid: int, start_token: str = "") -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not; nor does a new process that reused the pid, when
    ``start_token`` is known)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                    # it exists, under another user
    except OSError:
        return True
    info = _proc_stat(pid)
    if info is None:
        return True
    state, start = info
    if state in ("Z", "X"):
        return False
    return not start_token or start == start_token


# Leases held by this process: (root, akey) -> number of live Store objects holding it. The lease file is removed
