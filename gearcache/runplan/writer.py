"""Writing a run plan at compile time, and the check that it runs exactly like torch's loader.

:func:`write_run_plan` runs in the compiling process right after Inductor's artifact was saved and loaded by torch's
loader. It reads torch's cache entries in the artifact (AOTAutograd's runtime metadata, the FX graph entry with the
generated wrapper), refuses graphs whose per-call semantics the loader does not reproduce (aliased outputs, mutations
applied outside the graph, subclasses, effect tokens, constants, partitions, collectives other than torch's
functional ones), records the wrapper, the kernels (kernel_records.py), the extern kernels and the process groups the
graph's collectives name, then loads the plan with gearcache's loader and compares its outputs and in-place updates
with torch's on fresh copies of the inputs (collectives answered by stand-ins on both sides: collectives.py). Any
refusal is recorded as the plan's ``reason``; the artifact then loads with torch's loader. Imports torch's compiler
(only ever in a compiling process).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import marshal
import os
import pathlib
import shutil
import sys
from typing import Any, Callable, Iterator

import torch

from .._torch import runplan as torch_runplan
from ..errors import NoPlan
from . import collectives as collectives_mod
from .device_binding import unbind_device_index
from .format import FORMAT, PLAN_DIR, WRAPPER_FILENAME, require
from .kernel_records import triton_records
from .loader import load_plan

log = logging.getLogger("gearcache.runplan")


def write_run_plan(artifact: pathlib.Path, loaded: Callable[..., Any], example_inputs: list[Any]) -> None:
    """Write ``<artifact>/runplan`` (format: gearcache/runplan.py), from the artifact torch just loaded as ``loaded``.

    Runs ``loaded`` once on ``example_inputs`` (inputs the graph writes in place are copied first), which settles
    Inductor's autotuning, records what the wrapper and every kernel need, then loads the plan with gearcache's
    loader, runs it on fresh copies and compares outputs and in-place updates with torch's run. A graph the plan
    cannot run exactly like torch's loader gets ``{"supported": false, "reason": ...}``: it loads with torch's
    loader. Never raises for the plan's sake (a plan is an optimisation, not part of the compile)."""
    plan_dir = artifact / PLAN_DIR
    plan_dir.mkdir(parents=True, exist_ok=True)
    try:
        plan = _build_run_plan(artifact, plan_dir, loaded, example_inputs)
    except NoPlan as exc:
        plan = {"format": FORMAT, "supported": False, "reason": str(exc)}
    except Exception as exc:                                        # noqa: BLE001 - see the docstring
        log.warning("no run plan for %s: %s: %s", artifact.name, type(exc).__name__, exc, exc_info=True)
        plan = {"format": FORMAT, "supported": False, "reason": f"{type(exc).__name__}: {exc}"}
    if not plan["supported"]:                   # torch's loader runs it on the GPU it was compiled on
        try:
            plan["mutated_inputs"] = _mutated_inputs(artifact / "inductor")
        except Exception:                                           # noqa: BLE001 - unknown: CUDA graphs refuse
            log.info("artifact %s: its graph's in-place writes could not be read", artifact.name, exc_info=True)
        index = compile_device_index(example_inputs)
        plan.update(device_index=index, device_free=index is None)
        log.info("artifact %s gets no run plan (%s): it loads with torch's loader", artifact.name, plan["reason"])
        for leftover in list(plan_dir.iterdir()):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    (plan_dir / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True))


def _mutated_inputs(folder: pathlib.Path, fx: Any = None, aot: Any = None) -> list[int]:
    """The graph inputs the artifact's Inductor folder writes in place (Inductor's ``mutated_input_idxs`` and what
    AOTAutograd's runtime wrapper writes back)."""
    fx = fx or _cache_entry(folder, "fxgraph/*/*/*")
    aot = aot or _cache_entry(folder, "aotautograd/*/*")
    handled = getattr(aot.runtime_metadata, "mutated_graph_handled_indices", [])
    return sorted(set(fx.mutated_input_idxs) | set(handled))


