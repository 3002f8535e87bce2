"""Running a plan: execute Inductor's generated wrapper with the plan's kernels; the per-call wrapper around it.

:func:`load_artifact` never fails where torch's loader would have worked: a plan that is missing, unsupported or
cannot load in this process (an operator not registered, an import the stand-ins do not serve) is logged at INFO
with the reason, and the artifact loads through torch's loader instead. The one exception is another GPU than the
artifact was compiled on: torch's loader would run it on the compile GPU, so an artifact that cannot run on the
caller's GPU through its plan raises :class:`WrongDevice` (device binding: device_binding.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import marshal
import operator
import pathlib
import types
from typing import Any, Callable

import torch

from .. import _torch_compat as compat
from ..counters import counters
from .collectives import check_groups
from .device_binding import BOUND_NAME
from .format import ALIGNMENT, FORMAT, PLAN_DIR, WRAPPER_FILENAME, RunPlanUnavailable
from .launch_cpp import import_cpp_kernel
from .launch_driver import DriverLaunch
from .launch_static import StaticLaunch
from .stand_ins import builtins_with, stand_ins

log = logging.getLogger("gearcache.runplan")

LAUNCHERS = {"static": StaticLaunch, "driver": DriverLaunch}
"""Launch paths by the name a kernel's launch record gives (``"launcher"``; absent means static)."""


def load_artifact(folder: pathlib.Path, device_index: int | None = None,
                  before_torch_loader: Callable[[], None] | None = None) -> Callable[..., Any]:
    """Load an artifact folder: through its run plan when it has a usable one, else through torch's loader.

    ``device_index``: the CUDA device the caller's tensors are on (None: the one the artifact was compiled on, or
    none). A device-free plan is bound to it; an artifact that can only run on the GPU it was compiled on (a bound
    plan, no plan, or a device-free plan this process cannot load, where torch's loader would run it on the compile
    GPU) raises :class:`WrongDevice` for any other index. Returns ``fn(*graph_inputs) -> sequence of outputs``.

    ``before_torch_loader`` is called (its exceptions propagate) just before torch's loader is used: a caller that
    verified only :func:`files_read` verifies the rest of the artifact there."""
    plan = read_plan(folder)
    compiled_on = (plan or {}).get("device_index")
    other = device_index is not None and compiled_on is not None and device_index != compiled_on
    if other and not (plan or {}).get("device_free"):
        raise WrongDevice(f"{folder.name} is bound to cuda:{compiled_on} "
                          f"({plan.get('device_reason') or plan.get('reason') if plan else 'no run plan'})")
    fn = load(folder, device_index)
    if fn is not None:
        counters.direct_loads += 1
        return fn
    if other:
        raise WrongDevice(f"{folder.name}: its run plan cannot load in this process, and torch's loader would run "
                          f"it on cuda:{compiled_on}")
    if before_torch_loader is not None:
        before_torch_loader()
    return compat.load_folder(folder / "inductor")


def files_read(folder: pathlib.Path) -> list[str] | None:
    """What loading ``folder`` through its run plan reads, relative to it: ``runplan/`` (the plan, the wrapper, the
    cubins) and the C++ kernels' libraries the plan names; None when the artifact has no usable plan (torch's loader
    reads the whole folder). ``plan.json`` is read here before it is verified: only to choose what to verify, which
    includes it (a path the signed manifest does not list is refused by the verification)."""
    try:
        plan = read_plan(folder)
    except (OSError, ValueError):
        return None                             # unreadable: the whole artifact is verified (and found corrupt)
    if plan is None or not plan.get("supported"):
        return None
    libraries = plan.get("cpp", {})
    if not isinstance(libraries, dict) or not all(isinstance(v, str) for v in libraries.values()):
        return None
    return [PLAN_DIR + "/", *sorted(set(libraries.values()))]


class WrongDevice(RuntimeError):
    """The artifact runs only on the GPU it was compiled on, not on the caller's (compile one for this GPU)."""


def read_plan(folder: pathlib.Path) -> dict[str, Any] | None:
    """The artifact's ``plan.json``; None when it has none or one of another format (:func:`load` says which)."""
    try:
        plan = json.loads((folder / PLAN_DIR / "plan.json").read_bytes())
    except FileNotFoundError:
        return None
    return plan if plan.get("format") == FORMAT else None


def load(folder: pathlib.Path, device_index: int | None = None) -> Callable[..., Any] | None:
    """The artifact's run plan as a callable, or None (logged at INFO: why) when it has none or it is unusable.
    A device-free plan runs on CUDA device ``device_index`` (None: the one it was compiled on). Raises
    ``ProcessGroupMismatchError`` when the plan's collectives name a group this process lacks or has with other ranks
    or backend (collectives.py)."""
    plan = read_plan(folder)
    if plan is None:
        log.info("%s has no run plan of format %d (written by another gearcache); torch's loader is used", folder,
                 FORMAT)
        return None
    if not plan.get("supported"):
        log.info("%s: no run plan (%s); torch's loader is used", folder, plan.get("reason"))
        return None
    check_groups(plan.get("groups", {}), f"artifact {folder.name}")      # raises: never a collective on another group
    if device_index is None or not plan.get("device_free"):
        device_index = int(plan.get("device_index") or 0)
    try:
        return _Runner(folder, plan, device_index).run
    except RunPlanUnavailable as exc:
        log.info("%s: the run plan cannot load in this process (%s); torch's loader is used", folder, exc)
        return None


