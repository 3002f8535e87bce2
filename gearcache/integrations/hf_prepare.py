"""``model.prepare_inputs_for_generation`` after ``enable``: binds the cache first, and serves a decode step's inputs
without transformers' general path.

Binding first makes the cache's layers ServedLayers (not compileable), so ``generate()`` keeps the 2D attention mask
instead of building 4D masks for its own cache.

A decode step of ``generate()`` runs ``prepare_inputs_for_generation`` on the host between the previous step's
stopping check (on a GPU a host sync: transformers reads ``unfinished_sequences.max()`` at every step) and the next
step's launch, so its host time adds to every token. For a model that keeps ``GenerationMixin``'s own method, a
decode step's call (``next_sequence_length=1``, a bound cache, only the keywords ``generate()`` passes:
:data:`_DECODE_KEYS`) has one answer, built here directly: the last ids cloned contiguous, the last position ids
cloned contiguous, the 2D mask, the cache and the other keywords passed on (no 4D masks: a served cache is not
compileable; no device move: the inputs are on the cache's device; no remote-code ``cache_position``: refused at
``enable``-time below). That this is transformers' answer rests on reading its source: the direct path is taken only
where the installed method's source is one it was read against (``hf_compat.REVIEWED_PREPARE_SOURCES``: 5.17.0 and
5.24.0), any other is served by transformers' own method. Each kind of call (its keywords, which of them are None) is
also compared once with transformers' own result (keys, tensors' metadata and values, the other values): a
difference turns the direct path off for the model (a second line of defence, not the proof).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import torch

from . import hf_cache, hf_compat

_DECODE_KEYS = frozenset({"next_sequence_length", "attention_mask", "position_ids", "logits_to_keep", "use_cache"})


class Served(Protocol):
    """What :class:`Prepare` calls back into: the served model (transformers.py's ``ServedLM``), which imports this
    module."""

    @property
    def cache_kw(self) -> str: ...

    def bind(self, cache: Any, batch: int, need: int) -> hf_cache.Backing: ...


class Prepare:
    """The model's ``prepare_inputs_for_generation`` after ``enable`` (see the module docstring)."""

    def __init__(self, served: Served, model: torch.nn.Module, original: Callable[..., Any]):
        self.served = served                        # bind(cache, batch, need), cache_kw
        self.original = original
        self.cache_kw: str = served.cache_kw
        self.keys = _DECODE_KEYS | {self.cache_kw}
        self.direct = _generic_prepare(model)       # False: transformers' own method for every call
        self.checked: set[tuple[tuple[str, bool], ...]] = set()    # kinds of call checked against transformers'
        functools.update_wrapper(self, original)

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get(self.cache_kw)
        if cache is None:
            return self.original(input_ids, *args, **kwargs)
        backing = self.served.bind(cache, input_ids.shape[0], need=0)
        if (not self.direct or args or kwargs.get("next_sequence_length") != 1 or not self.keys.issuperset(kwargs)
                or input_ids.device != backing.device):
            return self.original(input_ids, *args, **kwargs)
        inputs = self._decode_inputs(input_ids, cache, kwargs)
        kind = tuple(sorted((k, v is None) for k, v in kwargs.items()))
        if kind in self.checked:
            return inputs
        theirs = self.original(input_ids, **kwargs)
        if same_inputs(inputs, theirs):
            self.checked.add(kind)
        else:
            self.direct = False
        return theirs

    def _decode_inputs(self, input_ids: torch.Tensor, cache: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What ``GenerationMixin.prepare_inputs_for_generation`` returns for a decode step's call."""
        inputs: dict[str, Any] = {"input_ids": input_ids[:, -1:].clone(memory_format=torch.contiguous_format),
                                  self.cache_kw: cache}
        positions = kwargs.get("position_ids")
        if positions is not None:
            inputs["position_ids"] = (positions if positions.shape[-1] == 1 else
                                      positions[..., -1:].clone(memory_format=torch.contiguous_format))
        mask = kwargs.get("attention_mask")
        if mask is not None:
            inputs["attention_mask"] = mask
        for key in ("logits_to_keep", "use_cache"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs


def same_inputs(ours: dict[str, Any], theirs: Any) -> bool:
    """Whether two prepared inputs are the same: the same keys, tensors of the same metadata and values (a host sync
    on a GPU: once per kind of call), every other value the same object or equal."""
    if not isinstance(theirs, dict) or set(ours) != set(theirs):
        return False
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and value.shape == other.shape and value.dtype == other.dtype
                    and value.device == other.device and value.stride() == other.stride()
                    and torch.equal(value, other)):
                return False
        elif not (value is other or (type(value) is type(other) and value == other)):
            return False
    return True


def _generic_prepare(model: torch.nn.Module) -> bool:
    """Whether ``model`` prepares its inputs with ``GenerationMixin``'s own method, as a decoder-only model whose code
    is not remote (a remote-code model may take a ``cache_position`` transformers then makes), and that method's
    source is one this module's decode path was read against (``hf_compat.prepare_source_reviewed``)."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:                 # pragma: no cover - enable() needs transformers
        return False
    config: Any = getattr(model, "config", None)        # a transformers PretrainedConfig
    remote = getattr(model, "is_remote_code", None)
    return (getattr(type(model), "prepare_inputs_for_generation", None) is
            GenerationMixin.prepare_inputs_for_generation and not getattr(config, "is_encoder_decoder", False)
            and not (callable(remote) and remote())
            and hf_compat.prepare_source_reviewed(GenerationMixin.prepare_inputs_for_generation))
