"""The one place gearcache touches torch's private APIs or branches on torch's version.

Supported: torch 2.11 (CUDA, the GPU machine) and 2.13 (CPU, CI). Every private symbol used by gearcache is imported
here, and each function says which mechanism it relies on, so a torch upgrade is reviewed in one file.

Mechanism (chosen by measurement, see docs/DESIGN.md): a Dynamo graph is compiled with
``torch._inductor.standalone_compile`` and saved in its "unpacked" format: a folder laid out like an Inductor cache
(AOTAutograd entry, FX graph entry with the generated Python wrapper, Triton kernels bundled with their cubins and
autotuning choices). On CPU the compiled C++ kernels (``.so``) are copied into that folder, so loading it in a fresh
process runs no compiler. Loading points Inductor's cache at the folder for the duration of the load only
(``temporary_cache_dir``, torch's own context manager), and never changes the process environment otherwise.

Warm processes normally do not use torch's loader: :func:`write_run_plan` records, at compile time, what
gearcache's own loader (``gearcache/runplan.py``) needs to run the artifact with ``torch._C`` alone; the run-time side
of that (``load_cubin``, ``cubin_launcher``, the C++ kernels' environment variable) is here too.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import pathlib
import pickle
import platform
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore

# Loading and compiling point TORCHINDUCTOR_CACHE_DIR at a folder for a moment: serialise them within the process.
_INDUCTOR_LOCK = threading.RLock()
log = logging.getLogger("gearcache.compat")


# ---------------------------------------------------------------------------------------------------------- capture
def dynamo_capture_config() -> contextlib.AbstractContextManager:
    """Dynamo settings for a capture: no automatic dynamic shapes (every entry is static). Parameters and buffers are
    graph inputs (``inline_inbuilt_nn_modules``, always on in 2.11 and 2.13), so a loaded entry reads live weights."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def symbolic_capture_config() -> contextlib.AbstractContextManager:
    """Settings for the symbolic trace that finds which marked dims meet: no duck sizing (two unrelated dims that
    happen to have the same example size must get different symbols)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)




@contextlib.contextmanager
def without_dynamic_marks(leaves: tuple):
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


def traced_code() -> list[Any]:
    """Code objects Dynamo traced for the graph being compiled (call inside a backend)."""
    return list(torch._guards.TracingContext.get_traced_code() or [])


def forget_dynamo_cache(code: Any) -> None:
    """Drop Dynamo's cache entries for ``code`` so captures of new shapes never count towards its recompile limit and
    nothing of the capture stays installed on the user's function."""
    torch._dynamo.eval_frame.reset_code(code)


def is_graph_break(exc: BaseException) -> bool:
    """Dynamo could not capture the method as one graph (``Unsupported``, or a ``UserError`` such as a Python branch
    on a data-dependent value)."""
    exc_mod = torch._dynamo.exc
    return isinstance(exc, (exc_mod.Unsupported, exc_mod.UserError, exc_mod.UncapturedHigherOrderOpError))


def explain_graph_breaks(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, str]]:
    """Run ``torch._dynamo.explain`` and return ``(reason, user source line)`` for every graph break."""
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = []
    for br in out.break_reasons:
        frames = [f for f in (br.user_stack or []) if "/torch/" not in f.filename.replace(os.sep, "/")]
        f = frames[-1] if frames else (br.user_stack[-1] if br.user_stack else None)
        where = f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" if f else "(source unknown)"
        breaks.append((str(br.reason).strip().splitlines()[0] if str(br.reason).strip() else "unknown", where))
    return breaks


# --------------------------------------------------------------------------------------------------------- compile
def compiled_mode(mode: str) -> str:
    """The mode whose Inductor settings a compile in ``mode`` uses: its own, minus CUDA graphs (gearcache captures
    those itself, per gear). In ``torch._inductor.list_mode_options`` (2.11 and 2.13) "reduce-overhead" is "default"
    plus ``triton.cudagraphs`` and "max-autotune" is "max-autotune-no-cudagraphs" plus ``triton.cudagraphs``."""
    return {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)


