"""The one place gearcache touches torch's private APIs or branches on torch's version.

Supported: torch 2.11 to 2.15 (README, "Supported torch versions"): 2.11 on the GPU machine (CUDA), 2.13 in CI (CPU,
full suite), 2.14.1 in CI (CUDA build on CPU, core suites), 2.15.0 checked by hand (CPU); 2.14 and 2.15 need no
branch here. Every private symbol used by gearcache is imported here, and each function says which mechanism it
relies on, so a torch upgrade is reviewed in one file.

Mechanism (chosen by measurement, see docs/DESIGN.md): a Dynamo graph is compiled with
``torch._inductor.standalone_compile`` and saved in its "unpacked" format: a folder laid out like an Inductor cache
(AOTAutograd entry, FX graph entry with the generated Python wrapper, Triton kernels bundled with their cubins and
autotuning choices). On CPU the compiled C++ kernels (``.so``) are copied into that folder, so loading it in a fresh
process runs no compiler. Loading points Inductor's cache at the folder for the duration of the load only
(``temporary_cache_dir``, torch's own context manager), and never changes the process environment otherwise.

Warm processes normally do not use torch's loader but gearcache's own (``gearcache/runplan/``); what it needs from
torch's private run-time API (``load_cubin``, ``cubin_launcher``, the C++ kernels' environment variable) is here too.
The dispatch shortcut's checks come from gearcache's native module where it is built for this torch (compiled
against torch's own headers, so its private C++ API is checked by the compiler; ``gearcache/native/``), else from
Dynamo. This module imports nothing else from gearcache; ``gearcache.native`` imports only ``gearcache.errors``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import os
import pathlib
import pickle
import platform
import re
import shutil
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

import torch

from . import native as gearcache_native

if TYPE_CHECKING:
    from torch.fx._graph_pickler import GraphPickler

    GraphPoolHandle = torch.cuda._POOL_HANDLE      # what torch.cuda.graph_pool_handle() returns (for annotations)

TORCH_VERSION = cast(tuple[int, int], tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]))

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
    from torch.utils._config_module import ConfigModule

    return cast(ConfigModule, fx_config).patch({"use_duck_shape": False})   # a config module, made one at its import




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


@dataclasses.dataclass(frozen=True)
class DynamoGuard:
    """One of Dynamo's guards for a capture, in plain terms (keys/guards_from_dynamo.py turns it into a value guard).

    ``kind``: Dynamo's guard type (``"CONSTANT_MATCH"``, ``"TYPE_MATCH"``, ...); ``source``: the guarded object as
    the Python expression Dynamo evaluates it with (``L['self']._modules['ln'].eps``, ``G['SCALE']``; ``""`` for
    global-state guards); ``value``: the object (``has_value`` False where there is none, e.g. a missing attribute);
    ``detail``: what the guard checks beyond the object: ``{"attr": name}`` (``HASATTR``,
    ``NOT_PRESENT_IN_GENERIC_DICT``), ``{"key": key, "invert": bool}`` (``DICT_CONTAINS`` and the like),
    ``{"other": source}`` (``DUPLICATE_INPUT``: the two sources are one object)."""

    kind: str
    source: str
    has_value: bool
    value: Any
    detail: dict


# Names of the globals Dynamo installs (install_global / install_global_by_id); an earlier capture in the process may
# have left one in the module before this capture began
_DYNAMO_GLOBAL = re.compile(r"__import_\w+|__builtins_dict__\w*|_\d+_c\d+|___\w+")


@dataclasses.dataclass
class GuardRecording:
    """What :func:`guard_recording_options` records: ``guards`` (:class:`DynamoGuard`, in Dynamo's order) and
    ``installed``, the globals Dynamo added to the method's module for the trace (``__import_torch_dot_nn``-style
    modules, ``__builtins_dict___0``, ``_<id>_c<n>`` objects), which guard sources start from; Dynamo removes them
    when the method's cache entries are reset."""
    guards: list = dataclasses.field(default_factory=list)
    installed: dict = dataclasses.field(default_factory=dict)


