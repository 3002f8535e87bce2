"""Compiling a graph with Inductor into an artifact folder, and loading one (gearcache/compiling/pipeline.py,
entry_life.py, workers.py, background.py; gearcache/runplan/loader.py; gearcache/config.py for mode settings).

On-disk format: a Dynamo graph is compiled with ``torch._inductor.standalone_compile`` and saved in its "unpacked"
format at ``<artifact>/inductor``: a folder laid out like an Inductor cache (AOTAutograd entry ``aotautograd/*/*``,
FX graph entry ``fxgraph/*/*/*`` with the generated Python wrapper, Triton kernels bundled with their cubins and
autotuning choices). On CPU the compiled C++ kernels (``<xx>/<key>.so`` with their sources) are copied into that
folder at the paths the cache had them, so loading it in a fresh process runs no compiler. Compiling and loading point
Inductor's cache at a folder for the duration only (``temporary_cache_dir``, torch's own context manager), never
changing the process environment otherwise, and are serialised within the process (one lock).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import pathlib
import shutil
import tempfile
import threading
from typing import Any, Callable, cast

import torch

# Loading and compiling point TORCHINDUCTOR_CACHE_DIR at a folder for a moment: serialise them within the process.
_INDUCTOR_LOCK = threading.RLock()


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


def serial_compiles() -> contextlib.AbstractContextManager[None]:
    """Inductor compiling in the calling thread only (``compile_threads=1``: no thread pool): at interpreter exit,
    where ``concurrent.futures`` takes no new work ("cannot schedule new futures after interpreter shutdown"), a
    compile that would submit its C++ or Triton builds to Inductor's pool fails. Changes no generated code."""
    from torch.utils._config_module import ConfigModule

    return cast(ConfigModule, torch._inductor.config).patch({"compile_threads": 1})     # a config module


def compile_to_folder(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                      config_patches: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor and write a self-contained, loadable artifact folder at ``folder``
    (``<artifact>/inductor``); returns the artifact as torch's loader loads it (the run plan's writer reads it).
    A first load writes whatever torch writes on load, before the digests are taken."""
    compile_unloaded(gm, example_inputs, folder, config_patches=config_patches)
    return load_folder(folder)


def views_of_one_base(example_inputs: list[Any]) -> list[Any]:
    """``example_inputs`` where the tensors on one storage object have autograd bases AOTAutograd cannot merge (two
    distinct ``_base`` objects, or a tensor with none that is not the others' base: ``b[0:4]`` beside
    ``b.detach()[2:6]``): each of them but that base rebuilt as an ``as_strided`` view of the first ``_base`` among
    them in input order, the one AOTAutograd's runtime wrapper merges a call's views over (``_synthetic_base_wrapper``:
    the first non-None ``_base`` of the group), over the same memory. Was: AssertionError "non-differentiable view
    input mutations" at the compile of a graph writing one of them. Others are returned as they are (the list
    itself where nothing changes; views of a dtype other than the base's are left to AOTAutograd). Cost: a storage
    per tensor input, at a compile only."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            groups.setdefault(id(t.untyped_storage()), []).append(i)
    rebuilt = list(example_inputs)
    for indices in groups.values():
        tensors = [example_inputs[i] for i in indices]
        bases = [t._base for t in tensors if t._base is not None]
        if len(tensors) < 2 or not bases or any(t.dtype != bases[0].dtype for t in tensors) or all(
                (t._base if t._base is not None else t) is bases[0] for t in tensors):
            continue                    # one base already, or views of another dtype (left to AOTAutograd)
        for i, t in zip(indices, tensors):
            if t is not bases[0] and t._base is not bases[0]:
                rebuilt[i] = bases[0].as_strided(t.size(), t.stride(), t.storage_offset())
    return rebuilt


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
    example_inputs = views_of_one_base(example_inputs)
    with _INDUCTOR_LOCK, tempfile.TemporaryDirectory(prefix="gearcache-compile-") as scratch:
        with temporary_cache_dir(scratch), _load_patches():
            artifact = standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs", options=options)
        try:
            artifact.save(path=str(folder), format="unpacked")
        except RuntimeError as exc:
            _refuse_freezing(exc)
            opaque = _opaque_call(gm)
            if opaque is None:
                raise
            raise RuntimeError(f"the graph calls {opaque}, a Python function Dynamo kept as one op (marked "
                               f"torch.compiler.allow_in_graph, or put in place of a torch function: "
                               f"torch.nn.functional.silu = f), which a stored artifact cannot hold. Fix: undo the "
                               f"mark or the patch, or call it outside the cached method") from exc
        _copy_compiled_libraries(pathlib.Path(scratch), folder)


