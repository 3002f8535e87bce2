"""What a method's CUDA graphs (gearcache/graphs/cuda_graphs.py) call back into, and nothing more: the cached method's
call path without graphs (:class:`UncapturedPath`, a ``cached_function.CachedFunction``) and its entries' stages
(:class:`EntryStages`, a ``compiling.entry_life.EntryLife``). Typed here as Protocols, so graphs/ names what it needs
of the call path instead of holding it as ``Any``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Protocol

if TYPE_CHECKING:
    from ..compiling.background import Compiling
    from ..compiling.entry_life import Loaded
    from ..config import CompilerConfig
    from ..compiling.gear_plan_life import GearPlanLife
    from ..gears.plan import GearPlan


class UncapturedPath(Protocol):
    """The cached method, as its graphs use it: its ``name`` (messages, logs), its ``config`` (``graph_outputs``), its
    call path without graphs (CPU inputs; a gear whose entry still compiles in the background), and its gear plan's
    stages (``gear_life``: the call past the largest gear, the check of a gear's first use)."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> CompilerConfig: ...

    def call_uncaptured(self, gear_plan: GearPlan | None, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                        served: bool = False) -> Any: ...

    @property
    def gear_life(self) -> GearPlanLife: ...


class EntryStages(Protocol):
    """The method's entries, as its graphs use them: the entry of a signature, found, loaded or compiled (a gear's
    capture: not counted as a hit). Also handed to ``compiling.background.wait_for`` (a capture that must wait for
    its gear's background compile)."""

    def get_or_miss(self, leaves: tuple[Any, ...], key: tuple[Hashable, ...], count: bool = True) -> Loaded: ...

    def settle_all(self, deadline: float | None = None) -> int: ...

    def try_settle(self, handle: Compiling[Any]) -> bool: ...