def _build_run_plan(artifact: pathlib.Path, plan_dir: pathlib.Path, loaded: Callable[..., Any],
                    example_inputs: list[Any]) -> dict[str, Any]:
    """The plan of the artifact torch loaded as ``loaded``, written into ``plan_dir`` once it ran exactly like
    ``loaded``; raises :class:`~gearcache.errors.NoPlan` (the reason) for a graph the loader cannot run so."""
    folder = artifact / "inductor"
    fx, aot = _cache_entry(folder, "fxgraph/*/*/*"), _cache_entry(folder, "aotautograd/*/*")
    meta = aot.runtime_metadata
    devices = _refuse_unsupported(fx, aot)
    mutated = _mutated_inputs(folder, fx, aot)
    source = fx.source_code
    uses = _wrapper_uses(source)
    checking = _collectives_during_check(uses, source)
    with checking() as group_names:
        reference, ref_inputs = _run_on_copies(loaded, example_inputs, mutated)     # settles autotuning
    try:
        groups = collectives_mod.describe_groups(group_names)
    except collectives_mod.ProcessGroupMismatchError as exc:
        raise NoPlan(str(exc)) from None
    module = _wrapper_module(fx.cache_key, folder)
    autotuners = torch_runplan.triton_autotuners(vars(module))
    plan: dict[str, Any] = {
        "format": FORMAT, "supported": True,
        "device_type": "cuda" if "cuda" in devices else "cpu",
        "device_index": next(iter(fx.device_idxs), 0) if "cuda" in devices else None,
        "num_inputs": len(example_inputs), "num_outputs": len(reference),
        "inputs_to_check": list(fx.inputs_to_check), "mutated_inputs": mutated,
        "version_bumped_inputs": list(getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", [])),
        "extern_kernels": {n: _extern_ref(n, getattr(module.extern_kernels, n)) for n in sorted(uses["extern"])},
        "ops": sorted(uses["ops"]), "groups": groups,
        "triton": triton_records(autotuners, torch_runplan.triton_bundle(fx), plan_dir),
        "cpp": _cpp_specs(module, uses["cpp"], folder, artifact),
    }
    plan.update(_unbind(source, plan))
    plan.update(write_wrapper(plan_dir, plan.pop("source")))
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    fn = load_plan(artifact)                    # as a warm process will: from plan.json
    if fn is None:
        raise NoPlan("gearcache's loader could not load it")
    loose = any(k.inductor_meta.get("atomic_add_found") for k in autotuners.values())
    with checking():
        outputs, inputs = _run_on_copies(fn, example_inputs, mutated)
    require(len(outputs) == len(reference), f"{len(outputs)} outputs, torch's loader gave {len(reference)}")
    for what, got, want in [*(("output", a, b) for a, b in zip(outputs, reference)),
                            *(("in-place input", inputs[i], ref_inputs[i]) for i in mutated)]:
        require(_same(got, want, loose), f"its {what} differs from torch's loader's")
    return plan


def _refuse_unsupported(fx: Any, aot: Any) -> set[str]:
    """Raise :class:`~gearcache.errors.NoPlan` for a graph whose per-call semantics the loader does not reproduce
    (from torch's FX graph and AOTAutograd entries); returns its device types."""
    meta = aot.runtime_metadata
    require(aot.maybe_subclass_meta is None, "tensor subclasses")
    require(meta.num_mutated_inp_runtime_indices == 0, "inputs updated outside the graph")
    require(all(o.output_type.name == "non_alias" for o in meta.output_info), "outputs aliasing inputs or others")
    require(meta.num_intermediate_bases == 0 and not meta.tokens, "outputs with intermediate bases or effects")
    require(not getattr(meta, "is_rng_op_functionalized", False), "functionalised random numbers")
    require(not any(getattr(w, "needs_post_compile", False) for w in aot.dispatch_wrappers),
            "duplicate or aliased inputs")
    require(not fx.constants and not getattr(fx, "torchbind_constants", None), "constants baked into the graph")
    require(not getattr(fx, "partition_maps", None), "graph partitions")
    devices = set(fx.device_types)
    require(devices <= {"cpu", "cuda"} and not torch.version.hip, f"devices {sorted(devices)}")
    require(len(fx.device_idxs) <= 1, "more than one GPU in one graph")
    return devices


def _collectives_during_check(uses: dict[str, set[Any]], source: str
                              ) -> Callable[[], contextlib.AbstractContextManager[set[str]]]:
    """Refuse kernels of other kinds than the loader's and collectives other than torch's functional ones with a
    stand-in; returns the context manager the graph runs under during the check: the graph runs in this process
    alone, its collectives answered by stand-ins (collectives.py). The test is on the text, not only on the calls
    found, so no spelling of a collective ever runs here for real."""
    require(uses["async_compile"] <= {"triton", "cpp_pybinding", "wait"},
            f"kernels of kinds {sorted(uses['async_compile'] - {'triton', 'cpp_pybinding', 'wait'})}")
    collectives = {op for ns, op in uses["ops"] if ns == collectives_mod.NAMESPACE}
    others = sorted(f"{ns}::{op}" for ns, op in uses["ops"] if ns in _COLLECTIVE_NAMESPACES - {"_c10d_functional"})
    require(not others, f"collectives other than torch's functional ones ({', '.join(others[:3])})")
    unknown = sorted(collectives - set(collectives_mod.STAND_INS))
    require(not unknown, f"functional collectives without a stand-in for the check ({', '.join(unknown[:3])})")
    mentions = collectives or any(f".{ns}." in source for ns in _COLLECTIVE_NAMESPACES)    # torch.ops.<ns>.<op>
    return collectives_mod.stand_in_collectives if mentions else _no_collectives


@contextlib.contextmanager
def _no_collectives() -> Iterator[set[str]]:
    yield set()


_COLLECTIVE_NAMESPACES = collectives_mod.OTHER_NAMESPACES | {collectives_mod.NAMESPACE}


def device_bound_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why an artifact of the captured graph ``gm`` will get no device-free plan, when the graph alone tells (its
    key then keeps the GPU's index from the start, so ranks compile their own at once instead of waiting for one
    they cannot use); None otherwise. Mirrors the refusals of :func:`_collectives_during_check` that the graph
    shows: keep it in step with them."""
    spaces = set()
    for node in gm.graph.nodes:
        ref = torch_runplan.operator_ref(node.target) if node.op == "call_function" else None
        if ref is not None:
            spaces.add(ref[0].split("::")[0])
    found = sorted(spaces & collectives_mod.OTHER_NAMESPACES)     # functional collectives get device-free plans
    return f"collectives without a stand-in ({', '.join(found)})" if found else None


def _cache_entry(folder: pathlib.Path, pattern: str) -> Any:
    """Unpickle the one torch cache entry matching ``pattern`` in an artifact's Inductor folder."""
    found = [p for p in folder.glob(pattern) if p.is_file()]
    require(len(found) == 1, f"{len(found)} cache entries match {pattern}")
    return torch_runplan.load_cache_entry(found[0])


def _run_on_copies(fn: Callable[..., Any], inputs: list[Any], mutated: list[int]) -> tuple[list[Any], list[Any]]:
    """Run ``fn`` with the inputs it writes in place replaced by copies; returns (outputs, the inputs it saw)."""
    inference = any(isinstance(x, torch.Tensor) and x.is_inference() for x in inputs)
    with torch.inference_mode() if inference else torch.no_grad():
        args = [x.clone() if i in mutated else x for i, x in enumerate(inputs)]
        outputs = list(fn(*args))
    for x in [*outputs, *args]:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            torch.cuda.synchronize(x.device)
            break
    return outputs, args


def _same(got: Any, want: Any, loose: bool) -> bool:
    if not isinstance(want, torch.Tensor):
        same: bool = got == want
        return same
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype or \
            got.device != want.device or (got.numel() > 1 and got.stride() != want.stride()):
        return False
    try:
        tolerance: dict[str, Any] = {} if loose else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance)
        return True
    except AssertionError:
        return False


