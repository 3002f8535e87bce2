"""A Dynamo graph retraced to ATen ops, where every op has a schema (which arguments it writes, which it returns a
view of): what gearcache/gears/padding.py reads of the gear plan's symbolic trace. Sizes of the retrace:
:mod:`gearcache._torch.shapes`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, cast

import torch


# gearcache/gears/padding.py reads the gear plan's symbolic trace (a Dynamo graph whose marked dims are SymInts) at
# the ATen
# level, where every op has a schema (which arguments it writes, which it returns a view of).
OpOverload = torch._ops.OpOverload
"""An ATen op's overload (``aten.gelu.default``): what a decomposition table maps."""


def op_overloads(value: object) -> list[OpOverload] | None:
    """``value``'s overloads: ``[value]`` for an overload, each overload of a packet (``aten.gelu``); None for
    anything else."""
    if isinstance(value, torch._ops.OpOverload):
        return [value]
    if isinstance(value, torch._ops.OpOverloadPacket):
        return [getattr(value, name) for name in value.overloads()]    # type: ignore[no-untyped-call]
    return None


def in_place_variant(op: OpOverload) -> OpOverload | None:
    """The in-place overload of a pointwise ``op`` (``aten.add_.Tensor`` of ``aten.add.Tensor``); None where there is
    none, where ``op`` is not pointwise (an in-place view or resize, ``squeeze_``, ``t_``, changes metadata, not data)
    or where their parameters differ in name or order."""
    if torch.Tag.pointwise not in op.tags:
        return None
    packet = getattr(getattr(torch.ops, op.namespace), f"{op.overloadpacket.__name__}_", None)
    found = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(found, torch._ops.OpOverload):
        return None
    names = [[a.name for a in o._schema.arguments] for o in (op, found)]
    return found if names[0] == names[1] else None      # polygamma(n, self) against polygamma_(self, n): none


def is_op_or_namespace(value: object) -> bool:
    """Whether ``value`` is an op, a packet or an op namespace (``torch.ops.aten``): named by its name alone."""
    return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops._OpNamespace))


def aten_graph(gm: torch.fx.GraphModule,
               decompositions: dict[OpOverload, Callable[..., object]] | None = None) -> torch.fx.GraphModule:
    """``gm`` retraced to ATen ops on its own fake example inputs (nothing runs on real data): ``make_fx`` of an FX
    interpreter under the graph's fake mode, symbolically, as AOTAutograd traces it but without functionalisation, so
    in-place ops and views stay in the graph; each node keeps the ``stack_trace`` of the Dynamo node it came from.
    ``decompositions``: the method's custom decompositions, applied as in the graph that is compiled."""
    import torch.fx.traceback as fx_traceback
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    fakes = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    with detect_fake_mode(fakes) or contextlib.nullcontext(), fx_traceback.preserve_node_meta(), torch.no_grad():
        # symbolic: the trace's own shape environment keeps each size a symbol (2.11's "real" mode fixed a batch a
        # 3-D matmul expands over to the example's number: padding.analyse would read it as static)
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=decompositions,
                       tracing_mode="symbolic")(*fakes)


def forget_unbacked_bindings(gm: torch.fx.GraphModule) -> None:
    """Drop the ``unbacked_bindings`` a ``make_fx`` trace left on ``gm``'s nodes (an ``item()`` of a float argument
    Dynamo passes as a tensor binds an unbacked symbol, ``zuf0``): AOTAutograd's retrace of ``gm`` in a fresh shape
    environment names its own symbol ``zuf0`` too, and ``rebind_unbacked`` takes the equal names for "possible memo
    disaster" (torch 2.13); it binds its own symbols without them."""
    for node in gm.graph.nodes:
        node.meta.pop("unbacked_bindings", None)


def op_schema(target: object) -> torch._C.FunctionSchema | None:
    """The schema (``torch._C.FunctionSchema``) of an ATen op overload; None for anything else."""
    return getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None


def aten_op(node: torch.fx.Node) -> torch._ops.OpOverload:
    """The ATen op overload that a ``call_function`` node of an ATen graph (:func:`aten_graph`) calls: the node's
    target, typed as what it is (for a node whose :func:`op_schema` is not None)."""
    return cast(torch._ops.OpOverload, node.target)