def guard_recording_options(recording: GuardRecording, globals_: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(options=...)`` under which Dynamo hands every guard of the capture of a function whose globals
    are ``globals_`` to ``recording`` and keeps them all. Mechanism: torch.compile's ``guard_filter_fn`` option (its
    entries: ``name``, ``has_value``, ``value``, ``guard_type``, ``orig_guard``), called while Dynamo's installed
    globals are still there; a fresh dict per call (torch pops the option from it)."""
    before = set(globals_)

    def record(entries: Any) -> list[bool]:
        recording.guards.extend(_dynamo_guard(e) for e in entries)
        recording.installed.update({k: globals_[k] for k in list(globals_)
                                    if k not in before or _DYNAMO_GLOBAL.fullmatch(k)})
        return [True] * len(entries)

    return {"guard_filter_fn": record}


def _source_name(source: Any) -> str:
    name = source.name
    return name() if callable(name) else name


def _dynamo_guard(entry: Any) -> DynamoGuard:
    guard = entry.orig_guard
    source = guard.originating_source
    keywords = dict(getattr(guard.create_fn, "keywords", None) or {})
    kind = entry.guard_type
    detail: dict[str, Any] = {}
    name = _source_name(source)
    if kind in ("HASATTR", "NOT_PRESENT_IN_GENERIC_DICT"):
        if "attr" in keywords:
            detail["attr"] = keywords["attr"]
        else:       # older Dynamo (2.11): the source is the attribute itself, the value the attribute's, not the
            detail["attr"], name = source.member, _source_name(source.base)     # base's that the guard reads
            return DynamoGuard(kind, "" if name is None else name, False, None, detail)
    elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"):
        detail["key"] = keywords.get("key")
        detail["invert"] = bool(keywords.get("invert", kind.endswith("NOT_CONTAINS")))
    elif kind == "DUPLICATE_INPUT" and "source_b" in keywords:
        detail["other"] = _source_name(keywords["source_b"])
    return DynamoGuard(kind, "" if name is None else name, bool(entry.has_value),
                       entry.value if entry.has_value else None, detail)


def default_device() -> str | None:
    """The device ``torch.set_default_device`` set for this thread (None: torch's own default). Dynamo guards it
    (``DEFAULT_DEVICE``): factory calls in a captured method are traced on it."""
    from torch.utils import _device

    device = _device.CURRENT_DEVICE
    return None if device is None else str(device)


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


# ------------------------------------------------------------------------------------------------ padding analysis
# gearcache/gears/padding.py reads the gear plan's symbolic trace (a Dynamo graph whose marked dims are SymInts) at
# the ATen
# level, where every op has a schema (which arguments it writes, which it returns a view of).
def aten_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` retraced to ATen ops on its own fake example inputs (nothing runs on real data): ``make_fx`` of an FX
    interpreter under the graph's fake mode, symbolically, as AOTAutograd traces it but without functionalisation, so
    in-place ops and views stay in the graph; each node keeps the ``stack_trace`` of the Dynamo node it came from."""
    import torch.fx.traceback as fx_traceback
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    fakes = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    with detect_fake_mode(fakes) or contextlib.nullcontext(), fx_traceback.preserve_node_meta(), torch.no_grad():
        # symbolic: the trace's own shape environment keeps each size a symbol (2.11's "real" mode fixed a batch a
        # 3-D matmul expands over to the example's number: padding.analyse would read it as static)
        return make_fx(torch.fx.Interpreter(gm).run, tracing_mode="symbolic")(*fakes)


def forget_unbacked_bindings(gm: torch.fx.GraphModule) -> None:
    """Drop the ``unbacked_bindings`` a ``make_fx`` trace left on ``gm``'s nodes (an ``item()`` of a float argument
    Dynamo passes as a tensor binds an unbacked symbol, ``zuf0``): AOTAutograd's retrace of ``gm`` in a fresh shape
    environment names its own symbol ``zuf0`` too, and ``rebind_unbacked`` takes the equal names for "possible memo
    disaster" (torch 2.13); it binds its own symbols without them."""
    for node in gm.graph.nodes:
        node.meta.pop("unbacked_bindings", None)


def op_schema(target: Any) -> Any:
    """The schema (``torch._C.FunctionSchema``) of an ATen op overload; None for anything else."""
    return getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None


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
                      config_patches: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor and write a self-contained, loadable artifact folder at ``folder``
    (``<artifact>/inductor``); returns the artifact as torch's loader loads it (the run plan's writer reads it).
    A first load writes whatever torch writes on load, before the digests are taken."""
    compile_unloaded(gm, example_inputs, folder, config_patches=config_patches)
    return load_folder(folder)


def compile_unloaded(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                     config_patches: dict[str, Any]) -> None:
    """The compile of :func:`compile_to_folder` without its first load (a warm-up worker process runs it; the caller
    loads the folder): ``standalone_compile`` against a private, empty Inductor cache, saved unpacked at ``folder``,
    with the C++ kernel libraries copied in.

    The private cache keeps anything from the user's Inductor or Triton caches (which know nothing of gearcache's
    key factors, e.g. custom decompositions) out of the artifact."""
    from torch._inductor import standalone_compile
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    options: dict[str, Any] = {"config_patches": dict(config_patches)}
    if any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs):
        _probe_cpu_isa()
    with _INDUCTOR_LOCK, tempfile.TemporaryDirectory(prefix="gearcache-compile-") as scratch:
        with temporary_cache_dir(scratch), _load_patches():
            artifact = standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs", options=options)
        artifact.save(path=str(folder), format="unpacked")
        _copy_compiled_libraries(pathlib.Path(scratch), folder)


_ISA_PROBED: list[bool] = []        # non-empty once _probe_cpu_isa ran in this process


def _probe_cpu_isa() -> None:
    """Run Inductor's CPU instruction-set probes (small C++ builds, once per process: ``valid_vec_isa_list`` is
    cached) in a throw-away cache, before a CPU compile or the load of an artifact with C++ kernels. Otherwise the
    process's first compile builds them into its private cache (and :func:`_copy_compiled_libraries` copies them
    into that artifact), or its first load into the artifact's folder: a gear's artifact would hold other files
    when compiled or loaded first in a process (warm-up workers, the caller of a parallel warm-up) than later."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with _INDUCTOR_LOCK:
        if _ISA_PROBED:
            return                      # (a throw-away cache costs a folder and two clears of Inductor's caches)
        with tempfile.TemporaryDirectory(prefix="gearcache-isa-") as scratch:
            with temporary_cache_dir(scratch), _load_patches():
                cpu_vec_isa.valid_vec_isa_list()
        _ISA_PROBED.append(True)


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
    """Load an artifact's Inductor folder (``<artifact>/inductor``) written by :func:`compile_to_folder`; returns
    ``fn(*flat_inputs) -> list[Tensor]``."""
    from torch._inductor.standalone_compile import CompiledArtifact

    if any(pathlib.Path(folder).glob("*/*.cpp")):      # C++ kernels: a first load in this process would probe here
        _probe_cpu_isa()
    with _INDUCTOR_LOCK, _load_patches():
        artifact = CompiledArtifact.load(path=str(folder), format="unpacked")
    return artifact


