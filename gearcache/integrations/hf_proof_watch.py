"""What the padding proof read, watched: a change of any of it since the proof sends the next call to a new proof.

The proof (hf_proof.py) is an answer about the model as it was: its modules, their classes and the functions they
call, the hooks around them, the masking and attention functions transformers looks up. The compiled step follows a
change of what its graph read (its entries' guard watch re-traces it), but a re-traced graph is served padded on the
proof's old answer: a class method patched to mix positions (``LlamaMLP.forward = ...``), a module set through
``layer._modules["mlp"] = ...`` (no registration hook runs), a hook on a glue module, a module function a layer calls
(``modeling_llama.apply_rotary_pos_emb``), a module's ``__class__`` assigned, a function's ``__code__`` replaced. So
:func:`watch` builds one ``GuardWatch`` (keys/guard_watch.py) over all of it, checked at every call: O(1) on Python
3.12+ (dict and type watchers, plus a pointer compare per module for its class and per function for its code), on
3.11 a version-tag compare per watched dict and type. What it covers, for every module of the model:

* its class (an attribute set on it or a base: type version tags) and ``type(module)`` itself (``__class__``
  assigned); the code of every function of its classes but torch's (``f.__code__ = ...``), and the module-level
  functions those name (``apply_rotary_pos_emb`` replaced in its module, or its code);
* its ``_modules`` (any submodule set, through ``setattr`` or the dict), the names of its submodules and ``forward`` in
  its instance ``__dict__`` (a submodule shadowed, a forward replaced on the instance), and its ``layer_idx`` where it
  has one (the cache layer eager uses: the regions map each layer to the cache layer of its place);

a hook registered through torch's API on any module (its handle class's counter: one watched class, not four hook
dicts per module; a hook written into a module's dicts by hand is not seen), torch's global forward hooks,
transformers' masking functions and its attention and mask registries, and the model's config
(``set_attn_implementation``, ``sliding_window``). When the watch fires, its :class:`Snapshot` tells a change of any
of this (the model is proved again) from a false alarm (the watch is built again).
"""
from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .._torch import nn_modules as torch_nn_modules
from ..keys import fingerprints, guard_watch, watch_reads

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")
_OBJECT_GETATTRIBUTE = object.__getattribute__


class Snapshot:
    """What a watch's rows read, as it was when built, compared in Python: :meth:`changed` tells a change of what the
    proof read from a false alarm of the watch (a class's version tag moves when anything is set on a base class:
    transformers and Dynamo set attributes of ``nn.Module`` at their first call, which changes no forward)."""

    def __init__(self, hops: guard_watch.Hops) -> None:
        self._rows = [(d, k, e) for d, k, e in hops.dicts if k is not None]
        self._whole = [(d, dict(d)) for d, k, _ in hops.dicts if k is None]
        self._checked = list(hops.checked)
        self._classes = {t: fingerprints.class_digest(t) for t in hops.types}

    def changed(self) -> str | None:
        """The first change of what the watch covers since it was built, in words; None when there is none."""
        for d, key, expected in self._rows:
            if d.get(key, guard_watch.ABSENT) is not expected:
                return f"{key!r} was set or removed"
        for d, copy in self._whole:
            if d.keys() != copy.keys() or any(d[k] is not v for k, v in copy.items()):
                return f"a dict of {len(copy)} items was changed ({sorted(map(str, copy))[:3]}...)"
        for op, parent, key, expected in self._checked:
            if not watch_reads.holds(op, parent, key, expected):
                return f"{getattr(parent, '__qualname__', type(parent).__qualname__)}'s {op} changed"
        for cls, digest in self._classes.items():
            if fingerprints.class_digest(cls) != digest:
                return f"class {cls.__qualname__} was changed"
        return None


def watch(model: torch.nn.Module) -> tuple[guard_watch.Watch | None, Snapshot]:
    """A watch over what the padding proof of ``model`` read (see the module docstring), as it is now, and the
    snapshot that tells a change from a false alarm."""
    from torch.nn.modules import module as nn_module

    hops = guard_watch.Hops()
    hops.type_(RemovableHandle)     # a hook registered through torch's API, on any module: its handle counter moves
    for module in model.modules():
        _module(hops, module)
    for name in _GLOBAL_HOOKS:
        hooks = getattr(nn_module, name, None)
        if isinstance(hooks, dict):
            hops.dict_item(hooks, None, None)
    _transformers(hops, model)
    return guard_watch.make_watch(hops), Snapshot(hops)


def _module(hops: guard_watch.Hops, module: torch.nn.Module) -> None:
    """One module: its class and code, its submodules and instance attributes that shadow them, its hooks."""
    cls = type(module)
    hops.instance_class(module)
    hops.type_(cls)
    own: dict[str, Any] = _OBJECT_GETATTRIBUTE(module, "__dict__")
    submodules = torch_nn_modules.submodule_dict(module)
    for name in ("forward", *submodules, *(("layer_idx",) if "layer_idx" in own else ())):
        hops.dict_item(own, name, own.get(name, guard_watch.ABSENT))
    if submodules:                      # a leaf's forward calls no submodule: one set on it changes nothing
        hops.dict_item(submodules, None, None)
    for func in guard_watch.own_functions(cls):
        _globals_called(hops, func)


def _globals_called(hops: guard_watch.Hops, func: types.FunctionType) -> None:
    """The module-level functions ``func`` names (and those a ``__wrapped__`` chain names): the global itself and its
    code."""
    current: Any = func
    while isinstance(current, types.FunctionType):
        for name in current.__code__.co_names:
            if name in current.__globals__:
                value = current.__globals__[name]
                hops.dict_item(current.__globals__, name, value)
                if isinstance(value, types.FunctionType):
                    hops.function_code(value)
        current = getattr(current, "__wrapped__", None)


def _transformers(hops: guard_watch.Hops, model: torch.nn.Module) -> None:
    """transformers' masking utilities, its attention and mask registries, and the model's config."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None:
        for name, value in vars(masking).items():
            if isinstance(value, types.FunctionType):
                hops.dict_item(vars(masking), name, value)
                hops.function_code(value)
                _globals_called(hops, value)
        _registry(hops, getattr(masking, "ALL_MASK_ATTENTION_FUNCTIONS", None))
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is not None:
        _registry(hops, getattr(utils, "ALL_ATTENTION_FUNCTIONS", None))
    config = getattr(model, "config", None)
    while config is not None:
        own = getattr(config, "__dict__", None)
        if isinstance(own, dict):
            hops.dict_item(own, None, None)
        text = getattr(config, "text_config", None) if hasattr(config, "get_text_config") else None
        config = text if text is not None and text is not config else None


def _registry(hops: guard_watch.Hops, registry: Any) -> None:
    """A transformers ``GeneralInterface`` (its class's global mapping and its instance's local one): whole."""
    for name in ("_global_mapping", "_local_mapping"):
        mapping = getattr(registry, name, None)
        if isinstance(mapping, dict):
            hops.dict_item(mapping, None, None)