def _wrapper_module(key: str, folder: pathlib.Path) -> Any:
    """The Python module torch loaded for the wrapper ``<key>.py`` (the copy loaded from ``folder`` if several)."""
    found = [m for m in list(sys.modules.values())
             if os.path.basename(str(getattr(m, "__file__", None) or "")) == f"{key}.py"]
    require(found, "torch's loaded wrapper module not found")
    inside = [m for m in found if pathlib.Path(m.__file__ or "").resolve().is_relative_to(folder.resolve())]
    return (inside or found)[-1]


def _wrapper_uses(source: str) -> dict[str, set[Any]]:
    """What the wrapper's code (not its kernel sources) uses: ``async_compile`` methods, ``extern_kernels`` names,
    operators looked up in ``torch.ops``, and the sources of its C++ kernels by the name they are bound to."""
    import ast

    uses: dict[str, set[Any]] = {"async_compile": set(), "extern": set(), "ops": set(),   # names; ops: (ns, op)
                                 "cpp": set()}
    roots = {"aten": "aten", "inductor_ops": "inductor", "_quantized": "_quantized"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain is None:
                continue
            if chain[0] == "async_compile" and len(chain) == 2:
                uses["async_compile"].add(chain[1])
            elif chain[0] == "extern_kernels" and len(chain) == 2:
                uses["extern"].add(chain[1])
            elif chain[0] in roots and len(chain) >= 2:
                uses["ops"].add((roots[chain[0]], chain[1]))
            elif chain[:2] == ["torch", "ops"] and len(chain) >= 4:
                uses["ops"].add((chain[2], chain[3]))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and _dotted(node.value.func) == ["async_compile",
                                                                                       "cpp_pybinding"]):
            src = node.value.args[1] if len(node.value.args) > 1 else None
            if not (isinstance(src, ast.Constant) and isinstance(src.value, str)):
                raise NoPlan("a C++ kernel without source")
            uses["cpp"].add((node.targets[0].id, src.value))
    uses["ops"] = {tuple(o) for o in uses["ops"]}
    return uses