# ------------------------------------------------------------------------------------------------------- run plans
# What gearcache's own loader (gearcache/runplan/) needs from torch at run time: torch._C only, never the compiler.
CPP_KERNEL_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def assert_size_stride(tensor: torch.Tensor, size: tuple, stride: tuple, op_name: str | None = None) -> None:
    """The C check Inductor's wrappers run on a kernel's output (``torch._C._dynamo.guards.assert_size_stride``,
    which ``torch._inductor.runtime.runtime_utils.assert_tensor_metadata`` calls in 2.15): AssertionError naming the
    differing size or stride."""
    torch._C._dynamo.guards.assert_size_stride(tensor, size, stride, op_name)


def cpp_kernel_env_value() -> str:
    """What Inductor's C++ kernel libraries read from ``CPP_KERNEL_ENV`` when imported (their tensor data-pointer
    offset; ``CppPythonBindingsCodeCache._load_library_inner`` sets it the same way)."""
    guards = torch._C._dynamo.guards
    return str(guards._torchinductor_pyobject_tensor_data_ptr)  # type: ignore[attr-defined]  # missing in torch's stubs


def load_cubin(path: str, function: str, shared: int, device: int) -> int:
    """Load a kernel from a cubin with torch's static CUDA launcher; returns the function handle. torch 2.11 returns
    ``(function, n_regs, n_spills)``, 2.13 ``(module, function, n_regs, n_spills)``. Loaded under a guard of
    ``device``: a thread whose current device is another (a warm-up thread of rank 1 is on cuda:0) would otherwise
    get a handle of the wrong context ("invalid resource handle" at launch, seen on 2 H200s)."""
    with torch.cuda.device(device):     # the module is loaded into the current context: make it the device's
        return torch._C._StaticCudaLauncher._load_kernel(path, function, shared, device)[-3]


def cubin_launcher() -> Callable[..., None]:
    """``launch(function, grid_x, grid_y, grid_z, num_warps, shared, arg_types, args, stream)``."""
    return torch._C._StaticCudaLauncher._launch_kernel


# ------------------------------------------------------------------------------------------- CUDA-graph outputs
def tensor_match(tensors: tuple) -> Callable[..., bool] | None:
    """A predicate in C++, ``match(*others) -> bool`` for exactly ``len(tensors)`` arguments (another count raises
    TypeError): True when each has the same Python type, dispatch keys under the thread's dispatch state (device type,
    layout, inference mode), dtype, device index, ``requires_grad``, sizes and strides as the tensor at its place, and
    no argument is passed twice. Nothing else (no values, no storage offset or alignment). Holds no reference to
    ``tensors``. None where torch lacks it: the caller then keys every call in Python (gearcache/call/signature.py).

    Mechanism: gearcache's native ``TensorMatch`` (gearcache/native/guards.cpp) where it is built for this torch,
    else Dynamo's ``torch._C._dynamo.guards.TensorGuards`` (guards.cpp ``TensorCheck``) with every size and stride
    given, so no dimension is dynamic."""
    native = gearcache_native.guards()
    if native is not None:
        try:
            return native.TensorMatch(tuple(tensors))
        except (TypeError, RuntimeError):     # not all plain strided tensors (sparse, nested, symbolic): Dynamo's
            pass
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    tensor_guards = getattr(guards, "TensorGuards", None)
    if tensor_guards is None:
        return None
    try:
        return tensor_guards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    except (TypeError, RuntimeError, SystemError):
        return None


