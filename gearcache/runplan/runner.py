"""The per-call work around a loaded plan's wrapper: :class:`PlanRunner`.

What torch's AOTAutograd and CompiledFxGraph wrappers do around Inductor's ``call(list)`` for an inference graph
without aliased outputs or mutations applied outside the graph (the only kind that gets a plan): grad and autocast
off during the call, version counters of inputs mutated in the graph bumped, misaligned inputs cloned (and written
back when the graph mutates them).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch

from .._torch import runplan as torch_runplan, state as torch_state
from .format import ALIGNMENT

GraphInputs = list[Any]
"""A compiled graph's inputs, as its wrapper's ``call(list)`` takes them (and clears): tensors and Python scalars."""


class PlanRunner:
    """A loaded run plan: ``runner(*graph_inputs) -> outputs``, from Inductor's ``call(list)`` and the plan's dict.

    What the per-call paths read (entry.py, ``gearcache.call._callpath.Runner``, benchmarks):

    * ``run_list(args)``: the per-call work on a list the caller hands over (it is changed: realigned, then
      cleared by ``call()``); ``runner(*inputs)`` is ``run_list(list(inputs))``;
    * ``wrapper_call``: Inductor's ``call(list)`` itself; ``plan``: the plan (format: ``runplan/__init__``);
      ``num_outputs``; ``stable_inputs``: the indices last given to :meth:`set_stable_inputs`.

    Alignment is checked on every call for every input, except the inputs named by :meth:`set_stable_inputs` (a
    module's parameters and buffers, which stay the same tensors from call to call): those are checked whenever a
    different tensor object arrives. A stable input whose storage is swapped in place (``param.data = t``) for a
    misaligned ``t`` is not noticed; on CUDA the kernel then fails with a misaligned-address error.

    ``run_list`` and the alignment check are closures built once here, not methods: a call then reads what it
    needs from closure cells instead of attributes of ``self``, as the plain function that this class replaced did
    (``benchmarks/call_overhead.py``, ``piece_run_plan``); ``set_stable_inputs`` changes the state they share in
    place, so a ``run_list`` handed out earlier (to ``_callpath.Runner``) sees the change."""

    __slots__ = ("wrapper_call", "plan", "num_outputs", "stable_inputs", "run_list", "_set_stable")

    def __init__(self, call: Callable[[GraphInputs], Any], plan: dict[str, Any]):
        self.wrapper_call = call
        self.plan = plan
        self.num_outputs: int = plan["num_outputs"]
        self.stable_inputs: tuple[int, ...] = ()
        realign, self._set_stable = _alignment(tuple(plan.get("inputs_to_check", ())),
                                               frozenset(plan.get("mutated_inputs", ())))
        self.run_list = self._per_call(call, realign)

    def __call__(self, *inputs: Any) -> Any:
        return self.run_list(list(inputs))

    def set_stable_inputs(self, indices: Iterable[int]) -> None:
        """The inputs that stay the same tensors from call to call (a module's parameters and buffers): their
        alignment is checked only when a different tensor object arrives."""
        chosen = frozenset(indices)
        self._set_stable(chosen)
        self.stable_inputs = tuple(sorted(chosen))

    def _per_call(self, call: Callable[[GraphInputs], Any],
                  realign: Callable[[GraphInputs], list[tuple[torch.Tensor, torch.Tensor]]]
                  ) -> Callable[[GraphInputs], Any]:
        """``run_list``: the per-call work (the class docstring says why a closure)."""
        plan = self.plan
        check = bool(plan.get("inputs_to_check"))
        bumped = tuple(plan.get("version_bumped_inputs", ()))
        n_in = plan["num_inputs"]
        grad_enabled, set_grad = torch.is_grad_enabled, torch_runplan.grad_mode_setter()
        any_autocast, disable_autocast = torch_state.any_autocast_enabled, torch_state.disable_autocast
        bump = torch.autograd.graph.increment_version

        def call_grad_off(args: GraphInputs) -> Any:
            if grad_enabled():
                set_grad(False)
                try:
                    return call(args)
                finally:
                    set_grad(True)
            return call(args)

        def run_list(args: GraphInputs) -> Any:
            """The per-call work on a list the caller hands over (it is changed: realigned, then cleared by call())."""
            if len(args) != n_in:
                raise TypeError(f"compiled graph takes {n_in} inputs, got {len(args)}")
            copies = realign(args) if check else ()
            if bumped:
                bump([args[i] for i in bumped])
            if any_autocast():
                with disable_autocast():
                    outs = call_grad_off(args)
            else:
                outs = call_grad_off(args)
            for original, copy in copies:
                original.copy_(copy)
            return outs

        return run_list


def _alignment(check: tuple[int, ...],
               mutated: frozenset[int]
               ) -> tuple[Callable[[GraphInputs], list[tuple[torch.Tensor, torch.Tensor]]],
                          Callable[[frozenset[int]], None]]:
    """``(realign, set_stable)``: ``realign(args)`` clones the misaligned inputs among ``check`` in place in ``args``
    and returns ``[(original, copy)]`` for those the graph mutates (copied back after the call); ``set_stable(indices)``
    names the inputs among them checked only when a different tensor object arrives (closures sharing their state:
    see :class:`PlanRunner`)."""
    same = operator.is_
    each_call: tuple[int, ...] = check
    stable: tuple[int, ...] = ()
    get_stable: Callable[[GraphInputs], tuple[Any, ...]] | None = None
    last: tuple[Any, ...] | None = None

    def set_stable(chosen: frozenset[int]) -> None:
        nonlocal each_call, stable, get_stable, last
        each_call = tuple(i for i in check if i not in chosen)
        stable = tuple(i for i in check if i in chosen)
        get_stable = (operator.itemgetter(*stable) if len(stable) > 1 else
                      (lambda a: (a[stable[0]],)) if stable else None)
        last = None

    def realign_one(args: GraphInputs, i: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        x = args[i]
        if x.data_ptr() % ALIGNMENT == 0:
            return False
        args[i] = _clone_preserve_strides(x)
        if i in mutated:
            copies.append((x, args[i]))
        return True

    def realign(args: GraphInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        nonlocal last
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in each_call:
            realign_one(args, i, copies)
        if get_stable is not None:
            current = get_stable(args)
            if last is None or not all(map(same, current, last)):
                misaligned = [realign_one(args, i, copies) for i in stable]
                last = None if any(misaligned) else current
        return copies

    return realign, set_stable


def _clone_preserve_strides(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides, in fresh (aligned) memory (torch._inductor.utils.clone_preserve_strides)."""
    needed = 0 if 0 in x.size() else sum((n - 1) * s for n, s in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())
