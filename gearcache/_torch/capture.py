"""Dynamo, as gearcache's capture uses it (gearcache/compiling/capture.py, gearcache/gears/plan.py): the settings a
capture runs under, dynamic-dim marks, the code a trace covered, dropping Dynamo's cache for a function, and telling a
graph break from other errors. What Dynamo's guards say is in :mod:`gearcache._torch.guards`; the symbolic sizes of
a trace in :mod:`gearcache._torch.shapes`.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import types
from typing import Iterator, cast

import torch

from ..snapshot import kept

DYNAMO_LOCK = threading.RLock()
"""Held by every trace gearcache runs (gearcache/compiling/: capture.py ``capture``, symbolic_trace.py
``symbolic_shapes``), one at a time in the process: Dynamo's cache entries live on the code object, so two threads
tracing one code at once (the first calls of two identical blocks, served by threads of their own) free each other's
entries (``forget_dynamo_cache``: an ``InternalTorchDynamoError``, or a segfault), and the settings below are
process-wide. Re-entrant (a trace that raises runs ``explain`` under it). Taken once per capture, never on the call
path."""


def dynamo_capture_config() -> contextlib.AbstractContextManager[None]:
    """Dynamo settings for a capture: no automatic dynamic shapes (every entry is static). Parameters and buffers are
    graph inputs (``inline_inbuilt_nn_modules``, always on in 2.11 and 2.13), so a loaded entry reads live weights."""
    from torch.utils._config_module import ConfigModule

    return cast(ConfigModule, torch._dynamo.config).patch({"automatic_dynamic_shapes": False})   # a config module


def symbolic_capture_config() -> contextlib.AbstractContextManager[None]:
    """Settings for the symbolic trace that finds which marked dims meet: no duck sizing (two unrelated dims that
    happen to have the same example size must get different symbols)."""
    import torch.fx.experimental._config as fx_config
    from torch.utils._config_module import ConfigModule

    return cast(ConfigModule, fx_config).patch({"use_duck_shape": False})   # a config module, made one at its import


@contextlib.contextmanager
def without_dynamic_marks(leaves: tuple[object, ...]) -> Iterator[None]:
    """Hide ``torch._dynamo.mark_dynamic`` marks (set by ``set_dim_gears`` for the torch.compile route) from a
    static capture, restoring them afterwards."""
    saved = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            for attr in [a for a in leaf.__dict__ if a.startswith(("_dynamo_", "_has_dynamo_"))]:
                saved.append((leaf, attr, leaf.__dict__.pop(attr)))
    try:
        yield
    finally:
        for leaf, attr, value in saved:
            setattr(leaf, attr, value)


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Let Dynamo treat ``dim`` as dynamic (the torch.compile route of gears): one graph for every gear."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def require_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Make ``dim`` of ``tensor`` dynamic in the next Dynamo trace, strictly (``torch._dynamo.mark_dynamic``): a trace
    that specialises on its size raises (a constraint violation) instead of quietly making it static."""
    torch._dynamo.mark_dynamic(tensor, dim)


def traced_code() -> list[types.CodeType]:
    """Code objects Dynamo traced for the graph being compiled (call inside a backend)."""
    return list(torch._guards.TracingContext.get_traced_code() or [])


