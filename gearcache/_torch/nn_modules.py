"""``torch.nn.Module`` internals gearcache reads: where a parameter or buffer lives (gearcache/call/entry.py holds
slots, never tensors), and a class attribute as torch defines it, whatever Dynamo, torch.fx's tracer or transformers
patched into ``nn.Module`` (gearcache/keys/fingerprints.py).
"""
from __future__ import annotations

import functools
import inspect
import types
import weakref
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
    (a process that had was served none of the entries a fresh one compiled). ``torch.fx``'s tracer
    (``Tracer.trace``: ``symbolic_trace``, and ``make_fx`` under every AOTAutograd compile and Inductor pattern pass)
    sets wrappers of ``__call__`` and ``__getattr__`` for the length of a trace, seen by every thread: a guard
    checked meanwhile (another thread's call, or a warm-up's look-up beside a gear compiled in its own thread) must
    read the class as outside a trace, else it fails and drops what it guards. Returns the wrapped original for the
    Dynamo and torch.fx patches, ``NOT_TORCHS`` for the mark and transformers' method, ``value`` otherwise."""
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
    if name in _FX_MODULE_PATCHES and isinstance(value, types.FunctionType) and value.__code__ in _fx_wrapper_codes():
        return getattr(value, "__wrapped__", value)   # (functools.wraps) the method torch.fx saved at its import
    return value


NOT_TORCHS = object()      # unpatched_class_attribute: an attribute Dynamo added, not torch's own


# nn.Module attribute -> (the qualified name of Dynamo's wrapper, the wrapped original's name in its closure)
_DYNAMO_MODULE_PATCHES = {
    "__init__": ("install_generation_tagging_init.<locals>.patched_init", "init"),
    "__setstate__": ("install_generation_tagging_init.<locals>.patched_setstate", "setstate"),
}


_LIBRARY_MODULE_METHODS = {"smart_apply": "transformers."}     # nn.Module attribute -> the library that adds it

# nn.Module attribute -> the name of the wrapper torch.fx's Tracer.trace sets on it for a trace's length
_FX_MODULE_PATCHES = {"__call__": "module_call_wrapper", "__getattr__": "module_getattr_wrapper"}


@functools.cache
def _fx_wrapper_codes() -> frozenset[types.CodeType]:
    """The code objects of ``torch.fx.Tracer.trace``'s wrappers of ``nn.Module`` methods (the nested functions it
    defines at every trace share them): a patched attribute is told by its code's identity, not its name. Read from
    the function under Dynamo's wrapper (its first compile in a process disables itself on ``Tracer.trace``)."""
    trace = inspect.unwrap(torch.fx.Tracer.trace)
    return frozenset(c for c in trace.__code__.co_consts
                     if isinstance(c, types.CodeType) and c.co_name in _FX_MODULE_PATCHES.values())


def submodule_dict(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s own dict of registered submodules (``_modules``: the dict itself, which a watch may watch)."""
    return module._modules


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward or forward-pre hooks of its own (the global ones are not counted)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def has_global_forward_hooks() -> bool:
    """Whether forward or forward-pre hooks are registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and its pre twin)."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


class SubmoduleWatch:
    """The handle :func:`watch_submodules` returns: ``remove()`` stops setting its flag."""

    def __init__(self, modules: list[torch.nn.Module], changed: list[bool]) -> None:
        self._ids = [id(m) for m in modules]
        self._changed = changed

    def remove(self) -> None:
        """Stop watching (idempotent)."""
        for key in self._ids:
            flags = _WATCHED.get(key)
            if flags is not None:
                flags[:] = [f for f in flags if f is not self._changed]
        self._ids = []


_WATCHED: dict[int, list[list[bool]]] = {}
"""id of a watched module -> the flags of its watches; an entry goes when its module is freed (``weakref.finalize``),
before its id can be reused. Keyed by id, not weakly by module: the hook runs at every module registration of the
process (transformers slices its layers' ModuleList at every eager forward), and an id look-up is the cheapest."""
_HOOK: list[int] = []        # HOOK_KEY, once the hook is installed in this process
HOOK_KEY = -0x6765617263
"""The key of gearcache's hook in torch's dict of global module registration hooks. torch keys a hook by its handle's
id, a counter shared by every hook of the process (``RemovableHandle.next_id``), and a traced graph guards on that
key: a process that registered another number of hooks before would miss every entry. A fixed key is the same in
every process."""


def _on_module_registration(module: torch.nn.Module, name: str, submodule: Any) -> None:
    """torch's global module registration hook of gearcache (one per process): sets the flags of the watches of
    ``module``. Under Dynamo it returns at once: transformers slices ``ModuleList``s inside a traced forward (a new
    ModuleList registers its modules), so every traced graph guards on this function, by its code (no closure, no
    state read), which is the same in every process; a module built inside a trace is no watched module."""
    if torch.compiler.is_compiling():
        return
    flags = _WATCHED.get(id(module))
    if flags:
        for flag in flags:
            flag[0] = True


def _forget(key: int) -> None:
    _WATCHED.pop(key, None)


def install_registration_hook() -> None:
    """Install gearcache's module registration hook in this process, once (idempotent). Call it before any graph a
    watch may see is traced, whatever the order of later watches: a traced graph guards on the hooks installed then
    (``enable()`` calls it first)."""
    from torch.nn.modules import module as nn_module

    if not _HOOK:           # torch's register_module_module_registration_hook, under a key of our own (see above)
        nn_module._global_module_registration_hooks[HOOK_KEY] = _on_module_registration
        _HOOK.append(HOOK_KEY)


def watch_submodules(modules: list[torch.nn.Module], changed: list[bool]) -> SubmoduleWatch:
    """Set ``changed[0]`` when a submodule of one of ``modules`` is set or registered (``module.mlp = ...``: torch's
    global module registration hook, ``register_module_module_registration_hook``, installed once per process and
    never removed: a graph traced with it guards on it); returns the watch's handle (``.remove()``). The modules are
    not kept alive."""
    install_registration_hook()
    for module in modules:
        if id(module) not in _WATCHED:
            _WATCHED[id(module)] = []
            weakref.finalize(module, _forget, id(module))
        _WATCHED[id(module)].append(changed)
    return SubmoduleWatch(modules, changed)