def mode_options(mode: str) -> dict[str, Any]:
    """Inductor settings of a torch.compile mode, minus CUDA graphs (gearcache captures those itself, per gear)."""
    opts = dict(torch._inductor.list_mode_options(mode))
    opts.pop("triton.cudagraphs", None)
    return opts


def apply_decompositions(gm: torch.fx.GraphModule, example_inputs: list[Any],
                         decompositions: dict[Any, Callable]) -> torch.fx.GraphModule:
    """Retrace ``gm`` to ATen ops with the user's decompositions applied (fake tensors; nothing runs).

    Passing them to Inductor instead (``compile_fx(decompositions=...)``) makes torch's AOTAutograd cache bypass the
    graph, and then it cannot be saved; a pre-decomposed graph saves like any other."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(gm, decomposition_table=decompositions, tracing_mode="fake")(*example_inputs)


def compile_to_folder(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                      config_patches: dict[str, Any], run_plan: bool = True) -> None:
    """Compile ``gm`` with Inductor and write a self-contained, loadable artifact folder at ``folder``
    (``<artifact>/inductor``), and with ``run_plan`` the artifact's run plan at ``<artifact>/runplan``
    (:func:`write_run_plan`; this runs the graph once on ``example_inputs``, in-place updates going to copies).

    The compile runs against a private, empty Inductor cache, so nothing from the user's Inductor or Triton caches
    (which know nothing of gearcache's key factors, e.g. custom decompositions) can leak into the artifact.
    """
    from torch._inductor import standalone_compile
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    options: dict[str, Any] = {"config_patches": dict(config_patches)}
    with _INDUCTOR_LOCK, tempfile.TemporaryDirectory(prefix="gearcache-compile-") as scratch:
        with temporary_cache_dir(scratch), _load_patches():    # the same C++ flags as a load: same kernel keys
            artifact = standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs", options=options)
        artifact.save(path=str(folder), format="unpacked")
        _copy_compiled_libraries(pathlib.Path(scratch), folder)
    loaded = load_folder(folder)    # a first load writes whatever torch writes on load, before the digests are taken
    if run_plan:
        write_run_plan(folder.parent, loaded, example_inputs)


def _copy_compiled_libraries(scratch: pathlib.Path, folder: pathlib.Path) -> None:
    """Copy the C++ kernel libraries (``<cache>/xx/<key>.so``, with their sources) built during the compile into the
    artifact folder, at the same relative paths, so loading it finds them instead of running g++ again."""
    for lib in scratch.glob("*/*.so"):
        key = lib.name.split(".")[0]
        for sibling in lib.parent.glob(f"{key}.*"):
            dest = folder / sibling.relative_to(scratch)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(sibling, dest)


def _load_patches() -> contextlib.AbstractContextManager:
    """Inductor settings under which an artifact loads without a compiler: no precompiled header (whose freshness
    check runs the C preprocessor on every load) and no ISA probe build (the ISA is a key factor instead).

    Compiles use them too: the precompiled-header setting changes the C++ kernels' cache keys, and a load must find
    the very libraries the compile built."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp_cache_precompile_headers": False, "cpp.vec_isa_ok": True})


def load_folder(folder: pathlib.Path) -> Callable[..., Any]:
    """Load an artifact folder written by :func:`compile_to_folder`; returns ``fn(*flat_inputs) -> list[Tensor]``."""
    from torch._inductor.standalone_compile import CompiledArtifact

    with _INDUCTOR_LOCK, _load_patches():
        artifact = CompiledArtifact.load(path=str(folder), format="unpacked")
    return artifact


# ------------------------------------------------------------------------------------------------------- run plans
# What gearcache's own loader (gearcache/runplan.py) needs from torch at run time: torch._C only, never the compiler.
CPP_KERNEL_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def cpp_kernel_env_value() -> str:
    """What Inductor's C++ kernel libraries read from ``CPP_KERNEL_ENV`` when imported (their tensor data-pointer
    offset; ``CppPythonBindingsCodeCache._load_library_inner`` sets it the same way)."""
    return str(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)


