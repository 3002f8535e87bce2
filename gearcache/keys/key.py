"""Cache keys built from ordered, named factors (after JAX's ``cache_key.py``).

A key is ``sha256`` over the lines ``"<name>=<sha256 of the factor's canonical JSON>"`` in factor order, cut to 40 hex
digits. Every factor is stored in the entry's manifest and each factor's hash is logged at DEBUG, so ``gearcache
explain`` can say which factor made a miss.

This module computes every key's value from its named factors; callers pass the factors' values and never assemble
factor lists themselves:

- :func:`entry_key`: a cached method's entry for one signature (the entry manifest's name in the store);
- :func:`artifact_key`: a compiled graph (the artifact folder's name), and :func:`device_bound_artifact_key` for one
  whose run plan turns out bound to the GPU it was compiled on (computed beside it, at capture);
- :func:`gear_plan_key`: a cached method's gear plan for one set of gear marks;
- :func:`environment_factors`: the factors entry and artifact keys share (this process's torch, devices and groups).

A key's value must not change for the same factors (caches written before must still hit): tests/test_key.py pins
each function's value for a fixed input. Change what a key depends on only with a :data:`FORMAT_VERSION` bump.
"""
from __future__ import annotations

import ctypes
import hashlib
import inspect
import json
import logging
import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch       # for annotations only: tensor_digest imports it where it reads a tensor

from .._torch import state as torch_state, versions as torch_versions
from ..ranks.topology import process_groups_factor

log = logging.getLogger("gearcache.keys.key")

FORMAT_VERSION = 7
"""gearcache's artifact and manifest format. Bump it whenever what is written or how it is read changes.
2: artifacts carry a run plan (gearcache/runplan/); the config factor names the mode instead of its options.
3: run plans also launch the kernels Inductor left to Triton's launcher (long names, clusters, scratch memory).
4: the process groups are a factor of entry and artifact keys; run plans for graphs with collectives; artifact
   keys leave out the GPU's index (one artifact for cuda:0..N-1), run plans bind it at load.
5: entry manifests and gear plans carry value guards (keys/guard_sets.py); an entry whose guards differ from the
   first of its signature is stored under a variant key; the global state names the default device.
6: value guards fingerprint classes by their contents and functions by code, defaults and closure contents, guard
   parameters and buffers (``tensor``) and the cached function's closure cells and defaults; module_state rows carry
   strides.
7: call keys tell tensors on one storage object from tensors on distinct storage objects over shared bytes
   (``call/memory.py``; an older entry keyed as views of one storage may have been compiled for distinct objects),
   and key views of one tensor by the base torch compiles them over; module_state's shares rows hold the first
   tensor's offset too; gear plans refuse a method output that is a view of a padded argument (older stored plans
   may serve one)."""


ENTRY_FACTORS = ("format", "method", "signature", "module_state", "config", "decompositions", "global_state",
                 "software", "devices", "process_groups")
"""The factors of an entry key, in key order: the one list (the call path builds them in this order, ``gearcache
inspect``/``explain`` print them in it). ``format``: FORMAT_VERSION; ``method``: the function's name and source
digest; ``signature``: the call's leaves (gearcache/call/signature.py); ``module_state``: the owner's parameters and
buffers (shapes, dtypes, devices); ``config``: what of the CompilerConfig changes the compiled code; the last five
are :data:`ENVIRONMENT_FACTORS`."""

ENVIRONMENT_FACTORS = ("decompositions", "global_state", "software", "devices", "process_groups")
"""The factors an artifact key shares with its entry key (after ``config``): custom decompositions, torch's global
state (grad mode, autocast, default device), torch/triton/Python versions, the devices' capabilities and the process
groups."""

ARTIFACT_FACTORS = ("format", "graph", "graph_constants", "inputs", "config", *ENVIRONMENT_FACTORS)
"""The factors of an artifact key, in key order: ``graph``: the captured graph's code; ``graph_constants``: digests of
its lifted constants; ``inputs``: shapes, strides, dtypes and devices of its example inputs."""


