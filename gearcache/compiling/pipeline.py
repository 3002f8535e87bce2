"""The one compile/load seam, after vLLM's ``compilation/compiler_interface.py`` (``CompilerInterface.compile`` and
``.load``): artifact key -> the store's artifact if present and valid, else compiled (Inductor, then the run plan),
published and loaded.

Both routes go through :class:`ArtifactPipeline`: a cached method's entries (gearcache/compiling/entry_life.py, which
adds the entry manifests around it) and the torch.compile backend (gearcache/compiling/torch_compile_backend.py).
The artifact key itself is computed by gearcache/keys/key.py's ``artifact_key``. The stages:

- :meth:`~ArtifactPipeline.load_stored`: the store's artifact ``akey``, verified (what its run plan reads), loaded for
  a GPU and leased; None (a miss) when it is absent, corrupt (quarantined), bound to another GPU or vanished.
- :meth:`~ArtifactPipeline.compile`: a graph into a build folder (:func:`compile_artifact`: Inductor's
  ``<artifact>/inductor``, then ``<artifact>/runplan``) under the config's Inductor patches
  (:meth:`~ArtifactPipeline.patches`); :meth:`~ArtifactPipeline.finish_compiled_elsewhere` for a folder a worker
  process compiled (:func:`finish_artifact`).
- :meth:`~ArtifactPipeline.publish`: a build under the artifact lock, once across the processes sharing the store,
  with ``config.on_cache_error`` applied when the store fails (``faults.publish_or_fallback``): ``(folder, built)``,
  folder None under ``"eager"`` after a fault.
- :meth:`~ArtifactPipeline.load_published`: the published folder loaded for a GPU (``runplan.load_artifact``; raises
  ``runplan.WrongDevice``), counted as a load when this process did not build it.
- :meth:`~ArtifactPipeline.compile_or_load`: publish (compiling the graph) then load_published: a :class:`Published`.

:func:`compile_artifact` is the one function every compile goes through (a cached method's entries, the torch.compile
route's backend; warm-up workers run its first half in another process and the caller :func:`finish_artifact`), so
tests can replace it as a whole.

Counters: ``compiles`` and ``compile_seconds`` for each compile here (a worker's seconds added for one compiled
elsewhere); ``loads`` and ``load_seconds`` for each artifact loaded that this process did not compile.

An artifact is immutable once published (its key is its content's address), so where a pipeline ``shares_loads`` a
process loads each one once per store folder and GPU (``_LOADED``): the entries of identical graphs (the repeated
blocks of a model compiled by region, gearcache/regions.py, one entry per block instance) share that load, each with
a runner of its own (``_own_runner``: a run plan's per-call alignment state is per entry).
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from typing import Any, Callable

import torch

from .._torch import aten as torch_aten, inductor as torch_inductor
from .._torch import state as torch_state
from .. import runplan
from ..runplan import write_run_plan
from ..config import CompilerConfig
from ..counters import counters
from ..errors import CacheCorruptionError, ConfigError
from ..store import Store
from . import artifact_io, faults

log = logging.getLogger("gearcache")

Build = Callable[[pathlib.Path], None]
"""What fills a build folder (``<artifact>/inductor``; it may write siblings such as ``<artifact>/runplan``)."""


@dataclasses.dataclass
class Published:
    """What :meth:`ArtifactPipeline.compile_or_load` gives: the artifact ``folder`` (the store's, or a private one:
    ``artifact_io.persisted`` tells), whether this process ``built`` it, and the ``compiled`` callable loaded from it.
    ``folder`` and ``compiled`` are None when the store failed under ``on_cache_error="eager"``: run uncompiled."""
    folder: pathlib.Path | None
    built: bool
    compiled: Callable[..., Any] | None


def decomposed(gm: torch.fx.GraphModule, example_inputs: list[Any],
               decompositions: dict[Any, Callable[..., Any]]) -> torch.fx.GraphModule:
    """``gm`` retraced to ATen ops with the user's ``decompositions`` applied (``make_fx`` on fake tensors: nothing
    runs): the graph a method with ``custom_decompositions`` compiles.

    Passing them to Inductor instead (``compile_fx(decompositions=...)``) makes torch's AOTAutograd cache bypass the
    graph, and then it cannot be saved; a pre-decomposed graph saves like any other."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with torch.no_grad():
            traced = make_fx(gm, decomposition_table=decompositions, tracing_mode="fake")(*example_inputs)
    except TypeError as exc:        # a decomposition whose parameters are not its op's
        raise ConfigError(f"custom_decompositions: applying them to the captured graph failed: {exc}. Fix: give each "
                          f"decomposition its op's parameters (torch.ops.aten.<op>.<overload>._schema lists "
                          f"them)") from exc
    made = {n.target for n in traced.graph.find_nodes(op="get_attr")} - {n.target for n in gm.graph.find_nodes(
        op="get_attr")}
    if made:
        raise ConfigError(f"custom_decompositions: a decomposition makes a tensor constant ({sorted(made)}: "
                          f"torch.tensor(...) or torch.as_tensor(...) of a number), which the compiled graph cannot "
                          f"take. Fix: use the number itself (x * 2.0), or torch.full_like(x, 2.0)")
    torch_aten.forget_unbacked_bindings(traced)     # a decomposition's .item(): Inductor's retrace binds its own
    return traced


