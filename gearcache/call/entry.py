"""A loaded entry: a compiled graph plus the glue that feeds it a call's inputs and rebuilds the method's result.

The glue is built once at load so a call does no interpretation:

- ``run(L) -> O``: the graph outputs from the call's flattened inputs ``L``: gathers the graph's input list from
  ``L`` and the owning modules' ``_parameters`` / ``_buffers`` dicts (a weight changed in place or replaced shows in
  the next call's output) and runs the compiled graph. For a run plan this is a ``gearcache.call._callpath.Runner``
  (C: the gathering, the alignment, grad-mode and autocast checks and Inductor's ``call()`` in one call; anything
  unusual is handed to the run plan's Python ``run_list``); without the C extension, or for an artifact loaded by
  torch's loader, it is ``compiled(*gather(L))`` in Python. Both do the same work; the C one saves ~10 µs per call.
- ``gather(L, S0, S1, ...)``: generated Python returning the graph's input list (CUDA-graph capture, benchmarks).
- ``build(O, L)``: generated Python returning the method's result from the graph outputs ``O``.
- ``result_outputs``: for a method returning one graph output ``i`` or a flat tuple of graph outputs, ``i`` or the
  tuple of their indices (the C dispatcher then builds the result itself, see dispatch.py); else None.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import types
from typing import Any, Callable, Iterator

import torch

from .._torch import nn_modules as torch_nn_modules, state as torch_state, tensor_checks as torch_tensor_checks
from ..errors import UnsupportedInputError
from . import memory, state_alias

try:
    from ._callpath import Runner as _NativeRunner      # built by setup.py (optional: no C compiler, no extension)
except ImportError:                 # pragma: no cover - depends on how gearcache was installed
    _NativeRunner = None

NATIVE = _NativeRunner is not None

Slot = tuple[dict[str, Any], str]
"""Where a parameter or buffer lives: its owner's ``_parameters`` or ``_buffers`` dict (of tensors; torch types the
two dicts differently) and its name there."""
Recipe = tuple[int | Slot, ...]
"""An entry's graph inputs, resolved once: a leaf index, or a :data:`Slot`."""
"""Whether loaded run plans take the C per-call path (``gearcache.call._callpath``); see ``Entry.native``."""