def tensor_meta_match(tensors: tuple) -> tuple[Callable[[], bool], Any]:
    """``(holds, capsule)``: ``holds() -> bool`` is True while every tensor of ``tensors`` (held) has the dtype, device,
    layout, sizes, strides and data address it has now; ``capsule`` (None without gearcache's native module) is
    the same check in C for gearcache.call._callpath's GuardWatch (``META_HOLDS``, called with ``holds``).

    Mechanism: gearcache's native ``MetaMatch`` (gearcache/native/guards.cpp) where it is built for this torch and
    every tensor is a plain strided one, else the same comparison in Python (microseconds per tensor: the first
    process, before the native module is built)."""
    native = gearcache_native.guards()
    if native is not None and hasattr(native, "MetaMatch"):
        try:
            return native.MetaMatch(tuple(tensors)), native.META_HOLDS
        except (TypeError, RuntimeError):     # not all plain strided tensors: Python's
            pass
    return _PyMetaMatch(tuple(tensors)), None


class _PyMetaMatch:
    """:func:`tensor_meta_match` in Python."""

    def __init__(self, tensors: tuple):
        self.tensors = tensors
        self.metas = [_meta(t) for t in tensors]

    def __call__(self) -> bool:
        return all(_meta(t) == m for t, m in zip(self.tensors, self.metas))