class ArtifactPipeline:
    """Compile, publish and load the artifacts of one ``store`` under one ``config`` (see the module docstring)."""

    def __init__(self, store: Store, config: CompilerConfig):
        self.store = store
        self.config = config
        self.shares_loads = False     # reuse this process's loads of an artifact (``_LOADED``; regions turn it on)

    def patches(self) -> dict[str, Any]:
        """Inductor's config patches for the config's mode and options."""
        return {**torch_inductor.mode_options(self.config.mode), **self.config.inductor_options}

    def compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path) -> None:
        """Compile ``graph`` into the build folder ``folder`` (Inductor, in this process, then its run plan)."""
        t0 = time.perf_counter()
        compile_artifact(graph, example_inputs, folder, config_patches=self.patches())
        counters.add(compiles=1, compile_seconds=time.perf_counter() - t0)

    def finish_compiled_elsewhere(self, example_inputs: list[Any], folder: pathlib.Path,
                                  worker_seconds: float) -> None:
        """The rest of :meth:`compile` for a folder a worker process compiled (a first load and the run plan from
        ``example_inputs``: :func:`finish_artifact`); counted as a compile of ``worker_seconds`` plus this."""
        t0 = time.perf_counter()
        finish_artifact(folder, example_inputs)
        counters.add(compiles=1, compile_seconds=worker_seconds + time.perf_counter() - t0)

    def publish(self, akey: str, build: Build) -> tuple[pathlib.Path | None, bool]:
        """Publish artifact ``akey`` built by ``build`` (``faults.publish_or_fallback`` under
        ``config.on_cache_error``): ``(folder, built)``; folder None where the store failed under ``"eager"``."""
        return faults.publish_or_fallback(self.store, akey, build, self.config.on_cache_error)

    def load_published(self, folder: pathlib.Path, built: bool, index: int | None) -> Callable[..., Any]:
        """The published ``folder`` loaded for CUDA device ``index`` (``runplan.load_artifact``; raises
        ``runplan.WrongDevice`` when it runs only on another GPU); counted as a load unless ``built`` here or loaded
        already by this process (``_LOADED``)."""
        shared = self._shared(folder.name, index)
        if shared is not None:
            return shared
        t0 = time.perf_counter()
        compiled = runplan.load_artifact(folder, index)
        if not built:
            counters.add(loads=1, load_seconds=time.perf_counter() - t0)
        if self.shares_loads and folder.parent == self.store.layout.artifacts:
            _LOADED[(str(self.store.root), folder.name, index)] = compiled
        return compiled

    def _shared(self, akey: str, index: int | None) -> Callable[..., Any] | None:
        """A runner of its own over artifact ``akey`` as this process loaded it already from this store, or None."""
        loaded = _LOADED.get((str(self.store.root), akey, index)) if self.shares_loads else None
        return None if loaded is None else _own_runner(loaded)

    def compile_or_load(self, akey: str, graph: torch.fx.GraphModule, example_inputs: list[Any],
                        index: int | None = None) -> Published:
        """Artifact ``akey``: published (compiled from ``graph`` here unless the store or another process has it),
        then loaded for CUDA device ``index``."""
        folder, built = self.publish(akey, lambda work: self.compile(graph, example_inputs, work))
        if folder is None:                                  # the store failed and on_cache_error="eager"
            return Published(None, built, None)
        return Published(folder, built, self.load_published(folder, built, index))

    def load_stored(self, akey: str, index: int | None, *, name: str,
                    ekey: str) -> tuple[Callable[..., Any], float] | None:
        """The store's artifact ``akey`` loaded for CUDA device ``index`` and leased (not evicted while in use), with
        the seconds its load took (counted in ``counters.loads``); None (a miss: compile it) when the store lacks it,
        it is corrupt (quarantined), it runs only on another GPU, or it vanished while loading. ``name`` and ``ekey``:
        the cached method and the entry that wants it, for the log."""
        shared = self._shared(akey, index)
        if shared is not None:                                # loaded already (another block of the same graph)
            return shared, 0.0
        try:        # what its run plan reads; artifact_io.load_stored verifies the rest if torch's loader is needed
            run_plan = artifact_io.verified_run_plan(self.store, akey)
        except FileNotFoundError:
            log.info("%s: entry %s has no artifact %s; recompiling", name, ekey, akey)
            return None
        except CacheCorruptionError as exc:
            self.store.artifacts.quarantine(akey, exc.reason)
            log.warning("%s: %s; recompiling", name, exc)
            return None
        t0 = time.perf_counter()
        try:                                                  # a verified private copy if the folder is read-only
            compiled = artifact_io.load_stored(self.store, akey, index, run_plan)
        except runplan.WrongDevice as exc:
            log.info("%s: entry %s cannot run on cuda:%s (%s); compiling", name, ekey, index, exc)
            return None
        if compiled is None:
            return None                                       # vanished since it was verified: a miss
        self.store.leases.take(akey)                                # in use: not evicted under max_size
        seconds = time.perf_counter() - t0
        counters.add(loads=1, load_seconds=seconds)
        if self.shares_loads:
            _LOADED[(str(self.store.root), akey, index)] = compiled
        return compiled, seconds


