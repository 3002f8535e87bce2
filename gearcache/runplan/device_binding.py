"""Free a generated wrapper of its GPU's index, so that one artifact runs on any GPU of the same kind.

Inductor writes the index of the GPU it compiled on into the Python wrapper as literals::

    with torch.cuda._DeviceGuard(0):                       device guard
        torch.cuda.set_device(0)                           current device inside the guard
        stream0 = get_raw_stream(0)                        the current stream of that device
        buf1 = torch.ops.aten.full.default(..., device=device(type='cuda', index=0), ...)     fallback kernels
        ... 'cuda:0' ...                                   device strings

Allocations (``empty_strided_cuda``) take the current device, which the guard sets. :func:`unbind_device_index`
rewrites each of these literals into the name :data:`BOUND_NAME`, which gearcache's loader binds to the live device
when it executes the wrapper (loader.py); kernels are loaded on that device from the same cubins. A pure function,
text in, text out.

It refuses (:class:`~gearcache.runplan.format.NoPlan` with the reason) any literal it does not understand: another
GPU's index in one of the forms above (a graph on two GPUs), an integer passed to any other call whose name speaks
of a device or a stream, a ``cuda:N`` inside a longer string. The artifact then stays bound to the GPU it was
compiled on (its plan says ``"device_free": false``) and its entries keep the device index in their artifact key.
Not looked at, because nothing in them runs at load: the Triton kernels' sources (``async_compile.triton(...)``:
their metadata names the compile device, the plan loads their cubins on the live one), ``benchmark_compiled_module``,
the ``if __name__ == "__main__":`` block and bare strings (torch 2.11 opens the wrapper with a docstring quoting its
compile-time auto-tuning code, ``'cuda:0'`` and all).
"""
from __future__ import annotations

import ast
import re
from typing import Iterator, NoReturn

from ..errors import NoPlan

BOUND_NAME = "gearcache_device_index"
"""The global name the rewritten wrapper reads the device index from (set in its scope by the loader)."""

_INDEX_CALLS = {"_DeviceGuard", "set_device", "get_raw_stream"}     # call(<index>)
_DEVICE_WORDS = ("cuda", "device", "stream", "event", "guard")      # names of calls that may take an index
_CUDA_STRING = re.compile(r"cuda:(\d+)")


def unbind_device_index(source: str, index: int) -> str:
    """``source`` with every literal of the CUDA device ``index`` replaced by :data:`BOUND_NAME` (``'cuda:N'``
    strings by an f-string). Raises ``NoPlan`` naming the line of any device literal it cannot rewrite."""
    tree = ast.parse(source)
    edits: list[tuple[ast.expr, str]] = []
    for node in _live_nodes(tree):
        if isinstance(node, ast.Call):
            edits.extend(_call_edits(node, index))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUDA_STRING.search(node.value):
            if node.value != f"cuda:{index}":
                _refuse(node, f"device string {node.value!r}")
            edits.append((node, f"f'cuda:{{{BOUND_NAME}}}'"))
    return _splice(source, edits)


def _call_edits(node: ast.Call, index: int) -> list[tuple[ast.expr, str]]:
    """The edits for one call, or NoPlan for an integer among its arguments that may be a device index."""
    name = _callee(node.func)
    if name in _INDEX_CALLS and len(node.args) == 1 and not node.keywords:
        return [(_the_index(node.args[0], index, name), BOUND_NAME)]
    if name == "device" and _is_cuda_device(node):
        kw = next((k.value for k in node.keywords if k.arg == "index"), node.args[1] if len(node.args) > 1 else None)
        if kw is None:
            _refuse(node, "a cuda device without an index")
        return [(_the_index(kw, index, "device"), BOUND_NAME)]
    named = any(w in name.lower() for w in _DEVICE_WORDS)
    ints = [a for a in node.args if named and _is_int(a)]
    ints += [k.value for k in node.keywords if _is_int(k.value) and (named or k.arg in ("device", "device_index"))]
    if ints:
        _refuse(node, f"an integer argument of {name}()")
    return []


def _the_index(arg: ast.expr, index: int, what: str) -> ast.expr:
    if not _is_int(arg):
        _refuse(arg, f"{what}() with a computed argument")
    value = arg.value           # type: ignore[attr-defined]  # an ast.Constant holding an int: _is_int above
    if value != index:
        _refuse(arg, f"{what}({value}) in a graph compiled on cuda:{index} (more than one GPU)")
    return arg


def _is_cuda_device(node: ast.Call) -> bool:
    kinds = [k.value for k in node.keywords if k.arg == "type"] + node.args[:1]
    return any(isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.startswith("cuda")
               for k in kinds)


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _callee(func: ast.AST) -> str:
    """The last name of a call's function (``torch.cuda._DeviceGuard`` -> ``_DeviceGuard``)."""
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _live_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node that runs when the wrapper is loaded and called: all but the Triton kernels' sources, the
    benchmark function and the ``__main__`` block."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef) and node.name == "benchmark_compiled_module":
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue            # a bare string: torch 2.11 opens the wrapper with its auto-tuning block as a docstring
        if isinstance(node, ast.Call) and _callee(node.func) == "triton" and \
                _callee(getattr(node.func, "value", node.func)) == "async_compile":
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _refuse(node: ast.AST, what: str) -> NoReturn:
    raise NoPlan(f"device index not bindable: {what} at line {getattr(node, 'lineno', '?')} of the wrapper")


def _splice(source: str, edits: list[tuple[ast.expr, str]]) -> str:
    """Replace each node's text by its new text (positions are UTF-8 byte offsets within lines)."""
    lines = [line.encode() for line in source.splitlines(keepends=True)]
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        if node.lineno != node.end_lineno:
            _refuse(node, "a literal spanning lines")
        row = node.lineno - 1
        lines[row] = lines[row][:node.col_offset] + text.encode() + lines[row][node.end_col_offset:]
    return b"".join(lines).decode()