def _meta(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided:
        return (t.layout, t.dtype, t.device, t.data_ptr())
    return (t.dtype, t.device, t.shape, t.stride(), t.data_ptr())


_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


def _plain_tensors(args: tuple) -> bool:
    """:func:`plain_tensors_check`'s answer in Python."""
    return (len({*map(id, args)}) == len(args) and all(type(a) is torch.Tensor for a in args)
            and not any(a.dtype in _COMPLEX and (a.is_conj() or a.is_neg()) for a in args))


def plain_tensors_check() -> Callable[[tuple], bool]:
    """``plain(args) -> bool`` for a tuple of tensors: each an exact ``torch.Tensor`` (no subclass), none passed twice,
    none with its conjugate or negative bit: a call whose key is each tensor's shape, stride, dtype and device alone.
    gearcache's native check (one C++ loop) where it is built, else the same in Python (~0.5 us more per call)."""
    native = gearcache_native.guards()
    return getattr(native, "plain_tensors", None) or _plain_tensors


def native_data_ptr() -> Any:
    """gearcache's native ``DATA_PTR`` capsule (``tensor.data_ptr()`` in C, for the C runner's alignment checks:
    gearcache/call/_callpath.c), or None where the native module is not loaded (the runner then calls
    ``data_ptr()``)."""
    native = gearcache_native.guards()
    return getattr(native, "DATA_PTR", None) if native is not None else None


def state_slot(module: torch.nn.Module, name: str) -> tuple[dict, str]:
    """Where the parameter or buffer ``name`` (dotted, from ``module``) lives: its owner's ``_parameters`` or
    ``_buffers`` dict and its key there. A read through the slot sees the tensor there now (replaced or updated in
    place); gearcache's entries and CUDA graphs hold slots, never the tensors."""
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if attr in owner._parameters:
        return owner._parameters, attr
    if attr in owner._buffers:
        return owner._buffers, attr
    raise KeyError(f"module has no parameter or buffer {name!r}")


def state_guard_covers_inference_mode(same: Callable[[], bool]) -> bool:
    """True when ``same`` (from :func:`state_guard`) also says False once inference mode differs from its snapshot's
    (gearcache's native snapshot does; Dynamo's does not)."""
    native = gearcache_native.guards()
    return native is not None and isinstance(same, native.StateSnapshot)


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


# -------------------------------------------------------------------------------------------------- process groups
def process_groups() -> dict[str, dict[str, Any]]:
    """``{group name: {"ranks": [global ranks, sorted], "backend": str}}`` for every process group this process is a
    member of; ``{}`` when ``torch.distributed`` is not initialised. A name is c10d's registry name: the string
    Dynamo records in a graph's functional collectives (``torch.ops._c10d_functional.all_reduce(x, "sum", "0")``),
    which resolves to the live group at run time. Reads ``distributed_c10d._world.pg_names`` and ``pg_group_ranks``
    (2.11 and 2.13). Importing ``torch.distributed`` imports neither Dynamo nor Inductor."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from torch.distributed import distributed_c10d as c10d

    groups = {}
    for pg, name in list(c10d._world.pg_names.items()):
        ranks = c10d._world.pg_group_ranks.get(pg)
        if ranks is not None:
            groups[str(name)] = {"ranks": sorted(int(r) for r in ranks), "backend": str(c10d.get_backend(pg))}
    return groups


def default_store() -> Any:
    """The key-value store of the default process group (c10d's ``_get_default_store()``: a ``PrefixStore`` over the
    job's TCPStore), or None without an initialised ``torch.distributed``. gearcache's fences
    (gearcache/ranks/phases.py) use
    it: ``set``, ``get``, ``check``, ``wait(keys, timedelta)`` (2.11 and 2.13)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def process_group_identity(obj: Any) -> list | None:
    """``["process_group", name, ranks]`` for a ``ProcessGroup`` this process belongs to (its c10d registry name and
    global ranks: what :func:`process_groups` keys, and what a graph's collectives name), else None. Dynamo guards a
    group a method reads (``dist.group.WORLD``) by identity; that name and those ranks identify it in any process."""
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(obj, dist.ProcessGroup)):
        return None
    from torch.distributed import distributed_c10d as c10d

    name, ranks = c10d._world.pg_names.get(obj), c10d._world.pg_group_ranks.get(obj)
    if name is None or ranks is None:
        return None
    return ["process_group", str(name), sorted(int(r) for r in ranks)]


def intercepting_ops(namespaces: frozenset[str],
                     handler: Callable[[str, str, tuple, dict], Any]) -> contextlib.AbstractContextManager:
    """A context in which every call of an operator of one of ``namespaces`` (e.g. ``"_c10d_functional"``) from this
    thread returns ``handler(namespace, op name without overload, args, kwargs)`` instead of running the operator;
    every other operator runs unchanged. A ``TorchDispatchMode`` (``torch.utils._python_dispatch``, 2.11 and 2.13):
    it sees the operators Inductor's wrapper calls through ``torch.ops``, not its Triton or C++ kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Intercept(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless a subclass opts out, and
            # that wrapper imports torch._dynamo (and Inductor) on its first call: seconds in a warm process, which
            # runs stand-ins (CudaGraphs' warm-up runs under a process group) and never runs under Dynamo.
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ns, _, op = func._schema.name.partition("::")
            if ns in namespaces:
                return handler(ns, op, args, kwargs)
            return func(*args, **kwargs)

    return _Intercept()


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
        extras = "+".join(name for name in CPU_ISA_EXTRAS if _cpu_supports(name))
        return f"cpu:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}" + (f"+{extras}" if extras else "")
    return dev.type


# Instruction-set extensions beyond ATen's CPU capability for which Inductor adds compiler flags when the CPU has them
# (-mavx512bf16, -mavx512vnni, -mamx-tile, -mamx-fp16: torch._inductor.cpu_vec_isa): kernels built with them may not
# run on a CPU of the same capability that lacks them, so they are part of the device's key factor.
CPU_ISA_EXTRAS = ("avx512_bf16", "vnni", "amx_tile", "amx_fp16")


def _cpu_supports(extension: str) -> bool:
    """``torch.cpu._is_<extension>_supported()`` (reads the CPU's flags; False where torch has no such check)."""
    check = getattr(torch.cpu, f"_is_{extension}_supported", None)
    return bool(check()) if check is not None else False


# ----------------------------------------------------------------------------------------------------- global state
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "privateuseone")


def _sdp_backends() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {name: bool(getattr(cuda, f"{name}_sdp_enabled", lambda: None)())
            for name in ("flash", "mem_efficient", "math", "cudnn")}


def global_state(devices: Iterable[str] = ()) -> dict[str, Any]:
    """The thread's torch settings, other than grad and inference mode (the signature holds those), that change what a
    capture traces or what Inductor generates for it, as JSON-able values (a cache key factor; equal dicts mean the
    same compiled code):

    - ``autocast``: ``{device type: dtype}`` for each device type whose autocast is on (the traced graph casts);
    - ``default_dtype``, ``deterministic`` (algorithms on, warn only), ``torch_function`` (enabled, all disabled);
    - ``matmul``: TF32 and reduced-precision reductions of cuBLAS, cuDNN's TF32, the float32 matmul precision;
    - ``sdp``: the scaled-dot-product attention backends enabled (Dynamo picks one at trace time);
    - ``default_device``: ``torch.set_default_device``'s (factory calls in the method are traced on it);
    - ``torch_function_modes``: the classes of the active ``TorchFunctionMode`` stack (Dynamo traces a mode into the
      graph: ``TORCH_FUNCTION_MODE_STACK``), ``functorch``: the active functorch transforms (vmap, grad, ...:
      ``FUNCTORCH_STACK_MATCH``), ``forward_ad_level``: forward-mode AD's level (``DUAL_LEVEL``);
    - ``cpu_threads``, only where a CPU is among ``devices`` (a key's devices): Inductor writes the thread count into
      its C++ kernels.

    The set follows Dynamo's global-state guard (``GlobalStateGuard``), the thread count only for CPU code, plus
    ``matmul``'s cuDNN/precision parts and ``sdp``, which Dynamo does not guard. Public APIs only; ~10 us: call it on
    a miss, not per call (see :func:`state_guard`)."""
    autocast = {}
    for device_type in _AUTOCAST_DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device_type):
                autocast[device_type] = str(torch.get_autocast_dtype(device_type))
        except (RuntimeError, ValueError):      # a device type this build does not know
            continue
    matmul = torch.backends.cuda.matmul
    state: dict[str, Any] = {
        "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled() if autocast else None,
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "torch_function": [torch._C._is_torch_function_enabled(),
                           bool(getattr(torch._C, "_is_torch_function_all_disabled", lambda: False)())],
        "matmul": {"cuda_tf32": matmul.allow_tf32,
                   "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
                   "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
                   "cudnn_tf32": torch.backends.cudnn.allow_tf32,
                   "float32_precision": torch.get_float32_matmul_precision()},
        "sdp": _sdp_backends(),
        "default_device": default_device(),
        "torch_function_modes": _torch_function_modes(),
        "functorch": _functorch_layers(),
        "forward_ad_level": _forward_ad_level(),
    }
    if any(str(d).startswith("cpu") for d in devices):
        state["cpu_threads"] = torch.get_num_threads()
    return state