class Entry:
    """A loaded entry (see the module docstring): ``entry(leaves)`` is ``build(run(leaves), leaves)``, the method's
    result for the call's flattened arguments ``leaves``."""
    __slots__ = ("_compiled", "_recipe", "_bound", "_addresses", "_shares", "run", "native", "gather", "build",
                 "result_outputs", "manifest", "hits", "guards", "real_elements", "padded_elements", "state_aliases",
                 "_records")

    def __init__(self, compiled: Callable[..., Any], module: torch.nn.Module, manifest: dict[str, Any],
                 native: bool = True):
        self.manifest = manifest
        # its value guards (keys/guard_sets.py's GuardSet: keys/ imports call/, so not named here), set by whoever
        # loaded or compiled it; held, never read, on the call path
        self.guards: object = None
        self.hits = 0               # calls served in this process (flushed to the index at exit: diagnostics)
        self.real_elements = self.padded_elements = 0     # of geared calls (GearPlan.record_padding), flushed too
        self.native = native and NATIVE     # False: Python per-call path even where the C one is built (tests)
        self._recipe = _recipe(manifest["inputs"], module)
        self._bound = _bound_dicts(self._recipe, manifest, module)
        self._addresses = _addresses(self._recipe)
        self._shares = _shares(self._recipe)       # as compiled: bound at its look-up, whose key holds the sharing
        self.gather = _make_gather(self._recipe)
        self._records = [(node, record_class(*node)) for node in _record_nodes(manifest["outputs"]["structure"])]
        self.build = _make_build(manifest["outputs"], module, [cls for _, cls in self._records])
        self.result_outputs = _result_outputs(manifest["outputs"])
        self.compiled = compiled
        stable = getattr(compiled, "set_stable_inputs", None)      # a run plan's: parameters and buffers
        if stable is not None:
            stable([j for j, (kind, _) in enumerate(manifest["inputs"]) if kind == "state"])

    def rebound(self, module: torch.nn.Module) -> "Entry":
        """This entry reading the module tensors where ``module`` holds them now (a submodule replaced by another of
        the same class and shapes, ``m.lin = nn.Linear(4, 4)``, holds its weights in dicts of its own): the same
        compiled graph, manifest, guards and counts, new glue (and so a new object: CUDA graphs of the old one go)."""
        entry = Entry(self._compiled, module, self.manifest, self.native)
        entry.guards, entry.hits, entry._shares = self.guards, self.hits, self._shares
        entry.real_elements, entry.padded_elements = self.real_elements, self.padded_elements
        return entry

    def state_moved(self, module: torch.nn.Module) -> bool:
        """Whether ``rebound`` must bind this entry anew: a module tensor it reads (as a graph input or an output)
        lives in another dict of ``module`` than the one it was bound to, one is gone, or one it reads as a graph input
        has another data address than when it was bound (a ``.data`` swap keeps the tensor object: the C runner
        checks the alignment of a new object only, and a CUDA graph of this entry holds the old address), or another
        storage (``state_aliases`` names the storages where it was bound)."""
        try:
            return (_state_dicts(self.manifest, module) != self._bound or _addresses(self._recipe) != self._addresses
                    or state_alias.rules(self._recipe, self.manifest, mutated_inputs(self._compiled))
                    != self.state_aliases)
        except (KeyError, AttributeError):
            return True

    def sharing_changed(self, module: torch.nn.Module) -> str | None:
        """What changed in which of the module tensors the graph reads share memory (``model.layers[1] =
        model.layers[0]``, ``m.count = m.buf[:1]``, ``p.data = q.data``) since the entry was compiled, or None: a graph
        reads and writes the tensors it was compiled with apart in its own order, so it serves no other sharing
        (its entry key holds the sharing: ``entry_life.shared_memory_rows``)."""
        try:
            live = _shares(_recipe(self.manifest["inputs"], module))
        except (KeyError, AttributeError):
            return None                     # a tensor gone: ``state_moved`` rebinds, which finds out
        if live == self._shares:
            return None
        names = [ref for kind, ref in self.manifest["inputs"] if kind == "state"]
        diff = sorted(set(live) ^ set(self._shares))[0]
        return (f"module tensors {names[diff[0]]} and {names[diff[1]]} "
                f"{'share memory now' if diff in live else 'no longer share memory'}")

    def records_changed(self) -> str | None:
        """What changed in the named tuple and dataclass classes ``build`` rebuilds the result with since it was
        made, or None: the class found by its name now is another object (``mod.Pair = namedtuple("Pair", ...)``
        anew: eager returns the class the method reads now; the entry is dropped, and its next load binds the class
        found then) or is no longer rebuildable. Cost: at ``_revalidate`` only (a module global rebound), a look-up
        by name per record class; none on the call path."""
        for (kind, name, fields), bound in self._records:
            try:
                found = record_class(kind, name, fields)
            except UnsupportedInputError as e:
                return str(e)
            if found is not bound:
                return f"the {kind} class {name} the result holds is another class now"
        return None

    def state_refs(self) -> list[Slot]:
        """The module tensors the graph reads, as (``_parameters`` or ``_buffers`` dict, name): read live at every
        call (a CUDA graph holds their addresses at capture instead: ``cuda_graphs``)."""
        return [item for item in self._recipe if not isinstance(item, int)]

    @property
    def compiled(self) -> Callable[..., Any]:
        """``compiled(*graph_inputs) -> outputs``: the loaded artifact (a run plan's ``run``, or torch's callable)."""
        return self._compiled

    @compiled.setter
    def compiled(self, fn: Callable[..., Any]) -> None:
        self._compiled = fn
        self.run = _make_run(fn, self._recipe, self.gather, self.native)
        # the call leaves that must not share memory with the module tensors the graph reads or writes, where it is
        # bound now (call/state_alias.py: the key's path refuses such a call, the shortcut's matcher passes it on)
        self.state_aliases: state_alias.Rules = state_alias.rules(self._recipe, self.manifest,
                                                                  mutated_inputs(fn))

    def __call__(self, leaves: tuple[Any, ...]) -> Any:
        """The method's result for the call's flattened arguments ``leaves``: the graph run, its result built."""
        return self.build(self.run(leaves), leaves)


