"""An entry's life as public stages: ``find``, ``capture``, ``compile``, ``publish``, ``load``, ``remember``.

:class:`EntryLife` holds one cached method's in-memory table of entries (signature key -> :class:`Entry`) and takes a
signature through the stages that give it an entry:

- ``find``: the entry key of a signature, the store's entry manifest for it whose value guards hold here
  (gearcache/keys/guard_sets.py), and the entry ``load``ed from it (None: a miss). Counts ``counters.misses``.
- ``load``: an entry from its stored manifest, through the run-plan loader (``artifact_io``).
- ``capture``: the graph of a call (Dynamo, in the calling thread), with its artifact's keys (the shared one, and
  the one for this GPU alone, should its run plan turn out bound to the GPU it is compiled on): a :class:`Pending`.
- ``compile``: the graph compiled into a build folder (Inductor); ``publish`` runs it under the artifact lock
  (``faults.publish_or_fallback``: once across the processes sharing the folder), ``finish`` writes the entry
  manifest and loads the published artifact.
- ``remember``: the entry in the table (and ``remembered``, the owner's hook).

:meth:`EntryLife.get_or_miss` is the one "get or miss": the table's entry (a hit, counted here), else find, capture,
compile, publish, load and remember under the lock. ``CachedFunction`` (the call path), ``warmup.py``,
``cuda_graphs.py`` and the integrations use these stages alike; the per-call shortcut (dispatch.py, C) counts its
own hits.
"""
from __future__ import annotations

import dataclasses
import pathlib
import logging
import threading
import time
import types
import weakref
from typing import Any, Callable, Hashable, NamedTuple, Union, cast

import torch

from . import artifact_io, background, faults
from ..store import diagnostics
from ..ranks import phases as ranks
from .. import runplan
from ..call import memory, signature
from ..keys import guard_paths, guard_sets
from .pipeline import ArtifactPipeline, Build, decomposed
from .capture import Captured, capture, dependencies_changed
from ..config import CompilerConfig
from ..counters import counters
from ..call.entry import Entry
from ..runplan.collectives import graph_groups
from ..errors import SignatureMismatchError
from ..keys import decompositions as key_decompositions, key as cache_keys
from ..keys.key import FORMAT_VERSION, source_digest
from ..store import Store
from ..ranks.topology import Topology

log = logging.getLogger("gearcache")

Loaded = Union[Entry, faults.EagerEntry]
"""What serves a signature: a loaded entry, or the eager stand-in of ``on_cache_error="eager"``."""


@dataclasses.dataclass
class Found:
    """What ``find`` found for a signature: its description, the key its entry is (or is to be) stored under, the
    key's factors, and its entry (None: a miss, to be captured and compiled)."""
    desc: dict[str, Any]
    ekey: str
    factors: dict[str, Any]
    entry: Entry | None = None