def ordered_factors(kind: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    """``values`` as ``[(name, value), ...]`` in the order of ``kind``'s list ("entry" or "artifact"); a missing or
    unknown name is a ValueError (a factor added in one place and not the list is a bug, not a silent key change)."""
    names = {"entry": ENTRY_FACTORS, "artifact": ARTIFACT_FACTORS}[kind]
    if set(values) != set(names):
        raise ValueError(f"{kind} key factors {sorted(values)} are not the list {list(names)} (gearcache/keys/key.py)")
    return [(name, values[name]) for name in names]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def sha256_text(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def factor_hash(value: Any) -> str:
    return sha256_text(canonical_json(value))


def build_key(kind: str, factors: Iterable[tuple[str, Any]]) -> tuple[str, dict[str, str]]:
    """Return ``(key, {factor name: factor hash})`` for the ordered ``(name, value)`` factors."""
    hashes: dict[str, str] = {}
    lines = []
    for name, value in factors:
        h = factor_hash(value)
        hashes[name] = h
        lines.append(f"{name}={h}")
        log.debug("%s key factor %s: %s", kind, name, h)
    key = sha256_text("\n".join(lines))[:40]
    log.debug("%s key: %s", kind, key)
    return key, hashes


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, then its shape."""
    import torch
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)    # (numpy is not a dependency)
    return sha256_text(ctypes.string_at(data.data_ptr(), data.numel()) if data.numel() else b"") + str(list(t.shape))


def graph_constants_factor(gm: torch.nn.Module) -> list[list[str]]:
    """A graph module's own parameters and buffers (constants its code reads) as ``[[name, tensor digest], ...]``."""
    return [[name, tensor_digest(t)] for name, t in list(gm.named_parameters()) + list(gm.named_buffers())]


def source_digest(obj: Any) -> str:
    """sha256 of an object's source text; its qualified name where there is no source (a builtin, a C op)."""
    try:
        return sha256_text(inspect.getsource(obj))
    except (OSError, TypeError):
        return sha256_text(f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}")


_CUDA_INDEX = re.compile(r"cuda:(\d+)|device\(type='cuda', index=(\d+)\)")
_INT_DEVICE = re.compile(r"device\s*=\s*\d|\.(?:to|cuda)\(\s*\d|'cuda',\s*\d")     # a GPU named by a bare int


def without_device_index(text: str, index: int) -> str | None:
    """``text`` (a graph's code, a device string) with CUDA device ``index`` written without its index
    (``cuda:*``), for artifact keys shared by the GPUs of a node; None when the text also names another GPU, or
    names one by a bare integer (``device=1``, ``.to(1)``: kept, as that GPU is meant whatever the caller's).

    The artifact key of a graph on one GPU leaves the index out (its run plan binds it at load, see
    gearcache/runplan/device_binding.py): the same graph on cuda:0 .. cuda:N-1 is one artifact."""
    other = False

    def replace(m: re.Match[str]) -> str:
        nonlocal other
        if int(m.group(1) or m.group(2)) != index:
            other = True
        return "cuda:*"

    out = _CUDA_INDEX.sub(replace, text)
    return None if other or _INT_DEVICE.search(text) else out


def environment_factors(devices: list[str], decompositions: list[list[str]]) -> dict[str, Any]:
    """The values of :data:`ENVIRONMENT_FACTORS` for a graph on ``devices`` (``["cpu"]``, ``["cuda:0"]``) compiled
    with custom decompositions (``decompositions``: their factor, gearcache/keys/decompositions.py ``factor``): read
    from this process (torch's global state and versions, the devices' capabilities, the process groups)."""
    return {
        "decompositions": decompositions,
        "global_state": torch_state.global_state(devices),
        "software": torch_versions.software_versions(),
        "devices": [torch_versions.device_capability(d) for d in devices],
        "process_groups": process_groups_factor(),
    }


def entry_key(*, method_name: str, method_digest: str, signature: dict[str, Any], module_state: list[Any],
              config: dict[str, Any], environment: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The entry key of one signature of a cached method, and its factors as the entry manifest stores them:
    ``(key, {"values": {name: value}, "hashes": {name: factor hash}})`` in :data:`ENTRY_FACTORS` order.
    ``method_digest``: :func:`source_digest` of the method; ``signature``: ``call.signature.describe``'s;
    ``module_state``: ``entry_life.module_state``'s rows; ``config``: ``CompilerConfig.compile_factors()``;
    ``environment``: :func:`environment_factors`'s."""
    factors = ordered_factors("entry", {
        "format": FORMAT_VERSION,
        "method": {"name": method_name, "source_sha256": method_digest},
        "signature": signature,
        "module_state": module_state,
        "config": config,
        **environment,
    })
    key, hashes = build_key("entry", factors)
    return key, {"values": dict(factors), "hashes": hashes}


def artifact_key(*, graph_code: str, graph_constants: list[list[str]], inputs: list[Any], config: dict[str, Any],
                 environment: dict[str, Any], device_index: int | None = None) -> tuple[str, dict[str, str]]:
    """The content address of a compiled graph: ``(key, {factor name: factor hash})`` over :data:`ARTIFACT_FACTORS`.
    ``graph_code``: the graph module's ``code``; ``graph_constants``: :func:`graph_constants_factor`'s; ``inputs``:
    ``call.signature.inputs_meta`` of its example inputs; ``config`` and ``environment`` as :func:`entry_key`'s.

    ``device_index``: the one GPU the graph runs on, when its run plan can bind the GPU at load
    (``runplan.device_bound_reason`` is None): that index is left out of the code and the inputs' devices
    (:func:`without_device_index`), so ranks on cuda:0..N-1 share one artifact. None: nothing is left out."""
    if device_index is not None:
        free = without_device_index(canonical_json([graph_code, inputs]), device_index)
        if free is not None:
            graph_code, inputs = json.loads(free)
    return build_key("artifact", ordered_factors("artifact", {
        "format": FORMAT_VERSION, "graph": sha256_text(graph_code), "graph_constants": graph_constants,
        "inputs": inputs, "config": config, **environment,
    }))


def device_bound_artifact_key(shared_key: str, device_index: int | None) -> tuple[str, dict[str, str]]:
    """The key of an artifact compiled for GPU ``device_index`` alone, for a graph whose device-free artifact
    ``shared_key`` turned out bound to the GPU it was compiled on (``runplan.WrongDevice`` at load)."""
    return build_key("artifact", [("shared", shared_key), ("device_index", device_index)])


def gear_plan_key(*, method_name: str, method_digest: str, structure: str, plan_format: int, marks: list[Any],
                  merge_policy: str, module_state: list[Any], global_state: dict[str, Any],
                  software: dict[str, str], process_groups: list[list[Any]] | None = None,
                  decompositions: list[list[str]] | None = None) -> str:
    """The key of a cached method's gear plan: everything its symbolic trace depends on. ``structure``: the repr of
    the call's structure (the signature key's first part); ``plan_format``: ``gears.plan.PLAN_FORMAT``; ``marks``:
    ``[[leaf, dim, gear sizes, pad value], ...]``; ``merge_policy``: ``dynamic_gears_merge_policy``;
    ``global_state`` and ``software``: ``_torch.state.global_state()`` and ``software_versions()``;
    ``process_groups``: :func:`process_groups_factor`, a factor only when there are any (a key without groups is as
    before): the trace may hold what ``dist.is_initialized()`` said (Dynamo folds it, unguarded), and a plan proved
    on a graph traced before ``init_process_group`` (no collectives) served the graph after it, whose
    ``all_to_all_single`` moved rows of the padded dim between ranks (a wrong answer instead of a refusal);
    ``decompositions``: the custom decompositions' factor, likewise only when there are any (the padding proof reads
    the trace with them applied)."""
    groups = [("process_groups", process_groups)] if process_groups else []
    groups += [("decompositions", decompositions)] if decompositions else []
    key, _ = build_key("gear plan", [
        ("format", FORMAT_VERSION),
        ("method", {"name": method_name, "source_sha256": method_digest}),
        ("structure", structure),
        ("plan_format", plan_format),
        ("marks", marks),
        ("policy", merge_policy),
        ("module_state", module_state),
        ("global_state", global_state),
        ("software", software),
        *groups,
    ])
    return key
