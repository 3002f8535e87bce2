"""Dims as factors: how the padding analysis follows which rows of a dim are real through views and reshapes.

A dim of a tensor the padding walk (padding_walk.py) follows is a tuple of *factors*, outer to inner: an int (a plain
factor > 1) or a sympy expression in a marked dim's symbol (a padded factor); ``()`` is a dim of size 1. A ``view``
that merges ``[s, 4]`` into ``[4 * s]`` gives one dim ``(s, 4)``, and a later view that splits it back is followed
exactly (:func:`regroup`). A dim is *padded* when one of its factors is a symbol's expression: its first (real size)
rows are the real ones, the rest are padding. Sizes are ints or sympy expressions (:func:`size_expr`); nothing here
knows a tensor or an op.
"""
from __future__ import annotations

import math
from typing import Any, Union

import sympy

from .._torch import shapes as torch_shapes

Factor = Union[int, sympy.Expr]
"""A plain factor > 1, or a sympy expression in a marked dim's symbol (a padded factor); sympy is untyped."""
Dim = tuple[Factor, ...]
"""Factors outer to inner; ``()`` is size 1."""


def size_expr(value: Any, same: dict[Any, Any]) -> Any:
    """A size as an int, or a sympy expression when it involves a symbol (each symbol replaced by the one ``same``
    says it equals: see symbolic_trace.size_classes)."""
    expr = torch_shapes.sym_expr(value)
    if isinstance(expr, (int, bool)):
        return int(expr)
    return int(expr) if getattr(expr, "is_number", False) else expr.xreplace(same)


def is_padded_dim(dim: Dim) -> bool:
    """Whether a dim has a padded factor (a symbol's expression): its rows past the real size are padding."""
    return any(not isinstance(f, int) for f in dim)


def dim_size(dim: Dim) -> Any:
    """A dim's size: the product of its factors (a sympy expression when one is padded)."""
    return sympy.Mul(*dim) if any(not isinstance(f, int) for f in dim) else math.prod(dim)


def canonical(dim: Dim) -> Dim:
    """Adjacent plain factors merged: two dims hold their padded rows in line iff these are equal."""
    out: list[Factor] = []
    for f in dim:
        if isinstance(f, int) and out and isinstance(out[-1], int):
            out[-1] *= f
        elif f != 1:
            out.append(f)
    return tuple(out)


def is_whole(x: Any) -> bool:
    """A positive integer, or an expression with no denominator (``4 * s / s``, ``s``)."""
    if isinstance(x, int):
        return x >= 1
    x = sympy.cancel(x)
    return bool(sympy.fraction(x)[1] == 1) and not (x.is_number and x < 1)


def regroup(dims: tuple[Dim, ...], sizes: list[Any]) -> tuple[Dim, ...] | None:
    """The factors of ``dims`` (in row-major order) regrouped into dims of ``sizes``, as ``view``/``reshape`` does;
    None when that would split a padded factor (its rows would no longer line up)."""
    queue = [f for d in dims for f in d if f != 1]
    out = []
    for size in sizes:
        group, prod = [], 1
        while not same_size(prod, size):
            if not queue:
                return None
            f = queue[0]
            rest = divide(size, mul(prod, f))
            if rest is not None:
                group.append(queue.pop(0))
                prod = mul(prod, f)
                continue
            need = divide(size, prod)
            left = divide(f, need) if need is not None and isinstance(f, int) and isinstance(need, int) else None
            if left is None:
                return None
            group.append(need)
            queue[0] = left
            prod = size
        out.append(tuple(group))
    return tuple(out) if not queue else None


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are equal for every value of the symbols."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0)


def mul(a: Any, b: Any) -> Any:
    """The product of two sizes (a sympy expression when one is)."""
    return a * b if isinstance(a, int) and isinstance(b, int) else sympy.sympify(a) * b


def divide(a: Any, b: Any) -> Any:
    """``a / b`` when it is whole (see :func:`is_whole`), else None."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b if b and a % b == 0 else None
    q = sympy.cancel(sympy.sympify(a) / b)
    if not is_whole(q):
        return None
    return int(q) if q.is_number else q


def numel(dims: tuple[Dim, ...]) -> Any:
    """The number of elements of a tensor of ``dims``."""
    return dim_size(tuple(f for d in dims for f in d))