def _refuse_freezing(exc: RuntimeError) -> None:
    """Raise a RuntimeError naming ``torch._inductor.config.freezing`` and the fix where it is on: Inductor then folds
    the weights into the compiled code, which torch's cache, and so a stored artifact, cannot hold (``save`` failed
    with "no artifact to save"); nothing where it is off."""
    if getattr(torch._inductor.config, "freezing", False):
        raise RuntimeError("torch._inductor.config.freezing=True: Inductor folds the weights into the compiled code, "
                           "which a stored artifact cannot hold (gearcache's entries read the live weights at every "
                           "call). Fix: set torch._inductor.config.freezing = False (or TORCHINDUCTOR_FREEZING=0) "
                           "for the cached methods") from exc


def _opaque_call(gm: torch.fx.GraphModule) -> str | None:
    """The first call of ``gm`` that torch's compiled-artifact cache will not store (its ``check_node_safe``), by
    name; None where there is none (or this torch has no such check)."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import check_node_safe
    except ImportError:
        return None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            check_node_safe(node)
        except Exception:
            target = node.target
            return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    return None


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


def _load_patches() -> contextlib.AbstractContextManager[None]:
    """Inductor settings under which an artifact loads without a compiler: no precompiled header (whose freshness
    check runs the C preprocessor on every load) and no ISA probe build (the ISA is a key factor instead).

    Compiles use them too: the precompiled-header setting changes the C++ kernels' cache keys, and a load must find
    the very libraries the compile built."""
    import torch._inductor.config as inductor_config

    from torch.utils._config_module import ConfigModule

    return cast(ConfigModule, inductor_config).patch({"cpp_cache_precompile_headers": CPP_PRECOMPILED_HEADERS,
                                                      "cpp.vec_isa_ok": True})     # a config module


CPP_PRECOMPILED_HEADERS = os.environ.get("GEARCACHE_CPP_PCH", "0") == "1"
"""Whether compiles build C++ kernels against a precompiled header (off: the default above; on: for measuring a
CPU cold start, issue #36)."""


def load_folder(folder: pathlib.Path) -> Callable[..., Any]:
    """Load an artifact's Inductor folder (``<artifact>/inductor``) written by :func:`compile_to_folder`; returns
    ``fn(*flat_inputs) -> list[Tensor]``."""
    from torch._inductor.standalone_compile import CompiledArtifact

    if any(pathlib.Path(folder).glob("*/*.cpp")):      # C++ kernels: a first load in this process would probe here
        _probe_cpu_isa()
    with _INDUCTOR_LOCK, _load_patches():
        artifact = CompiledArtifact.load(path=str(folder), format="unpacked")
    return artifact


_SETTINGS_GEARCACHE_PATCHES = {"compile_threads", "cpp_cache_precompile_headers", "cpp.vec_isa_ok"}


def changed_compiler_settings() -> dict[str, dict[str, str]]:
    """The Inductor and AOTAutograd settings this process set in code to other values than they have without
    (``torch._inductor.config.emulate_precision_casts = True``): ``{"inductor": {name: repr(value)}, "functorch":
    {...}}``, modules without such a setting left out; ``{}`` for none. A compile runs under them (and a worker's
    under the caller's: ``worker_compile.compiler_settings``), so they change the compiled code, as a
    ``CompilerConfig.inductor_options`` does.

    Read without importing torch's compiler (a warm start must not): a setting can only have been set in code where
    its config module is imported, so a module not imported has none. Left out: settings torch's own caches ignore
    (private ones, ``_cache_config_ignore_prefix``: paths, thread counts, cache switches) and those gearcache patches
    itself around a compile or load. Settings changed through ``TORCHINDUCTOR_*`` environment variables are not read
    here (interpreting them needs the config module): :func:`compiler_environment` keys those. Cost, at an entry key (a
    miss or a warm-up's look-up), never on the call path: ~0.5 ms where the config modules are imported (a walk over
    ~600 settings), none where not (a warm process)."""
    import sys

    changed: dict[str, dict[str, str]] = {}
    for label, name in (("inductor", "torch._inductor.config"), ("functorch", "torch._functorch.config")):
        module = sys.modules.get(name)
        entries = getattr(module, "_config", None)
        if not isinstance(entries, dict):
            continue
        ignored = ("_", *getattr(module, "_cache_config_ignore_prefix", []))
        found = {}
        for key, entry in entries.items():
            if key.startswith(ignored) or key in _SETTINGS_GEARCACHE_PATCHES or getattr(entry, "alias", None):
                continue
            value = _overridden(entry)
            if value is not _NOT_OVERRIDDEN:
                found[key] = repr(value)
        if found:
            changed[label] = dict(sorted(found.items()))
    passes = custom_passes()
    if passes:
        changed["custom_passes"] = passes
    return changed


_CUSTOM_PASS_SETTINGS = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                         "joint_custom_pre_pass", "joint_custom_post_pass", "_pre_fusion_custom_pass",
                         "_post_fusion_custom_pass", "_fuse_ddp_communication_passes", "custom_partitioner_fn")