@dataclasses.dataclass
class Pending:
    """A captured signature whose artifact is not published yet (between ``capture`` and ``finish``)."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    desc: dict[str, Any]
    ekey: str
    factors: dict[str, Any]
    captured: Captured
    akey: str
    artifact_factors: dict[str, str]
    bound: tuple[str, dict[str, str]]   # the key and factors of the artifact for this GPU alone (_load_published)
    t0: float
    index: int | None = None        # the GPU the call runs on (cuda_index)


class EntryLife:
    """The stages of the entries of one bound method of an ``nn.Module`` (see the module docstring)."""

    def __init__(self, method: types.MethodType, *, config: CompilerConfig, store: Store, topology: Topology,
                 decompositions: dict[Any, Callable[..., Any]] | None, name: str, scope: guard_paths.Scope,
                 remembered: Callable[[Loaded], None] | None = None):
        self.method = method
        self.module = cast(torch.nn.Module, method.__self__)
        self.config = config
        self.store = store
        self.pipeline = ArtifactPipeline(store, config)     # the artifacts' compile, publish and load
        self.topology = topology
        self.decompositions = decompositions
        self.name = name
        self.scope = scope
        self.method_digest = source_digest(method.__func__)
        self.table: dict[tuple[Hashable, ...], Loaded] = {}
        # on_new_signature="background": the handles of compiles in flight (eager stand-ins until settled)
        self.compiling: dict[tuple[Hashable, ...], background.Compiling[Pending]] = {}
        # ... and of those another method compiles (an identical block's: background.Waiting)
        self.waiting: dict[tuple[Hashable, ...], background.Waiting] = {}
        self.communicates: bool | None = None   # whether its graphs call collectives (None: not known yet)
        self.lock = threading.RLock()
        # called with each entry ``remember`` puts in the table; held weakly, so the owner (a CachedFunction holding
        # this object) is freed as soon as its last user drops it, not at the next cyclic collection: its Store's
        # leases go with it, and an evicting process may then remove the artifact
        self._remembered = _weak(remembered)

    # ---------------------------------------------------------------------------------------------- get or miss
    def get_or_miss(self, leaves: tuple[Any, ...], key: tuple[Hashable, ...], count: bool = True) -> Loaded:
        """The entry of signature ``key``: the table's (a hit: counted in ``counters.hits`` and the entry's ``hits``
        unless ``count`` is False, for a look-up that serves no call: a CUDA graph's capture), else a miss
        (``miss``). The call path's hot look-ups (``CachedFunction._call`` and ``call_geared``) do the same inline,
        then call ``miss``; the shortcut (dispatch.py) counts its own hits."""
        entry = self.table.get(key)
        if entry is None:
            return self.miss(leaves, key)
        if count:
            counters.hits += 1
            entry.hits += 1
        return entry

    def miss(self, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
             call: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Loaded:
        """Find (load) the entry of signature ``key``, or capture, compile and publish it; remember it. Under
        ``on_new_signature="background"`` a signature the store lacks is compiled in a worker and served by an eager
        stand-in until it is done (gearcache/compiling/background.py): the stand-in is returned, not remembered."""
        with self.lock:
            if key in self.table:
                return self.table[key]
            stand_in = self.compiling.get(key)
            if stand_in is not None:                # compiling in the background: the entry once done, else eager
                return self.settle(key, stand_in)
            waiting = self.waiting.get(key)
            if waiting is not None:                 # another method compiles its entry: eager until settled
                if not waiting.over():
                    return waiting
                del self.waiting[key]               # settled: looked up in the store below
            found = self.find(leaves, key)
            entry: Loaded | None = found.entry
            if entry is None:
                args, kwargs = call if call is not None else signature.unflatten(key[0], leaves)
                if self.config.on_new_signature == "background":
                    entry = self.start_background(key, args, kwargs, leaves, found)
                    if isinstance(entry, background.StandIn):
                        return entry            # served eagerly until settled; remembered then
                else:
                    entry = self.new_entry(args, kwargs, leaves, found)
            return self.remember(key, entry)

    # ------------------------------------------------------------------------------------------------ background
    def start_background(self, key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                         leaves: tuple[Any, ...], found: Found) -> Loaded:
        """A miss the store cannot serve, under ``on_new_signature="background"`` (under the lock): captured here,
        compiled in a worker (gearcache/compiling/background.py); returns the :class:`background.Compiling` handle
        (kept in ``compiling``, not in the table), or the entry itself when the graph must compile in this process.
        When another method of this store compiles the same entry key already (an identical block), nothing is
        captured: a :class:`background.Waiting` stand-in (kept in ``waiting``) serves it until that is settled."""
        elsewhere = background.compiling_elsewhere(self.shared_as(found.ekey))
        if elsewhere is not None and elsewhere.owner() is not self:
            waiting = background.Waiting(self.method, self.name, args, kwargs, elsewhere)
            self.waiting[key] = waiting
            return waiting
        tensors = [*(x for x in leaves if isinstance(x, torch.Tensor)), *self.module.parameters(),
                   *self.module.buffers()]
        with background.starting(tensors, self.config.inference_config.warmup_workers) as launcher:
            pending = self.capture(args, kwargs, leaves, found)
            handle = launcher.launch(self, self.method, self.name, pending, self.graph_to_compile(pending.captured),
                                     self.compile_patches(), self.shared_as(found.ekey))
            if handle is None:                  # cannot travel to a worker: compiled here
                folder, built = self.publish(pending)
                return self.finish(pending, folder, built)
            self.compiling[key] = handle
        log.info("%s: entry %s compiles in the background; its calls run eagerly until it is loaded", self.name,
                 pending.ekey)
        return handle

    def settle(self, key: tuple[Hashable, ...], handle: background.Compiling[Pending], wait: bool = False) -> Loaded:
        """The entry of ``key`` if its background compile is done (or, with ``wait``, once it is): published,
        loaded and remembered here (gearcache/compiling/background.py's docstring); else the eager ``handle``.
        Called under the lock."""
        if not (wait or handle.done()):
            return handle
        reply = handle.reply()
        try:
            folder, built = self.publish(handle.pending, lambda work: handle.fill(self.pipeline, reply, work))
            entry = self.finish(handle.pending, folder, built)
        finally:
            del self.compiling[key]
            handle.close()
        return self.remember(key, entry)

    def shared_as(self, ekey: str) -> tuple[str, str, str]:
        """The name of entry ``ekey``'s background compile among every method of this process
        (``background.compiling_elsewhere``): the store's folder, the topology's folder, the entry key."""
        return str(self.store.root), self.topology.folder, ekey

    def try_settle(self, handle: background.Compiling[Any]) -> bool:
        """Settle ``handle`` (one of this method's background compiles, done) now, unless another thread holds this
        method's lock (a waiter never waits for another method's lock: ``background.Waiting``); whether it was."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            key = next((k for k, h in self.compiling.items() if h is handle), None)
            if key is None:
                return False
            self.settle(key, handle, wait=True)
            return True
        finally:
            self.lock.release()

    def settle_all(self, deadline: float | None = None) -> int:
        """Wait for this method's background compiles (until ``deadline``, a ``time.monotonic()``: the compiles not
        done by then stay in flight) and settle them; returns how many of those in flight when it began are settled
        (here, or meanwhile by a call). The waits hold no lock: the method's calls, in other threads, are served
        eagerly meanwhile; only the settling takes the lock."""
        settled = 0
        with self.lock:
            todo = list(self.compiling.items())
        for key, handle in todo:
            if not handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                continue
            with self.lock:
                if self.compiling.get(key) is handle:
                    self.settle(key, handle, wait=True)
            settled += handle.closed
        return settled

    # ---------------------------------------------------------------------------------------------------- find
    def find(self, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
             reading: guard_sets.Reading | None = None) -> Found:
        """A miss: the signature's entry key and factors, and its entry if the store has one whose value guards hold
        here (loaded: ``load``). ``reading``: the live values a pass of look-ups under the lock read already (a
        warm-up's gears: ``warmup.driver.find_all``)."""
        counters.add(misses=1)
        diagnostics.track_hits(self)
        module = self.module
        tensors = (ModuleTensors.read(module) if reading is None else
                   reading.once(("module tensors", id(module)), lambda: ModuleTensors.read(module)))
        desc, ekey, factors = self.describe(leaves, key, tensors)
        found = self.choose(ekey, reading)
        if found.mismatch is not None:
            factors = {**factors, "guard_miss": str(found.mismatch)}
        entry = None
        if found.record is not None:
            entry = self.load(found.record, found.key, found.guards, cuda_index(leaves, module, tensors))
        return Found(desc, found.key, factors, entry)

    def choose(self, ekey: str, reading: guard_sets.Reading | None = None) -> guard_sets.Choice:
        """The stored entry of signature key ``ekey`` whose value guards hold here (``guard_sets.choose``)."""
        folder, name = self.topology.folder, self.name
        return guard_sets.choose(lambda k: self.store.entries.read_for_load(folder, name, k), ekey, self.scope,
                                 reading)

    def describe(self, leaves: tuple[Any, ...], key: tuple[Hashable, ...],
                 tensors: "ModuleTensors | None" = None) -> tuple[dict[str, Any], str, dict[str, Any]]:
        """The signature's description, its entry key and the key's factors (``tensors``: as ``entry_key``'s)."""
        desc = signature.describe(leaves, key)
        ekey, factors = self.entry_key(desc, leaves, tensors)
        return desc, ekey, factors

    def entry_key(self, desc: dict[str, Any], leaves: tuple[Any, ...],
                  tensors: "ModuleTensors | None" = None) -> tuple[str, dict[str, Any]]:
        """The entry key of the signature ``desc`` (everything its entry depends on) and its factors. ``tensors``:
        the module's tensors as this pass of look-ups read them (None: read now)."""
        tensors = tensors if tensors is not None else ModuleTensors.read(self.module)
        devices = sorted({str(x.device) for x in leaves if isinstance(x, torch.Tensor)} | tensors.devices) or ["cpu"]
        return cache_keys.entry_key(method_name=self.name, method_digest=self.method_digest, signature=desc,
                                    module_state=tensors.rows, config=self.config.compile_factors(),
                                    environment=cache_keys.environment_factors(
                                        devices, key_decompositions.factor(self.decompositions)))

    # ---------------------------------------------------------------------------------------------------- load
    def load(self, manifest: dict[str, Any], ekey: str, guards: guard_sets.GuardSet | None,
             index: int | None) -> Entry | None:
        """Load the stored entry ``manifest`` (stored under ``ekey``; its value guards hold here), or None (a miss)."""
        changed = dependencies_changed(manifest.get("dependencies", []))
        if changed:
            log.info("%s: entry %s is stale (%s changed since it was compiled); recompiling", self.name, ekey, changed)
            return None
        akey = manifest["akey"]
        loaded = self.pipeline.load_stored(akey, index, name=self.name, ekey=ekey)
        if loaded is None:
            return None                                       # a miss
        compiled, dt = loaded
        entry = Entry(compiled, self.module, manifest)
        entry.guards = guards
        diagnostics.record_load(self.store, ekey, dt)
        log.info("%s: loaded entry %s (artifact %s) in %.3f s", self.name, ekey, akey, dt)
        return entry

    # ------------------------------------------------------------------------------ capture, compile, publish
    def new_entry(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: tuple[Any, ...], found: Found) -> Loaded:
        """The entry of a signature the store lacks: ``capture``, ``publish`` (``compile``), ``finish``."""
        pending = self.capture(args, kwargs, leaves, found)
        folder, built = self.publish(pending)
        return self.finish(pending, folder, built)

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: tuple[Any, ...], found: Found) -> Pending:
        """Capture the call's graph and key its artifact (in the calling thread: Dynamo)."""
        if self.config.on_new_signature == "error":
            known = self.store.entries.in_method(self.topology.folder, self.name)
            if known or self.table:
                compile_new = ("set config.on_new_signature='compile' with cache_compile(..., dynamic=True), the "
                               "default (dynamic=False pins the method to its first signature whatever the config)")
                fix = ("call with one of the known signatures, pad to a gear (gearcache.set_dim_gears), or "
                       + compile_new)
                if "guard_miss" in found.factors:
                    fix = (f"the entry of this signature was compiled for other values ({found.factors['guard_miss']});"
                           f" restore them, or {compile_new} to compile one for these")
                raise SignatureMismatchError(
                    self.name, signature.short(found.desc), [signature.short(k["signature"]) for k in known], fix)
        diagnostics.record_miss(self.store, self.topology.folder, self.name, found.ekey, found.factors)
        factors = {k: v for k, v in found.factors.items() if k != "guard_miss"}
        t0 = time.perf_counter()
        counters.traces += 1
        captured = capture(self.method, self.module, args, kwargs, leaves)
        index = cuda_index(leaves, self.module)
        akey, artifact_factors = self.artifact_key(captured, factors, index)
        bound = cache_keys.device_bound_artifact_key(akey, index)
        return Pending(args, kwargs, found.desc, found.ekey, factors, captured, akey, artifact_factors, bound, t0,
                       index)

    def artifact_key(self, captured: Captured, factors: dict[str, Any],
                     index: int | None) -> tuple[str, dict[str, str]]:
        """The content address of the compiled graph. For a graph on one GPU, its index is left out of the graph's
        code and the inputs' devices (``keys.key.artifact_key``'s ``device_index``): ranks on cuda:0..N-1 share one
        artifact, whose run plan binds the live GPU at load. Graphs that cannot get a device-free plan (collectives:
        runplan.device_bound_reason) keep the index; an artifact that turns out bound to its compile GPU is keyed
        again with it (``finish``), by the key ``capture`` computes beside this one (``Pending.bound``)."""
        gm = captured.graph
        values = factors["values"]
        free = index is not None and runplan.device_bound_reason(gm) is None
        return cache_keys.artifact_key(graph_code=gm.code, graph_constants=cache_keys.graph_constants_factor(gm),
                                       inputs=signature.inputs_meta(captured.example_inputs), config=values["config"],
                                       environment={name: values[name] for name in cache_keys.ENVIRONMENT_FACTORS},
                                       device_index=index if free else None)

    def compile(self, captured: Captured, folder: pathlib.Path) -> None:
        """Compile the captured graph into the build folder ``folder`` (Inductor, in this process)."""
        self.pipeline.compile(self.graph_to_compile(captured), captured.example_inputs, folder)

    def finish_compiled_elsewhere(self, captured: Captured, folder: pathlib.Path, worker_seconds: float) -> None:
        """The rest of ``compile`` for a folder a worker process compiled (warm-up, background compiles):
        ``ArtifactPipeline.finish_compiled_elsewhere`` with the captured example inputs."""
        self.pipeline.finish_compiled_elsewhere(captured.example_inputs, folder, worker_seconds)

    def graph_to_compile(self, captured: Captured) -> torch.fx.GraphModule:
        """The captured graph with the method's custom decompositions applied (what ``compile`` compiles)."""
        if self.decompositions:
            return decomposed(captured.graph, captured.example_inputs, self.decompositions)
        return captured.graph

    def compile_patches(self) -> dict[str, Any]:
        """Inductor's config patches for the config's mode and options (``ArtifactPipeline.patches``)."""
        return self.pipeline.patches()

    def publish(self, pending: Pending, build: Build | None = None) -> tuple[pathlib.Path | None, bool]:
        """Publish the pending artifact (``ArtifactPipeline.publish``: the artifact lock, a private build folder,
        digests, an atomic rename; once across the processes sharing the store): ``(folder, built)``, folder None
        where the store failed and ``on_cache_error="eager"``. ``build``: what builds it (default: ``compile``)."""
        if build is None:
            build = lambda work: self.compile(pending.captured, work)   # noqa: E731
        ranks.note(f"{self.name}: publishing artifact {pending.akey[:16]} (compiling it, or waiting for the process "
                   f"that compiles it)")
        return self.pipeline.publish(pending.akey, build)

    def finish(self, p: Pending, folder: pathlib.Path | None, built: bool) -> Loaded:
        """Given the published artifact folder (``publish``), write the entry manifest and load the entry. An artifact
        this process did not build (another process compiled it while this one waited, or another entry of the same
        graph did) counts as a load."""
        folder, built, compiled = self._load_published(p, folder, built)
        args, kwargs, ekey, akey, captured, t0 = p.args, p.kwargs, p.ekey, p.akey, p.captured, p.t0
        manifest = {
            "format": FORMAT_VERSION, "ekey": ekey, "akey": akey, "method": self.name,
            "topology": self.topology.folder, "signature": p.desc, "factors": p.factors,
            "artifact_factors": p.artifact_factors, "inputs": captured.inputs, "outputs": captured.outputs,
            "dependencies": captured.dependencies,
            "guards": None if captured.guards.local else captured.guards.to_json(),
            "groups": graph_groups(captured.graph),        # the ranks its collectives reach (ranks.py's fences)
            "created": time.time(),
            "compile_seconds": time.perf_counter() - t0 if built else 0.0,
        }
        if folder is None or compiled is None:                # the store failed and on_cache_error="eager"
            return faults.EagerEntry(self.method, args, kwargs, manifest)
        entry = Entry(compiled, self.module, manifest)
        entry.guards = captured.guards
        guard_sets.warn_local(self.name, captured.guards)
        if artifact_io.persisted(self.store, akey, folder) and captured.guards.local is None:
            self.store.entries.write(self.topology.folder, self.name, ekey, manifest)
            self.store.leases.take(akey)
        if built:
            log.info("%s: compiled entry %s (artifact %s) in %.2f s", self.name, ekey, akey, time.perf_counter() - t0)
        else:
            log.info("%s: entry %s reuses artifact %s, compiled by another process or for another entry (nothing "
                     "compiled here), in %.2f s", self.name, ekey, akey, time.perf_counter() - t0)
        return entry

    def _load_published(self, p: Pending, folder: pathlib.Path | None,
                        built: bool) -> tuple[pathlib.Path | None, bool, Callable[..., Any] | None]:
        """Load the published artifact for the call's GPU: ``(folder, built, loaded)``. An artifact bound to another
        GPU (runplan.WrongDevice) is replaced by one keyed with this GPU's index (``p.bound``), compiled here (``p`` is
        updated)."""
        if folder is None:                                    # the store failed and on_cache_error="eager"
            return None, built, None
        try:
            return folder, built, self.pipeline.load_published(folder, built, p.index)
        except runplan.WrongDevice as exc:
            log.info("%s: %s; compiling for cuda:%s", self.name, exc, p.index)
        p.akey, p.artifact_factors = p.bound
        folder, built = self.publish(p)
        return folder, built, None if folder is None else self.pipeline.load_published(folder, built, p.index)

    # ------------------------------------------------------------------------------------------------ remember
    def remember(self, key: tuple[Hashable, ...], entry: Loaded) -> Loaded:
        """Put ``entry`` in the table under signature key ``key`` (and tell the owner: ``remembered``); returns the
        entry the table holds for ``key`` then (the owner may have bound it anew to where the module holds its tensors
        now), else ``entry`` itself (the owner dropped it: its value guards no longer hold)."""
        self.table[key] = entry
        hook = self._remembered()
        if hook is not None:
            hook(entry)
        return self.table.get(key, entry)