NOT_TORCHS = object()      # unpatched_class_attribute: an attribute Dynamo added, not torch's own

# nn.Module attribute -> (the qualified name of Dynamo's wrapper, the wrapped original's name in its closure)
_DYNAMO_MODULE_PATCHES = {
    "__init__": ("install_generation_tagging_init.<locals>.patched_init", "init"),
    "__setstate__": ("install_generation_tagging_init.<locals>.patched_setstate", "setstate"),
}


_LIBRARY_MODULE_METHODS = {"smart_apply": "transformers."}     # nn.Module attribute -> the library that adds it


def unpatched_class_attribute(cls: type, name: str, value: Any) -> Any:
    """``value`` (``cls.__dict__[name]``) as torch itself defines it: Dynamo's first capture in a process replaces
    ``nn.Module.__init__`` and ``__setstate__`` by wrappers that call them and tag the module
    (``torch._dynamo.mutation_guard.install_generation_tagging_init``), and marks the class with
    ``___needs_generation_tag_patch``; a class's fingerprint must not depend on whether this process ran Dynamo.
    transformers adds ``nn.Module.smart_apply`` the first time a ``PreTrainedModel`` initialises its weights (no
    forward reads it): every other class's fingerprint must not depend on whether this process built such a model
    (a process that had was served none of the entries a fresh one compiled). Returns the wrapped original for the
    Dynamo patches, ``NOT_TORCHS`` for the mark and transformers' method, ``value`` otherwise."""
    if cls is not torch.nn.Module:
        return value
    library = _LIBRARY_MODULE_METHODS.get(name)
    if name == "___needs_generation_tag_patch" or (
            library is not None and (getattr(value, "__module__", None) or "").startswith(library)):
        return NOT_TORCHS
    patch = _DYNAMO_MODULE_PATCHES.get(name)
    if (patch is not None and getattr(value, "__qualname__", None) == patch[0]
            and getattr(value, "__module__", None) == "torch._dynamo.mutation_guard"
            and patch[1] in value.__code__.co_freevars):
        return value.__closure__[value.__code__.co_freevars.index(patch[1])].cell_contents
    return value


def _torch_function_modes() -> list[str]:
    """The classes of the thread's ``TorchFunctionMode`` stack, innermost last."""
    modes = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [f"{type(m).__module__}.{type(m).__qualname__}" for m in modes]


def _functorch_layers() -> list:
    """The active functorch transforms (each interpreter's state: transform, level, options), outermost first."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return []
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return [json.loads(json.dumps(ci.get_state(), default=str)) for ci in retrieve_all_functorch_interpreters()]


def _forward_ad_level() -> int:
    """Forward-mode AD's current dual level (-1: none)."""
    import torch.autograd.forward_ad as forward_ad
    return int(forward_ad._current_level)