def load_cubin(path: str, function: str, shared: int, device: int) -> int:
    """Load a kernel from a cubin with torch's static CUDA launcher; returns the function handle. torch 2.11 returns
    ``(function, n_regs, n_spills)``, 2.13 ``(module, function, n_regs, n_spills)``."""
    return torch._C._StaticCudaLauncher._load_kernel(path, function, shared, device)[-3]


def cubin_launcher() -> Callable[..., None]:
    """``launch(function, grid_x, grid_y, grid_z, num_warps, shared, arg_types, args, stream)``."""
    return torch._C._StaticCudaLauncher._launch_kernel


class _NoPlan(Exception):
    """The artifact cannot get a run plan (the reason is recorded in the plan)."""


def _require(ok: Any, why: str) -> None:
    if not ok:
        raise _NoPlan(why)


def write_run_plan(artifact: pathlib.Path, loaded: Callable[..., Any], example_inputs: list[Any]) -> None:
    """Write ``<artifact>/runplan`` (format: gearcache/runplan.py), from the artifact torch just loaded as ``loaded``.

    Runs ``loaded`` once on ``example_inputs`` (inputs the graph writes in place are copied first), which settles
    Inductor's autotuning, records what the wrapper and every kernel need, then loads the plan with gearcache's
    loader, runs it on fresh copies and compares outputs and in-place updates with torch's run. A graph the plan
    cannot run exactly like torch's loader gets ``{"supported": false, "reason": ...}``: it loads with torch's
    loader. Never raises for the plan's sake (a plan is an optimisation, not part of the compile)."""
    from . import runplan

    plan_dir = artifact / runplan.PLAN_DIR
    plan_dir.mkdir(parents=True, exist_ok=True)
    try:
        plan = _build_run_plan(artifact, plan_dir, loaded, example_inputs)
    except _NoPlan as exc:
        plan = {"format": runplan.FORMAT, "supported": False, "reason": str(exc)}
    except Exception as exc:                                        # noqa: BLE001 - see the docstring
        log.warning("no run plan for %s: %s: %s", artifact.name, type(exc).__name__, exc, exc_info=True)
        plan = {"format": runplan.FORMAT, "supported": False, "reason": f"{type(exc).__name__}: {exc}"}
    if not plan["supported"]:
        log.info("artifact %s gets no run plan (%s): it loads with torch's loader", artifact.name, plan["reason"])
        for leftover in list(plan_dir.iterdir()):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    (plan_dir / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True))