def _make_run(fn: Callable[..., Any], recipe: Recipe, gather: Callable[[tuple[Any, ...]], list[Any]],
              native: bool) -> Callable[[tuple[Any, ...]], Any]:
    """``run(leaves) -> outputs`` for the compiled callable ``fn`` (see the module docstring)."""
    run_list = getattr(fn, "run_list", None)       # a run plan's: takes the gathered list itself
    call = getattr(fn, "wrapper_call", None)
    plan = getattr(fn, "plan", None)
    if native and run_list is not None and call is not None and plan is not None:
        runner: Callable[[tuple[Any, ...]], Any] = _NativeRunner(   # the C extension: no stubs
            call=call, fallback=run_list, recipe=recipe, check=tuple(plan.get("inputs_to_check", ())),
            always_fallback=bool(plan.get("version_bumped_inputs")), is_grad_enabled=torch.is_grad_enabled,
            is_autocast_enabled=torch_state.any_autocast_enabled, data_ptr=torch_tensor_checks.native_data_ptr())
        return runner
    if run_list is not None:
        return lambda leaves: run_list(gather(leaves))
    return lambda leaves: fn(*gather(leaves))


def _recipe(inputs: list[list[Any]], module: torch.nn.Module) -> Recipe:
    """The graph inputs, resolved once (``_NativeRunner`` and ``gather``): a leaf index, or the
    (``_parameters``/``_buffers`` dict, name)."""
    return tuple(int(ref) if kind == "leaf" else torch_nn_modules.state_slot(module, ref) for kind, ref in inputs)


def _addresses(recipe: Recipe) -> list[int]:
    """The data address of each module tensor the recipe reads, as the dicts hold them now."""
    return [item[0][item[1]].data_ptr() for item in recipe if not isinstance(item, int)]


def _shares(recipe: Recipe) -> list[tuple[int, int, int, bool, int]]:
    """``memory.shared_memory`` of the module tensors the recipe reads (numbered among them)."""
    return memory.shared_memory([item[0][item[1]] for item in recipe if not isinstance(item, int)])


def _state_dicts(manifest: dict[str, Any], module: torch.nn.Module) -> list[int]:
    """The identity of the dict each module tensor the entry reads lives in (inputs, then outputs)."""
    refs = [ref for kind, ref in manifest["inputs"] if kind == "state"]
    refs += [ref for kind, ref in manifest["outputs"]["leaves"] if kind == "state"]
    return [id(torch_nn_modules.state_slot(module, ref)[0]) for ref in refs]


def _bound_dicts(recipe: Recipe, manifest: dict[str, Any], module: torch.nn.Module) -> list[int]:
    """:func:`_state_dicts` of an entry whose ``recipe`` was just resolved from ``manifest["inputs"]`` (its slots are
    the inputs' module tensors, in order: they are not resolved a second time)."""
    refs = [ref for kind, ref in manifest["outputs"]["leaves"] if kind == "state"]
    return ([id(item[0]) for item in recipe if not isinstance(item, int)]
            + [id(torch_nn_modules.state_slot(module, ref)[0]) for ref in refs])


def _make_gather(recipe: Recipe) -> Callable[[tuple[Any, ...]], list[Any]]:
    """``gather(L)`` in generated Python from the recipe of :func:`_recipe` (the dicts already resolved)."""
    dicts: list[dict[str, Any]] = []
    items = []
    for item in recipe:
        if isinstance(item, int):
            items.append(f"L[{item}]")
        else:
            d, attr = item
            idx = next((i for i, x in enumerate(dicts) if x is d), None)
            if idx is None:
                dicts.append(d)
                idx = len(dicts) - 1
            items.append(f"S{idx}[{attr!r}]")
    params = "".join(f", S{i}=S{i}" for i in range(len(dicts)))
    src = f"def gather(L{params}):\n    return [{', '.join(items)}]\n"
    return _compile(src, "gather", {f"S{i}": d for i, d in enumerate(dicts)})