def _weak(hook: Callable[[Loaded], None] | None) -> Callable[[], Callable[[Loaded], None] | None]:
    """A weak reference to ``hook`` when it is a bound method (its object may die first: then None), else a
    function returning ``hook`` itself."""
    if isinstance(hook, types.MethodType):
        return weakref.WeakMethod(hook)
    return lambda: hook


class ModuleTensors(NamedTuple):
    """What a look-up reads of a module's parameters and buffers (:meth:`read`): once per pass of look-ups under the
    method's lock (``guard_sets.Reading.once``: a warm-up's gears), as the pass reads each guarded value once."""
    rows: list[list[Any]]           # module_state's
    devices: frozenset[str]         # the parameters' devices (an entry key's)
    cuda: frozenset[int | None]     # the GPU index of each parameter and buffer on a GPU (cuda_index's)

    @staticmethod
    def read(module: torch.nn.Module) -> "ModuleTensors":
        params = list(module.parameters())
        on_gpu = [t.device.index for t in [*params, *module.buffers()] if t.is_cuda]
        return ModuleTensors(module_state(module), frozenset(str(p.device) for p in params), frozenset(on_gpu))


def cuda_index(leaves: tuple[Any, ...], module: torch.nn.Module, tensors: ModuleTensors | None = None) -> int | None:
    """The index of the one GPU a call's tensors and the module's parameters and buffers are on; None when none is
    on a GPU, or they are on several (their artifact keeps every index). ``tensors``: the module's, as a pass of
    look-ups read them (None: read now)."""
    tensors = tensors if tensors is not None else ModuleTensors.read(module)
    indexes = {x.device.index for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda} | tensors.cuda
    if len(indexes) != 1 or None in indexes:
        return None
    return next(iter(indexes))


