"""Loading an artifact folder: through its run plan when the plan can serve it, else through torch's loader.

:func:`load_artifact` is the one way gearcache loads an artifact (the call path, warm-up and CUDA-graph capture
through the store's ``artifact_io.load_stored``, the torch.compile route directly). It reads ``runplan/plan.json``
once (or takes the plan its caller read to choose what to verify: :func:`read_plan`, :func:`files_read`), builds a
:class:`~gearcache.runplan.runner.PlanRunner` from it, and never fails where torch's loader would have worked: a plan
that is missing, unsupported or cannot load in this process (an operator not registered, an import the stand-ins do
not serve) is logged at INFO with the reason, and the artifact loads through torch's loader instead. The one
exception is another GPU than the artifact was compiled on: torch's loader would run it on the compile GPU, so an
artifact that cannot run on the caller's GPU through its plan raises :class:`~gearcache.errors.WrongDevice` (device
binding: device_binding.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import marshal
import pathlib
import threading
import types
from typing import Any, Callable

import torch

from .._torch import inductor as torch_inductor
from ..counters import counters
from ..errors import RunPlanUnavailable, WrongDevice
from .collectives import check_groups
from .device_binding import BOUND_NAME
from .format import FORMAT, PLAN_DIR, WRAPPER_FILENAME
from .launch_cpp import import_cpp_kernel
from .launch_driver import DriverLaunch
from .launch_static import StaticLaunch
from .runner import GraphInputs, PlanRunner
from .stand_ins import builtins_with, stand_ins

log = logging.getLogger("gearcache.runplan")

_TORCH_LOADER_LOCK = threading.Lock()
"""torch's loader, one artifact at a time (a warm-up loads its gears side by side; torch's loader imports its compiler
on first use and writes into the folder it loads from)."""

LAUNCHERS = {"static": StaticLaunch, "driver": DriverLaunch}
"""Launch paths by the name a kernel's launch record gives (``"launcher"``; absent means static)."""


def load_artifact(folder: pathlib.Path, device_index: int | None = None,
                  before_torch_loader: Callable[[], None] | None = None,
                  plan: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Load an artifact folder: through its run plan when it has a usable one, else through torch's loader.

    ``device_index``: the CUDA device the caller's tensors are on (None: the one the artifact was compiled on, or
    none). A device-free plan is bound to it; an artifact that can only run on the GPU it was compiled on (a bound
    plan, no plan, or a device-free plan this process cannot load, where torch's loader would run it on the compile
    GPU) raises :class:`~gearcache.errors.WrongDevice` for any other index. Returns ``fn(*graph_inputs) -> sequence
    of outputs``: a :class:`PlanRunner`, or torch's callable.

    ``plan``: the folder's plan as :func:`read_plan` returned it, when the caller has read it already (to choose what
    to verify); None: read here. ``before_torch_loader`` is called (its exceptions propagate) just before torch's
    loader is used: a caller that verified only :func:`files_read` verifies the rest of the artifact there. Raises
    ``ProcessGroupMismatchError`` when the plan's collectives name a group this process lacks (collectives.py)."""
    if plan is None:
        plan = read_plan(folder)
    compiled_on = plan.get("device_index")
    other = device_index is not None and compiled_on is not None and device_index != compiled_on
    if other and not plan.get("device_free"):
        raise WrongDevice(f"{folder.name} is bound to cuda:{compiled_on} "
                          f"({plan.get('device_reason') or plan.get('reason')})")
    runner = load_plan(folder, plan, device_index)
    if runner is not None:
        counters.add(direct_loads=1)
        return runner
    if other:
        raise WrongDevice(f"{folder.name}: its run plan cannot load in this process, and torch's loader would run "
                          f"it on cuda:{compiled_on}")
    with _TORCH_LOADER_LOCK:
        if before_torch_loader is not None:
            before_torch_loader()
        return TorchLoaded(torch_inductor.load_folder(folder / "inductor"), plan)


class TorchLoaded:
    """An artifact torch's loader loaded (it has no usable run plan), beside its unsupported ``plan``: what the plan
    writer still read of it (``mutated_inputs``, where it could: the inputs its graph writes in place, which CUDA
    graphs copy back after each replay). Called as torch's callable is."""
    __slots__ = ("fn", "plan")

    def __init__(self, fn: Callable[..., Any], plan: dict[str, Any]):
        self.fn, self.plan = fn, plan

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def read_plan(folder: pathlib.Path) -> dict[str, Any]:
    """The artifact's ``runplan/plan.json``, parsed (format: ``runplan/__init__``). An artifact without one, or with
    one of another format (written by another gearcache), gets an unsupported plan saying so (``"supported":
    false``, ``"reason"``). Raises ``OSError`` or ``ValueError`` when the file cannot be read or is not a plan."""
    try:
        plan = json.loads((folder / PLAN_DIR / "plan.json").read_bytes())
    except FileNotFoundError:
        return {"format": FORMAT, "supported": False, "reason": "the artifact has no runplan/plan.json"}
    if not isinstance(plan, dict):
        raise ValueError(f"{folder / PLAN_DIR / 'plan.json'} holds no JSON object")
    if plan.get("format") != FORMAT:
        return {"format": FORMAT, "supported": False,
                "reason": f"its plan is of format {plan.get('format')!r}, not {FORMAT} (written by another gearcache)"}
    return plan


