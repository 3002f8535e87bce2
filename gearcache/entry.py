"""A loaded entry: a compiled graph plus the glue that feeds it a call's inputs and rebuilds the method's result.

The glue is generated Python (two small functions per entry, built once at load) so a call does no interpretation:
``gather(L, S0, S1, ...)`` returns the graph's input list from the call's flattened inputs ``L`` and the owning
modules' ``_parameters`` / ``_buffers`` dicts ``S0, S1, ...`` (read at every call: a changed or replaced weight
shows in the output); ``build(O, L)`` returns the method's result from the graph outputs ``O``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch



class Entry:
    __slots__ = ("_compiled", "_run_list", "gather", "build", "manifest", "hits")

    def __init__(self, compiled: Callable[..., Any], module: torch.nn.Module, manifest: dict[str, Any]):
        self.compiled = compiled
        self.manifest = manifest
        self.hits = 0               # calls served in this process (flushed to the index at exit: diagnostics)
        self.gather = _make_gather(manifest["inputs"], module)
        self.build = _make_build(manifest["outputs"], module)
        stable = getattr(compiled, "set_stable_inputs", None)      # a run plan's: parameters and buffers
        if stable is not None:
            stable([j for j, (kind, _) in enumerate(manifest["inputs"]) if kind == "state"])

    @property
    def compiled(self) -> Callable[..., Any]:
        """``compiled(*graph_inputs) -> outputs``: the loaded artifact (a run plan's ``run``, or torch's callable)."""
        return self._compiled

    @compiled.setter
    def compiled(self, fn: Callable[..., Any]) -> None:
        self._compiled = fn
        # A run plan takes the gathered list itself (no unpacking into arguments and copying back into a list).
        self._run_list = getattr(fn, "run_list", None) or (lambda args: fn(*args))

    def __call__(self, leaves: tuple) -> Any:
        return self.build(self._run_list(self.gather(leaves)), leaves)


def _state_dict_for(module: torch.nn.Module, name: str) -> tuple[dict, str]:
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if attr in owner._parameters:
        return owner._parameters, attr
    if attr in owner._buffers:
        return owner._buffers, attr
    raise KeyError(f"module has no parameter or buffer {name!r}")


def _make_gather(recipe: list[list], module: torch.nn.Module) -> Callable[[tuple], list]:
    dicts: list[dict] = []
    items = []
    for kind, ref in recipe:
        if kind == "leaf":
            items.append(f"L[{int(ref)}]")
        else:
            d, attr = _state_dict_for(module, ref)
            idx = next((i for i, x in enumerate(dicts) if x is d), None)
            if idx is None:
                dicts.append(d)
                idx = len(dicts) - 1
            items.append(f"S{idx}[{attr!r}]")
    params = "".join(f", S{i}=S{i}" for i in range(len(dicts)))
    src = f"def gather(L{params}):\n    return [{', '.join(items)}]\n"
    return _compile(src, "gather", {f"S{i}": d for i, d in enumerate(dicts)})


def _make_build(outputs: dict[str, Any], module: torch.nn.Module) -> Callable[[list, tuple], Any]:
    env: dict[str, Any] = {}
    items = []
    for i, (kind, ref) in enumerate(outputs["leaves"]):
        if kind == "out":
            items.append(f"O[{int(ref)}]")
        elif kind == "leaf":
            items.append(f"L[{int(ref)}]")
        elif kind == "state":
            d, attr = _state_dict_for(module, ref)
            env[f"D{i}"] = d
            items.append(f"D{i}[{attr!r}]")
        else:
            env[f"C{i}"] = ref
            items.append(f"C{i}")
    body = _structure_expr(outputs["structure"], iter(items), env)
    defaults = "".join(f", {k}={k}" for k in env)
    src = f"def build(O, L{defaults}):\n    return {body}\n"
    return _compile(src, "build", env)


def _structure_expr(node: list, items, env: dict[str, Any]) -> str:
    """A Python expression rebuilding the nested tuples, lists and dicts of the method's result."""
    kind = node[0]
    if kind == "leaf":
        return next(items)
    if kind in ("tuple", "list"):
        parts = [_structure_expr(child, items, env) for child in node[1]]
        if kind == "list":
            return f"[{', '.join(parts)}]"
        return f"({', '.join(parts)},)" if parts else "()"
    if kind == "dict":
        keys, children = node[1], node[2]
        env_name = f"K{len(env)}"
        env[env_name] = tuple(keys)      # keys come from the manifest: bound as values, never spliced into source
        parts = [f"{env_name}[{j}]: {_structure_expr(child, items, env)}" for j, child in enumerate(children)]
        return "{" + ", ".join(parts) + "}"
    raise ValueError(f"unknown output structure node {kind!r}")


def _compile(src: str, name: str, env: dict[str, Any]) -> Callable:
    namespace = dict(env)
    exec(compile(src, f"<gearcache {name}>", "exec"), namespace)   # noqa: S102 - generated from a recipe above
    return namespace[name]