class _Runner:
    """Executes the generated wrapper with the plan's kernels and exposes ``run(*inputs)``."""

    def __init__(self, folder: pathlib.Path, plan: dict[str, Any], device_index: int):
        self.folder, self.plan, self.device_index = folder, plan, device_index
        _check_ops(plan.get("ops", []))
        kernels = _Kernels(folder, plan, device_index)
        scope = self._exec_wrapper(kernels, _resolve_extern_kernels(plan.get("extern_kernels", {})))
        call = scope.get("call")
        if not callable(call):
            raise RunPlanUnavailable("the wrapper defines no call()")
        self.run = _make_run(call, plan)

    def _exec_wrapper(self, kernels: "_Kernels", extern: types.SimpleNamespace) -> dict[str, Any]:
        path = self.folder / PLAN_DIR / self.plan["wrapper"]
        code = _wrapper_code(path, self.plan.get("wrapper_code"))
        scope: dict[str, Any] = {"__name__": f"gearcache_wrapper_{self.folder.name}", "__file__": str(path),
                                 "__builtins__": builtins_with(stand_ins(kernels, extern)),
                                 BOUND_NAME: self.device_index}      # the device a device-free wrapper runs on
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


def _make_run(call: Callable[[list], Any], plan: dict[str, Any]) -> Callable[..., Any]:
    """The per-call function: what torch's AOTAutograd and CompiledFxGraph wrappers do around ``call`` for an
    inference graph without aliased outputs or mutations applied outside the graph (the only kind that gets a plan):
    grad and autocast off during the call, version counters of inputs mutated in the graph bumped, misaligned inputs
    cloned (and written back when the graph mutates them).

    Alignment is checked on every call for every input, except the inputs named by ``run.set_stable_inputs(indices)``
    (a module's parameters and buffers, which stay the same tensors from call to call): those are checked whenever a
    different tensor object arrives. A stable input whose storage is swapped in place (``param.data = t``) for a
    misaligned ``t`` is not noticed; on CUDA the kernel then fails with a misaligned-address error."""
    check = tuple(plan.get("inputs_to_check", ()))
    mutated = frozenset(plan.get("mutated_inputs", ()))
    bumped = tuple(plan.get("version_bumped_inputs", ()))
    n_in, n_out = plan["num_inputs"], plan["num_outputs"]
    grad_enabled, set_grad = torch.is_grad_enabled, torch._C._set_grad_enabled
    any_autocast = compat.any_autocast_enabled
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
        run.stable_inputs = tuple(sorted(chosen))   # type: ignore[attr-defined]

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

    def call_grad_off(args: list) -> Any:
        if grad_enabled():
            set_grad(False)
            try:
                return call(args)
            finally:
                set_grad(True)
        return call(args)

    def run_list(args: list) -> Any:
        """The per-call work on a list the caller hands over (it is changed: realigned, then cleared by call())."""
        if len(args) != n_in:
            raise TypeError(f"compiled graph takes {n_in} inputs, got {len(args)}")
        copies = realign(args) if check else ()
        if bumped:
            bump([args[i] for i in bumped])
        if any_autocast():
            with compat.disable_autocast():
                outs = call_grad_off(args)
        else:
            outs = call_grad_off(args)
        for original, copy in copies:
            original.copy_(copy)
        return outs

    def run(*inputs: Any) -> Any:
        return run_list(list(inputs))

    run.run_list = run_list                         # type: ignore[attr-defined] # Entry: no unpacking per call
    run.num_outputs = n_out                         # type: ignore[attr-defined]
    run.wrapper_call = call                         # type: ignore[attr-defined] # Inductor's call(list): benchmarks
    run.set_stable_inputs = set_stable_inputs       # type: ignore[attr-defined]
    run.stable_inputs = ()                          # type: ignore[attr-defined]
    run.plan = plan                                 # type: ignore[attr-defined] # benchmarks: the same wrapper
    return run


def _clone_preserve_strides(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides, in fresh (aligned) memory (torch._inductor.utils.clone_preserve_strides)."""
    needed = 0 if 0 in x.size() else sum((n - 1) * s for n, s in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())


class _Kernels:
    """Stands for Inductor's ``AsyncCompile`` in the wrapper: hands out the plan's kernels instead of compiling."""

    def __init__(self, folder: pathlib.Path, plan: dict[str, Any], device_index: int):
        self._folder, self._plan, self._device_index = folder, plan, device_index
        self._triton = plan.get("triton", {})
        self._cpp = plan.get("cpp", {})

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda", **_: Any) -> Any:
        spec = self._triton.get(kernel_name)
        if spec is None:
            raise RunPlanUnavailable(f"no launch record for Triton kernel {kernel_name}")
        launcher = LAUNCHERS.get(spec.get("launcher", "static"))
        if launcher is None:
            raise RunPlanUnavailable(f"{kernel_name}: launch path {spec.get('launcher')!r} unknown to this gearcache")
        return launcher(kernel_name, spec, self._folder, self._device_index)

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        digest = hashlib.sha256(source_code.encode()).hexdigest()
        rel = self._cpp.get(digest)
        if rel is None:
            raise RunPlanUnavailable(f"no compiled library for a C++ kernel (source sha256 {digest[:12]})")
        return import_cpp_kernel(self._folder / rel, digest)

    def wait(self, scope: dict[str, Any]) -> None:
        """Kernels are ready as soon as they are handed out."""

    def __getattr__(self, name: str) -> Any:
        raise RunPlanUnavailable(f"the wrapper uses async_compile.{name}, which gearcache's loader does not provide")



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