def _build_run_plan(artifact: pathlib.Path, plan_dir: pathlib.Path, loaded: Callable[..., Any],
                    example_inputs: list[Any]) -> dict[str, Any]:
    from . import runplan

    folder = artifact / "inductor"
    fx, aot = _cache_entry(folder, "fxgraph/*/*/*"), _cache_entry(folder, "aotautograd/*/*")
    meta = aot.runtime_metadata
    _require(aot.maybe_subclass_meta is None, "tensor subclasses")
    _require(meta.num_mutated_inp_runtime_indices == 0, "inputs updated outside the graph")
    _require(all(o.output_type.name == "non_alias" for o in meta.output_info), "outputs aliasing inputs or others")
    _require(meta.num_intermediate_bases == 0 and not meta.tokens, "outputs with intermediate bases or effects")
    _require(not getattr(meta, "is_rng_op_functionalized", False), "functionalised random numbers")
    _require(not any(getattr(w, "needs_post_compile", False) for w in aot.dispatch_wrappers),
             "duplicate or aliased inputs")
    _require(not fx.constants and not getattr(fx, "torchbind_constants", None), "constants baked into the graph")
    _require(not getattr(fx, "partition_maps", None), "graph partitions")
    devices = set(fx.device_types)
    _require(devices <= {"cpu", "cuda"} and not torch.version.hip, f"devices {sorted(devices)}")
    _require(len(fx.device_idxs) <= 1, "more than one GPU in one graph")
    mutated = sorted(set(fx.mutated_input_idxs) | set(getattr(meta, "mutated_graph_handled_indices", [])))

    source = fx.source_code
    uses = _wrapper_uses(source)
    _require(uses["async_compile"] <= {"triton", "cpp_pybinding", "wait"},
             f"kernels of kinds {sorted(uses['async_compile'] - {'triton', 'cpp_pybinding', 'wait'})}")
    collectives = sorted({f"{ns}::{op}" for ns, op in uses["ops"] if ns in _COLLECTIVE_NAMESPACES})
    # The check below runs the graph in this process alone; collectives would wait for ranks that are not running it.
    _require(not collectives, f"collectives ({', '.join(collectives[:3])})")
    reference, ref_inputs = _run_on_copies(loaded, example_inputs, mutated)     # settles autotuning
    module = _wrapper_module(fx.cache_key, folder)
    plan: dict[str, Any] = {
        "format": runplan.FORMAT, "supported": True,
        "device_type": "cuda" if "cuda" in devices else "cpu", "device_index": next(iter(fx.device_idxs), 0),
        "num_inputs": len(example_inputs), "num_outputs": len(reference),
        "inputs_to_check": list(fx.inputs_to_check), "mutated_inputs": mutated,
        "version_bumped_inputs": list(getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", [])),
        "extern_kernels": {n: _extern_ref(n, getattr(module.extern_kernels, n)) for n in sorted(uses["extern"])},
        "ops": sorted(uses["ops"]),
        "triton": _triton_specs(module, fx, plan_dir), "cpp": _cpp_specs(module, uses["cpp"], folder, artifact),
    }
    plan.update(runplan.write_wrapper(plan_dir, source))
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    fn = runplan.load(artifact)
    _require(fn is not None, "gearcache's loader could not load it")
    loose = any(k.inductor_meta.get("atomic_add_found") for k in _autotuners(module).values())
    outputs, inputs = _run_on_copies(fn, example_inputs, mutated)
    _require(len(outputs) == len(reference), f"{len(outputs)} outputs, torch's loader gave {len(reference)}")
    for what, got, want in [*(("output", a, b) for a, b in zip(outputs, reference)),
                            *(("in-place input", inputs[i], ref_inputs[i]) for i in mutated)]:
        _require(_same(got, want, loose), f"its {what} differs from torch's loader's")
    return plan


_COLLECTIVE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor",
                          "symm_mem"}


def _cache_entry(folder: pathlib.Path, pattern: str) -> Any:
    """Unpickle the one torch cache entry matching ``pattern`` in an artifact's Inductor folder."""
    import importlib
    import pickle

    for classes in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.output_code"):
        importlib.import_module(classes)     # the classes the entries pickle

    found = [p for p in folder.glob(pattern) if p.is_file()]
    _require(len(found) == 1, f"{len(found)} cache entries match {pattern}")
    with open(found[0], "rb") as f:
        return pickle.load(f)


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
        return got == want
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype or \
            got.device != want.device or (got.numel() > 1 and got.stride() != want.stride()):
        return False
    try:
        tolerance = {} if loose else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance)
        return True
    except AssertionError:
        return False


def _wrapper_module(key: str, folder: pathlib.Path) -> Any:
    """The Python module torch loaded for the wrapper ``<key>.py`` (the copy loaded from ``folder`` if several)."""
    found = [m for m in list(sys.modules.values())
             if os.path.basename(str(getattr(m, "__file__", None) or "")) == f"{key}.py"]
    _require(found, "torch's loaded wrapper module not found")
    inside = [m for m in found if pathlib.Path(m.__file__).resolve().is_relative_to(folder.resolve())]
    return (inside or found)[-1]


