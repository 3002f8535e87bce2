"""``torch.nn.Module`` internals gearcache reads: where a parameter or buffer lives (gearcache/call/entry.py holds
slots, never tensors), and a class attribute as torch defines it, whatever Dynamo or transformers patched into
``nn.Module`` (gearcache/keys/fingerprints.py).
"""
from __future__ import annotations

from typing import Any

import torch


def state_slot(module: torch.nn.Module, name: str) -> tuple[dict[str, Any], str]:
    """Where the parameter or buffer ``name`` (dotted, from ``module``) lives: its owner's ``_parameters`` or
    ``_buffers`` dict and its key there. A read through the slot sees the tensor there now (replaced or updated in
    place); gearcache's entries and CUDA graphs hold slots, never the tensors."""
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    # the dict is torch's dict[str, Parameter | None] or dict[str, Tensor | None]: a slot holds either
    if attr in owner._parameters:
        return owner._parameters, attr
    if attr in owner._buffers:
        return owner._buffers, attr
    raise KeyError(f"module has no parameter or buffer {name!r}")


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


NOT_TORCHS = object()      # unpatched_class_attribute: an attribute Dynamo added, not torch's own


# nn.Module attribute -> (the qualified name of Dynamo's wrapper, the wrapped original's name in its closure)
_DYNAMO_MODULE_PATCHES = {
    "__init__": ("install_generation_tagging_init.<locals>.patched_init", "init"),
    "__setstate__": ("install_generation_tagging_init.<locals>.patched_setstate", "setstate"),
}


_LIBRARY_MODULE_METHODS = {"smart_apply": "transformers."}     # nn.Module attribute -> the library that adds it



def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward or forward-pre hooks of its own (the global ones are not counted)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def has_global_forward_hooks() -> bool:
    """Whether forward or forward-pre hooks are registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and its pre twin)."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def watch_submodules(modules: list[torch.nn.Module], changed: list[bool]) -> Any:
    """Set ``changed[0]`` when a submodule of one of ``modules`` is set or registered (``module.mlp = ...``: torch's
    global module registration hook, ``register_module_module_registration_hook``); returns the hook's handle
    (``.remove()``). The hook holds the modules' ids and ``changed`` only, never the modules."""
    from torch.nn.modules import module as nn_module

    ids = frozenset(map(id, modules))

    def hook(module: torch.nn.Module, name: str, submodule: Any) -> None:
        if id(module) in ids:
            changed[0] = True
    return nn_module.register_module_module_registration_hook(hook)
