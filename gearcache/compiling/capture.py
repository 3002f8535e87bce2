"""Capture a bound method as one Dynamo graph and describe how to feed it and rebuild its result.

``capture(method, args, kwargs)`` runs the method once through Dynamo (``fullgraph=True``, static shapes) with a
backend that records the graph instead of compiling it, and returns a :class:`Captured`:

* ``graph`` and ``example_inputs``: what Inductor compiles;
* ``inputs``: one recipe per graph input, ``["leaf", i]`` (the call's i-th flattened input) or ``["state", name]``
  (a parameter or buffer of the module, read live at every call, so a changed weight shows in the output);
* ``outputs``: the method's return structure (a serialised pytree spec) and one recipe per leaf, ``["out", i]``
  (the graph's i-th output), ``["leaf", i]``, ``["state", name]`` or ``["const", value]``;
* ``dependencies``: the source of every user function the trace inlined, to detect a stale entry on load;
* ``guards``: the Python values the graph bakes in (module attributes, globals, constants, closure cells, ...), from
  Dynamo's guards (gearcache/keys/guards_from_dynamo.py): an entry is served only where they still hold.

A graph break raises :class:`~gearcache.errors.GraphBreakError` listing every break (from ``torch._dynamo.explain``).
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import types
from typing import Any, Callable

import torch

from .._torch import capture as torch_capture, guards as torch_guards
from ..call.entry import rebuild_refusal, record_class
from ..call.memory import storage_address
from ..keys import guard_sets, guards_from_dynamo
from ..errors import (ConfigError, DataDependentShape, GearcacheError, GraphBreakError, SideEffects,
                      UnsupportedInputError)
from ..keys.key import sha256_text

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass
class Captured:
    graph: torch.fx.GraphModule
    example_inputs: list[Any]
    inputs: list[list[Any]]
    outputs: dict[str, Any]
    dependencies: list[dict[str, Any]]
    guards: guard_sets.GuardSet


def _recording_backend(state: dict[str, Any], empty_like: Callable[[Any], Any]
                       ) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., list[Any]]]:
    """A Dynamo backend that records the graph into ``state`` (``"gm"``, ``"inputs"``, ``"code"``, ``"sources"``: where
    Dynamo read each input, for messages) and does not run
    it: the call's real run is the compiled entry's, once (an in-place update of an input must not happen twice).
    The outputs it gives Dynamo to build the result are ``empty_like(node)`` per output node, kept as
    ``state["flat_out"]``."""
    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., list[Any]]:
        written = torch_capture.local_side_effects()
        if written:                 # raised before Dynamo replays them: nothing is written
            raise SideEffects(written)
        dependent = torch_capture.first_data_dependent(gm)
        if dependent is not None:   # entries are static: refused before anything compiles
            raise DataDependentShape(getattr(dependent.target, "__name__", None) or str(dependent.target),
                                     torch_capture.source_line(dependent))
        state["gm"], state["inputs"], state["code"] = gm, list(example_inputs), torch_capture.traced_code()
        state["sources"] = torch_capture.input_sources(gm)      # Dynamo drops them from the graph after this call

        def run(*flat: Any) -> list[Any]:
            nodes = _output_nodes(gm)
            out = _mark_numbers([empty_like(n) for n in nodes], nodes)
            state["flat_out"] = out
            return out

        return run
    return record


def capture(method: types.MethodType, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            leaves: tuple[Any, ...]) -> Captured:
    """The call ``method(*args, **kwargs)`` (``leaves``: its flattened arguments) as one Dynamo graph, recorded and
    not run (see the module docstring): a :class:`Captured`. Nothing stays installed in Dynamo. Raises
    ``GraphBreakError`` listing every break, and the eager method's own error for an input it refuses."""
    _refuse_arguments_sharing_state(method, module, leaves)
    with torch_capture.DYNAMO_LOCK:        # one trace at a time in the process (see its docstring)
        state: dict[str, Any] = {}
        record = _recording_backend(state, _empty_like_example)
        code = method.__func__.__code__
        recording = torch_guards.GuardRecording()
        compiled = torch.compile(method, fullgraph=True, dynamic=False, backend=record,
                                 options=torch_guards.guard_recording_options(recording, method.__func__.__globals__))
        torch_capture.forget_dynamo_cache(code)
        try:
            with torch_capture.dynamo_capture_config(), torch_capture.without_dynamic_marks(leaves):
                result = compiled(*args, **kwargs)
        except Exception as exc:
            if torch_capture.is_graph_break(exc):
                torch_capture.forget_dynamo_cache(code)
                _raise_op_type_error(method, exc)
                _raise_cached_call(method, exc)
                breaks = torch_capture.explain_graph_breaks(method, args, kwargs, exc, [*leaves, *module.buffers()])
                raise GraphBreakError(_qualname(method), breaks) from None
            _raise_side_effects(method, exc)
            _raise_data_dependent(method, exc)
            _raise_op_runtime_error(method, exc)
            raise
        finally:
            torch_capture.forget_dynamo_cache(code)
    if "gm" not in state:           # no tensor work at all (it returns constants): an empty graph serves it
        state["gm"], state["inputs"], state["code"] = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), [], []
    state_names = _state_names(module)
    outputs = _output_recipe(result, state.get("flat_out", []), leaves, state_names)
    sources = state.get("sources", [])
    inputs = [_input_recipe(t, leaves, state_names, i, method, sources[i] if i < len(sources) else None)
              for i, t in enumerate(state["inputs"])]
    _inputs_returned_as_they_are(state["gm"], outputs, inputs)
    _ensure_an_output(state["gm"], state["inputs"])
    passed = passed_names(method, args, kwargs)
    return Captured(
        graph=state["gm"],
        example_inputs=state["inputs"],
        inputs=inputs,
        outputs=outputs,
        dependencies=_dependencies(state["code"]),
        guards=guards_from_dynamo.from_dynamo(recording, method, passed),
    )