def _dotted(node: Any) -> list[str] | None:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _extern_ref(name: str, fn: Any) -> list[str | None]:
    """How gearcache's loader finds extern kernel ``name`` without torch's compiler: a public torch function or a
    registered operator."""
    ref = torch_runplan.operator_ref(fn)
    if ref is not None:
        return ["op", *ref]
    attr = getattr(fn, "__name__", None)
    require(attr and getattr(torch, attr, None) is fn, f"extern kernel {name} is not a public torch function")
    return ["torch", attr]


def _cpp_specs(module: Any, bound: set[tuple[str, str]], folder: pathlib.Path,
               artifact: pathlib.Path) -> dict[str, str]:
    """``{sha256 of a C++ kernel's source: its library's path in the artifact}``."""
    import hashlib

    specs = {}
    for name, source in bound:
        fn = getattr(module, name, None)
        lib = str(getattr(getattr(fn, "__self__", None), "__file__", None) or "")
        require(lib.endswith(".so"), f"{name}: no compiled library")
        inside = sorted(folder.glob(f"*/{os.path.basename(lib)}"))
        require(len(inside) == 1, f"{name}: its library {os.path.basename(lib)} is not in the artifact")
        specs[hashlib.sha256(source.encode()).hexdigest()] = inside[0].relative_to(artifact).as_posix()
    return specs


def compile_device_index(example_inputs: list[Any]) -> int | None:
    """The index of the one GPU the example inputs are on; None when they are all on the CPU. (Graphs on several
    GPUs get no plan; their index is that of the first, and they stay bound to it.)"""
    indexes = sorted({x.device.index or 0 for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda})
    return indexes[0] if indexes else None


def _unbind(source: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's device fields and its wrapper's source: CPU plans and CUDA wrappers whose device literals could
    all be rewritten (device_binding.py) are ``device_free``; the others keep the literals and stay bound."""
    if plan["device_type"] != "cuda":
        return {"device_free": True, "source": source}
    try:
        return {"device_free": True, "source": unbind_device_index(source, plan["device_index"])}
    except NoPlan as exc:
        log.info("the run plan stays bound to cuda:%d (%s)", plan["device_index"], exc)
        return {"device_free": False, "device_reason": str(exc), "source": source}


def write_wrapper(plan_dir: pathlib.Path, source: str) -> dict[str, str]:
    """Write the wrapper's source and its compiled code into ``plan_dir``; returns the plan's fields naming them."""
    (plan_dir / "wrapper.py").write_text(source)
    code = compile(source, WRAPPER_FILENAME, "exec")
    (plan_dir / "wrapper.code").write_bytes(importlib.util.MAGIC_NUMBER + marshal.dumps(code))
    return {"wrapper": "wrapper.py", "wrapper_code": "wrapper.code"}
