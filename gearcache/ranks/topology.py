"""Where a process sits in a distributed job, and the folder name that keys its cache entries.

Resolution order for ``global_rank`` and ``world_size``, each time they are read: the argument (which must equal the
group's rank once a group exists), else
``torch.distributed`` when it is initialised, else torchrun's ``RANK`` / ``WORLD_SIZE`` environment variables (as at
construction), else 0 and 1. ``tp_rank`` and
``pp_rank`` are as passed (0 when not). :func:`process_groups_factor` describes the process groups for the keys.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from .._torch import distributed as torch_distributed
from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the process sits. ``world_size`` and ``global_rank`` are read when asked, not fixed at construction:
    ``torch.distributed``'s once its default group exists (a model built before ``init_process_group``, as jobs
    started by ``torch.multiprocessing.spawn`` often are, takes its rank from the group by its first call), else the
    environment's as it was at construction (``env_world``, ``env_rank``); a rank passed as an argument
    (``given_rank``) is used, and must equal the group's. A rank's graph may hold its rank as a constant (Dynamo
    folds ``dist.get_rank()``), so two ranks must never share a folder because one of them asked too early, nor
    because a given rank disagrees with the group's (``ConfigError`` once the group exists:
    ``global_rank=int(os.environ.get("RANK", 0))`` under ``torch.multiprocessing.spawn`` gave every rank 0, and
    rank 1 was served rank 0's graph)."""
    tp_rank: int
    pp_rank: int
    given_rank: int | None = None
    env_world: int = 1
    env_rank: int = 0

    @property
    def world_size(self) -> int:
        return self._resolved()[0]

    @property
    def global_rank(self) -> int:
        return self._resolved()[1]

    @property
    def folder(self) -> str:
        """``world{W}_rank{g}_tp{t}_pp{p}``: the per-rank folder of entry manifests (torchair's layout)."""
        world, rank = self._resolved()
        return f"world{world}_rank{rank}_tp{self.tp_rank}_pp{self.pp_rank}"

    def _resolved(self) -> tuple[int, int]:
        """``(world_size, global_rank)`` now (the world grows to hold a given rank)."""
        group = torch_distributed.default_group_place()
        world, rank = group if group is not None else (self.env_world, self.env_rank)
        if self.given_rank is not None:
            if group is not None and self.given_rank != rank:
                raise ConfigError(
                    f"global_rank={self.given_rank}: this process is rank {rank} of {world} in torch.distributed's "
                    f"default group, and a rank's graph may hold its rank (Dynamo folds dist.get_rank()), so its "
                    f"entries must be filed under that rank; pass global_rank=dist.get_rank(), or leave it None "
                    f"(read from the group; RANK is not set under torch.multiprocessing.spawn)")
            rank = self.given_rank
        return max(world, rank + 1), rank


def _check_rank(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r}: expected a non-negative int (or None to detect it)")
    return value


def _from_env(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {var}={raw!r} is not an integer") from None


def resolve_topology(global_rank: int | None, tp_rank: int | None, pp_rank: int | None) -> Topology:
    """The caller's ranks checked, with the environment's ``WORLD_SIZE`` / ``RANK`` as they are now (used until a
    process group exists: :class:`Topology`)."""
    world, rank = _from_env("WORLD_SIZE", 1), _from_env("RANK", 0)
    if world < 1 or rank < 0:
        raise ConfigError(f"environment WORLD_SIZE={world} / RANK={rank}: expected WORLD_SIZE >= 1 and RANK >= 0")
    given = None if global_rank is None else _check_rank("global_rank", global_rank)
    tp = 0 if tp_rank is None else _check_rank("tp_rank", tp_rank)
    pp = 0 if pp_rank is None else _check_rank("pp_rank", pp_rank)
    return Topology(tp_rank=tp, pp_rank=pp, given_rank=given, env_world=world, env_rank=rank)


def process_groups_factor() -> list[list[Any]]:
    """The process groups of this process as a key factor: ``[[name, [global ranks], backend], ...]`` sorted by name
    (``[]`` without ``torch.distributed``). Graphs name groups by registry name (``'0'`` is the default group in
    every job), so without this factor a job of another size or layout would load an artifact whose collectives
    then run on a different group. It is the same on every rank of a group (ranks are global, not this rank's)."""
    return [[name, g["ranks"], g["backend"]] for name, g in sorted(torch_distributed.process_groups().items())]
