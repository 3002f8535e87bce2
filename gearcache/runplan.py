"""Run a compiled artifact without torch's compiler: gearcache's own loader for Inductor's generated code.

torch's loader (``CompiledArtifact.load``) imports Inductor and AOTAutograd with all their registrations before it
reads a byte (3.7 s on the H200 host, 1.5 s here). A call needs far less: Inductor's generated Python wrapper, the
kernel binaries, the launch parameters the autotuner settled on and a handful of runtime helpers. At compile time
gearcache writes these into the artifact's ``runplan/`` folder (``_torch_compat.write_run_plan``), after checking on
the compiling call's own inputs that the plan's outputs are identical to those of torch's loader. This module runs
such a plan importing nothing from ``torch._inductor`` or ``triton``: Triton kernels are launched from their cubins
through torch's static CUDA launcher (the one Inductor itself uses), C++ kernels are imported from their ``.so``.

On-disk format (``runplan/`` of an artifact folder; covered by the artifact's digests and signature)::

    plan.json   {"format": 1, "supported": bool, "reason": str (why not, when not supported),
                 "device_type": "cuda" | "cpu", "device_index": int, "wrapper": "wrapper.py",
                 "wrapper_code": "wrapper.code",
                 "num_inputs": int, "num_outputs": int,
                 "inputs_to_check": [int],      inputs assumed 16-byte aligned (cloned when they are not)
                 "mutated_inputs": [int],       inputs the graph writes in place (written back after a clone)
                 "version_bumped_inputs": [int],  inputs whose autograd version counter a call bumps
                 "extern_kernels": {name: ["torch", attr] | ["op", "ns::op", overload]},
                 "ops": [[ns, op], ...],        operators the wrapper looks up in torch.ops
                 "triton": {kernel: {"cubin": "runplan/kernels/<hash>.cubin", "function": str, "shared": int,
                            "num_warps": int, "arg_types": str, "scratch_args": int, "def_args": [str],
                            "call_args": [str], "grid_prefix": [str], "grid": [x, y, z]}},
                 "cpp": {sha256 of a C++ kernel's source: path of its .so inside the artifact}}
    wrapper.py  Inductor's generated wrapper module, run unchanged
    wrapper.code  the same, compiled: the interpreter's magic number + marshalled code (skips a ~20 ms compile)
    kernels/    Triton cubins

Imports the wrapper makes from ``torch._inductor`` and ``triton`` are served by stand-ins here (a run needs only
trivial helpers from them; kernel sources, the one place ``triton`` is used, are never compiled). A wrapper that needs
anything else cannot load this way, and the caller falls back to torch's loader: :func:`load_artifact` never fails
where torch's loader would have worked.
"""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.util
import json
import logging
import marshal
import operator
import os
import pathlib
import sys
import types
from typing import Any, Callable

import torch

from . import _torch_compat as compat
from .counters import counters

log = logging.getLogger("gearcache.runplan")

FORMAT = 1
PLAN_DIR = "runplan"
ALIGNMENT = 16          # Inductor compiles kernels assuming 16-byte aligned inputs (torch._inductor.utils.ALIGNMENT)
ALIGN_BYTES = 64        # torch._inductor.utils.ALIGN_BYTES, behind codegen.memory_planning._align
WRAPPER_FILENAME = "<gearcache artifact>/runplan/wrapper.py"      # in tracebacks


class RunPlanUnavailable(RuntimeError):
    """This process cannot run the plan (the wrapper needs something gearcache's loader does not provide)."""


def load_artifact(folder: pathlib.Path) -> Callable[..., Any]:
    """Load an artifact folder: through its run plan when it has a usable one, else through torch's loader.

    Returns ``fn(*graph_inputs) -> sequence of outputs``."""
    fn = load(folder)
    if fn is not None:
        counters.direct_loads += 1
        return fn
    return compat.load_folder(folder / "inductor")


def load(folder: pathlib.Path) -> Callable[..., Any] | None:
    """The artifact's run plan as a callable, or None (logged at INFO: why) when it has none or it is unusable."""
    path = folder / PLAN_DIR / "plan.json"
    try:
        plan = json.loads(path.read_bytes())
    except FileNotFoundError:
        log.info("%s has no run plan (written by an older gearcache); loading it with torch's loader", folder)
        return None
    if plan.get("format") != FORMAT:
        log.info("%s: run plan format %r, this gearcache reads %d; torch's loader is used", folder,
                 plan.get("format"), FORMAT)
        return None
    if not plan.get("supported"):
        log.info("%s: no run plan (%s); torch's loader is used", folder, plan.get("reason"))
        return None
    try:
        return _Runner(folder, plan).run
    except RunPlanUnavailable as exc:
        log.info("%s: the run plan cannot load in this process (%s); torch's loader is used", folder, exc)
        return None