"""Inductor's settings that hold the user's graph passes: torch's caches leave them out of the settings they read
(``_cache_config_ignore_prefix``) and key each by its ``uuid()`` instead (``FxGraphHashDetails``), and its portable
config snapshot, a worker's settings, leaves them out too."""


def custom_passes() -> dict[str, str]:
    """The custom graph passes set in Inductor's settings (``post_grad_custom_post_pass = MyPass()``), ``{setting:
    what identifies it}``: a pass object by its class and ``uuid()`` (torch's own identity for it), a pass named by a
    string by that name, lists item by item; ``{}`` where none is set to other than its default (or the config module
    is not imported: a warm process). A pass changes the compiled code (a process without it loaded an entry compiled
    with it: 8 for ``3 * 5``), so :func:`changed_compiler_settings` holds them; and a worker process would compile
    without them (``compiling/workers.job_for`` keeps such a graph in the calling process). A pass whose ``uuid()`` is
    None cannot be stored (torch's cache bypasses the graph: its save fails). Cost: 9 reads, at an entry key."""
    import sys

    module = sys.modules.get("torch._inductor.config")
    entries = getattr(module, "_config", None)
    if not isinstance(entries, dict):
        return {}
    found = {}
    for name in _CUSTOM_PASS_SETTINGS:
        entry = entries.get(name)
        value = getattr(module, name, None) if entry is not None else None
        if value and value != getattr(entry, "default", None):
            found[name] = _pass_identity(value)
    return found


