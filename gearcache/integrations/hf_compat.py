"""Every difference between the transformers versions gearcache serves (5.17 on the GPU machine, 5.24 on CPU CI), in
one place. Nothing here imports transformers at import time.

* The cache's keyword: 5.17 calls it ``past_key_values`` (forward argument, ``prepare_inputs_for_generation``
  argument, output field); 5.24 calls it ``cache`` (``past_key_values`` still accepted by the forward, with a
  deprecation warning). Read from the model's forward signature.
* ``generate()`` sizes its ``StaticCache`` as ``max(max_length, model._previous_max_cache_length)`` in both, and
  records that length on the model; a sliding-window layer forgets it (it keeps ``min(window, length)``), so it is
  read back as a hint (:func:`generate_length_hint`), never trusted for bounds.
* ``GenerationMixin.prepare_inputs_for_generation``: the sources of 5.17.0 and 5.24.0 were read line by line against
  gearcache's direct decode-step path (``hf_prepare``): :data:`REVIEWED_PREPARE_SOURCES` holds their digests; any
  other source (another version, a patched method) is served by transformers' own method.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes (and its output returns) the KV cache."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def causal_lm_output(logits: torch.Tensor, cache: Any, keyword: str) -> Any:
    """The forward's return value as ``generate()`` reads it: ``.logits`` and the cache under ``keyword``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits, **{keyword: cache})


def generate_length_hint(model: torch.nn.Module) -> int:
    """The cache length the last ``generate()`` asked for (0 if none): a starting size for caches whose layers are
    all sliding-window layers (they do not keep it). Only a hint: the served cache grows when a call needs more."""
    return int(getattr(model, "_previous_max_cache_length", 0) or 0)


def static_layer_classes() -> tuple[type[StaticLayer], type[StaticSlidingWindowLayer]]:
    """(StaticLayer, StaticSlidingWindowLayer) of the installed transformers."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    return StaticLayer, StaticSlidingWindowLayer


def head_shapes(model: torch.nn.Module) -> tuple[int, int] | None:
    """(key/value heads, head size) of the decoder's attention layers from its config, or None if it does not say
    (then the cache is allocated by one eager forward on a dummy token)."""
    config: Any = model.config          # a transformers PretrainedConfig
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return (heads, head_dim) if heads and head_dim else None


def text_config(model: torch.nn.Module) -> Any:
    config: Any = model.config          # a transformers PretrainedConfig
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


GENERATE_MASKS = (("sliding_window", "create_sliding_window_causal_mask"),
                  ("attention_chunk_size", "create_chunked_causal_mask"))
"""The config fields with which transformers' ``create_masks_for_generate`` builds another 4D mask than the causal one
(when the config has no ``layer_types``), and the masking function a model's forward must call to build the same."""


def generate_mask_mismatch(model: torch.nn.Module) -> str | None:
    """Why ``generate()`` would mask ``model`` otherwise than its forward does from a 2D mask (which is what
    ``enable()`` serves), or None. ``generate()`` with a static cache builds the 4D mask itself from the config
    (``create_masks_for_generate``: a sliding window when ``config.sliding_window`` is set, ...); the forward builds it
    from the 2D mask with the masking functions its code names. A config field the forward's code ignores (a
    ``sliding_window`` set on a Llama) makes eager ``generate()`` attend otherwise than the forward. Read from the
    names the base model's forward calls (through decorators); None when its code cannot be read."""
    config = text_config(model)
    if getattr(config, "layer_types", None):
        return None
    field = next((f for f, _ in GENERATE_MASKS if getattr(config, f, None) is not None), None)
    if field is None:
        return None
    base = getattr(model, "base_model", model)
    forward: Any = getattr(type(base), "forward", None)
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    needed = dict(GENERATE_MASKS)[field]
    if "create_causal_mask" not in names or needed in names:
        return None
    return (f"config.{field}={getattr(config, field)!r}: generate() masks with {needed} for it, while "
            f"{type(base).__qualname__}.forward builds its masks without it (create_causal_mask only), so eager "
            f"generate() and the forward gearcache serves would attend to other keys")


REVIEWED_PREPARE_SOURCES = frozenset({
    "1956c1944594e3113c56e5fbb7c785098ebb29c94b39381d49cfe4452e04d6c6",      # transformers 5.17.0
    "018a76f42a134e27245c17b3ac03d798a29b224522ae5a273e270e3389b7dc5c",      # transformers 5.24.0
})
"""sha256 of ``inspect.getsource(GenerationMixin.prepare_inputs_for_generation)`` (decorators included) of the
transformers versions whose decode-step branch ``hf_prepare.Prepare`` reproduces (read against their source)."""


def prepare_source_reviewed(method: Any) -> bool:
    """Whether ``method`` (``GenerationMixin.prepare_inputs_for_generation`` as installed) has the source of a
    version :data:`REVIEWED_PREPARE_SOURCES` names."""
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest() in REVIEWED_PREPARE_SOURCES


def attention_function(implementation: str) -> str:
    """The module and name of the function transformers' attention registry holds for ``implementation`` ("" when
    none: the layers' own eager attention)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:                 # pragma: no cover - an older transformers has no registry
        return ""
    func = ALL_ATTENTION_FUNCTIONS.get(implementation) if hasattr(ALL_ATTENTION_FUNCTIONS, "get") else None
    return "" if func is None else f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)}"