# ---------------------------------------------------------------------------------------------------- the runner
class _Runner:
    """Executes the generated wrapper with the plan's kernels and exposes ``run(*inputs)``."""

    def __init__(self, folder: pathlib.Path, plan: dict[str, Any]):
        self.folder, self.plan = folder, plan
        _check_ops(plan.get("ops", []))
        kernels = _Kernels(folder, plan)
        scope = self._exec_wrapper(kernels, _resolve_extern_kernels(plan.get("extern_kernels", {})))
        call = scope.get("call")
        if not callable(call):
            raise RunPlanUnavailable("the wrapper defines no call()")
        self.run = _make_run(call, plan)

    def _exec_wrapper(self, kernels: "_Kernels", extern: types.SimpleNamespace) -> dict[str, Any]:
        path = self.folder / PLAN_DIR / self.plan["wrapper"]
        code = _wrapper_code(path, self.plan.get("wrapper_code"))
        scope: dict[str, Any] = {"__name__": f"gearcache_wrapper_{self.folder.name}", "__file__": str(path),
                                 "__builtins__": _builtins_with(_stand_ins(kernels, extern))}
        try:
            exec(code, scope)                   # defines call() and loads every kernel
        except RunPlanUnavailable:
            raise
        except Exception as exc:                # noqa: BLE001 - torch's loader gets its chance (and says what fails)
            raise RunPlanUnavailable(f"{type(exc).__name__}: {exc}") from None
        return scope


def _wrapper_code(path: pathlib.Path, compiled: str | None) -> types.CodeType:
    """The wrapper's code object: from the plan's compiled copy (``wrapper_code``: the interpreter's magic number
    followed by the marshalled code; the Python version is part of every key) when it is this interpreter's, else
    compiled from the source."""
    if compiled:
        data = (path.parent / compiled).read_bytes()
        magic = importlib.util.MAGIC_NUMBER
        if data[:len(magic)] == magic:
            return marshal.loads(data[len(magic):])
    return compile(path.read_text(), WRAPPER_FILENAME, "exec")


def write_wrapper(plan_dir: pathlib.Path, source: str) -> dict[str, str]:
    """Write the wrapper's source and its compiled code into ``plan_dir``; returns the plan's fields naming them."""
    (plan_dir / "wrapper.py").write_text(source)
    code = compile(source, WRAPPER_FILENAME, "exec")
    (plan_dir / "wrapper.code").write_bytes(importlib.util.MAGIC_NUMBER + marshal.dumps(code))
    return {"wrapper": "wrapper.py", "wrapper_code": "wrapper.code"}