def _pass_identity(value: Any) -> str:
    """A custom pass setting's value as :func:`custom_passes` names it."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_pass_identity(v) for v in value) + "]"
    if isinstance(value, str):
        return value
    kind = type(value)
    uuid = getattr(value, "uuid", None)
    detail = repr(uuid()) if callable(uuid) else getattr(value, "__qualname__", repr(value))
    return f"{kind.__module__}.{kind.__qualname__}:{detail}"


_NOT_OVERRIDDEN = object()


_ENVIRONMENT_PREFIX = "TORCHINDUCTOR_"
_ENVIRONMENT_IGNORED = frozenset({
    # where torch's caches live and whether they are used (a compile runs against a private cache of its own)
    "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT",
    "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_NON_BLOCKING_REMOTE_CACHE_WRITE",
    # how many threads and processes compile, and how long they wait (gearcache's workers set the thread count)
    "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_WORKER_START", "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
    "TORCHINDUCTOR_WORKER_LOGPATH", "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT", "TORCHINDUCTOR_FILE_LOCK_TIMEOUT",
    "TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL", "TORCHINDUCTOR_PRECOMPILATION_TIMEOUT_SECONDS",
    # settings gearcache patches itself around a compile (_SETTINGS_GEARCACHE_PATCHES)
    "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCHINDUCTOR_VEC_ISA_OK",
})


def compiler_environment() -> dict[str, str]:
    """The ``TORCHINDUCTOR_*`` environment variables of this process, ``{name: value}`` sorted by name, less those
    known not to change the compiled code (cache folders and switches, thread counts, time-outs, those gearcache
    patches itself: ``_ENVIRONMENT_IGNORED``); ``{}`` for none.

    Inductor and AOTAutograd read most settings' defaults from these variables when their config modules are
    imported (``emulate_precision_casts = os.environ.get("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "0") == "1"``),
    and their compile code reads others directly, so :func:`changed_compiler_settings` (values set in code, over
    those defaults) cannot see them: a process started with ``TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1`` loaded the
    entry another compiled without it (0.125 off eager where its own compile is exact). Read from ``os.environ``,
    never from the config modules, so a warm process (which must not import them) keys a call as the compiling one
    did. A variable unknown here counts (at worst a miss more, never a stale load); one set in ``os.environ`` after
    torch's config module was imported counts though the compile did not read it (set them before ``import
    torch``). Cost: a pass over ``os.environ``'s names (~20 us for 43 variables: each name is decoded), at an entry
    key (a miss, a warm-up's look-up), never on the call path."""
    names = sorted(name for name in os.environ if name.startswith(_ENVIRONMENT_PREFIX))
    return {name: os.environ[name] for name in names if name not in _ENVIRONMENT_IGNORED}


def _overridden(entry: Any) -> Any:
    """A torch config entry's value set in code, where it differs from the value it has without
    (``_NOT_OVERRIDDEN`` otherwise, or where torch's ``_ConfigEntry`` lacks the fields read here). torch 2.11 keeps
    the value set in ``user_override`` itself (a dict-valued setting's ``{}`` has a ``get`` of its own), later
    versions a ``ContextVar`` of it."""
    from torch.utils import _config_module

    unset = getattr(_config_module, "_UNSET_SENTINEL", None)
    if unset is None or not hasattr(entry, "user_override"):
        return _NOT_OVERRIDDEN
    override = entry.user_override          # torch >= 2.13: a ContextVar; 2.11: the value itself
    value = override.get() if isinstance(override, contextvars.ContextVar) else override
    if value is unset:
        return _NOT_OVERRIDDEN
    force, env_default = getattr(entry, "env_value_force", unset), getattr(entry, "env_value_default", unset)
    if force is not unset:
        return _NOT_OVERRIDDEN                  # the environment forces the value: the setting in code is ignored
    without = env_default if env_default is not unset else getattr(entry, "default", unset)
    return _NOT_OVERRIDDEN if value == without else value


def settings_context() -> contextvars.Context:
    """The calling thread's compiler settings, for a compile in another thread to run under:
    ``threads.submit(settings_context().run, fn, *args)``. torch (2.13 and later) keeps an Inductor or AOTAutograd
    setting set in code (``torch._inductor.config.x = v``, ``config.patch``) in a ``ContextVar``, which a new thread
    does not see (it starts in an empty context): a compile there ran without the setting, under the key that names
    it (:func:`changed_compiler_settings`, read in the caller). A copy of the caller's whole context (each call a new
    one: a context is entered by one thread at a time); on torch 2.11 (settings are plain values, shared by every
    thread) it changes nothing. Cost: one ``contextvars.copy_context()`` (~1 us), per compile started elsewhere."""
    return contextvars.copy_context()


def run_under_settings(settings: contextvars.Context, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under the compiler settings ``settings`` holds (:func:`settings_context`, taken earlier, maybe in
    another thread), with the compile-thread count the calling thread has now: at interpreter exit the caller runs
    under :func:`serial_compiles`, which a context taken at launch does not hold (the compile then asked Inductor's
    pool for work: "cannot schedule new futures after interpreter shutdown"). Changes no generated code."""
    from torch.utils._config_module import ConfigModule

    config = cast(ConfigModule, torch._inductor.config)
    threads = {"compile_threads": config.compile_threads}     # as the calling thread reads it

    def run() -> Any:
        with config.patch(threads):
            return fn(*args)

    return settings.copy().run(run)


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

