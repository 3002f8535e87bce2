"""Serve a Hugging Face causal LM with transformers' own ``StaticCache`` through gearcache: no adapter to write.

    from transformers import StaticCache
    from gearcache.integrations.transformers import StaticCacheLM

    served = StaticCacheLM(model, cache_dir="/srv/gearcache")          # model: any *ForCausalLM, eval mode
    cache = StaticCache(config=model.config, max_cache_len=256)        # transformers' cache, as its docs make it
    logits = served(prompt_ids, cache)                                 # prefill: model(..., past_key_values=cache)
    logits = served(next_ids, cache)                                   # decode step, same call

``served(input_ids, cache, **tensors)`` returns what ``model(input_ids=input_ids, past_key_values=cache,
use_cache=True, **tensors).logits`` returns, and updates ``cache`` in place exactly as that call does, through one
cached method (``StaticCacheLM.step``): every distinct input shape (prefill of length T, decode of length 1) is one
gearcache entry, compiled once and loaded by later processes with no compiler. ``greedy(...)`` generates with it.

How the cache crosses into the compiled graph. A ``StaticCache`` is a Python object whose layers hold tensors
(``keys``, ``values`` and, in transformers 5.x, a ``cumulative_length`` counter) that the model's forward updates in
place (``index_copy_``, ``add_``). A cached method can take only tensors as arguments, so the cache is *bound* to
the wrapper instead: every tensor attribute of every layer is registered as a non-persistent buffer
(``cache_<layer>_<attr>``) and the cache object is kept as a plain attribute that ``step`` hands to the model. When
Dynamo captures ``step``, those tensors are graph inputs whose identity is a buffer's, so gearcache reads them live
from the wrapper's buffers at every call (as it reads weights) and the graph's in-place updates land in the user's
cache. Binding another cache of the same shapes (a new request) swaps the buffers, and the entries are reused; a
cache of other shapes is another key. A cache not yet allocated (transformers allocates layers lazily, on their
first ``update``) is allocated with the config's key/value heads and head size (``early_initialization``).

The model's config is part of the entry key: its sha256 is the name of an empty buffer, so two models of equal
shapes but different configs (rope scaling, sliding window, ...) never share an entry.

Only layers whose whole state is tensors are accepted (``StaticLayer``): a sliding-window layer keeps its position
in a Python int that selects branches and mask offsets while tracing, which an entry would replay unchanged (wrong
outputs), so a cache with such layers is refused with an error. Also not supported: gears (padding a prompt would advance the cache's position counter by the padded length, so each
prompt length is its own entry; pad prompts to a few lengths yourself, or run prefill eagerly as transformers'
``generate(cache_implementation="static")`` does), ``mode="reduce-overhead"`` (the cache tensors are buffers, not
call arguments), caches whose layers grow by concatenation (``DynamicCache``).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..api import cache_compile
from ..config import CompilerConfig
from ..errors import ConfigError

# Cache layer classes (transformers.cache_utils) whose state is all tensors, updated in place by the graph. Checked by
# class name so this module does not import transformers.
SUPPORTED_LAYERS = {"StaticLayer"}

class StaticCacheLM(torch.nn.Module):
    """A transformers causal LM whose forward with a ``StaticCache`` is served from gearcache entries."""

    def __init__(self, model: torch.nn.Module, *, config: CompilerConfig | None = None, cache_dir: str | None = None,
                 **cache_compile_kwargs: Any):
        super().__init__()
        if not hasattr(model, "config") or not callable(getattr(model, "get_output_embeddings", None)):
            raise ConfigError(f"model={type(model).__qualname__}: expected a transformers *ForCausalLM model (it "
                              f"has no .config / get_output_embeddings)")
        if config is not None and config.inference_config.dim_gears:
            raise ConfigError("StaticCacheLM: config.inference_config.dim_gears must be empty: padding input_ids "
                              "would advance the StaticCache's position by the padded length. Fix: drop the gears")
        self.model = model
        self.register_buffer(f"hf_config_{_config_digest(model.config)}", torch.empty(0), persistent=False)
        self.cache: Any = None
        self._cache_names: list[str] = []
        self.cached_step = cache_compile(self.step, config=config, cache_dir=cache_dir, **cache_compile_kwargs)

    def step(self, input_ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The cached method: one forward of the model on the bound cache; returns the logits."""
        return self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, **tensors).logits

    def forward(self, input_ids: torch.Tensor, past_key_values: Any, **tensors: torch.Tensor) -> torch.Tensor:
        if past_key_values is not self.cache:
            self.bind(past_key_values, batch_size=input_ids.shape[0])
        return self.cached_step(input_ids, tensors)

    def bind(self, cache: Any, batch_size: int) -> None:
        """Make ``cache`` the one ``step`` updates: allocate it if it is not yet, register its tensors as buffers."""
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ConfigError(f"past_key_values={type(cache).__qualname__}: expected a transformers StaticCache. "
                              f"Fix: pass StaticCache(config=model.config, max_cache_len=N)")
        other = sorted({type(layer).__name__ for layer in layers} - SUPPORTED_LAYERS)
        if other:
            raise ConfigError(
                f"past_key_values={type(cache).__qualname__} has layers of type {other}; StaticCacheLM serves only "
                f"{sorted(SUPPORTED_LAYERS)}, whose whole state is tensors. A sliding-window layer "
                f"(StaticSlidingWindowLayer) keeps its position in a Python int that picks branches and mask offsets "
                f"at trace time; torch.compile guards on it and recompiles, a gearcache entry would replay the "
                f"traced value: wrong outputs. Fix: a config without sliding_window / layer_types "
                f"'sliding_attention', or serve this model with torch.compile")
        if not all(layer.is_initialized for layer in layers):
            _allocate(self.model, cache, batch_size)
        for name in self._cache_names:
            del self._buffers[name]
        self._cache_names = []
        for i, layer in enumerate(layers):
            for attr, value in sorted(vars(layer).items()):
                if isinstance(value, torch.Tensor):
                    name = f"cache_{i}_{attr}"
                    self.register_buffer(name, value, persistent=False)
                    self._cache_names.append(name)
        self.cache = cache

    @torch.inference_mode()
    def greedy(self, input_ids: torch.Tensor, cache: Any, new_tokens: int) -> torch.Tensor:
        """Greedy decoding of ``new_tokens`` tokens after the prompt ``input_ids`` [B, T]; returns [B, new_tokens].
        The cache must be empty (new, or ``reset()``) and hold at least T + new_tokens positions."""
        logits = self(input_ids, cache)
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(new_tokens - 1):
            logits = self(tokens[-1][:, None], cache)
            tokens.append(logits[:, -1].argmax(-1))
        return torch.stack(tokens, 1)


def _allocate(model: torch.nn.Module, cache: Any, batch_size: int) -> None:
    """Allocate the cache's layers: ``early_initialization`` with the config's key/value heads and head size when the
    config has them (no model run: a warm start pays nothing eager), else one eager forward on a dummy token (then
    ``reset()``). Wrong sizes cannot pass silently: the cache's shapes are in the entry key, and a graph writing
    other shapes fails while it is traced."""
    param = next(model.parameters())
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // text.num_attention_heads
                                                   if getattr(text, "hidden_size", None) and heads else None)
    if heads and head_dim and hasattr(cache, "early_initialization"):
        cache.early_initialization(batch_size, heads, head_dim, param.dtype, param.device)
        return
    with torch.inference_mode():
        model(input_ids=torch.zeros(batch_size, 1, dtype=torch.long, device=param.device), past_key_values=cache,
              use_cache=True)
    cache.reset()


def _config_digest(hf_config: Any) -> str:
    """sha256 of the model config's JSON (what changes the model's code path beyond its weights' shapes)."""
    text = hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else \
        json.dumps(vars(hf_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]