def _make_build(outputs: dict[str, Any], module: torch.nn.Module,
                record_classes: list[type]) -> Callable[[list[Any], tuple[Any, ...]], Any]:
    """The result's builder; ``record_classes``: the classes of its named tuple and dataclass nodes, in
    ``_record_nodes`` order (found once, at the entry's load)."""
    env: dict[str, Any] = {}
    items = []
    for i, (kind, ref) in enumerate(outputs["leaves"]):
        if kind == "out":
            items.append(f"O[{int(ref)}]")
        elif kind == "leaf":
            items.append(f"L[{int(ref)}]")
        elif kind == "state":
            d, attr = torch_nn_modules.state_slot(module, ref)
            env[f"D{i}"] = d
            items.append(f"D{i}[{attr!r}]")
        else:
            env[f"C{i}"] = ref
            items.append(f"C{i}")
    body = _structure_expr(outputs["structure"], iter(items), env, iter(record_classes))
    defaults = "".join(f", {k}={k}" for k in env)
    src = f"def build(O, L{defaults}):\n    return {body}\n"
    return _compile(src, "build", env)


def _result_outputs(outputs: dict[str, Any]) -> int | tuple[int, ...] | None:
    """``Entry.result_outputs``: what ``build`` returns when it is one graph output or a flat tuple of them."""
    leaves, structure = outputs["leaves"], outputs["structure"]
    if not all(kind == "out" for kind, _ in leaves):
        return None
    if structure == ["leaf"] and len(leaves) == 1:
        return int(leaves[0][1])
    if (structure[0] == "tuple" and all(child == ["leaf"] for child in structure[1])
            and len(structure[1]) == len(leaves)):
        return tuple(int(ref) for _, ref in leaves)
    return None


def _structure_expr(node: list[Any], items: Iterator[str], env: dict[str, Any], classes: Iterator[type]) -> str:
    """A Python expression rebuilding the nested tuples, lists and dicts of the method's result."""
    kind = node[0]
    if kind == "leaf":
        return next(items)
    if kind in ("tuple", "list"):
        parts = [_structure_expr(child, items, env, classes) for child in node[1]]
        if kind == "list":
            return f"[{', '.join(parts)}]"
        return f"({', '.join(parts)},)" if parts else "()"
    if kind == "dict":
        keys, children = node[1], node[2]
        env_name = f"K{len(env)}"
        env[env_name] = tuple(keys)      # keys come from the manifest: bound as values, never spliced into source
        parts = [f"{env_name}[{j}]: {_structure_expr(child, items, env, classes)}" for j, child in enumerate(children)]
        return "{" + ", ".join(parts) + "}"
    if kind in ("namedtuple", "dataclass"):
        cls_name, fields_name = f"T{len(env)}", f"F{len(env)}"
        env[cls_name] = next(classes)            # record_class(kind, node[1], node[2]), found at the load
        env[fields_name] = tuple(node[2])
        parts = [_structure_expr(child, items, env, classes) for child in node[3]]
        values = f"({', '.join(parts)},)" if parts else "()"
        if kind == "namedtuple":
            return f"{cls_name}._make({values})"
        return f"{cls_name}(**dict(zip({fields_name}, {values})))"
    raise ValueError(f"unknown output structure node {kind!r}")


def _record_nodes(node: list[Any]) -> Iterator[tuple[str, str, list[str]]]:
    """``(kind, name, fields)`` of every named tuple and dataclass node of an output structure, outermost first."""
    if node[0] in ("namedtuple", "dataclass"):
        yield node[0], node[1], node[2]
        children = node[3]
    else:
        children = node[1] if node[0] in ("tuple", "list") else node[2] if node[0] == "dict" else []
    for child in children:
        yield from _record_nodes(child)


def record_class(kind: str, name: str, fields: list[str]) -> type:
    """The named tuple or dataclass class ``name`` (``module:qualname``, the module imported if it is not yet) of
    an entry's result, checked to have the ``fields`` it had at the compile: UnsupportedInputError where it cannot be
    found or its fields changed (the entry is not served with another class's fields)."""
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UnsupportedInputError(f"the entry's result holds a {kind} {name}, which this process cannot find "
                                    f"({e}). Fix: import the module that defines it before the call") from e
    now = list(obj._fields) if kind == "namedtuple" and hasattr(obj, "_fields") else (
        [f.name for f in dataclasses.fields(obj)] if kind == "dataclass" and dataclasses.is_dataclass(obj) else None)
    if not isinstance(obj, type) or now != list(fields):
        raise UnsupportedInputError(f"the entry's result holds a {kind} {name} with fields {fields}; here it is "
                                    f"{obj!r} with {now}. Fix: the class as it was at the compile, or a new cache")
    refusal = rebuild_refusal(kind, obj)
    if refusal is not None:
        raise UnsupportedInputError(f"the entry's result holds a {kind} {name}, {refusal}. Fix: the class as it was "
                                    f"at the compile, or a new cache")
    return obj


