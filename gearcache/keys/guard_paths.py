"""A value guard's path: where the guarded object is, from a root in the cached method's process (:class:`Scope`),
its JSON form and its text, and the object it leads to now (:func:`evaluate`: ``MISSING_OBJECT`` where a step fails).

On-disk form, a guard's ``path`` (gearcache/keys/value_guard.py): ``[root, step, ...]``. root ``"self"`` (the
module), ``["global", name]`` (the method's module's globals), ``["module", name]`` (a Python module,
``sys.modules[name]``), ``"builtins"``, ``["closure", name]`` (the cell of the cached function's free variable
``name``: a class built by a factory reads its ``scale`` there) or ``["default", name]`` (the default of the cached
function's parameter ``name``, for a call that does not pass it); a step is ``["attr", name]``,
``["generic_attr", name]`` (``object.__getattribute__(x, name)``, as Dynamo reads past a custom ``__getattribute__``),
``["item", key]`` (a str, int, float, bool or None key), ``["item_at", i]`` (the value at a dict's i-th key),
``["key_at", i]`` (a dict's i-th key) or ``["type"]``. In memory a path is a tuple of the root and the steps, each a
tuple.
"""
from __future__ import annotations

import builtins
import sys
import types
from typing import Any

import torch


PathStep = tuple[Any, ...]
"""A step of a path in memory: ``("attr", name)``, ``("item", key)`` (a JSON scalar key), ``("type",)``, ..."""
GuardPath = tuple[Any, ...]
"""``(root, *steps)``: root a str or a ``(kind, name)`` pair of str, each step a :data:`PathStep`."""
PathValues = dict[tuple[Any, ...], Any]
"""The objects of the user's program read at paths in one pass (by path; other marks beside them)."""


class Scope:
    """Where guard paths start in a process: the cached method's module, its function's globals and the function itself
    (its closure cells and defaults)."""

    def __init__(self, module: torch.nn.Module, globals_: dict[str, Any], func: types.FunctionType | None = None):
        self.module, self.globals, self.func = module, globals_, func
        self.installed: dict[str, Any] = {}         # at capture: the globals Dynamo added for the trace

    def root(self, root: Any) -> Any:
        if root == "self":
            return self.module
        if root == "builtins":
            return builtins.__dict__
        kind, name = root
        if kind == "global":
            return self.globals[name]
        if kind == "closure":
            return self.cell(name).cell_contents        # ValueError for an empty cell: evaluate() says missing
        if kind == "default":
            holder, key = self.default_holder(name)
            return holder[key]
        module = sys.modules.get(name)
        if module is None:
            import importlib
            module = importlib.import_module(name)
        return module

    def cell(self, name: str) -> Any:
        """The cell of the cached function's free variable ``name`` (KeyError where there is none)."""
        func = self.func
        if func is None or func.__closure__ is None or name not in func.__code__.co_freevars:
            raise KeyError(name)
        return func.__closure__[func.__code__.co_freevars.index(name)]

    def default_holder(self, name: str) -> tuple[Any, Any]:
        """``(func.__defaults__, index)`` or ``(func.__kwdefaults__, name)``: where the default of the cached function's
        parameter ``name`` is (KeyError where it has none)."""
        func = self.func
        if func is None:
            raise KeyError(name)
        code = func.__code__
        positional = code.co_varnames[:code.co_argcount]
        defaults = func.__defaults__ or ()
        if name in positional:
            i = positional.index(name) - (len(positional) - len(defaults))
            if i < 0:
                raise KeyError(name)
            return defaults, i
        if name in (func.__kwdefaults__ or {}):
            return func.__kwdefaults__, name
        raise KeyError(name)


def evaluate(path: GuardPath, scope: Scope, values: PathValues | None = None) -> Any:
    """The object at ``path`` (``MISSING_OBJECT`` where a step fails). ``values`` caches prefixes across calls."""
    if values is not None and path in values:
        return values[path]
    if len(path) == 1:
        try:
            obj = scope.root(path[0])
        except (KeyError, IndexError, ValueError, ImportError):    # no such global, cell, default or module
            obj = MISSING_OBJECT
    else:
        obj = step(evaluate(path[:-1], scope, values), path[-1])
        if obj is not MISSING_OBJECT and _shadowed(path, scope, values):
            obj = MISSING_OBJECT
    if values is not None:
        values[path] = obj
    return obj


_MODULE_STORES = ("_modules", "_parameters", "_buffers")


def _shadowed(path: GuardPath, scope: Scope, values: PathValues | None) -> bool:
    """Whether ``path`` reads a name from an ``nn.Module``'s ``_modules``, ``_parameters`` or ``_buffers`` that an
    attribute of the module's instance ``__dict__`` shadows (``object.__setattr__(layer, "mlp", other)``: the forward
    reads ``other``), so that a guard on it does not hold."""
    if len(path) < 3 or path[-1][0] != "item" or path[-2][0] not in ("attr", "generic_attr"):
        return False
    if path[-2][1] not in _MODULE_STORES:
        return False
    owner = evaluate(path[:-2], scope, values)
    if not isinstance(owner, torch.nn.Module):
        return False
    own = object.__getattribute__(owner, "__dict__")
    return isinstance(own, dict) and path[-1][1] in own


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING_OBJECT = _Missing()


def step(obj: Any, s: PathStep) -> Any:
    """One step of a path from ``obj`` (``MISSING_OBJECT`` where it fails)."""
    if obj is MISSING_OBJECT:
        return obj
    try:
        op = s[0]
        if op == "attr":
            return getattr(obj, s[1])
        if op == "generic_attr":                # object.__getattribute__: past a class's own __getattribute__
            return object.__getattribute__(obj, s[1])
        if op == "item":
            return obj[s[1]]
        if op in ("item_at", "key_at"):
            key = list(dict.keys(obj) if isinstance(obj, dict) else obj.keys())[s[1]]
            return obj[key] if op == "item_at" else key
        if op == "type":
            return type(obj)
    except (AttributeError, KeyError, IndexError, TypeError):
        return MISSING_OBJECT
    except ValueError:
        if isinstance(obj, types.CellType):     # an empty closure cell (``del cell.cell_contents``)
            return MISSING_OBJECT
        raise
    raise ValueError(f"unknown path step {s!r}")


def path_json(path: GuardPath) -> list[Any]:
    root = path[0]
    return [root if isinstance(root, str) else list(root)] + [list(s) for s in path[1:]]


def path_tuple(data: list[Any]) -> GuardPath:
    root = data[0]
    return (root if isinstance(root, str) else tuple(root), *map(tuple, data[1:]))


def path_text(path: GuardPath) -> str:
    root = path[0]
    text = root if isinstance(root, str) else (root[1] if root[0] == "global" else root[1])
    for s in path[1:]:
        if s[0] in ("attr", "generic_attr"):
            text += f".{s[1]}"
        elif s[0] == "item":
            text += f"[{s[1]!r}]"
        elif s[0] == "item_at":
            text += f".<value at key {s[1]}>"
        elif s[0] == "key_at":
            text += f".<key {s[1]}>"
        else:
            text = f"type({text})"
    return text