def _make_run(call: Callable[[list], Any], plan: dict[str, Any]) -> Callable[..., Any]:
    """The per-call function: what torch's AOTAutograd and CompiledFxGraph wrappers do around ``call`` for an
    inference graph without aliased outputs or mutations applied outside the graph (the only kind that gets a plan):
    grad off during the call, version counters of inputs mutated in the graph bumped, misaligned inputs cloned (and
    written back when the graph mutates them).

    Alignment is checked on every call for every input, except the inputs named by ``run.set_stable_inputs(indices)``
    (a module's parameters and buffers, which stay the same tensors from call to call): those are checked whenever a
    different tensor object arrives. A stable input whose storage is swapped in place (``param.data = t``) for a
    misaligned ``t`` is not noticed; on CUDA the kernel then fails with a misaligned-address error."""
    check = tuple(plan.get("inputs_to_check", ()))
    mutated = frozenset(plan.get("mutated_inputs", ()))
    bumped = tuple(plan.get("version_bumped_inputs", ()))
    n_in, n_out = plan["num_inputs"], plan["num_outputs"]
    grad_enabled, set_grad = torch.is_grad_enabled, torch._C._set_grad_enabled
    bump = torch.autograd.graph.increment_version
    same = operator.is_
    each_call, stable, get_stable, last = check, (), None, None

    def set_stable_inputs(indices: Any) -> None:
        nonlocal each_call, stable, get_stable, last
        chosen = frozenset(indices)
        each_call = tuple(i for i in check if i not in chosen)
        stable = tuple(i for i in check if i in chosen)
        get_stable = (operator.itemgetter(*stable) if len(stable) > 1 else
                      (lambda a: (a[stable[0]],)) if stable else None)
        last = None

    def realign_one(args: list, i: int, copies: list) -> bool:
        x = args[i]
        if x.data_ptr() % ALIGNMENT == 0:
            return False
        args[i] = _clone_preserve_strides(x)
        if i in mutated:
            copies.append((x, args[i]))
        return True

    def realign(args: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        nonlocal last
        copies: list = []
        for i in each_call:
            realign_one(args, i, copies)
        if get_stable is not None:
            current = get_stable(args)
            if last is None or not all(map(same, current, last)):
                misaligned = [realign_one(args, i, copies) for i in stable]
                last = None if any(misaligned) else current
        return copies

    def run(*inputs: Any) -> Any:
        if len(inputs) != n_in:
            raise TypeError(f"compiled graph takes {n_in} inputs, got {len(inputs)}")
        args = list(inputs)
        copies = realign(args) if check else ()
        if bumped:
            bump([args[i] for i in bumped])
        if grad_enabled():
            set_grad(False)
            try:
                outs = call(args)
            finally:
                set_grad(True)
        else:
            outs = call(args)
        for original, copy in copies:
            original.copy_(copy)
        return outs

    run.num_outputs = n_out                         # type: ignore[attr-defined]
    run.wrapper_call = call                         # type: ignore[attr-defined] # Inductor's call(list): benchmarks
    run.set_stable_inputs = set_stable_inputs       # type: ignore[attr-defined]
    return run


def _clone_preserve_strides(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides, in fresh (aligned) memory (torch._inductor.utils.clone_preserve_strides)."""
    needed = 0 if 0 in x.size() else sum((n - 1) * s for n, s in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())


# ------------------------------------------------------------------------------------------------------ kernels
class _TritonKernel:
    """Stands for Inductor's ``CachingAutotuner`` after autotuning: ``run(*args, stream)`` launches the chosen
    config's cubin with the grid Inductor computes for it."""
    __slots__ = ("run", "_function")

    def __init__(self, name: str, spec: dict[str, Any], folder: pathlib.Path, device_index: int):
        self._function = compat.load_cubin(str(folder / spec["cubin"]), spec["function"], spec["shared"],
                                           device_index)
        args = [*spec["call_args"], *(["None"] * spec["scratch_args"])]
        lines = [f"def launcher({', '.join([*spec['def_args'], 'stream'])}):",
                 *[f"    {line}" for line in spec["grid_prefix"]],
                 *[f"    grid_{i} = {expr}" for i, expr in enumerate(spec["grid"])],
                 f"    launch(function, grid_0, grid_1, grid_2, {int(spec['num_warps'])}, {int(spec['shared'])}, "
                 f"{spec['arg_types']!r}, ({', '.join(args)},), stream)"]
        scope = {"launch": compat.cubin_launcher(), "function": self._function, "__builtins__": builtins}
        exec(compile("\n".join(lines), f"<gearcache launcher {name}>", "exec"), scope)
        self.run = scope["launcher"]


class _Kernels:
    """Stands for Inductor's ``AsyncCompile`` in the wrapper: hands out the plan's kernels instead of compiling."""

    def __init__(self, folder: pathlib.Path, plan: dict[str, Any]):
        self._folder, self._plan = folder, plan
        self._triton = plan.get("triton", {})
        self._cpp = plan.get("cpp", {})

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda", **_: Any) -> _TritonKernel:
        spec = self._triton.get(kernel_name)
        if spec is None:
            raise RunPlanUnavailable(f"no launch record for Triton kernel {kernel_name}")
        return _TritonKernel(kernel_name, spec, self._folder, int(self._plan.get("device_index", 0)))

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        digest = hashlib.sha256(source_code.encode()).hexdigest()
        rel = self._cpp.get(digest)
        if rel is None:
            raise RunPlanUnavailable(f"no compiled library for a C++ kernel (source sha256 {digest[:12]})")
        return _import_cpp_kernel(self._folder / rel, digest)

    def wait(self, scope: dict[str, Any]) -> None:
        """Kernels are ready as soon as they are handed out."""

    def __getattr__(self, name: str) -> Any:
        raise RunPlanUnavailable(f"the wrapper uses async_compile.{name}, which gearcache's loader does not provide")


def _import_cpp_kernel(path: pathlib.Path, digest: str) -> Callable[..., Any]:
    """Import a C++ kernel library Inductor built as a Python extension (entry point ``kernel``), as torch's
    ``CppPythonBindingsCodeCache`` does; its init reads the tensor data-pointer offset from the environment, which is
    set for the duration of the import only."""
    name = f"gearcache_cpp_{digest[:24]}.kernel"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RunPlanUnavailable(f"cannot import {path}")
        with _environ(compat.CPP_KERNEL_ENV, compat.cpp_kernel_env_value()):
            module = importlib.util.module_from_spec(spec)      # runs the library's init
            spec.loader.exec_module(module)
        sys.modules[name] = module
    return module.kernel


@contextlib.contextmanager
def _environ(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ------------------------------------------------------------------------------------------- the wrapper's imports
def _run_intermediate_hooks(name: str, value: Any) -> None:
    """Debug hooks (``torch._inductor.hooks``) are not run for entries loaded by gearcache."""


@contextlib.contextmanager
def _maybe_profile(should_profile: bool, *args: Any, **kwargs: Any):
    if should_profile:
        with torch.profiler.profile(*args, **kwargs) as prof:
            yield prof
    else:
        yield


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


def _no_op(*_: Any) -> None:
    """Bandwidth-profiling bookkeeping (``start_graph``/``end_graph``) is not done for entries loaded by gearcache."""


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _stand_ins(kernels: _Kernels, extern: types.SimpleNamespace) -> dict[str, types.ModuleType]:
    language = _module("triton.language")
    return {
        "torch._inductor.hooks": _module("torch._inductor.hooks", run_intermediate_hooks=_run_intermediate_hooks),
        "torch._inductor.utils": _module("torch._inductor.utils", maybe_profile=_maybe_profile),
        "torch._inductor.codegen.memory_planning": _module("torch._inductor.codegen.memory_planning", _align=_align),
        "torch._inductor.async_compile": _module("torch._inductor.async_compile", AsyncCompile=lambda: kernels),
        "torch._inductor.select_algorithm": _module("torch._inductor.select_algorithm", extern_kernels=extern),
        "torch._inductor.runtime.triton_heuristics": _module("torch._inductor.runtime.triton_heuristics",
                                                             start_graph=_no_op, end_graph=_no_op),
        # The wrapper imports triton for the kernel sources it passes to async_compile, which are never compiled.
        "triton": _module("triton", language=language),
        "triton.language": language,
    }


def _builtins_with(stand_ins: dict[str, types.ModuleType]) -> dict[str, Any]:
    """A copy of the builtins whose ``__import__`` serves the stand-ins and refuses anything else from
    ``torch._inductor`` or ``triton`` (so a wrapper needing more falls back to torch's loader)."""
    real_import = builtins.__import__

    def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (name == "triton" or name.startswith(("triton.", "torch._inductor"))):
            if fromlist and name in stand_ins:
                return stand_ins[name]
            if not fromlist and name.split(".")[0] == "triton":
                return stand_ins["triton"]
            raise ImportError(f"the wrapper imports {name} {list(fromlist or [])}, which gearcache's loader does not "
                              f"provide")
        return real_import(name, globals, locals, fromlist, level)

    table = dict(builtins.__dict__)
    table["__import__"] = _import
    return table


def _resolve_extern_kernels(spec: dict[str, list]) -> types.SimpleNamespace:
    """``extern_kernels.<name>`` as the plan records them: public torch functions or registered operators."""
    out = types.SimpleNamespace()
    for name, ref in spec.items():
        try:
            if ref[0] == "torch":
                fn = getattr(torch, ref[1])
            elif ref[0] == "op":
                ns, op = ref[1].split("::")
                fn = getattr(getattr(torch.ops, ns), op)
                if ref[2]:
                    fn = getattr(fn, ref[2])
            else:
                raise AttributeError(ref[0])
        except (AttributeError, RuntimeError) as exc:
            raise RunPlanUnavailable(f"extern kernel {name} ({ref}) is not available: {exc}") from None
        setattr(out, name, fn)
    return out


def _check_ops(ops: list[list[str]]) -> None:
    """Every operator the wrapper calls must be registered without torch's compiler imported."""
    for ns, op in ops:
        try:
            getattr(getattr(torch.ops, ns), op)
        except (AttributeError, RuntimeError):
            raise RunPlanUnavailable(f"operator {ns}::{op} is not registered in this process") from None