def rebuild_refusal(kind: str, cls: type) -> str | None:
    """Why ``build`` cannot rebuild an instance of the record class ``cls`` from the field values eager's instance
    holds, or None. The values are final (Dynamo ran the constructor eager ran), so the rebuild must run nothing of
    the user's on them again: a named tuple is rebuilt by namedtuple's own ``_make`` (not an override); a dataclass
    by its dataclass-generated ``__init__`` taking exactly its fields (not an ``__init__`` of its own, a subclass's
    ``__init__``, an ``InitVar`` parameter or a field it does not take), with no ``__post_init__``. Cost: at a
    capture and an entry's load only."""
    if kind == "namedtuple":
        make = getattr(getattr(cls, "_make", None), "__func__", None)
        if not _made_by(make, "namedtuple", "_make"):
            return "a named tuple class overriding _make, which gearcache would run on the values eager's built"
        return None
    if hasattr(cls, "__post_init__"):
        return ("a dataclass with a __post_init__, which would run again on the values eager's __post_init__ "
                "already made")
    init: Callable[..., None] = cls.__init__    # type: ignore[misc]   # (the class's, not the instance's)
    if not _made_by(init, "__create_fn__", "__init__"):
        return (f"a dataclass whose __init__ ({getattr(init, '__qualname__', init)}) is not the one @dataclass "
                f"generates: it would run again on the values eager's __init__ already made")
    code = init.__code__
    params = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    if sorted(params) != sorted(f.name for f in dataclasses.fields(cls)):
        return f"a dataclass whose __init__ takes {list(params[:8])}, not exactly its fields (an InitVar, init=False)"
    return None


def _made_by(fn: object, maker: str, name: str) -> bool:
    """Whether the function ``fn`` is the ``name`` that the standard library's ``maker`` (``namedtuple``, or
    dataclasses' ``__create_fn__``) generates: by its code's qualified name (3.11+); on 3.10 by its name and file."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType) or code.co_name != name:
        return False
    qualname = getattr(code, "co_qualname", None)
    if qualname is not None:
        return bool(qualname == f"{maker}.<locals>.{name}")
    return code.co_filename == "<string>" if maker == "__create_fn__" else code.co_filename.endswith(  # 3.10
        f"collections{os.sep}__init__.py")


def _compile(src: str, name: str, env: dict[str, Any]) -> Callable[..., Any]:
    namespace = dict(env)
    exec(_code(src, name), namespace)   # noqa: S102 - generated from a recipe above
    fn: Callable[..., Any] = namespace[name]
    return fn


@functools.lru_cache(maxsize=256)
def _code(src: str, name: str) -> types.CodeType:
    """The compiled code of a generated ``gather`` or ``build`` source (the gears of one method load the same
    recipes: compiled once; the values it reads are bound per entry by ``_compile``'s namespace)."""
    return compile(src, f"<gearcache {name}>", "exec")


def writes_a_leaf(entry: Entry) -> bool:
    """Whether ``entry``'s graph may write one of the call's inputs in place: its run plan's ``mutated_inputs`` name
    a call leaf, or the plan cannot tell (torch's loader without a readable plan: True)."""
    mutated = mutated_inputs(entry.compiled)
    if mutated is None:
        return True
    inputs = entry.manifest["inputs"]
    return any(inputs[j][0] == "leaf" for j in mutated)


def mutated_inputs(compiled: Callable[..., Any]) -> list[int] | None:
    """The graph inputs the loaded artifact ``compiled`` writes in place, as its run plan says (an unsupported plan
    too, where its writer could read them); None when unknown."""
    plan = getattr(compiled, "plan", None)
    mutated = plan.get("mutated_inputs") if isinstance(plan, dict) else None
    return [int(j) for j in mutated] if isinstance(mutated, list) else None

