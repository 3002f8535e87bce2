"""Collectives in run plans: the stand-ins the compile-time check runs them with, and the groups a plan is bound to.

A graph captured from ``dist.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor`` or
``all_to_all_single`` calls torch's functional collectives (``torch.ops._c10d_functional.*``, then ``wait_tensor``)
with a process group's registry name (``'0'`` for the default group). The plan runs Inductor's wrapper unchanged, so
in a warm process these calls are the very operator calls torch's loader would make, on the live group of that name.

The exactness check (writer.py) runs the graph twice in the compiling process alone: through torch's loader and
through the plan. A real collective there would wait for ranks that are not running it (they wait for the artifact),
so both runs happen under :func:`stand_in_collectives`: every ``_c10d_functional`` call is answered here, as on a
group whose every rank holds this rank's data, by a deterministic function of its inputs with the real output's
shape, dtype and layout, and no communication. What the check compares (kernels, launch records, the per-call
wrapper) runs on both sides exactly as it will at run time; docs/DESIGN.md ("Collectives in run plans") says why
this is sound.

The groups the wrapper names are recorded in the plan (``"groups": {name: {"ranks", "backend"}}``) and checked at
load by :func:`check_groups`: a plan never runs a collective on a group of another size, membership or backend (the
process groups are also a key factor, so a warm process only meets such a plan through a copied or tampered cache).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .._torch import distributed as torch_distributed, runplan as torch_runplan
from ..errors import ProcessGroupMismatchError

__all__ = ["NAMESPACE", "STAND_INS", "ProcessGroupMismatchError", "check_groups", "communicates",
           "describe_groups", "graph_groups", "stand_in_collectives"]

NAMESPACE = "_c10d_functional"
OTHER_NAMESPACES = frozenset({"_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor", "symm_mem"})
"""Operators that communicate but have no stand-in: refused by the writer, and never run during the check."""


def communicates(gm: torch.fx.GraphModule) -> bool:
    """Whether the FX graph calls a communicating operator (a functional collective or another of
    ``OTHER_NAMESPACES``): Inductor resolves the process groups it names while compiling it, so only a process that
    has those groups can compile it (parallel warm-up compiles such a graph in the calling process)."""
    spaces = OTHER_NAMESPACES | {NAMESPACE}
    return any(node.op == "call_function" and _namespace(node.target) in spaces for node in gm.graph.nodes)


def graph_groups(gm: torch.fx.GraphModule) -> dict[str, dict[str, Any]] | None:
    """``{name: {"ranks", "backend"}}`` of the process groups the captured graph's functional collectives name (as
    :func:`describe_groups`; ``{}`` for a graph without collectives), or None when it calls a communicating operator
    whose group argument is not known here (``OTHER_NAMESPACES``): then which ranks it talks to is unknown."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or _namespace(node.target) not in OTHER_NAMESPACES | {NAMESPACE}:
            continue
        ref = torch_runplan.operator_ref(node.target)
        op = ref[0].partition("::")[2] if ref is not None else ""
        if _namespace(node.target) != NAMESPACE or op not in STAND_INS:
            return None
        index = STAND_INS[op][1]
        if index < 0:
            continue                                    # wait_tensor names no group
        name = node.args[index] if len(node.args) > index else node.kwargs.get("group_name")
        if not isinstance(name, str):
            return None
        names.add(name)
    try:
        return describe_groups(names)
    except ProcessGroupMismatchError:
        return None


def _namespace(target: Any) -> str | None:
    """The operator namespace of an FX call target: ``OpOverload`` (after AOT) or ``OpOverloadPacket`` (what Dynamo
    records for ``dist.all_reduce``); a Python function of ``torch.distributed`` counts as ``c10d``."""
    ref = torch_runplan.operator_ref(target)
    if ref is not None:
        return ref[0].partition("::")[0]
    module = getattr(target, "__module__", None) or ""
    return "c10d" if module.startswith("torch.distributed") else None