def _wrapper_uses(source: str) -> dict[str, set]:
    """What the wrapper's code (not its kernel sources) uses: ``async_compile`` methods, ``extern_kernels`` names,
    operators looked up in ``torch.ops``, and the sources of its C++ kernels by the name they are bound to."""
    import ast

    uses: dict[str, set] = {"async_compile": set(), "extern": set(), "ops": set(), "cpp": set()}
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
            _require(isinstance(src, ast.Constant) and isinstance(src.value, str), "a C++ kernel without source")
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


def _extern_ref(name: str, fn: Any) -> list:
    """How gearcache's loader finds extern kernel ``name`` without torch's compiler: a public torch function or a
    registered operator."""
    if isinstance(fn, torch._ops.OpOverload):
        return ["op", fn._schema.name, fn._overloadname]
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return ["op", fn._qualified_op_name, ""]
    attr = getattr(fn, "__name__", None)
    _require(attr and getattr(torch, attr, None) is fn, f"extern kernel {name} is not a public torch function")
    return ["torch", attr]


def _autotuners(module: Any) -> dict[str, Any]:
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return {n: k for n, k in vars(module).items() if isinstance(k, CachingAutotuner)}


def _triton_specs(module: Any, fx: Any, plan_dir: pathlib.Path) -> dict[str, Any]:
    """Launch records of the wrapper's Triton kernels, as autotuned by the run, cubins written to ``kernels/``."""
    from torch._inductor.runtime.triton_heuristics import GridExpr

    kernels = _autotuners(module)
    if not kernels:
        return {}
    bundle = getattr(fx, "_triton_bundle", None)
    _require(bundle is not None, "Triton kernels not bundled with the graph")
    cubins = {(group.kernel_hash, item.filename): item.payload
              for group in bundle.kernel_artifacts for item in group.artifacts}
    specs = {}
    for name, kernel in kernels.items():
        _require(len(kernel.launchers) == 1, f"{name}: {len(kernel.launchers)} launchers after autotuning")
        launcher = kernel.launchers[0]
        result = next((r for r in kernel.compile_results if r.config is launcher.config), None)
        _require(type(result).__name__ == "StaticTritonCompileResult" and not getattr(launcher, "store_cubin", 0),
                 f"{name}: not launched by torch's static CUDA launcher")
        binary = result.kernel
        _require(type(binary).__name__ == "StaticallyLaunchedCudaKernel", f"{name}: {type(binary).__name__}")
        payload = cubins.get((launcher.cache_hash, f"{binary.name}.cubin"))
        _require(payload is not None, f"{name}: its cubin is not in the artifact")
        (plan_dir / "kernels").mkdir(exist_ok=True)
        (plan_dir / "kernels" / f"{launcher.cache_hash}.cubin").write_bytes(payload)
        _, def_args, none_args = result._get_arg_lists(binary.arg_names, binary.declared_constexprs)
        grid = GridExpr.from_meta(result.inductor_meta, result.config)
        scratch = int(bool(binary.has_global_scratch)) + int(bool(binary.has_profile_scratch))
        specs[name] = {
            "cubin": f"runplan/kernels/{launcher.cache_hash}.cubin", "function": binary.name,
            "shared": int(binary.shared), "num_warps": int(binary.num_warps),
            "arg_types": binary.arg_tys + "O" * scratch, "scratch_args": scratch, "def_args": list(def_args),
            "call_args": [a for i, a in enumerate(binary.arg_names)
                          if i not in binary.full_constexprs and a not in none_args],
            "grid_prefix": list(grid.prefix), "grid": [str(grid.x_grid), str(grid.y_grid), str(grid.z_grid)],
        }
    return specs


