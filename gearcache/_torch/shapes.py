"""Symbolic sizes of a trace (a Dynamo graph whose marked dims are SymInts, or its ATen retrace): a size's sympy
expression and example value, the guards the trace put on sizes, the sizes its shape environment specialised.
Consumers: gearcache/compiling/capture.py, gearcache/compiling/torch_compile_backend.py, gearcache/gears/padding.py.
"""
from __future__ import annotations

from typing import Any

import torch


def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt, SymFloat or SymBool; plain numbers come back as they are."""
    node = getattr(value, "node", None)
    return node.expr if node is not None and hasattr(node, "expr") else value


def size_hint(value: Any) -> int:
    """The example value of a size that may be a SymInt (what the trace's example input had)."""
    node = getattr(value, "node", None)
    return int(node.hint) if node is not None else int(value)


def shape_guards(gm: torch.fx.GraphModule) -> list[tuple[Any, str]]:
    """The guards the trace put on sizes, ``(sympy expression, user source line or "")``: a Python branch on a
    marked dim's size shows here (``s0 > 2``)."""

    env = _shape_env(gm)
    if env is None:
        return []
    return [(g.expr, str(getattr(g.sloc, "maybe_user_loc", "") or "")) for g in env.guards]


def specialized_sizes(gm: torch.fx.GraphModule) -> dict[Any, Any]:
    """The size symbols of ``gm``'s trace that its shape environment has replaced by a number by now, ``{symbol:
    number}``. ``aten_graph`` on torch 2.11 specializes a batch size a 3-D matmul expands over (its
    ``expand(view, [4, 4, 4])`` holds the example's number, not the symbol; 2.13 keeps the symbol): a graph read after
    that treats the size as static, so the caller must not take it as a proof about other sizes."""
    env = _shape_env(gm)
    if env is None:
        return {}
    return {sym: value for sym, value in getattr(env, "replacements", {}).items() if getattr(value, "is_number", False)}


def _shape_env(gm: torch.fx.GraphModule) -> Any:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")])
    return getattr(mode, "shape_env", None)