def _gather(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.cat([x] * int(group_size)) if x.dim() else x.repeat(int(group_size))


def _scatter(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.narrow(0, 0, x.size(0) // int(group_size)).clone()


def _all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]) -> torch.Tensor:
    rows = int(sum(output_split_sizes)) if output_split_sizes else x.size(0)
    out = x.new_zeros((rows, *x.shape[1:]))
    n = min(rows, x.size(0))
    out[:n].copy_(x[:n])
    return out


def _out(result: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(result)


# op name -> (stand-in(args, kwargs) -> result, index of the group_name argument). Every rank holds this rank's data:
# a reduction returns its input, a gather repeats it, a scatter keeps the first share.
STAND_INS: dict[str, tuple[Any, int]] = {
    "all_reduce": (lambda a, k: a[0].clone(), 2),
    "all_reduce_": (lambda a, k: a[0], 2),
    "all_reduce_coalesced": (lambda a, k: [x.clone() for x in a[0]], 2),
    "all_reduce_coalesced_": (lambda a, k: a[0], 2),
    "all_gather_into_tensor": (lambda a, k: _gather(a[0], a[1]), 2),
    "all_gather_into_tensor_out": (lambda a, k: _out(_gather(a[0], a[1]), k["out"]), 2),
    "all_gather_into_tensor_coalesced": (lambda a, k: [_gather(x, a[1]) for x in a[0]], 2),
    "reduce_scatter_tensor": (lambda a, k: _scatter(a[0], a[2]), 3),
    "reduce_scatter_tensor_out": (lambda a, k: _out(_scatter(a[0], a[2]), k["out"]), 3),
    "reduce_scatter_tensor_coalesced": (lambda a, k: [_scatter(x, a[2]) for x in a[0]], 3),
    "all_to_all_single": (lambda a, k: _all_to_all(a[0], a[1], a[2]), 3),
    "broadcast": (lambda a, k: a[0].clone(), 2),
    "broadcast_": (lambda a, k: a[0], 2),
    "wait_tensor": (lambda a, k: a[0], -1),
}


@contextlib.contextmanager
def stand_in_collectives() -> Iterator[set[str]]:
    """Answer every functional collective called in this thread with its stand-in (no communication); yields the
    set of group names the calls passed, filled as they happen. A communicating operator without a stand-in
    (``OTHER_NAMESPACES``) raises ``NotImplementedError``: the artifact gets no plan and nothing waits on peers."""
    names: set[str] = set()

    def handle(ns: str, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if ns != NAMESPACE or op not in STAND_INS:
            raise NotImplementedError(f"{ns}::{op} has no stand-in for the run plan's check (never run there)")
        fn, group_arg = STAND_INS[op]
        if group_arg >= 0:
            names.add(str(args[group_arg] if len(args) > group_arg else kwargs["group_name"]))
        return fn(args, kwargs)

    with torch_distributed.intercepting_ops(OTHER_NAMESPACES | {NAMESPACE}, handle):
        yield names


def describe_groups(names: set[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"ranks": [...], "backend": str}}`` of the named groups in this process (compile time); a name that
    is not a group of this process is a ``ProcessGroupMismatchError``."""
    live = torch_distributed.process_groups()
    missing = sorted(names - set(live))
    if missing:
        raise ProcessGroupMismatchError(f"the graph names process groups {missing}, which this process does not have "
                                        f"(it has {sorted(live)})")
    return {name: live[name] for name in sorted(names)}


def check_groups(recorded: dict[str, dict[str, Any]], where: str) -> None:
    """Raise ``ProcessGroupMismatchError`` unless every group the plan names exists in this process with the same
    global ranks and backend."""
    if not recorded:
        return
    live = torch_distributed.process_groups()
    for name, want in recorded.items():
        have = live.get(name)
        if have != want:
            found = f"has it as {have}" if have else (f"has only groups {sorted(live)}" if live else
                                                      "has no initialised process group")
            raise ProcessGroupMismatchError(
                f"{where} was compiled for process group {name!r} = {want}; this process {found}. Its collectives "
                f"would run on another group. Fix: run it with the same process groups (init_process_group and "
                f"new_group in the same order with the same ranks), or use a cache folder per job layout")
