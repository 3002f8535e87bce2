"""The padding proof of ``enable()``: may a served causal LM's prompt be right-padded to its gear and its batch padded
with rows? Proved from each distinct decoder layer's graph, once per process, before the first padded call.

``enable()`` pads a prompt of T tokens to its gear G (the pads after every real token) and a batch of B rows to its
batch gear. That is exact when no op lets a real position or row read a pad one, except the attention over the KV
cache, whose mask is causal (a real query sees no key after it, and the pads' keys sit after every real one; they are
dropped from the cache after the call: ``hf_regions.drop_pads``). The proof, per distinct decoder layer class:

1. runs the model's own forward once eagerly on a tiny prompt (``B`` rows of ``G`` tokens), then a decode step of one
   token, with each layer's call recorded: the layer's real arguments (hidden states, the attention mask
   transformers built, the rotary embeddings, its constants); every layer's call of each is proved, a layer being
   traced unless an earlier trace of its kind and phase has value guards that hold on it (its ``layer_idx`` and
   attributes as that graph assumed);
2. traces the layer's call as its region makes it (``hf_regions.LayerRegion.layer_call``, the graph ``run`` compiles
   before its pads' drop) with the hidden states' batch and sequence dims symbolic, and the same dims of the mask, the
   rotary embeddings and the cache's batch dim (symbolic_trace.symbolic_shapes: Dynamo, no compile);
3. walks that graph with the padding analysis (gearcache/gears/padding.py, the rules of ``set_dim_gears``), the cache
   tensors and the mask given their roles (gearcache/gears/padding_cache.py): every op must keep padded rows and
   positions in line (elementwise, matmuls over hidden, norms over hidden, per-token routing), and the attention
   that reads the cache must take the layer's mask argument unchanged.

The mask itself is built by transformers' masking utilities from the 2D mask and the cache position, outside the
layer (``kv_idx <= q_idx``, and padding and window terms that only remove keys): that construction, and the glue
between the layers (embedding, rotary embeddings, final norm, LM head: per token), are what the proof takes as given.
A finding (an op mixing positions or rows: a mean over the sequence, a reduction over the batch, a mask built or
changed inside the layer, ``is_causal=True`` or no mask over the cache) makes :func:`prove` return it; ``enable()``
then serves that model's prompts, batches and cache lengths at their exact sizes (transformers.py).

The proof runs once per model in a process, before its first call picks a gear, and its answer is recorded in the
store (:func:`proved`): a warm process reads it, unless a function its traces ran has changed since.
"""
from __future__ import annotations

import json
import types
from typing import TYPE_CHECKING, Any, cast

import torch

from .._torch import nn_modules as torch_nn_modules
from .._torch import versions as torch_versions
from ..call import signature
from ..compiling.capture import dependencies_changed
from ..compiling.symbolic_trace import symbolic_shapes
from ..keys.fingerprints import class_digest
from ..keys.key import FORMAT_VERSION, sha256_text
from ..store import Store
from . import hf_cache, hf_compat, hf_glue, hf_regions

if TYPE_CHECKING:
    from ..keys.guard_sets import GuardSet

ROWS, WIDTH, LENGTH = 2, 5, 32
"""The tiny call the proof records: 2 rows of a 5-token prompt in a 32-position cache (sizes no weight has)."""


METHOD = "ServedLM.padding_proof"
"""The store folder of the proofs' records (one JSON per proof key, as a gear plan's)."""


def proved(model: torch.nn.Module, cache_kw: str, layers: list[torch.nn.Module], store: Store | None,
           folder: str) -> str | None:
    """:func:`prove`'s answer, read from ``store`` when a record of this model's proof key (:func:`proof_key`) is
    there, the functions its traces ran are unchanged (``capture.dependencies_changed``) and nothing the key lacks is
    set on the layers' modules (:func:`_keyed`), else proved and recorded: a warm process traces nothing. The glue
    and the masking utilities the proof takes as given are checked first, in every process (hf_glue.py)."""
    glue = hf_glue.glue_finding(model, layers)
    if glue is not None:
        return glue
    key = proof_key(model, layers)
    record = None
    if store is not None and _keyed(layers):
        record = store.entries.read_gear_plan(folder, METHOD, key)
    if record is not None and "refused" in record and not dependencies_changed(record.get("dependencies", [])):
        refused: str | None = record["refused"]
        return refused
    refused, dependencies = prove(model, cache_kw, layers)
    if store is not None:
        store.entries.write_gear_plan(folder, METHOD, key, {"format": FORMAT_VERSION, "pkey": key,
                                                            "refused": refused, "dependencies": dependencies})
    return refused