def _raise_cached_call(method: types.MethodType, exc: BaseException) -> None:
    """A cached method calling another cached method (a ``CachedFunction``, whose call Dynamo cannot trace): one break
    naming the line and the fix, raised before ``torch._dynamo.explain``, which would run the other method's miss,
    compile and all, under Dynamo and list gearcache's own lines as the breaks."""
    where = torch_capture.untraceable_call(exc, "CachedFunction")
    if where is not None:
        raise GraphBreakError(_qualname(method), [(
            "it calls a cache_compile'd method, which cannot run inside another's capture. Fix: call the plain "
            "method there (self._forward, not the cached self.cached_forward): its ops become part of this graph",
            where)]) from None


def passed_names(method: types.MethodType, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str] | None:
    """The names of the parameters a call of the bound ``method`` passes (the others take their defaults); None where
    the call does not bind (Dynamo then raised already). ``*args`` and ``**kwargs`` parameters are always passed (an
    empty tuple or dict where the call gives them nothing: they have no default, and the signature key holds their
    structure)."""
    try:
        sig = inspect.signature(method)
        names = set(sig.bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return None
    return names | {p.name for p in sig.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:     # FX output arguments (nodes): torch's Argument union
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return []
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


def _inputs_returned_as_they_are(gm: torch.fx.GraphModule, outputs: dict[str, Any], inputs: list[list[Any]]) -> None:
    """A graph whose every output is one of its inputs (``return x``) compiles to nothing Inductor saves: read such
    outputs from the inputs instead (the call's leaf or the module's tensor, the very object eager returns; the
    ``inputs`` recipes) and leave the graph without outputs (``_ensure_an_output`` then gives it an empty one)."""
    nodes = _output_nodes(gm)
    if not nodes or not all(isinstance(n, torch.fx.Node) and n.op == "placeholder" for n in nodes):
        return
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs["leaves"] = [list(inputs[places.index(nodes[r[1]])]) if r[0] == "out" else r for r in outputs["leaves"]]
    gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))
    gm.recompile()


