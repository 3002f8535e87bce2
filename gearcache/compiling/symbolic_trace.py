"""The gear plan's symbolic trace: the method traced once by Dynamo with its marked dims dynamic (no compile), read
for the symbol of each marked dim, the output dims to cut back, the graph for the padding analysis
(gearcache/gears/padding.py) and the trace's guards. Refused here: a marked dim the method specialises on, an output
dim derived from a marked one without equalling it; and, where the gear plan is built (refuse_views_of_padded), an
output that is a view of a padded argument.
"""
from __future__ import annotations

import types
from typing import Any

import torch

from .._torch import capture as torch_capture, guards as torch_guards, shapes as torch_shapes
from ..call import signature
from ..errors import GearcacheError, GraphBreakError
from ..gears.plan import SymbolicTrace
from ..keys import guards_from_dynamo
from .capture import (_dependencies, _output_nodes, _output_recipe, _qualname, _raise_data_dependent,
                      _raise_op_type_error, _raise_side_effects, _recording_backend, _refuse_unmarked_partner,
                      _state_names, passed_names)
from ..snapshot import kept


def symbolic_shapes(method: types.MethodType, module: torch.nn.Module, structure: Any, leaves: tuple[Any, ...],
                    marked: list[tuple[int, int]]) -> SymbolicTrace:
    """Trace the method once with the ``marked`` (leaf, dim) pairs dynamic (no compile) and read the symbols.

    Returns the symbol of each marked dim (dims that meet in the graph share one); for each output leaf, ``(dim,
    symbol)`` for every dim whose size is exactly a marked symbol; the traced user functions; the trace's value guards;
    and the graph with its inputs, outputs and size guards, for the padding analysis. The graph is not run: its
    outputs are empty tensors of the example's sizes, so the trace writes nothing (a buffer or input the method
    updates in place keeps its value). A marked dim the model specialises on (its size became a constant) cannot be
    padded: error.
    """
    from ..call.signature import unflatten

    clones = _dynamic_clones(leaves, marked)
    args, kwargs = unflatten(structure, tuple(clones))
    with torch_capture.DYNAMO_LOCK:        # one trace at a time in the process (see its docstring)
        state, result, recording = _trace_symbolically(method, module, args, kwargs)
    gm, state_names = state["gm"], _state_names(module)
    guards = torch_shapes.shape_guards(gm)
    same = size_classes(guards)
    inputs = [_symbolic_input(t, clones, state_names) for t in state["inputs"]]
    symbols = _marked_symbols(method, gm, inputs, marked, same)
    recipe = _output_recipe(result, state.get("flat_out", []), tuple(clones), state_names)
    outputs = {int(ref): j for j, (kind, ref) in enumerate(recipe["leaves"]) if kind == "out"}
    return SymbolicTrace(symbols, _cut_dims(method, gm, outputs, symbols, same), _dependencies(state["code"]),
                         guards_from_dynamo.from_dynamo(recording, method, passed_names(method, args, kwargs)), gm,
                         inputs, outputs, guards, same)


def _dynamic_clones(leaves: tuple[Any, ...], marked: list[tuple[int, int]]) -> list[Any]:
    """``leaves`` with each marked leaf replaced by a clone whose marked dims are dynamic (the caller's tensors keep
    no mark)."""
    clones = list(leaves)
    for leaf_index, _ in marked:
        if clones[leaf_index] is leaves[leaf_index]:
            clones[leaf_index] = leaves[leaf_index].clone()
    for leaf_index, dim in marked:
        torch_capture.require_dynamic(clones[leaf_index], dim)
    return clones


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's flattened arguments (``signature.flatten``)."""
    leaves: list[Any] = []
    signature.flatten((args, kwargs), leaves)
    return leaves


def _trace_symbolically(method: types.MethodType, module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any, torch_guards.GuardRecording]:
    """Trace ``method(*args, **kwargs)`` with Dynamo without compiling or running its graph: returns ``(state, result,
    recording)``, ``state`` holding the graph (``"gm"``), its example inputs (``"inputs"``), the traced code
    (``"code"``) and the empty outputs the graph gave (``"flat_out"``); ``result`` is the method's return value built
    from them, ``recording`` the guards Dynamo recorded."""
    state: dict[str, Any] = {}
    record = _recording_backend(state, _empty_like_hint)
    code = method.__func__.__code__
    torch_capture.forget_dynamo_cache(code)
    recording = torch_guards.GuardRecording()
    try:
        # the graph is not run (``run`` returns empty outputs); whatever tracing itself writes into the module's
        # buffers is put back all the same, so a call that builds the plan updates the state once, as eager does
        with (torch_capture.dynamo_capture_config(), torch_capture.symbolic_capture_config(),
              kept(list(module.buffers()))):
            result = torch.compile(method, fullgraph=True, dynamic=None, backend=record,
                                   options=torch_guards.guard_recording_options(
                                       recording, method.__func__.__globals__))(*args, **kwargs)
    except Exception as exc:
        if torch_capture.is_graph_break(exc):
            _raise_op_type_error(method, exc)
            breaks = torch_capture.explain_graph_breaks(method, args, kwargs, exc,
                                                        [*_leaves(args, kwargs), *module.buffers()])
            raise GraphBreakError(_qualname(method), breaks) from None
        if "specializ" in str(exc).lower() or "constraint" in str(exc).lower():
            raise GearcacheError(
                f"{_qualname(method)}: a dim marked with gears cannot vary: the method specialises on its size "
                f"({str(exc).strip().splitlines()[0]}). Fix: remove the gears of that dim, or avoid Python logic on "
                f"that size") from None
        _raise_side_effects(method, exc)
        _raise_data_dependent(method, exc)
        _refuse_unmarked_partner(method, exc)
        raise
    finally:
        torch_capture.forget_dynamo_cache(code)
    if "gm" not in state:
        raise GearcacheError(f"{_qualname(method)} computes nothing with tensors: there is no graph to compile")
    return state, result, recording