def _keyed(layers: list[torch.nn.Module]) -> bool:
    """Whether what the layers' traces read is all in :func:`proof_key`: no module inside a layer has forward hooks,
    a forward replaced on its instance or an instance attribute shadowing a submodule (none is in the key: a record
    of the same classes would be read for a layer whose submodule mixes positions through them; the layers' own are
    ``ServedLM._layers_bypassing_the_proof``'s)."""
    for layer in layers:
        for module in layer.modules():
            own = vars(module)
            if module is not layer and (torch_nn_modules.has_forward_hooks(module) or "forward" in own):
                return False
            if any(name in own for name in torch_nn_modules.submodule_dict(module)):
                return False
    return True


def proof_key(model: torch.nn.Module, layers: list[torch.nn.Module]) -> str:
    """What the proof depends on beyond the functions its traces ran: the classes of the model and of every module
    of each of its layers, in order (``class_digest``: a patched ``LlamaMLP.forward`` is another key), the model's
    config (its layer count and layer types too: every layer is proved, one whose code branches on its ``layer_idx``
    on its own), its attention implementation and the function registered for it, the parameters' dtype and device
    type, and the software's versions."""
    import transformers

    def name(k: type) -> str:
        return f"{k.__module__}.{k.__qualname__}:{class_digest(k)}"

    classes = [sorted({name(type(m)) for m in layer.modules()}) for layer in layers]
    config: Any = model.config
    settings = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    param = next(model.parameters())
    implementation = str(getattr(config, "_attn_implementation", None))
    attention = hf_compat.attention_function(implementation)     # a registered function is another key
    parts = [name(type(model)), classes, settings, implementation, attention,
             str(param.dtype), param.device.type, transformers.__version__, torch_versions.software_versions(),
             PROOF_FORMAT]
    return sha256_text(json.dumps(parts, sort_keys=True, default=str))[:40]


PROOF_FORMAT = 2     # 2: every layer and a decode step proved (a record of 1 proved one layer per kind)


def prove(model: torch.nn.Module, cache_kw: str, layers: list[torch.nn.Module]) -> tuple[str | None, list[Any]]:
    """``(None, dependencies)`` when every decoder layer of ``layers`` passes the proof (see the module docstring) in
    a prompt's call and in a decode step's, else ``(why not: the layer, the op, where and why, dependencies)``;
    ``dependencies``: the functions the traces ran (symbolic_trace.symbolic_shapes). A layer is traced unless an earlier
    trace of its kind (class and layer type) and phase has value guards that hold on it (Dynamo would reuse that
    graph): a layer whose code branches on its ``layer_idx`` or on an attribute of its own is proved on its own."""
    backing = hf_cache.allocate(model, ROWS, LENGTH)
    try:
        calls = _record(model, cache_kw, layers, backing.cache)
    except Exception as exc:       # noqa: BLE001 - a forward the proof cannot run is not proved
        return f"the model's forward could not be recorded ({type(exc).__name__}: {str(exc)[:200]})", []
    dependencies: list[Any] = []
    traced: list[tuple[Any, GuardSet | None]] = []         # (kind and phase, the trace's value guards)
    for (phase, index), call in calls.items():
        kind = (phase, _kind(model, layers, index))
        if any(k == kind and _guards_hold(guards, layers[index], cache_kw, call) for k, guards in traced):
            continue
        found, guards = _prove_layer(layers[index], cache_kw, call, backing.cache.layers[index], dependencies)
        if found is not None:
            return f"decoder layer {index} ({type(layers[index]).__qualname__}, {phase}): {found}", dependencies
        traced.append((kind, guards))
    missing = [i for i in range(len(layers)) for p in ("prompt", "decode") if (p, i) not in calls]
    if missing:
        return f"decoder layer {missing[0]} was not called with keywords only (its region refuses it)", dependencies
    return None, dependencies


def _kind(model: torch.nn.Module, layers: list[torch.nn.Module], index: int) -> tuple[Any, Any]:
    """A layer's kind: its class and its config's ``layer_types`` entry (sliding or full attention)."""
    types_ = list(getattr(hf_compat.text_config(model), "layer_types", None) or [])
    return type(layers[index]), types_[index] if index < len(types_) else None


def _guards_hold(guards: GuardSet | None, layer: torch.nn.Module, cache_kw: str, call: tuple[Any, ...]) -> bool:
    """Whether an earlier trace's value guards (all checkable here) hold on ``layer``'s region with its call's
    constants: Dynamo would run that trace's graph for it."""
    from ..keys.guard_paths import Scope

    if guards is None or guards.local is not None:
        return False
    region = hf_regions.LayerRegion(layer, cache_kw)
    region.constants = _constants(call[2], cache_kw)
    func = cast(types.FunctionType, hf_regions.LayerRegion.layer_call)
    try:
        return bool(guards.mismatch(Scope(region, func.__globals__, func)) is None)
    except Exception:       # noqa: BLE001 - a guard that cannot be read on this layer: trace it
        return False


def _constants(kwargs: dict[str, Any], cache_kw: str) -> dict[str, Any]:
    """A recorded call's keywords its region passes as constants (all but the tensors the region takes)."""
    skip = {"attention_mask", cache_kw, "past_key_values", "position_embeddings", "position_ids"}
    return {k: v for k, v in kwargs.items() if k not in skip}