def input_sources(gm: torch.fx.GraphModule) -> list[str | None]:
    """Where Dynamo read each input of its graph ``gm``, as its source names it (``L['self'].t``, ``G['SCALE']``,
    ``L['bias']``), in placeholder order; None where a placeholder has no source (for messages only)."""
    names: list[str | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        names.append(name if isinstance(name, str) else None)
    return names


_LIBRARY_PATHS = re.compile(r"/(torch|gearcache)/|/(contextlib|functools)\.py$")


def source_line(node: torch.fx.Node) -> str:
    """``file:line in function: code`` of the user's source line that made ``node`` (from its stack trace): the
    innermost frame outside torch and gearcache, else the innermost frame."""
    lines = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((m.group(1), f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}: {code}"))
    user = [text for path, text in frames if not _LIBRARY_PATHS.search(path)]
    return (user or [text for _, text in frames] or [""])[-1]


def first_data_dependent(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first node of Dynamo's graph ``gm`` whose value has a size (or is a number) computed from tensor values (an
    unbacked symbol: ``nonzero``, boolean-mask indexing, ``unique``), or None. Inside a backend's call (the nodes'
    ``example_value``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    nodes: list[torch.fx.Node] = list(gm.graph.nodes)
    return next((n for n in nodes if n.op == "call_function" and free_unbacked_symbols(n.meta.get("example_value"))),
                None)


def forget_dynamo_cache(code: types.CodeType) -> None:
    """Drop Dynamo's cache entries for ``code`` so captures of new shapes never count towards its recompile limit and
    nothing of the capture stays installed on the user's function."""
    torch._C._dynamo.eval_frame.reset_code(code)


def is_graph_break(exc: BaseException) -> bool:
    """Dynamo could not capture the method as one graph (``Unsupported``, or a ``UserError`` such as a Python branch
    on a data-dependent value)."""
    exc_mod = torch._dynamo.exc
    return isinstance(exc, (exc_mod.Unsupported, exc_mod.UserError, exc_mod.UncapturedHigherOrderOpError))


def op_type_error(exc: BaseException) -> TypeError | None:
    """The ``TypeError`` an op of the traced code raised on the call's arguments (``linear()`` given None where a
    tensor goes), which Dynamo reports as a graph break ("TypeError when making fake tensor call", with it as the direct
    cause: checked on 2.13 and 2.14); None for any other break (a torch that chains it otherwise reports a graph
    break, as before)."""
    cause = exc.__cause__
    if isinstance(exc, torch._dynamo.exc.Unsupported) and type(cause) is TypeError:
        return cause
    return None


def op_runtime_error(exc: BaseException) -> RuntimeError | None:
    """The ``RuntimeError`` an op of the traced code raised on the call's fake tensors (``linear()`` given a [3, 9]
    input for an [8, 8] weight), which Dynamo raises as a ``TorchRuntimeError`` chained to it (its context a graph
    break caused by it: checked on 2.13); None for any other error."""
    if not isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
        return None
    inner: BaseException | None = exc
    for _ in range(4):
        inner = inner.__cause__ or inner.__context__ if inner is not None else None
        if isinstance(inner, RuntimeError) and not isinstance(inner, torch._dynamo.exc.TorchDynamoException):
            return inner
    return None


def local_side_effects() -> list[str]:
    """Inside a Dynamo backend's call: the sources of the Python objects reachable from the traced frame's locals (the
    module ``self``, the arguments) that the trace writes outside its graph and Dynamo would replay after it
    (``["L['self'].seen"]``); writes to globals and other modules (a library's own context state) are not listed.
    Checked on 2.13-2.14 (``OutputGraph.get_replayed_side_effect_source_refs``) and 2.11, which lacks it: there the
    same list is read from ``side_effects`` (its modified variables whose mutation is of an existing object, as that
    method reads them; a source's ``name`` a method there, a property since)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    output = InstructionTranslator.current_tx().output
    if hasattr(output, "get_replayed_side_effect_source_refs"):
        refs = output.get_replayed_side_effect_source_refs()
    else:
        refs = replayed_sources(output)
    return [r for r in refs if r.startswith("L[")]


def replayed_sources(output: object) -> list[str]:
    """What ``local_side_effects`` reads where ``OutputGraph.get_replayed_side_effect_source_refs`` is missing (2.11):
    the sources of ``output.side_effects``' modified variables whose mutation is of an existing object."""
    from torch._dynamo.variables.base import AttributeMutationExisting, ValueMutationExisting

    existing = (AttributeMutationExisting, ValueMutationExisting)
    return [_source_name(var.source) for var in output.side_effects._get_modified_vars()  # type: ignore[attr-defined]
            if isinstance(getattr(var, "mutation_type", None), existing)]


def _source_name(source: object) -> str:
    """A Dynamo source's name (``L['self'].seen``): a property on 2.13+, a method on 2.11."""
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    return name if isinstance(name, str) else "<unknown source>"


def backend_error(exc: BaseException) -> BaseException | None:
    """The exception a backend raised, out of Dynamo's ``BackendCompilerFailed`` (None for any other error)."""
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
        return exc.inner_exception
    return None


def untraceable_call(exc: BaseException, class_name: str) -> str | None:
    """Where the capture stopped at a call of an instance of ``class_name`` that Dynamo cannot trace (its C
    ``__call__``), as ``"file:line in name: source"`` (the innermost user frame); None for any other break. Checked on
    2.13: ``Unsupported`` says "method `__call__` of class `<name>`"; 2.14: "no traceable __call__", the object's repr
    (``<gearcache.<name> ...>``) in its debug context; both carry ``innermost_user_frame_summary``."""
    if not isinstance(exc, torch._dynamo.exc.Unsupported):
        return None
    text = f"{getattr(exc, 'msg', '')}\n{exc}"
    if f"`__call__` of class `{class_name}`" not in text and f"object=<gearcache.{class_name} " not in text:
        return None
    f = getattr(exc, "innermost_user_frame_summary", None)
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" if f is not None else "(source unknown)"


def explain_graph_breaks(method: types.MethodType, args: tuple[object, ...], kwargs: dict[str, object],
                         exc: BaseException, written: list[object]) -> list[tuple[str, str]]:
    """``(reason, user source line)`` for every graph break of the call that ``torch._dynamo.explain`` finds (the
    method's Dynamo cache entries dropped after it); where explain itself fails, or finds none, the one break the
    capture's error ``exc`` tells of. Explain runs the method: what it may write, ``written`` (its tensors), is
    restored after it."""
    breaks = []
    try:
        with kept(written):
            out = torch._dynamo.explain(method)(*args, **kwargs)
        for br in out.break_reasons:
            frames = [f for f in (br.user_stack or []) if "/torch/" not in f.filename.replace(os.sep, "/")]
            f = frames[-1] if frames else (br.user_stack[-1] if br.user_stack else None)
            where = f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" if f else "(source unknown)"
            breaks.append((str(br.reason).strip().splitlines()[0] if str(br.reason).strip() else "unknown", where))
    except Exception:           # explain itself failed: report the one break we know of
        breaks = []
    finally:
        forget_dynamo_cache(method.__func__.__code__)
    return breaks or [(str(exc).strip().splitlines()[0], "(see the traceback of torch._dynamo.exc.Unsupported)")]


def as_subclass_sharing_storage(cls: type, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as an instance of the Tensor subclass ``cls``, sharing its storage
    (``torch.Tensor._make_subclass``)."""
    return torch.Tensor._make_subclass(cls, tensor)

