"""Dynamo's guard sources, the Python expressions it evaluates a guarded object with (``L['self']._modules['ln'].eps``,
``G['SCALE']``), read as value guard paths (gearcache/keys/guard_paths.py) whose root is still Dynamo's:
``("L", name)`` (a local: ``self``, an argument, a closure cell) or ``("G", name)`` (a global);
gearcache/keys/guards_from_dynamo.py resolves it. Any form not read here is ``Unpersistable``.
"""
from __future__ import annotations

import ast
from typing import Any

from ..errors import Unpersistable
from .guard_paths import GuardPath


def parse_source(text: str) -> GuardPath:
    """Dynamo's source expression (``L['self']._modules['ln'].eps``, ``G['SCALE']``,
    ``dict(type(G['c']).__mro__[1].__dict__)['f']``, ``dict.__getitem__(X, list(dict.keys(X))[1])``) as a path whose
    root is ``("L", name)`` or ``("G", name)``. Unpersistable for any other form."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise Unpersistable(f"source {text!r} is not an expression") from None
    return _parse(node, text)


def _parse(node: ast.AST, text: str) -> GuardPath:
    key_at = _key_at(node)
    if key_at is not None:
        return _parse(key_at[0], text) + (("key_at", key_at[1]),)
    if isinstance(node, ast.Subscript):
        key_at = _key_at(node.slice)
        if key_at is not None and ast.dump(key_at[0]) == ast.dump(node.value):    # X[list(dict.keys(X))[i]]
            return _parse(node.value, text) + (("item_at", key_at[1]),)
        key = _constant(node.slice, text)
        if isinstance(node.value, ast.Name) and node.value.id in ("L", "G"):
            return ((node.value.id, key),)
        return _parse(node.value, text) + (("item", key),)
    if isinstance(node, ast.Attribute):
        return _parse(node.value, text) + (("attr", node.attr),)
    if isinstance(node, ast.Call) and not node.keywords:
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id == "type" and len(args) == 1:
            return _parse(args[0], text) + (("type",),)
        if isinstance(func, ast.Name) and func.id == "dict" and len(args) == 1:
            return _parse(args[0], text)                # a copy of a mapping: items read the same
        if isinstance(func, ast.Name) and func.id == "___odict_getitem" and len(args) == 2:
            return _parse(args[0], text) + (("item", _constant(args[1], text)),)
        item_at = _dict_item_at(func, args)
        if item_at is not None:
            return _parse(args[0], text) + (("item_at", item_at),)
        if (isinstance(func, ast.Attribute) and func.attr == "__getattribute__" and isinstance(func.value, ast.Name)
                and func.value.id == "object" and len(args) == 2):
            return _parse(args[0], text) + (("generic_attr", _constant(args[1], text)),)
    raise Unpersistable(f"source {text!r} has a form gearcache does not read")


def _dict_item_at(func: ast.AST, args: list[ast.expr]) -> int | None:
    """``dict.__getitem__(X, list(dict.keys(X))[i])``, the value at X's i-th key: ``i``; None for any other form."""
    if not (isinstance(func, ast.Attribute) and func.attr == "__getitem__" and isinstance(func.value, ast.Name)
            and func.value.id == "dict" and len(args) == 2):
        return None
    key_at = _key_at(args[1])
    return key_at[1] if key_at is not None and ast.dump(key_at[0]) == ast.dump(args[0]) else None


def _key_at(node: ast.AST) -> tuple[ast.expr, int] | None:
    """``list(dict.keys(X))[i]``, X's i-th key: ``(X, i)``; None for any other form."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "list" and len(node.value.args) == 1):
        return None
    keys = node.value.args[0]
    if (isinstance(keys, ast.Call) and isinstance(keys.func, ast.Attribute) and keys.func.attr == "keys"
            and isinstance(keys.func.value, ast.Name) and keys.func.value.id == "dict" and len(keys.args) == 1):
        return keys.args[0], node.slice.value
    return None


def _constant(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))):
        return -node.operand.value
    raise Unpersistable(f"source {text!r} indexes with a key that is not a constant")