def _record(model: torch.nn.Module, cache_kw: str, layers: list[torch.nn.Module],
            cache: Any) -> dict[tuple[str, int], tuple[Any, ...]]:
    """Run the model's forward on a tiny prompt, then a decode step of one token; every layer's call of each, by
    ``(phase, layer index)`` (a positional call is not recorded: its region refuses it)."""
    calls: dict[tuple[str, int], tuple[Any, ...]] = {}
    phase = ["prompt"]
    saved = [layer.__dict__.pop("forward", None) for layer in layers]
    for i, layer in enumerate(layers):
        def recorder(hidden: torch.Tensor, *args: Any, _i: int = i, _layer: Any = layer, **kwargs: Any) -> Any:
            if not args:
                calls[(phase[0], _i)] = (hidden.clone(), kwargs.get("attention_mask"), dict(kwargs))
            return type(_layer).forward(_layer, hidden, *args, **kwargs)
        layer.__dict__["forward"] = recorder
    try:
        ids = torch.ones(ROWS, WIDTH, dtype=torch.long, device=next(model.parameters()).device)
        mask = torch.zeros(ROWS, LENGTH, dtype=torch.bool, device=ids.device)    # as ServedLM's: [rows, length]
        mask[:, :WIDTH] = True
        mask[1, 0] = False          # a left-padded row: the mask is one (transformers may skip an all-ones one)
        step = mask.clone()
        step[:, WIDTH] = True
        with torch.no_grad():
            type(model).forward(model, input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kw: cache})
            phase[0] = "decode"
            type(model).forward(model, input_ids=ids[:, :1], attention_mask=step, use_cache=True,
                                **{cache_kw: cache})
    finally:
        for layer, forward in zip(layers, saved):
            layer.__dict__.pop("forward", None)
            if forward is not None:
                layer.__dict__["forward"] = forward
    return calls


def _prove_layer(layer: torch.nn.Module, cache_kw: str, call: tuple[Any, ...], cache_layer: Any,
                 dependencies: list[Any]) -> tuple[str | None, GuardSet | None]:
    """The proof of one recorded layer call: ``(None, the trace's value guards)`` when proved, else ``(the first
    finding, None)``; the functions its trace ran are added to ``dependencies``."""
    from ..gears import padding  # the analysis (and sympy) only where a proof runs, never on a warm read
    from ..gears.padding_cache import Roles

    hidden, mask, recorded = call
    kwargs = _constants(recorded, cache_kw)
    cos_sin, position_ids = recorded.get("position_embeddings"), recorded.get("position_ids")
    if cos_sin is None or not isinstance(position_ids, torch.Tensor):
        return "called without rotary position embeddings or position ids, which its region takes", None
    odd = [k for k, v in kwargs.items() if not isinstance(v, hf_regions.CONSTANTS)]
    if odd:
        return f"called with {odd[0]}={type(kwargs[odd[0]]).__name__}, which its region does not take", None
    region = hf_regions.LayerRegion(layer, cache_kw)
    region.constants = kwargs
    keys, values = cache_layer.keys.clone(), cache_layer.values.clone()
    length = torch.zeros_like(cache_layer.cumulative_length)
    args = (hidden, mask, cos_sin[0].clone(), cos_sin[1].clone(), position_ids.clone(), keys, values, length)
    leaves, key = signature.call_key(args, {})
    where = {id(t): i for i, t in enumerate(leaves)}
    marked: list[tuple[int, int]] = []
    for t, seq_dim in ((hidden, 1), (mask, 2), (args[2], -2), (args[3], -2), (keys, None), (values, None)):
        if isinstance(t, torch.Tensor) and id(t) in where:
            marked += [(where[id(t)], d) for d, size in ((0, ROWS), (seq_dim, WIDTH))
                       if d is not None and t.dim() > abs(d) and t.shape[d] == size]
    marked = [(leaf, dim % leaves[leaf].dim()) for leaf, dim in marked]
    roles = Roles(frozenset(where[id(t)] for t in (keys, values, length)),
                  frozenset([where[id(mask)]] if id(mask) in where else []))
    try:
        with torch.no_grad():
            trace = symbolic_shapes(cast(types.MethodType, region.layer_call), region, key[0], leaves, marked)
    except Exception as exc:       # noqa: BLE001 - a layer the proof cannot trace is not proved
        return f"its call could not be traced with its batch and sequence dims symbolic ({str(exc)[:300]})", None
    dependencies.extend(trace.dependencies)
    names = dict(enumerate(["hidden_states", "attention_mask", "cos", "sin", "position_ids", "keys", "values",
                            "length"])) if len(leaves) == 8 else {}
    report = padding.analyse(trace, names, {leaf for leaf, _ in marked}, roles=roles)
    findings = report.mixing + report.unsafe_writes
    if not findings:
        return None, trace.plan_guards
    f = findings[0]
    return f"{f.op} at {f.where}: {f.why} (it reaches {f.reaches})", None
