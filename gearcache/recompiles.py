"""Warnings about a cached method that compiles an entry per value or per size (once per method and argument).

An entry is keyed on the value of every Python scalar argument and on the shape of every tensor argument. A scalar
that takes many values (a temperature, a step count), or a dim that takes many sizes without gears (a batch whose
``set_dim_gears`` marks were lost before the first call), means one compile per value or size: the answers are
right, but every cold start pays for each one. :class:`RecompileWatch` sees every miss of one method in this
process (never a hit: nothing here is on the hot path) and warns the first time an argument reaches its
``DISTINCT_BEFORE_WARNING``-th distinct value, or a dim of a tensor argument its ``DISTINCT_BEFORE_WARNING``-th
distinct size while the method has no gear plan.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch

DISTINCT_BEFORE_WARNING = 3


class RecompileWatch:
    """The values and sizes one cached method has missed on in this process, and the arguments warned about."""

    def __init__(self, method_name: str):
        self.name = method_name
        self._seen: dict[tuple[str, int | None], list[object]] = {}   # (argument, dim or None) -> distinct values
        #                                                              or sizes, in order
        self._warned: set[str] = set()

    def miss(self, method: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any],
             leaves: tuple[Any, ...], *, geared: bool,
             gear_plans_stored: Callable[[], bool]) -> None:
        """Record a miss (``leaves``: the call's flattened arguments); warn about an argument that crossed the
        threshold. ``geared``: the method has a gear plan (tensor sizes are then the plan's business);
        ``gear_plans_stored()``: whether the store holds gear plans of the method (its marks were lost)."""
        names = leaf_names(method, args, kwargs)
        if len(names) != len(leaves):
            return
        for name, leaf in zip(names, leaves):
            if isinstance(leaf, torch.Tensor):
                if not geared:
                    for dim, size in enumerate(leaf.shape):
                        self._note(name, dim, size, gear_plans_stored)
            elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
                self._note(name, None, leaf, gear_plans_stored)

    def _note(self, name: str, dim: int | None, value: Any, gear_plans_stored: Callable[[], bool]) -> None:
        if name in self._warned:
            return
        seen = self._seen.setdefault((name, dim), [])
        if value in seen:
            return
        seen.append(value)
        if len(seen) < DISTINCT_BEFORE_WARNING:
            return
        self._warned.add(name)
        listed = ", ".join(map(repr, seen))
        if dim is None:
            message = (f"gearcache: {self.name}: argument {name} is a Python {type(value).__name__} and took its "
                       f"{_ordinal(len(seen))} value ({listed}): each value is an entry of its own, compiled (or "
                       f"loaded) once per value. Fix: pass it as a tensor (e.g. torch.tensor({name})), which one "
                       f"entry serves for every value, or keep it constant (warned once per method and argument)")
        else:
            lost = (" The store holds gear plans of this method, so the tensors passed here lost their "
                    "set_dim_gears marks before its first call in this process (clone(), slicing and most tensor "
                    "operations drop them)." if gear_plans_stored() else "")
            message = (f"gearcache: {self.name}: argument {name} dim {dim} took its {_ordinal(len(seen))} size "
                       f"({listed}) and the method has no gears in this process: each size is an entry of its own, "
                       f"compiled (or loaded) once per size.{lost} Fix: mark the tensor passed to the first call "
                       f"(gearcache.set_dim_gears({name}, {{{dim}: [...]}})), or set "
                       f"config.inference_config.dim_gears = {{{name!r}: {{{dim}: [...]}}}}, which needs no marks "
                       f"(warned once per method and argument)")
        warnings.warn(message, stacklevel=5)


def leaf_names(method: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The name of each flattened leaf of a call, in ``signature.call_key``'s order: ``x``, ``kv[1]``,
    ``cfg['scale']``; an extra positional argument of ``*args`` is ``args[2]``. Empty when the call does not bind."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
    names: list[str] = []

    def walk(obj: Any, path: str) -> None:
        kind = type(obj)
        if kind is tuple or kind is list:
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
        elif kind is dict:
            for key, item in obj.items():
                walk(item, f"{path}[{key!r}]")
        else:
            names.append(path)

    for i, arg in enumerate(args):
        walk(arg, positional[i] if i < len(positional) else f"{star}[{i - len(positional)}]")
    for key, arg in kwargs.items():
        walk(arg, key)
    return names


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