def files_read(plan: dict[str, Any] | None) -> list[str] | None:
    """What loading an artifact through ``plan`` (:func:`read_plan`'s) reads, relative to the artifact folder:
    ``runplan/`` (the plan, the wrapper, the cubins) and the C++ kernels' libraries the plan names; None when the
    plan cannot serve a load, or is None (it could not be read): torch's loader reads the whole folder.

    A caller reads the plan before it is verified, only to choose what to verify, which includes ``plan.json``
    itself (a path the signed manifest does not list is refused by the verification); it then hands the same plan to
    :func:`load_artifact`."""
    if plan is None or not plan.get("supported"):
        return None
    libraries = plan.get("cpp", {})
    if not isinstance(libraries, dict) or not all(isinstance(v, str) for v in libraries.values()):
        return None
    return [PLAN_DIR + "/", *sorted(set(libraries.values()))]


def load_plan(folder: pathlib.Path, plan: dict[str, Any] | None = None,
              device_index: int | None = None) -> PlanRunner | None:
    """The artifact's run plan alone, loaded (no fallback: :func:`load_artifact` adds it; the writer's exactness
    check loads a plan this way), or None (logged at INFO: why) when it is unsupported or cannot load in this
    process. ``plan``: :func:`read_plan`'s, or None to read it here. A device-free plan runs on CUDA device
    ``device_index`` (None: the one it was compiled on). Raises ``ProcessGroupMismatchError`` when the plan's
    collectives name a group this process lacks or has with other ranks or backend (collectives.py)."""
    if plan is None:
        plan = read_plan(folder)
    if not plan.get("supported"):
        log.info("%s: no run plan (%s); torch's loader is used", folder, plan.get("reason"))
        return None
    check_groups(plan.get("groups", {}), f"artifact {folder.name}")      # raises: never a collective on another group
    if device_index is None or not plan.get("device_free"):
        device_index = int(plan.get("device_index") or 0)
    try:
        return PlanRunner(_wrapper_call(folder, plan, device_index), plan)
    except RunPlanUnavailable as exc:
        log.info("%s: the run plan cannot load in this process (%s); torch's loader is used", folder, exc)
        return None


def _wrapper_call(folder: pathlib.Path, plan: dict[str, Any], device_index: int) -> Callable[[GraphInputs], Any]:
    """Execute the plan's wrapper with its kernels (loaded on CUDA device ``device_index``) and extern kernels;
    returns the ``call(list)`` it defines. Raises :class:`RunPlanUnavailable` for anything this process lacks."""
    _check_ops(plan.get("ops", []))
    kernels = _Kernels(folder, plan, device_index)
    extern = _resolve_extern_kernels(plan.get("extern_kernels", {}))
    path = folder / PLAN_DIR / plan["wrapper"]
    code = _wrapper_code(path, plan.get("wrapper_code"))
    scope: dict[str, Any] = {"__name__": f"gearcache_wrapper_{folder.name}", "__file__": str(path),
                             "__builtins__": builtins_with(stand_ins(kernels, extern)),
                             BOUND_NAME: device_index}      # the device a device-free wrapper runs on
    try:
        exec(code, scope)                       # defines call() and loads every kernel
    except RunPlanUnavailable:
        raise
    except Exception as exc:                    # noqa: BLE001 - torch's loader gets its chance (and says what fails)
        raise RunPlanUnavailable(f"{type(exc).__name__}: {exc}") from None
    call: Callable[[GraphInputs], Any] | None = scope.get("call")
    if not callable(call):
        raise RunPlanUnavailable("the wrapper defines no call()")
    return call


def _wrapper_code(path: pathlib.Path, compiled: str | None) -> types.CodeType:
    """The wrapper's code object: from the plan's compiled copy (``wrapper_code``: the interpreter's magic number
    followed by the marshalled code; the Python version is part of every key) when it is this interpreter's, else
    compiled from the source."""
    if compiled:
        data = (path.parent / compiled).read_bytes()
        magic = importlib.util.MAGIC_NUMBER
        if data[:len(magic)] == magic:
            code: types.CodeType = marshal.loads(data[len(magic):])
            return code
    return compile(path.read_text(), WRAPPER_FILENAME, "exec")


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


def _resolve_extern_kernels(spec: dict[str, list[str]]) -> types.SimpleNamespace:
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