def module_state(module: torch.nn.Module) -> list[list[Any]]:
    """The module's parameters and buffers as key rows (name, shape, dtype, device, strides: a graph reads them as
    inputs of these exact strides, ``model.to(memory_format=torch.channels_last)`` compiles anew)."""
    rows = [["param", n, list(p.shape), str(p.dtype), str(p.device), _strides(p)] for n, p in
            module.named_parameters(remove_duplicate=False)]
    rows += [["buffer", n, list(b.shape), str(b.dtype), str(b.device), _strides(b)] for n, b in
             module.named_buffers(remove_duplicate=False)]
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return rows + shared_memory_rows(named)


def shared_memory_rows(named: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``["shares", name, first, offset, same(, first_offset)]`` for each tensor of ``named`` whose memory is that of an
    earlier one (``first``, the earlier's name; ``offset``, its storage offset; ``same``: the very same tensor object;
    ``first_offset``, the earlier's storage offset, where not 0: without it, ``c = t[1:5]`` beside ``d = t[2:6]`` was
    keyed as ``c = t[0:4]``, and the entry compiled for that wrote ``t[0:4]``; rows with the earlier at 0 are those of
    before, so their entries keep their keys): a graph
    captured with its module tensors apart reads and writes them in its own order, so an entry compiled for one
    sharing (``model.layers[1] = model.layers[0]``, ``m.count = m.buf[:1]``, ``p.data = q.data``) must not serve
    another. No row where nothing is shared (the keys of such modules are those of before). Cost: one storage read
    per tensor, at a look-up only."""
    return [["shares", named[i][0], named[j][0], offset, same, *([first_offset] if first_offset else [])]
            for i, j, offset, same, first_offset in memory.shared_memory([t for _, t in named])]


def _strides(t: torch.Tensor) -> list[int] | str:
    return list(t.stride()) if t.layout == torch.strided else str(t.layout)