_LOADED: dict[tuple[str, str, int | None], Callable[..., Any]] = {}
"""(store folder, artifact key, GPU index) -> the artifact as this process loaded it (see the module docstring)."""


def _own_runner(loaded: Callable[..., Any]) -> Callable[..., Any]:
    """A runner of its own over a loaded artifact: a run plan's per-call state (which inputs are stable, their
    alignment) is per entry; torch's loaded callable has none."""
    if isinstance(loaded, runplan.PlanRunner):
        return runplan.PlanRunner(loaded.wrapper_call, loaded.plan)
    return loaded


def compile_artifact(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                     config_patches: dict[str, Any]) -> None:
    """Write the artifact whose Inductor folder is ``folder`` (``<artifact>/inductor``) and its run plan
    (``<artifact>/runplan``; this runs the graph on ``example_inputs``, in-place updates going to copies). The
    process's random generators are left as they were (``torch_state.generators_kept``): the call that compiles
    draws what eager and a warm process draw from the same seed."""
    with torch_state.generators_kept():
        torch_inductor.compile_unloaded(gm, example_inputs, folder, config_patches=config_patches)
        finish_artifact(folder, example_inputs)


def finish_artifact(folder: pathlib.Path, example_inputs: list[Any]) -> None:
    """The second half of :func:`compile_artifact`, for an Inductor folder compiled elsewhere (a warm-up worker
    process, ``_torch.inductor.compile_unloaded``): a first load, then the run plan from the real ``example_inputs``,
    the random generators left as they were (a background compile settles between the caller's calls)."""
    with torch_state.generators_kept():
        loaded = torch_inductor.load_folder(folder)
        write_run_plan(pathlib.Path(folder).parent, loaded, example_inputs)