def state_guard() -> Callable[[], bool] | None:
    """``same() -> bool`` in C++: True while the calling thread's grad mode, autocast, default dtype, deterministic
    algorithms, cuBLAS TF32/reduced-precision flags, torch-function state and thread count are what they were when
    this was called (~0.2-0.5 us). With gearcache's native module it also sees inference mode, the thread's dispatch
    keys and the SDPA backends; neither sees cuDNN's TF32 flag nor the float32 matmul precision beyond what it does to
    cuBLAS TF32 (torch.compile does not either). None where torch lacks both (callers then compute
    :func:`global_state` each time).

    Mechanism: gearcache's native ``StateSnapshot`` (gearcache/native/guards.cpp) where it is built for this torch,
    else Dynamo's ``torch._C._dynamo.guards.GlobalStateGuard`` (guards.cpp); a snapshot taken at construction."""
    native = gearcache_native.guards()
    if native is not None:
        return native.StateSnapshot()
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    guard_type = getattr(guards, "GlobalStateGuard", None)
    if guard_type is None:
        return None
    try:
        return guard_type().check
    except (TypeError, RuntimeError):
        return None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _set_settings(state: dict[str, Any]) -> None:
    """Set the non-autocast parts of a :func:`global_state` that differ from this thread's (only those: setting a
    value equal to the current one can still change torch's state, e.g. the float32 matmul precision also sets the
    ``fp32_precision`` fields, which Inductor's cache keys read; the precision goes first: it sets the TF32 flag)."""
    now = global_state()
    if state["default_dtype"] != now["default_dtype"]:
        torch.set_default_dtype(_dtype(state["default_dtype"]))
    if state["deterministic"] != now["deterministic"]:
        torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    matmul, now_matmul = state["matmul"], now["matmul"]
    if matmul["float32_precision"] != now_matmul["float32_precision"]:
        torch.set_float32_matmul_precision(matmul["float32_precision"])
        now_matmul = global_state()["matmul"]
    cuda = torch.backends.cuda.matmul
    for key, attr in (("cuda_tf32", "allow_tf32"), ("fp16_reduced", "allow_fp16_reduced_precision_reduction"),
                      ("bf16_reduced", "allow_bf16_reduced_precision_reduction")):
        if matmul[key] != now_matmul[key]:
            setattr(cuda, attr, matmul[key])
    if matmul["cudnn_tf32"] != now_matmul["cudnn_tf32"]:
        torch.backends.cudnn.allow_tf32 = matmul["cudnn_tf32"]
    for name, enabled in state["sdp"].items():
        if enabled != now["sdp"].get(name):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)


@contextlib.contextmanager
def global_state_applied(state: dict[str, Any]):
    """Within the block, this thread's global torch state is ``state`` (a :func:`global_state` of another thread or
    process: a compile worker compiles under the caller's autocast, TF32 flags, ...); the previous state is restored
    after. ValueError (nothing changed) when the state cannot be reproduced here, e.g. another torch-function state:
    the caller then compiles in its own thread."""
    before = global_state()
    with contextlib.ExitStack() as stack:
        try:
            stack.callback(_set_settings, before)
            _set_settings(state)
            for device_type, dtype in state["autocast"].items():
                stack.enter_context(torch.autocast(device_type, dtype=_dtype(dtype),
                                                   cache_enabled=state["autocast_cache"]))
            now = global_state()
            if now != state:
                differ = sorted(k for k in state if now.get(k) != state.get(k))
                raise ValueError(f"the global torch state cannot be reproduced here (differs in {differ})")
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"global_state_applied: {exc}") from exc
        yield


any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
"""True when autocast is on for any device type in this thread (C++; what AOTAutograd reads at load)."""
disable_autocast: Callable[[], contextlib.AbstractContextManager] = torch._C._DisableAutocast
"""Autocast off for every device type within the block: compiled code runs so, as its casts are already in the graph
(AOTAutograd's runtime wrapper does the same: ``disable_amp``)."""


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
# Parallel warm-up (gearcache/compiling/workers.py) captures in the calling process and compiles in worker processes:
# the
# Dynamo graph travels as bytes (torch's own ``GraphPickler``, which its subprocess compile uses too), the example
# inputs as metadata, Inductor's and AOTAutograd's settings as torch's portable config snapshot. The worker runs the
# first half of :func:`compile_to_folder` (:func:`compile_unloaded`); the caller runs the second
# (``compiler.finish_artifact``), the run plan's check needing the real example inputs.
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
def _graph_pickler() -> type[GraphPickler]:
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
    gm = cast(torch.fx.GraphModule, GraphPickler.loads(parts["graph"], FakeTensorMode(shape_env=ShapeEnv())))
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