def _cpp_specs(module: Any, bound: set[tuple[str, str]], folder: pathlib.Path,
               artifact: pathlib.Path) -> dict[str, str]:
    """``{sha256 of a C++ kernel's source: its library's path in the artifact}``."""
    import hashlib

    specs = {}
    for name, source in bound:
        fn = getattr(module, name, None)
        lib = str(getattr(getattr(fn, "__self__", None), "__file__", None) or "")
        _require(lib.endswith(".so"), f"{name}: no compiled library")
        inside = sorted(folder.glob(f"*/{os.path.basename(lib)}"))
        _require(len(inside) == 1, f"{name}: its library {os.path.basename(lib)} is not in the artifact")
        specs[hashlib.sha256(source.encode()).hexdigest()] = inside[0].relative_to(artifact).as_posix()
    return specs


# ------------------------------------------------------------------------------------------- CUDA-graph outputs
def storage_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s memory through a non-owning storage of its own (so that storage can be made
    unreadable without touching ``tensor``'s), as torch's CUDA-graph trees build their outputs."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return tensor.new_empty(0).set_(alias, tensor.storage_offset(), tensor.size(), tensor.stride())


def forbid_storage_access(tensor: torch.Tensor, message: str) -> None:
    """Make any later access to ``tensor``'s storage raise ``message`` (CUDA builds of torch; elsewhere a no-op)."""
    forbid = getattr(torch._C, "_set_storage_access_error_msg", None)
    if forbid is not None:
        forbid(tensor, message)


# ------------------------------------------------------------------------------------------------------ environment
def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def software_versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "triton": _dist_version("triton"),
            "cuda": str(torch.version.cuda), "platform": platform.machine()}


@functools.cache
def device_capability(device: str) -> str:
    """What the compiled code depends on about a device: the GPU's name and compute capability, or the CPU's ISA."""
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return f"cuda:sm_{major}{minor}:{torch.cuda.get_device_name(idx)}"
    if dev.type == "cpu":
        return f"cpu:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"
    return dev.type


# ------------------------------------------------------------------------------------------------------------ pytree
def tree_flatten(tree: Any):
    return torch.utils._pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any):
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def treespec_dumps(spec: Any) -> str:
    return torch.utils._pytree.treespec_dumps(spec)


def treespec_loads(text: str) -> Any:
    return torch.utils._pytree.treespec_loads(text)


# --------------------------------------------------------------------------- compiling in a worker process (warm-up)
# Parallel warm-up (gearcache/workers.py) captures in the calling process and compiles in worker processes: the
# Dynamo graph travels as bytes (torch's own ``GraphPickler``, which its subprocess compile uses too), the example
# inputs as metadata, Inductor's and AOTAutograd's settings as torch's portable config snapshot. The worker runs the
# first half of :func:`compile_to_folder` (:func:`compile_unloaded`); the caller runs the second (:func:`finish_folder`),
# the run plan's check needing the real example inputs.
_PLACEHOLDER_META = ("example_value", "stack_trace", "tensor_dict")
_STATIC_INPUT_ATTR = "_dynamo_static_input_type"


def graph_to_bytes(gm: torch.fx.GraphModule) -> bytes:
    """Serialise a Dynamo (or ``make_fx``) graph for :func:`graph_from_bytes` in another process.

    Kept: the nodes with their names, ``stack_trace`` and fake ``example_value`` meta, the module's attributes and
    constants, and what AOTAutograd reads from a Dynamo graph to find the static inputs (placeholders'
    ``_dynamo_source``, ``tensor_dict[_dynamo_static_input_type]``, ``_param_name_to_source``, ``meta``), so the
    compile is the one the calling process would run. Dropped: module stacks (they name the user's classes, which the
    worker may not import) and any other tensor attribute. Raises if the graph holds something torch cannot pickle
    (a call to a user function, say): the caller then compiles it in-process."""
    from torch.fx._graph_pickler import Options
    from torch.fx._lazy_graph_module import _LazyGraphModule

    saved = {}
    for node in gm.graph.nodes:
        saved[node] = dict(node.meta)
        if "tensor_dict" in node.meta:
            node.meta["tensor_dict"] = {k: v for k, v in node.meta["tensor_dict"].items() if k == _STATIC_INPUT_ATTR}
    sources = [getattr(n, "_dynamo_source", None) for n in gm.graph.find_nodes(op="placeholder")]
    try:
        options = Options(ops_filter=None, node_metadata_key_filter=lambda k: k in _PLACEHOLDER_META)
        return pickle.dumps({"graph": _graph_pickler().dumps(gm, options), "sources": sources,
                             "lazy": isinstance(gm, _LazyGraphModule)})
    finally:
        for node, meta in saved.items():
            node.meta = meta


