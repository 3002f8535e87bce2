"""What the padding proof takes as given, checked: the glue between the decoder layers and the mask construction are
transformers' own code.

The proof (hf_proof.py) walks each decoder layer's graph; the rest of the model's forward (the embedding, the rotary
embeddings, the final norm, the LM head: per token in transformers' models) and the 4D mask transformers' masking
utilities build from the 2D mask (``kv_idx <= q_idx`` and terms that only remove keys) are not walked. That is sound
only while they are the code it was written against: a custom or patched glue module (a final norm that adds the
mean over the positions), a forward hook on one, or a patched masking function (a mask that lets a query see later
keys) would let a real position read a pad, and a padded call would differ from eager. :func:`glue_finding` names
the first such thing; ``enable()`` then serves the model at its exact sizes, as for a layer the proof refuses.
"""
from __future__ import annotations

import sys
import types
from typing import Any

import torch

from .._torch import nn_modules as torch_nn_modules

PER_TOKEN_TORCH = (torch.nn.Embedding, torch.nn.Linear, torch.nn.Dropout, torch.nn.Identity, torch.nn.LayerNorm,
                   torch.nn.ModuleList, torch.nn.ModuleDict)
"""torch's own module classes that may sit in the glue: per token (or no forward of their own)."""

_OWN_ROOTS = ("transformers.", "torch.")


def _own(origin: str) -> bool:
    """Whether code of module ``origin`` is transformers', torch's or Python's own."""
    return origin == "torch" or origin.startswith(_OWN_ROOTS) or origin.split(".")[0] in sys.stdlib_module_names


def glue_finding(model: torch.nn.Module, layers: list[torch.nn.Module]) -> str | None:
    """The first module of ``model`` outside ``layers`` whose forward is not transformers' own class code (a class of
    torch's other than :data:`PER_TOKEN_TORCH`, a forward defined or patched elsewhere, replaced on the instance, or
    hooked), or the first function of transformers' masking utilities or of the globals of a transformers forward
    (glue or layer: a warm process reads the proof's record, whose key has the classes, not the module functions
    they call) that is defined elsewhere (patched); None when there is none."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    for name, module in model.named_modules():
        if id(module) in inside:        # traced by the proof; a warm read trusts the module functions it called
            found = None if not _origin(type(module).forward).startswith("transformers.") else (
                _patched_globals(type(module).forward))
            if found is not None:
                return f"{name} ({type(module).__qualname__}): {found}"
            continue
        where = f"{name or 'the model'} ({type(module).__qualname__})"
        if type(module) in PER_TOKEN_TORCH:
            found = None
        elif type(module).__module__.startswith("torch."):
            found = "a torch module the proof does not know is per token"
        else:
            found = _foreign_forward(type(module))
        if found is None and module is not model:           # the model's own forward is enable()'s
            if torch_nn_modules.has_forward_hooks(module) or "forward" in module.__dict__:
                found = "it has forward hooks or a forward replaced on the instance"
        if found is not None:
            return f"{where}, outside the decoder layers: {found} (the proof takes the glue as transformers' own)"
    return _patched_masking()


def _foreign_forward(cls: type) -> str | None:
    """Why ``cls.forward`` is not transformers' own code (defined, or patched, outside transformers), or None."""
    forward = getattr(cls, "forward", None)
    origin = _origin(forward)
    if not origin.startswith("transformers."):
        return f"its forward is {origin}.{getattr(forward, '__qualname__', forward)}, not transformers' code"
    return _patched_globals(forward)


def _origin(func: Any) -> str:
    """The module that defined ``func`` (through decorators' ``__wrapped__``: the innermost's)."""
    while isinstance(getattr(func, "__wrapped__", None), types.FunctionType):
        if not _own(str(getattr(func, "__module__", ""))):
            break
        func = func.__wrapped__
    return str(getattr(func, "__module__", None) or "?")


def _patched_globals(forward: Any) -> str | None:
    """The first global a transformers forward (or a function it wraps) names that is a function defined outside
    transformers and torch: a masking or helper function patched in its module."""
    func = forward
    while isinstance(func, types.FunctionType):
        for name in func.__code__.co_names:
            value = func.__globals__.get(name)
            if isinstance(value, types.FunctionType) and not _own(_origin(value)):
                return f"its module's {name} is {_origin(value)}.{value.__qualname__} (patched)"
        func = getattr(func, "__wrapped__", None)
    return None


def _patched_masking() -> str | None:
    """The first function of transformers' masking utilities defined outside transformers and torch (patched)."""
    try:
        from transformers import masking_utils
    except ImportError:         # pragma: no cover - an older transformers builds its masks elsewhere
        return None
    registry = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", {})
    for name, value in [*vars(masking_utils).items(), *(registry.items() if hasattr(registry, "items") else ())]:
        if isinstance(value, types.FunctionType) and not _own(_origin(value)):
            return f"transformers' masking utilities' {name} is {_origin(value)}.{value.__qualname__} (patched)"
    return None
