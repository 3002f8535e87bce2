"""``torch.distributed`` internals gearcache reads: the process groups by c10d registry name (gearcache/ranks/,
gearcache/runplan/collectives.py, gearcache/graphs/cuda_graphs.py, gearcache/keys/guards.py), the default group's
key-value store (gearcache/ranks/phases.py), and intercepting collective operators (gearcache/runplan/collectives.py).
Importing ``torch.distributed`` imports neither Dynamo nor Inductor.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch._C._distributed_c10d import Store as Store     # re-exported for ranks/phases.py


def process_groups() -> dict[str, dict[str, Any]]:
    """``{group name: {"ranks": [global ranks, sorted], "backend": str}}`` for every process group this process is a
    member of; ``{}`` when ``torch.distributed`` is not initialised. A name is c10d's registry name: the string
    Dynamo records in a graph's functional collectives (``torch.ops._c10d_functional.all_reduce(x, "sum", "0")``),
    which resolves to the live group at run time. Reads ``distributed_c10d._world.pg_names`` and ``pg_group_ranks``
    (2.11 and 2.13). Importing ``torch.distributed`` imports neither Dynamo nor Inductor."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from torch.distributed import distributed_c10d as c10d

    groups = {}
    for pg, name in list(c10d._world.pg_names.items()):
        ranks = c10d._world.pg_group_ranks.get(pg)
        if ranks is not None:
            groups[str(name)] = {"ranks": sorted(int(r) for r in ranks), "backend": str(c10d.get_backend(pg))}
    return groups


def default_group_place() -> tuple[int, int] | None:
    """``(world size, global rank)`` of the default process group, or None while ``torch.distributed`` is not
    initialised (public API; cheap enough to ask at every miss)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_world_size(), dist.get_rank()


def default_group_slot() -> tuple[dict[str, Any], str] | None:
    """The dict and key that hold the default process group (c10d's ``_world.__dict__["_default_pg"]``, set by
    ``init_process_group`` and cleared by ``destroy_process_group``; 2.11 and 2.13), for a guard watch to notice the
    group being created or replaced; None where torch.distributed is not available."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed import distributed_c10d as c10d

    state = vars(c10d._world)
    return (state, "_default_pg") if "_default_pg" in state else None


def default_store() -> Store | None:
    """The key-value store of the default process group (c10d's ``_get_default_store()``: a ``PrefixStore`` over the
    job's TCPStore), or None without an initialised ``torch.distributed``. gearcache's fences
    (gearcache/ranks/phases.py) use
    it: ``set``, ``get``, ``check``, ``wait(keys, timedelta)`` (2.11 and 2.13)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def process_group_identity(obj: Any) -> list[object] | None:
    """``["process_group", name, ranks]`` for a ``ProcessGroup`` this process belongs to (its c10d registry name and
    global ranks: what :func:`process_groups` keys, and what a graph's collectives name), else None. Dynamo guards a
    group a method reads (``dist.group.WORLD``) by identity; that name and those ranks identify it in any process."""
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(obj, dist.ProcessGroup)):
        return None
    from torch.distributed import distributed_c10d as c10d

    name, ranks = c10d._world.pg_names.get(obj), c10d._world.pg_group_ranks.get(obj)
    if name is None or ranks is None:
        return None
    return ["process_group", str(name), sorted(int(r) for r in ranks)]


def intercepting_ops(namespaces: frozenset[str],
                     handler: Callable[[str, str, tuple[Any, ...], dict[str, Any]], object]
                     ) -> contextlib.AbstractContextManager[object]:
    """A context in which every call of an operator of one of ``namespaces`` (e.g. ``"_c10d_functional"``) from this
    thread returns ``handler(namespace, op name without overload, args, kwargs)`` instead of running the operator;
    every other operator runs unchanged. A ``TorchDispatchMode`` (``torch.utils._python_dispatch``, 2.11 and 2.13):
    it sees the operators Inductor's wrapper calls through ``torch.ops``, not its Triton or C++ kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Intercept(TorchDispatchMode):    # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ untyped
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless a subclass opts out, and
            # that wrapper imports torch._dynamo (and Inductor) on its first call: seconds in a warm process, which
            # runs stand-ins (CudaGraphs' warm-up runs under a process group) and never runs under Dynamo.
            return False

        def __torch_dispatch__(self, func: OpOverload, types: Sequence[type],
                               args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> object:
            kwargs = kwargs or {}
            ns, _, op = func._schema.name.partition("::")
            if ns in namespaces:
                return handler(ns, op, args, kwargs)
            return func(*args, **kwargs)

    return _Intercept()     # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ untyped

