"""The ranks of a job: a fence between a warm-up's compile phase and its runs, what each rank is doing, and waits
across ranks that end in an error naming the rank and what it waited for (docs/DESIGN.md, "Ranks: phases that
cannot deadlock").

A warm-up on the ranks of a process group has two phases. Its **compile phase** (look-ups, captures, compiles,
publishing under the artifact locks, loads) runs in an order of each rank's own (ranks start on different gears) and
never runs a collective: captures and gear-plan traces never run the graph, and the run plan's exactness check
answers collectives with local stand-ins (runplan/collectives.py). Its **run phase** (CUDA-graph warm-up runs and
records, each gear's first run) runs the collectives, in one order that is the same on every rank (the gears'
order, not the rank's). :func:`fence` separates them: every rank of the groups the method's graphs name arrives,
and their run plans (which gears, in which order) are compared, before any rank runs a collective. A rank still in
its compile phase may wait for an artifact lock, but only on another rank's compile phase (a lock is never held
at a fence or in a run phase), so no cycle of waits can form.

Every wait here is bounded: a fence gives up after ``config.rank_timeout_s`` with :class:`RankWaitError` naming the
ranks that never arrived and what each last reported (:func:`note`: "compiling artifact ...", "waiting for the lock
of artifact ... held by rank 2 pid 123", ...); ranks about to run different things raise :class:`RankDivergenceError`
instead of pairing their collectives wrongly. The job's own key-value store carries the reports and the fences
(``_torch.distributed.default_store``); without ``torch.distributed`` everything here does nothing.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from .._torch import distributed as torch_distributed
from ..counters import counters
from ..errors import RankDivergenceError, RankWaitError

if TYPE_CHECKING:
    from .._torch.distributed import Store

log = logging.getLogger("gearcache.ranks.phases")

REPORT_EVERY_S = 30.0       # a rank waiting at a fence logs who it waits for, and what they report, this often
_HOST = socket.gethostname()


class _Board:
    """This process's view of its job: the store, its global rank, and how many fences it passed per group."""

    def __init__(self, store: Store, rank: int):
        self.store, self.rank = store, rank
        self.fences: dict[str, int] = {}
        self.lock = threading.Lock()


_board: list[_Board] = []


def _current() -> _Board | None:
    """The board of the job this process is in now (a new one after the default group was made again), or None."""
    store = torch_distributed.default_store()
    if store is None:
        return None
    if not _board or _board[0].store is not store:
        import torch.distributed as dist

        _board[:] = [_Board(store, dist.get_rank())]
    return _board[0]


def note(what: str) -> None:
    """Report what this rank is doing now (for the errors and logs of ranks waiting for it). Never raises."""
    board = _current()
    if board is None:
        return
    report = json.dumps({"what": what, "since": time.time(), "pid": os.getpid(), "host": _HOST})
    try:
        board.store.set(f"gearcache/status/{board.rank}", report)
    except Exception as exc:                        # noqa: BLE001 - a report must never fail the work it reports
        log.debug("could not report this rank's status (%s)", exc)


def status(rank: int) -> str:
    """What rank ``rank`` last reported (:func:`note`), with how long ago; "nothing reported" if it never did."""
    board = _current()
    if board is None:
        return "unknown (no process group)"
    key = f"gearcache/status/{rank}"
    try:
        if not board.store.check([key]):
            return "nothing reported (it has not started a gearcache phase)"
        report = json.loads(board.store.get(key))
    except Exception as exc:                        # noqa: BLE001 - only used to describe a wait
        return f"unreadable ({type(exc).__name__}: {exc})"
    ago = time.time() - float(report.get("since", time.time()))
    return f"{report.get('what')} (pid {report.get('pid')} on {report.get('host')}, {ago:.0f} s ago)"


def group_ranks(groups: Iterable[dict[str, Any]]) -> list[int]:
    """The global ranks of the process groups ``groups`` (``{"ranks": [...]}`` each, as a run plan records them)."""
    return sorted({int(r) for g in groups for r in g.get("ranks", [])})


def fence(ranks: list[int], what: str, plan: str, timeout_s: float) -> None:
    """Wait until every rank of ``ranks`` (global ranks) reached this fence with the same ``what`` and ``plan``
    (e.g. ``"decode warm-up runs"`` and the gears in their order); this rank's ``plan`` is compared with theirs.

    Nothing when this process has no process group, ``ranks`` has one rank or does not hold this one. Raises
    :class:`RankWaitError` after ``timeout_s`` (naming the ranks that did not arrive and their reports) and
    :class:`RankDivergenceError` when the ranks arrived with different plans. Fences of one group are numbered in
    the order this process reaches them; the ranks of a group reach them in the same order."""
    board = _current()
    if board is None or len(ranks) <= 1 or board.rank not in ranks:
        return
    group = "-".join(map(str, ranks))
    with board.lock:
        seq = board.fences[group] = board.fences.get(group, 0) + 1
    where = f"{what} (fence {seq} of ranks {group})"
    keys = {r: f"gearcache/fence/{group}/{seq}/{r}" for r in ranks}
    note(f"at {where}, waiting for the other ranks")
    board.store.set(keys[board.rank], json.dumps({"what": what, "plan": plan}))
    _wait_for(board, keys, where, timeout_s)
    arrived = {r: json.loads(board.store.get(k)) for r, k in keys.items()}
    if any((a["what"], a["plan"]) != (what, plan) for a in arrived.values()):
        raise RankDivergenceError(board.rank, where, {r: f"{a['what']}: {a['plan']}" for r, a in arrived.items()})
    counters.rank_fences += 1
    note(f"running {what}")


def _wait_for(board: _Board, keys: dict[int, str], where: str, timeout_s: float) -> None:
    """Wait for every key of ``keys`` (one per rank) in the store, logging who is missing every
    ``REPORT_EVERY_S``; :class:`RankWaitError` after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        step = max(0.001, min(REPORT_EVERY_S, timeout_s - (time.monotonic() - t0)))
        try:
            board.store.wait(list(keys.values()), datetime.timedelta(seconds=step))
            return
        except RuntimeError:                        # the store's timeout (DistStoreError is a RuntimeError)
            pass
        missing = {r: status(r) for r, k in keys.items() if not board.store.check([k])}
        if not missing:
            return
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise RankWaitError(board.rank, where, waited, missing)
        log.warning("rank %d has waited %.0f s at %s for rank(s) %s; they report: %s", board.rank, waited, where,
                    sorted(missing), "; ".join(f"rank {r}: {s}" for r, s in sorted(missing.items())))