@functools.cache
def _graph_pickler() -> type:
    """torch's ``GraphPickler``, also clearing the fake mode of a view's base: torch clears the view's own (its
    unpickler sets both) but not the base's, so a graph with a view among its fake values fails to pickle (2.13)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._graph_pickler import GraphPickler, _TensorPickleData

    class Pickler(GraphPickler):
        def reducer_override(self, obj: object) -> Any:
            if isinstance(obj, FakeTensor):
                fn, (data, token) = _TensorPickleData.reduce_helper(self, obj)
                if data.metadata.base is not None:
                    base = dataclasses.replace(data.metadata.base, fake_mode=None)
                    data.metadata = dataclasses.replace(data.metadata, base=base)
                return fn, (data, token)
            return super().reducer_override(obj)

    return Pickler


def graph_from_bytes(data: bytes) -> torch.fx.GraphModule:
    """The graph :func:`graph_to_bytes` serialised, its fake tensors in a new fake mode. A Dynamo graph comes back
    as the lazily recompiled kind Dynamo makes (``_LazyGraphModule``): AOTAutograd's cache key hashes the module's
    attributes in the order a copy of it gets them, which differs between the two kinds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    parts = pickle.loads(data)
    gm = GraphPickler.loads(parts["graph"], FakeTensorMode(shape_env=ShapeEnv()))
    for node, source in zip(gm.graph.find_nodes(op="placeholder"), parts["sources"]):
        if source is not None:
            node._dynamo_source = source
    if parts["lazy"]:
        gm.__class__ = type(_LazyGraphModule.__new__(_LazyGraphModule))     # its own subclass, as every GraphModule
    else:
        gm.recompile()
    return gm


def compiler_settings() -> dict[str, Any]:
    """Inductor's and AOTAutograd's settings in this process (the user may have changed them at run time), for
    :func:`apply_compiler_settings` in a worker: the compile there then runs under the same settings."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return {"inductor": inductor_config.save_config_portable(), "functorch": functorch_config.save_config_portable()}


def apply_compiler_settings(settings: dict[str, Any]) -> None:
    """Load :func:`compiler_settings` of the calling process (worker processes only: it changes them for good)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.load_config(settings["inductor"])
    functorch_config.load_config(settings["functorch"])


def compile_unloaded(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                     config_patches: dict[str, Any]) -> None:
    """The compile of :func:`compile_to_folder` without its first load and run plan (:func:`finish_folder` does
    those): ``standalone_compile`` against a private, empty Inductor cache, saved unpacked at ``folder``, with the C++
    kernel libraries copied in."""
    from torch._inductor import standalone_compile
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    options: dict[str, Any] = {"config_patches": dict(config_patches)}
    with _INDUCTOR_LOCK, tempfile.TemporaryDirectory(prefix="gearcache-compile-") as scratch:
        with temporary_cache_dir(scratch), _load_patches():
            artifact = standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs", options=options)
        artifact.save(path=str(folder), format="unpacked")
        _copy_compiled_libraries(pathlib.Path(scratch), folder)


def finish_folder(folder: pathlib.Path, example_inputs: list[Any], *, run_plan: bool = True) -> None:
    """The rest of :func:`compile_to_folder` for a folder :func:`compile_unloaded` wrote (possibly in another
    process): a first load, then the run plan from the real ``example_inputs``."""
    loaded = load_folder(folder)
    if run_plan:
        write_run_plan(folder.parent, loaded, example_inputs)