def _ensure_an_output(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Give a graph without outputs (a method returning None or constants, maybe after in-place updates) one empty
    tensor output, which no output recipe reads: Inductor saves no artifact for a graph that returns nothing."""
    if _output_nodes(gm):
        return
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    graph = gm.graph
    old = next((n for n in graph.nodes if n.op == "output"), None)
    if old is not None:
        graph.erase_node(old)
    graph.output((graph.call_function(torch.empty, ((0,),), {"device": device}),))
    gm.recompile()


class _GraphNumber:
    """Stands in, during a capture, for a Python number the graph computes (a ``SymInt``, ``SymFloat`` or ``SymBool``
    output: ``.item()``, ``float(t)``, ``int(t)`` on a tensor, or a size that gears pad). A compiled graph returns
    tensors only, so such a number cannot be served: :func:`_output_recipe` names where it is in the result."""

    def __init__(self, kind: str):
        self.kind = kind

    def message(self, path: str) -> str:
        return (f"the method's {path} is a Python {self.kind} computed from a tensor (by .item(), float(), int() or "
                f"bool() on a tensor, or from a size that gears pad): a compiled graph returns tensors only, so "
                f"gearcache cannot serve it (it would be the compiling call's value on every call). Fix: return the "
                f"0-d tensor instead (e.g. `t.sum()` rather than `float(t.sum())` or `t.sum().item()`) and call "
                f".item() on the result outside the cached method (a size: read it from the input there)")


class _FloatProbe(torch.Tensor):
    """The 0-d tensor Dynamo turns a Python float result into (``torch.scalar_tensor``), then reads back with
    ``.item()``: here ``.item()`` gives a :class:`_GraphNumber`. Returned as a tensor, it is that graph output."""

    def item(self) -> Any:    # a _GraphNumber where Tensor.item gives a number
        return _GraphNumber("float")


def _mark_numbers(outs: list[Any], nodes: list[Any]) -> list[Any]:
    """``outs`` (one per graph output node) with every Python number the graph computes made recognisable:
    a ``_GraphNumber`` for a symbolic int or bool output, a ``_FloatProbe`` for a float made a 0-d tensor."""
    marked = []
    for value, node in zip(outs, nodes):
        example = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            value = _GraphNumber(type(example).__name__[3:].lower())
        elif (isinstance(value, torch.Tensor) and isinstance(node, torch.fx.Node) and node.op == "call_function"
              and node.target is torch.scalar_tensor):
            value = torch_capture.as_subclass_sharing_storage(_FloatProbe, value)
        marked.append(value)
    return marked


def _empty_like_example(node: Any) -> Any:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return value


def _qualname(method: types.MethodType) -> str:
    return f"{type(method.__self__).__qualname__}.{method.__name__}"


def _raise_op_type_error(method: types.MethodType, exc: BaseException) -> None:
    """An op of the method refused the call's arguments (None where a tensor goes): the ``TypeError`` the method
    raises uncompiled, not a graph break."""
    error = torch_capture.op_type_error(exc)
    if error is not None:
        raise TypeError(f"{_qualname(method)}: {error} (an op of the method refused the call's arguments while torch "
                        f"traced it, as the method does when it runs uncompiled)") from error


def _raise_side_effects(method: types.MethodType, exc: BaseException) -> None:
    """The method writes Python state reachable from its module or arguments outside its graph (``self.calls += 1``,
    ``self.seen.append(...)``, ``self.last = x * 5``): a compiled entry runs the graph only, so those writes would
    happen at no call (eager makes them at every call; the capture left ``self.last`` holding an uninitialised
    tensor). Refused, naming what it writes and the fix; nothing was written (the backend raised before Dynamo
    replays them). Writes to globals and other modules (a library's context state, set and reset) pass as before."""
    inner = torch_capture.backend_error(exc)
    if isinstance(inner, SideEffects):
        written = ", ".join(_readable_source(s) for s in inner.sources)
        raise GearcacheError(
            f"{_qualname(method)} writes Python state outside its tensors ({written}): a compiled entry runs only the "
            f"graph, so the write would be made at no call. Fix: keep such state in a buffer updated in place "
            f"(self.register_buffer(...), then .add_() / .copy_()), or make the write outside the cached method, "
            f"from its outputs") from None


def _raise_data_dependent(method: types.MethodType, exc: BaseException) -> None:
    """The graph computes a size from tensor values (``x[x > 0]``, ``nonzero``, ``unique``): a compiled entry has
    static shapes, and torch failed on it later with its own messages ("SymIntArrayRef expected to contain only
    concrete integers", "u0 possible memo disaster"), at every call. Refused as a graph break naming the op, the
    user's line and the fix; nothing was compiled."""
    inner = torch_capture.backend_error(exc)
    if isinstance(inner, DataDependentShape):
        raise GraphBreakError(_qualname(method), [(
            f"{inner.op} makes a size that depends on the values of a tensor (boolean-mask indexing, nonzero, unique, "
            f"...), which a compiled entry's static shapes cannot hold. Fix: keep the shape static (torch.where(mask, "
            f"x, 0), x.masked_fill(~mask, 0), a sum of x * mask), or do it outside the cached method on its outputs",
            inner.where)]) from None


def _readable_source(source: str) -> str:
    """``L['self'].seen`` as ``self.seen``; ``L['x']`` as ``x``."""
    text = source.replace("L['", "").replace("G['", "")
    return text.replace("']", "", 1) if "']" in text else text


def _raise_op_runtime_error(method: types.MethodType, exc: BaseException) -> None:
    """An op of the method raised on the call's arguments while torch traced it (shapes that do not fit): its
    ``RuntimeError``, named after the method, instead of Dynamo's report of the fake tensors."""
    error = torch_capture.op_runtime_error(exc)
    if error is not None:
        raise RuntimeError(f"{_qualname(method)}: {error} (an op of the method refused the call's arguments while "
                           f"torch traced it, as the method does when it runs uncompiled)") from error


def _refuse_unmarked_partner(method: types.MethodType, exc: BaseException) -> None:
    """An op refused the gear plan's trace (the marked dims symbolic, at the largest gear; ``exc`` Dynamo's report of
    the op's ``RuntimeError`` on the fake tensors): a size the op needs equal to a marked dim is not marked (the
    method, at the call's own sizes, may run it), or the method refuses these inputs at any size. ``ConfigError``
    naming the op's error and the fix, instead of Dynamo's report (whose hint blames the eager code)."""
    error = torch_capture.op_runtime_error(exc)
    if error is not None:
        raise ConfigError(f"{_qualname(method)}: traced with its marked dims at their largest gear, an op refuses the "
                          f"call ({error}): a size that must equal a marked dim is not marked, or the method refuses "
                          f"these inputs at any size. Fix: mark every tensor dim that goes with a marked one with the "
                          f"same gears (set_dim_gears), or call it without gears") from error


def _state_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in list(module.named_buffers(remove_duplicate=False)) + list(
            module.named_parameters(remove_duplicate=False)):
        names.setdefault(id(t), name)
    return names


def _refuse_arguments_sharing_state(method: types.MethodType, module: torch.nn.Module,
                                    leaves: tuple[Any, ...]) -> None:
    """Raise ``UnsupportedInputError`` for a call one of whose tensors is a parameter or buffer of ``module`` or shares
    its memory (a view of one): Dynamo makes the graph read that argument where the method reads the module's tensor
    (one graph input for both), so the entry, keyed by the call's shapes, would read an unrelated tensor of a later
    call in the module's place. Cost: one storage address per tensor, on a capture only."""
    owners: dict[int, str] = {}
    named = [("buffer", n, t) for n, t in module.named_buffers(remove_duplicate=False)]
    named += [("parameter", n, t) for n, t in module.named_parameters(remove_duplicate=False)]
    for kind, name, t in named:
        owners.setdefault(storage_address(t), f"{kind} {name}")
    for i, leaf in enumerate(leaves):
        owner = owners.get(storage_address(leaf)) if isinstance(leaf, torch.Tensor) else None
        if owner is not None:
            raise UnsupportedInputError(
                f"{_qualname(method)}: argument at flattened position {i} is the module's {owner} or a view of its "
                f"memory; the compiled graph would read that argument in the module's tensor's place, also for a later "
                f"call passing another tensor. Fix: pass a .clone() of it, or read it through the module in the method")


def _input_recipe(t: Any, leaves: tuple[Any, ...], state_names: dict[int, str], index: int,
                  method: types.MethodType, source: str | None) -> list[Any]:
    """Graph input ``index`` (``t``, read from Dynamo's ``source``) as a call leaf or a module tensor; else
    ``UnsupportedInputError`` naming the method, where the tensor is read from and the fix."""
    for i, leaf in enumerate(leaves):
        if leaf is t:
            return ["leaf", i]
    if id(t) in state_names:
        return ["state", state_names[id(t)]]
    where = _foreign_tensor(source, method)
    raise UnsupportedInputError(
        f"{_qualname(method)}: graph input {index}, {type(t).__qualname__}{list(getattr(t, 'shape', []))}"
        f"{f' ({where})' if where else ''}, is neither an argument nor a parameter or buffer of the module, so a "
        f"compiled entry could not read it at a later call. Fix: register tensors the method reads as buffers "
        f"(self.register_buffer(name, tensor)) instead of plain attributes or globals, and pass a tensor default "
        f"explicitly (or default to None and build the tensor in the method).")


def _foreign_tensor(source: str | None, method: types.MethodType) -> str | None:
    """Where a tensor ``_input_recipe`` refuses is read from, for its message (``self.plain, a plain attribute``),
    from Dynamo's ``source`` (``L['self'].plain``); None without one."""
    if source is None:
        return None
    readable = _readable_source(source)
    local = re.fullmatch(r"L\['(\w+)'\]", source)
    if source.startswith("G['"):
        kind = "a global"
    elif source.startswith("L['self']"):
        kind = "a plain attribute"
    elif local and local.group(1) in inspect.signature(method).parameters:
        kind = "the default of a parameter the call does not pass"
    elif local:
        kind = "a variable of the method's closure"
    else:
        kind = "read by the method"
    return f"{readable}, {kind}"


def _output_recipe(result: Any, flat_out: list[Any], leaves: tuple[Any, ...],
                   state_names: dict[int, str]) -> dict[str, Any]:
    """``{"structure": nested ["tuple"|"list", [children]] / ["dict", [keys], [children]] / ["namedtuple"|"dataclass",
    "module:qualname", [fields], [children]] / ["leaf"], "leaves": [...]}`` with one recipe per leaf in order."""
    recipe: list[list[Any]] = []

    def walk(obj: Any, path: str) -> list[Any]:
        t = type(obj)
        if t is tuple or t is list:
            return [t.__name__, [walk(o, f"{path}[{i}]") for i, o in enumerate(obj)]]
        if t is dict and all(type(k) in (str, int) for k in obj):
            return ["dict", list(obj), [walk(v, f"{path}[{k!r}]") for k, v in obj.items()]]
        record = _record_of(obj, path)
        if record is not None:
            kind, name, fields = record
            return [kind, name, fields, [walk(getattr(obj, f), f"{path}.{f}") for f in fields]]
        if isinstance(obj, torch.Tensor):
            recipe.append(_tensor_output(obj, flat_out, leaves, state_names))
        elif isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnsupportedInputError(_GraphNumber(type(obj).__name__[3:].lower()).message(path))
        elif isinstance(obj, _GraphNumber):
            raise UnsupportedInputError(obj.message(path))
        elif isinstance(obj, (int, float, bool, str, type(None))):
            recipe.append(["const", obj])
        else:
            raise UnsupportedInputError(
                f"the method's {path} is a {type(obj).__qualname__}; cached methods return tensors, Python scalars "
                f"(constants) and tuples, lists, dicts (with str or int keys), named tuples and dataclasses of them "
                f"(defined at a module's top level). Fix: return tensors "
                f"(convert {type(obj).__qualname__} to one) or build it outside the cached method")
        return ["leaf"]

    structure = walk(result, "output")
    return {"structure": structure, "leaves": recipe}


def _record_of(obj: Any, path: str) -> tuple[str, str, list[str]] | None:
    """``(kind, "module:qualname", fields)`` for a named tuple or a dataclass instance the result holds (rebuilt at
    each call by ``call.entry``: ``cls._make(values)``, ``cls(**fields)``), None for anything else. A class defined
    inside a function (not importable by its name in another process), or one whose rebuild would run user code on
    the values again (``call.entry.rebuild_refusal``: a ``__post_init__``, a custom ``__init__``), is refused."""
    t = type(obj)
    if isinstance(obj, tuple) and hasattr(t, "_fields") and hasattr(t, "_make"):
        kind, fields = "namedtuple", list(t._fields)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kind, fields = "dataclass", [f.name for f in dataclasses.fields(obj)]
    else:
        return None
    refusal = rebuild_refusal(kind, t)
    if refusal is not None:
        raise UnsupportedInputError(
            f"the method's {path} is a {t.__qualname__}, {refusal}: gearcache rebuilds it from its fields at each "
            f"call. Fix: return its fields (a dict or tuple) and build the {t.__qualname__} outside the cached method")
    name = f"{t.__module__}:{t.__qualname__}"
    try:
        found = record_class(kind, name, fields) if "<locals>" not in t.__qualname__ else None
    except UnsupportedInputError:
        found = None
    if found is not t:
        raise UnsupportedInputError(
            f"the method's {path} is a {t.__qualname__}, a {kind} class defined inside a function (or not found as "
            f"{name}): another process cannot find it by name. Fix: define {t.__name__} at the top level of "
            f"{t.__module__}")
    return kind, name, fields


def _tensor_output(t: torch.Tensor, flat_out: list[Any], leaves: tuple[Any, ...],
                   state_names: dict[int, str]) -> list[Any]:
    for i, o in enumerate(flat_out):
        if o is t:
            return ["out", i]
    for i, leaf in enumerate(leaves):
        if leaf is t:
            return ["leaf", i]
    if id(t) in state_names:
        return ["state", state_names[id(t)]]
    raise UnsupportedInputError("the method returns a tensor that is not produced by its graph (a global or a "
                                "constant); return something computed from the inputs instead")


def _dependencies(codes: list[Any]) -> list[dict[str, Any]]:
    """One record per traced user function: file, first line, line count and sha256 of those lines."""
    deps, seen = [], set()
    for code in codes:
        path = os.path.abspath(code.co_filename)
        if path.startswith(_TORCH_DIR) or (path, code.co_firstlineno) in seen or not os.path.isfile(path):
            continue            # torch's own code is covered by the torch version factor
        seen.add((path, code.co_firstlineno))
        try:
            lines, first = inspect.getsourcelines(code)
        except (OSError, TypeError):
            continue
        deps.append({"file": path, "name": code.co_qualname if hasattr(code, "co_qualname") else code.co_name,
                     "first_line": first, "n_lines": len(lines), "sha256": sha256_text("".join(lines))})
    return deps


def dependencies_changed(deps: list[dict[str, Any]]) -> str | None:
    """The first dependency whose source changed since capture, as ``"file:line name"``; None if all match."""
    cache: dict[str, list[str]] = {}
    for d in deps:
        path = d["file"]
        if path not in cache:
            try:
                with open(path, encoding="utf-8") as f:
                    cache[path] = f.readlines()
            except OSError:
                return f"{path} (missing)"
        lines = cache[path][d["first_line"] - 1: d["first_line"] - 1 + d["n_lines"]]
        if sha256_text("".join(lines)) != d["sha256"]:
            return f"{path}:{d['first_line']} {d['name']}"
    return None
