"""``CachedFunction``: what ``cache_compile`` returns. Dispatches each call to a compiled entry.

Hot path (``__call__``): compute the call's signature key (shapes, strides, dtypes, devices, grad mode), look it up
in a dict of loaded entries, run the entry. No Dynamo, no guards, no disk.

Miss path (``_miss``), once per signature per process: build the entry key from its factors; if the store has a
valid manifest and artifact for it, load it (no tracing, no compiler); otherwise capture the method with Dynamo,
compile it with Inductor (once across all processes sharing the folder), publish, and load.
"""
from __future__ import annotations

import inspect
import logging
import re
import threading
import time
from typing import Any, Callable

import torch

from . import _torch_compat as compat
from . import signature
from .capture import Captured, capture, dependencies_changed
from .config import CompilerConfig
from .counters import counters
from .entry import Entry
from .errors import CacheCorruptionError, GradModeError, SignatureMismatchError
from .key import FORMAT_VERSION, build_key, decompositions_factor, sha256_text, source_digest
from .store import Store
from .topology import Topology

log = logging.getLogger("gearcache")


class CachedFunction:
    """A bound method of an ``nn.Module`` served from compiled, persisted entries."""

    def __init__(self, method: Callable, *, config: CompilerConfig, store: Store, topology: Topology,
                 decompositions: dict[Any, Callable] | None):
        self._method = method
        self._module: torch.nn.Module = method.__self__
        self.config = config
        self.store = store
        self.topology = topology
        self._decompositions = decompositions
        self.name = _entry_point_name(method)
        self._table: dict[tuple, Entry] = {}
        self._first: Entry | None = None
        self._lock = threading.RLock()
        self._method_digest = source_digest(method.__func__)

    # ----------------------------------------------------------------------------------------------- hot path
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.config.check_signature and self._first is not None:
            return self._first(args)
        leaves, key = signature.call_key(args, kwargs)
        if key[1][0]:                       # grad enabled: inference-only entries must not silently drop grads
            self._check_no_grad(leaves)
        entry = self._table.get(key)
        if entry is None:
            entry = self._miss(args, kwargs, leaves, key)
        else:
            counters.hits += 1
        return entry(leaves)

    def _check_no_grad(self, leaves: tuple) -> None:
        needs = [f"argument leaf {i}" for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        needs += [f"parameter {n}" for n, p in self._module.named_parameters() if p.requires_grad][:3]
        if needs:
            raise GradModeError(
                f"{self.name} was called with grad enabled and {', '.join(needs[:3])} requiring grad; gearcache "
                f"entries are inference only. Fix: call it under torch.inference_mode() (or torch.no_grad()), or "
                f"call model.requires_grad_(False) and detach the inputs.")

    # ----------------------------------------------------------------------------------------------- miss path
    def _miss(self, args: tuple, kwargs: dict, leaves: tuple, key: tuple) -> Entry:
        with self._lock:
            if key in self._table:
                return self._table[key]
            counters.misses += 1
            desc = signature.describe(leaves, key)
            ekey, factors = self._entry_key(desc, leaves)
            entry = self._load_entry(ekey) or self._compile_entry(args, kwargs, leaves, desc, ekey, factors)
            self._table[key] = entry
            if self._first is None:
                self._first = entry
            return entry

    def _entry_key(self, desc: dict, leaves: tuple) -> tuple[str, dict[str, Any]]:
        devices = sorted({str(x.device) for x in leaves if isinstance(x, torch.Tensor)} |
                         {str(p.device) for p in self._module.parameters()}) or ["cpu"]
        factors = [
            ("format", FORMAT_VERSION),
            ("method", {"name": self.name, "source_sha256": self._method_digest}),
            ("signature", desc),
            ("module_state", _module_state(self._module)),
            ("config", self.config.compile_factors()),
            ("decompositions", decompositions_factor(self._decompositions)),
            ("software", compat.software_versions()),
            ("devices", [compat.device_capability(d) for d in devices]),
        ]
        ekey, hashes = build_key("entry", factors)
        return ekey, {"values": dict(factors), "hashes": hashes}

    def _load_entry(self, ekey: str) -> Entry | None:
        manifest = self.store.read_entry(self.topology.folder, self.name, ekey)
        if manifest is None:
            return None
        changed = dependencies_changed(manifest.get("dependencies", []))
        if changed:
            log.info("%s: entry %s is stale (%s changed since it was compiled); recompiling", self.name, ekey, changed)
            return None
        akey = manifest["akey"]
        try:
            self.store.verify_artifact(akey)
        except FileNotFoundError:
            log.info("%s: entry %s has no artifact %s; recompiling", self.name, ekey, akey)
            return None
        except CacheCorruptionError as exc:
            self.store.quarantine(akey, exc.reason)
            log.warning("%s: %s; recompiling", self.name, exc)
            return None
        t0 = time.perf_counter()
        compiled = compat.load_folder(self.store.artifact_dir(akey) / "inductor")
        entry = Entry(compiled, self._module, manifest)
        dt = time.perf_counter() - t0
        counters.loads += 1
        counters.load_seconds += dt
        self.store.touch(ekey)
        log.info("%s: loaded entry %s (artifact %s) in %.3f s", self.name, ekey, akey, dt)
        return entry

    def _compile_entry(self, args: tuple, kwargs: dict, leaves: tuple, desc: dict, ekey: str,
                       factors: dict[str, Any]) -> Entry:
        if self.config.on_new_signature == "error":
            known = self.store.list_entries(self.topology.folder, self.name)
            if known or self._table:
                raise SignatureMismatchError(
                    self.name, signature.short(desc), [signature.short(k["signature"]) for k in known],
                    "call with one of the known signatures, pad to a gear (gearcache.set_dim_gears), or set "
                    "config.on_new_signature='compile'")
        t0 = time.perf_counter()
        counters.traces += 1
        captured = capture(self._method, self._module, args, kwargs, leaves)
        akey, artifact_factors = self._artifact_key(captured, factors)
        folder, built = self.store.publish_artifact(akey, lambda work: self._build(captured, work))
        compiled = compat.load_folder(folder / "inductor")
        manifest = {
            "format": FORMAT_VERSION, "ekey": ekey, "akey": akey, "method": self.name,
            "topology": self.topology.folder, "signature": desc, "factors": factors,
            "artifact_factors": artifact_factors, "inputs": captured.inputs, "outputs": captured.outputs,
            "dependencies": captured.dependencies, "created": time.time(),
            "compile_seconds": time.perf_counter() - t0 if built else 0.0,
        }
        entry = Entry(compiled, self._module, manifest)
        self.store.write_entry(self.topology.folder, self.name, ekey, manifest)
        log.info("%s: %s entry %s (artifact %s) in %.2f s", self.name, "compiled" if built else "reused artifact for",
                 ekey, akey, time.perf_counter() - t0)
        return entry

    def _artifact_key(self, captured: Captured, factors: dict[str, Any]) -> tuple[str, dict[str, str]]:
        gm = captured.graph
        constants = [[name, _tensor_digest(t)] for name, t in
                     list(gm.named_parameters()) + list(gm.named_buffers())]
        values = factors["values"]
        akey, hashes = build_key("artifact", [
            ("format", FORMAT_VERSION),
            ("graph", sha256_text(gm.code)),
            ("graph_constants", constants),
            ("inputs", [_example_meta(t) for t in captured.example_inputs]),
            ("config", values["config"]),
            ("decompositions", values["decompositions"]),
            ("software", values["software"]),
            ("devices", values["devices"]),
        ])
        return akey, hashes

    def _build(self, captured: Captured, folder) -> None:
        t0 = time.perf_counter()
        graph = captured.graph
        if self._decompositions:
            graph = compat.apply_decompositions(graph, captured.example_inputs, self._decompositions)
        patches = {**compat.mode_options(self.config.mode), **self.config.inductor_options}
        compat.compile_to_folder(graph, captured.example_inputs, folder, config_patches=patches)
        counters.compiles += 1
        counters.compile_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------- public
    @property
    def entries(self) -> int:
        """How many signatures this process has an entry for."""
        return len(self._table)

    def __repr__(self) -> str:
        return f"<gearcache.CachedFunction {self.name} entries={len(self._table)} store={self.store.root}>"


def _entry_point_name(method: Callable) -> str:
    cls = type(method.__self__)
    raw = f"{cls.__module__}.{cls.__qualname__}.{method.__name__}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


def _module_state(module: torch.nn.Module) -> list[list]:
    rows = [["param", n, list(p.shape), str(p.dtype), str(p.device)] for n, p in
            module.named_parameters(remove_duplicate=False)]
    rows += [["buffer", n, list(b.shape), str(b.dtype), str(b.device)] for n, b in
             module.named_buffers(remove_duplicate=False)]
    return rows


def _example_meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return [list(t.shape), list(t.stride()), str(t.dtype), str(t.device)]
    return repr(t)


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous()
    return sha256_text(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"") + str(list(t.shape))