# ------------------------------------------------- capture, config, workers, padding analysis (#29: misc)
def require_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Make ``dim`` of ``tensor`` dynamic in the next Dynamo trace, strictly (``torch._dynamo.mark_dynamic``): a trace
    that specialises on its size raises (a constraint violation) instead of quietly making it static."""
    torch._dynamo.mark_dynamic(tensor, dim)


def as_subclass_sharing_storage(cls: type, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as an instance of the Tensor subclass ``cls``, sharing its storage
    (``torch.Tensor._make_subclass``)."""
    return torch.Tensor._make_subclass(cls, tensor)


def inductor_setting_names() -> set[str]:
    """The names of Inductor's settings (``torch._inductor.config``; imports the compiler's config, not the
    compiler)."""
    import torch._inductor.config as inductor_config

    return set(inductor_config.get_config_copy())


def import_torch_loader() -> None:
    """Import torch's artifact loader (``standalone_compile`` and Inductor's ``compile_fx``) now. Background
    compiles settle at interpreter exit (gearcache/compiling/background.py), when importing Inductor fails: it registers
    thread exit hooks, refused once the interpreter shuts down."""
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401


def warm_up_compiler() -> None:
    """Import what a compile needs (AOTAutograd, Inductor, ``standalone_compile``) and start Inductor's compile
    pool now (worker processes only: a warm process must not import the compiler)."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()


def aten_op(node: torch.fx.Node) -> torch._ops.OpOverload:
    """The ATen op overload that a ``call_function`` node of an ATen graph (:func:`aten_graph`) calls: the node's
    target, typed as what it is (for a node whose :func:`op_schema` is not None)."""
    return cast(torch._ops.OpOverload, node.target)


# ------------------------------------------------------------------------------- run plans: writer and loader (#29)
# What gearcache/runplan/ reads of torch's private API beyond the run-time section above. The writer's functions run
# in a compiling process only and import torch's compiler lazily, inside each function; the loader's
# (``grad_mode_setter``) touch torch._C only: a warm process imports nothing from torch._inductor or triton.
def grad_mode_setter() -> Callable[[bool], None]:
    """``torch._C._set_grad_enabled``: sets grad mode with no Python frame (``torch.set_grad_enabled`` is a context
    manager class), for the run plan's per-call function."""
    return torch._C._set_grad_enabled


def operator_ref(target: Any) -> tuple[str, str] | None:
    """``("namespace::op", overload name)`` of an operator (``OpOverload``; an ``OpOverloadPacket`` gets the overload
    name ``""``), None for anything else (a Python function)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, ""
    return None


def load_cache_entry(path: pathlib.Path) -> Any:
    """Unpickle one of torch's cache entries in a saved artifact (AOTAutograd's ``aotautograd/*/*`` or the FX graph
    entry ``fxgraph/*/*/*``), after importing the modules defining the classes they pickle."""
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401 - the AOTAutograd entry's classes
    import torch._inductor.output_code  # noqa: F401 - the FX graph entry's classes

    with open(path, "rb") as f:
        return pickle.load(f)


def triton_bundle(fx_entry: Any) -> Any:
    """The FX graph entry's Triton bundle (the cubins of every config compiled), or None."""
    return getattr(fx_entry, "_triton_bundle", None)


def triton_autotuners(namespace: dict[str, Any]) -> dict[str, Any]:
    """The Triton kernels (Inductor's ``CachingAutotuner`` objects) among a loaded wrapper module's globals."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return {n: k for n, k in namespace.items() if isinstance(k, CachingAutotuner)}


def kernel_grid(inductor_meta: dict[str, Any], config: Any) -> tuple[list[str], list[str]]:
    """A Triton kernel's launch grid as Inductor computes it at run time (``GridExpr.from_meta``): the lines that
    precede it (``prefix``) and its x, y, z expressions."""
    from torch._inductor.runtime.triton_heuristics import GridExpr

    grid = GridExpr.from_meta(inductor_meta, config)
    return list(grid.prefix), [str(grid.x_grid), str(grid.y_grid), str(grid.z_grid)]


def kernel_arg_lists(compile_result: Any, arg_names: list[str], constexprs: Any) -> tuple[list[str], list[str], Any]:
    """Inductor's argument lists for launching a compiled Triton kernel (``TritonCompileResult._get_arg_lists``):
    the call arguments, the definition's arguments and (an ordered set) the names passed as None."""
    return compile_result._get_arg_lists(arg_names, constexprs)


def triton_constexprs(jit_function: Any) -> list[int]:
    """The indices of a Triton ``JITFunction``'s constexpr parameters (``triton_helpers.get_constexprs``)."""
    from torch._inductor.runtime.triton_helpers import get_constexprs

    return get_constexprs(jit_function)