def size_classes(guards: list[tuple[Any, str]]) -> dict[Any, Any]:
    """symbol -> the symbol it equals by the trace's guards, one representative per class. Two marked dims that meet
    in an op Dynamo does not unify them in keep two symbols and get a guard ``Eq(s91, s77)`` instead."""
    import sympy

    from ..gears.plan import joined_classes

    pairs = [(expr.lhs, expr.rhs) for expr, _ in guards
             if isinstance(expr, sympy.Eq) and expr.lhs.is_Symbol and expr.rhs.is_Symbol]
    return {x: r for x, r in joined_classes(pairs).items() if r != x}


def _empty_like_hint(node: Any) -> Any:
    """An empty tensor shaped like an output node's example value at the trace's example sizes."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node
    if isinstance(value, torch.Tensor):
        return torch.empty_strided([torch_shapes.size_hint(s) for s in value.shape],
                                   [torch_shapes.size_hint(s) for s in value.stride()], dtype=value.dtype,
                                   device=value.device)
    return value


def _symbolic_input(t: Any, clones: list[Any], state_names: dict[int, str]) -> list[Any]:
    """A graph input of the symbolic trace: ``["leaf", i]``, ``["state", name]``, ``["size"]`` (a SymInt) or
    ``["other"]``."""
    if not isinstance(t, torch.Tensor):
        return ["size"]
    for i, clone in enumerate(clones):
        if clone is t:
            return ["leaf", i]
    return ["state", state_names[id(t)]] if id(t) in state_names else ["other"]


def _marked_symbols(method: types.MethodType, gm: torch.fx.GraphModule, inputs: list[list[Any]],
                    marked: list[tuple[int, int]], same: dict[Any, Any]) -> list[str]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_of = {recipe[1]: node.meta.get("example_value") for node, recipe in zip(placeholders, inputs)
               if recipe[0] == "leaf"}
    symbols = []
    for leaf_index, dim in marked:
        size = fake_of[leaf_index].shape[dim] if leaf_index in fake_of else None
        if not isinstance(size, torch.SymInt):
            raise GearcacheError(
                f"{_qualname(method)}: input {leaf_index} dim {dim} is marked with gears, but the traced graph "
                f"treats it as the constant {size}: the method specialises on that size, so padding it would change "
                f"its result. Fix: remove the gears of that dim")
        symbols.append(str(torch_shapes.sym_expr(size).xreplace(same)))
    return symbols


def refuse_views_of_padded(method: types.MethodType, trace: SymbolicTrace, padded: set[int]) -> None:
    """Error for a method output that is a view of an argument the gear plan pads (a leaf in ``padded``: their
    example values in ``trace`` share a storage): a padded call copies that argument, so the caller would get a view
    of the copy, through which eager's later writes (to the view or the argument) would not show."""
    places = [n for n in trace.graph.graph.nodes if n.op == "placeholder"]
    storages = {id(v.untyped_storage()): int(r[1]) for n, r in zip(places, trace.inputs)
                if r[0] == "leaf" and r[1] in padded and isinstance(v := n.meta.get("example_value"), torch.Tensor)}
    out_nodes = _output_nodes(trace.graph)
    for i, j in sorted(trace.outputs.items(), key=lambda item: item[1]):
        value = out_nodes[i].meta.get("example_value")
        if isinstance(value, torch.Tensor) and id(value.untyped_storage()) in storages:
            raise GearcacheError(
                f"{_qualname(method)}: output {j} is a view of the argument at flattened position "
                f"{storages[id(value.untyped_storage())]}, whose dims have gears: a padded call copies that argument, "
                f"so the output would be a view of the copy (in eager, writes through either show in the other). "
                f"Fix: return a .clone() of it, or remove the gears of that argument")


def _cut_dims(method: types.MethodType, gm: torch.fx.GraphModule, outputs: dict[int, int], symbols: list[str],
              same: dict[Any, Any]) -> dict[int, list[tuple[int, str]]]:
    """For each method output leaf made by the graph, ``(dim, symbol)`` for each dim whose size is a marked symbol;
    a dim derived from one without equalling it cannot be cut back: error."""
    out_nodes = _output_nodes(gm)
    output_dims: dict[int, list[tuple[int, str]]] = {}
    for i, j in sorted(outputs.items(), key=lambda item: item[1]):
        value = out_nodes[i].meta.get("example_value")
        dims = []
        for dim, size in enumerate(getattr(value, "shape", [])):
            if isinstance(size, torch.SymInt):
                expr = torch_shapes.sym_expr(size).xreplace(same)
                if str(expr) in symbols:
                    dims.append((dim, str(expr)))
                elif any(s in {str(x) for x in expr.free_symbols} for s in symbols):
                    raise GearcacheError(
                        f"{_qualname(method)}: output {j} dim {dim} has size {expr}, derived from a padded dim but "
                        f"not equal to one, so it cannot be cut back. Fix: remove the gears of that dim")
        if dims:
            output_dims[j] = dims
    return output_dims
