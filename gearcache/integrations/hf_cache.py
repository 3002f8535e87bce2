"""The KV storage behind a served transformers cache: one allocated cache per (batch gear, length gear), reused.

A compiled entry is one static shape, so the cache the graph updates has a gear's shape ``[Bg, heads, Lg, head]``
(batch ``Bg`` >= the request's batch, length ``Lg`` >= the cache's length), not the user's. That gear-shaped cache is
a **backing**: a transformers ``Cache`` of plain ``StaticLayer`` s, allocated once per (Bg, Lg) and kept, so its
tensors keep their addresses across requests (what CUDA graphs need) and a new request costs a reset, not an
allocation. The user's cache (the one ``generate()`` made, or the user's ``StaticCache``) is **bound** to a backing:
each of its layers is replaced by a :class:`ServedLayer` whose ``keys``/``values`` are views ``[:B, :, :L]`` of the
backing's and whose ``cumulative_length`` is the backing's very tensor, so after every call the user's cache holds
exactly what an eager run would have written (``L`` = its own length).

A backing serves one user cache at a time (its **owner**). Binding another cache to it first **detaches** the
owner (its layers get copies of their views: nothing is lost) and then **loads** the new cache's state into the
backing (a fresh cache: zeros; a detached or partly filled one: its tensors copied in). Binding the owner again is
free.

Sliding-window layers become full-length layers: the backing keeps every position of every layer and the model's
sliding-window mask selects the window (docs/TRANSFORMERS.md says why that is exact). A cache whose layers are all
sliding-window layers has no length of its own (it never runs out eagerly), so its backing grows to the next length
gear when a call needs more (state copied over).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..graphs.graphed_entry import mark_static_address
from . import hf_compat


@functools.lru_cache(maxsize=None)
def served_layer_class() -> type[Any]:
    """``ServedLayer``: a transformers ``StaticLayer`` whose tensors are views of a backing (built on first use, so
    that importing gearcache does not import transformers). Typed ``Any``: a class built at run time on a base that
    is imported then."""
    static_layer: Any = hf_compat.static_layer_classes()[0]

    class ServedLayer(static_layer):     # type: ignore[misc]  # transformers' class, imported at run time
        """A user cache's layer bound to a gearcache backing (or detached from it: then it owns copies).

        ``served_length`` mirrors ``cumulative_length`` on the host (no device sync per call). ``is_compileable``
        is False on purpose: the forward is compiled by gearcache, so ``generate()`` must neither ``torch.compile``
        it nor turn the 2D attention mask into 4D masks sized for this cache (it does both for compileable caches).
        """
        is_compileable = False

        def __init__(self, max_cache_len: int, backing: "Backing | None", served_length: int, grows: bool):
            super().__init__(max_cache_len=max_cache_len)
            self.backing = backing
            self.served_length = served_length
            self.grows = grows          # all layers sliding-window: no length of its own, the backing grows

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.served_length += key_states.shape[-2]
            kv: tuple[torch.Tensor, torch.Tensor] = super().update(key_states, value_states, *args, **kwargs)
            return kv

        def reset(self) -> None:
            super().reset()
            self.served_length = 0

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.served_length -= abs(tokens_to_remove)

        def _refuse(self, *args: Any, **kwargs: Any) -> None:
            raise ConfigError("this cache is served by gearcache (gearcache.integrations.transformers.enable): "
                              "reordering, repeating, selecting or offloading its rows (beam search, contrastive "
                              "search, offloading) is not supported. Fix: num_beams=1, or gearcache.integrations."
                              "transformers.disable(model) for this generate() call")

        reorder_cache = batch_repeat_interleave = batch_select_indices = offload = prefetch = _refuse

    return ServedLayer


class Backing:
    """One gear-shaped cache ``[batch, heads, length, head]`` per layer, and the user cache it serves now."""

    def __init__(self, cache: Any, batch: int, length: int, device: torch.device):
        self.cache = cache
        self.batch = batch
        self.length = length
        self.device = device                             # where its tensors are (the model's, at allocation)
        self.owner: Callable[[], Any] = lambda: None     # weakref to the user cache bound to it
        self.inputs: StepInputs | None = None            # the step's mask and pad count (made on first use)

    def step_inputs(self, device: torch.device) -> StepInputs:
        """The :class:`StepInputs` of this backing's gears on ``device`` (the inputs' device)."""
        if self.inputs is None or self.inputs.mask.device != device:
            self.inputs = StepInputs(self.batch, self.length, device)
        return self.inputs

    def reset(self) -> None:
        for layer in self.cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
            layer.cumulative_length.zero_()


class StepInputs:
    """The step's attention mask ``[Bg, Lg]`` (bool) and pad count (a 0-dim long) for one backing: one tensor each,
    updated in place by every call and marked with ``mark_static_address`` (CUDA graphs read them where they are: no
    copy into a static buffer). A decode step of ``generate()`` costs one copy of the user's 2D mask: the columns and
    rows the last call set are known on the host (``_state``), so only they are reset; the pad count is written only
    when it changes (a prompt's pads, then 0 for every decode step).

    The mask holds what a fresh one would: the user's mask in rows ``[:batch]`` and its columns, False after it,
    True over the prompt's pads ``[start + tokens, start + width)`` and in the padded rows ``[batch:]`` (every query
    attends to something: finite values); all True without a user mask."""

    def __init__(self, rows: int, length: int, device: torch.device):
        self.mask = mark_static_address(torch.zeros(rows, length, dtype=torch.bool, device=device))
        self.pad = mark_static_address(torch.zeros((), dtype=torch.long, device=device))
        self._pad_value = 0
        # (batch, hi): rows [batch:] True, rows [:batch] False from column hi on; "ones": all True; None: unknown
        self._state: tuple[int, int] | str | None = None

    def pad_count(self, n: int) -> torch.Tensor:
        if n != self._pad_value:
            self._pad_value = -1                # unknown until the write is done
            self.pad.fill_(n)
            self._pad_value = n
        return self.pad

    def fill_mask(self, attention_mask: torch.Tensor | None, batch: int, start: int, tokens: int,
                  width: int) -> torch.Tensor:
        """The mask of a call of ``tokens`` tokens padded to ``width``, after ``start`` cached ones (see the class)."""
        mask, state = self.mask, self._state
        self._state = None                      # unknown until the writes are done
        if attention_mask is None:
            if state != "ones":
                mask.fill_(True)
            self._state = "ones"
            return mask
        length = mask.shape[1]
        if not isinstance(state, tuple) or state[0] != batch:
            mask.zero_()
            mask[batch:] = True
            state = (batch, 0)
        cols = min(attention_mask.shape[1], length)
        mask[:batch, :cols].copy_(attention_mask[:, :cols])
        if state[1] > cols:
            mask[:batch, cols:state[1]] = False
        lo, hi = start + tokens, min(start + width, length)
        if hi > lo:
            mask[:batch, lo:hi] = True
        self._state = (batch, max(cols, hi if hi > lo else 0))
        return mask


def check_layers(cache: Any) -> None:
    """Refuse caches whose layers are not (static or static sliding-window) attention layers."""
    layers = getattr(cache, "layers", None)
    if layers is None or not hasattr(cache, "get_seq_length"):
        raise ConfigError(f"cache={type(cache).__qualname__}: gearcache serves transformers' StaticCache. Fix: "
                          f"generate(..., cache_implementation='static') or pass StaticCache(config=model.config, "
                          f"max_cache_len=N)")
    static, sliding = hf_compat.static_layer_classes()
    allowed = (static, sliding, served_layer_class())
    other = sorted({type(layer).__name__ for layer in layers if type(layer) not in allowed})
    if other:
        raise ConfigError(
            f"cache={type(cache).__qualname__} has layers of type {other}; gearcache serves caches of StaticLayer "
            f"and StaticSlidingWindowLayer only (a DynamicCache grows by concatenation: every step would be a new "
            f"shape). Fix: generate(..., cache_implementation='static'), or a StaticCache")


def user_length(cache: Any) -> int | None:
    """The cache's own length (its full-attention layers'), or None when every layer is a sliding-window layer."""
    _, sliding = hf_compat.static_layer_classes()
    if cache.layers and type(cache.layers[0]) is served_layer_class():
        return None if cache.layers[0].grows else cache.layers[0].max_cache_len
    lengths = {layer.max_cache_len for layer in cache.layers if not isinstance(layer, sliding)}
    if len(lengths) > 1:
        raise ConfigError(f"cache: its full-attention layers have different lengths {sorted(lengths)}; expected one")
    return lengths.pop() if lengths else None


def user_batch(cache: Any) -> int | None:
    """The batch size the cache was allocated for, or None if it is not allocated yet."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            batch: int = layer.keys.shape[0]
            return batch
    return None


def bound_backing(cache: Any) -> Backing | None:
    """The backing ``cache`` is bound to now, or None (never bound, detached, or another cache took the backing)."""
    if not cache.layers:
        return None
    first = cache.layers[0]
    if type(first) is not served_layer_class() or first.backing is None or first.backing.owner() is not cache:
        return None
    backing: Backing = first.backing
    return backing


def detach(cache: Any) -> None:
    """Give the layers of ``cache`` (bound to a backing another cache is taking) copies of their state."""
    for layer in cache.layers:
        layer.keys = layer.keys.clone()
        layer.values = layer.values.clone()
        layer.cumulative_length = layer.cumulative_length.clone()
        layer.backing = None


def bind(cache: Any, backing: Backing, batch: int, length: int | None) -> None:
    """Load the state of ``cache`` into ``backing`` and replace its layers by views of the backing's.
    ``length``: the cache's own length (its layers are views ``[:batch, :, :length]``), None: the backing's."""
    previous = backing.owner()
    if previous is not None and previous is not cache:
        detach(previous)
    for layer in cache.layers:                 # moving to another backing (a larger length gear): release the old
        old = getattr(layer, "backing", None)
        if old is not None and old is not backing and old.owner() is cache:
            old.owner = lambda: None
    states = [_layer_state(layer, batch) for layer in cache.layers]
    backing.reset()
    served = served_layer_class()
    view_len = length or backing.length
    for i, (src, dst) in enumerate(zip(states, backing.cache.layers)):
        done = 0
        if src is not None:
            keys, values, counter, done = src
            n = min(keys.shape[2], backing.length)
            dst.keys[:batch, :, :n].copy_(keys[:, :, :n])
            dst.values[:batch, :, :n].copy_(values[:, :, :n])
            dst.cumulative_length.copy_(counter)
        layer = served(view_len, backing, done, length is None)
        layer.keys = dst.keys[:batch, :, :view_len]
        layer.values = dst.values[:batch, :, :view_len]
        layer.cumulative_length = dst.cumulative_length
        for attr in ("device", "batch_size", "num_heads", "k_head_dim", "v_head_dim"):
            if hasattr(dst, attr):
                setattr(layer, attr, getattr(dst, attr))
        if hasattr(layer, "batch_size"):
            layer.batch_size = batch
        layer.is_initialized = True
        cache.layers[i] = layer
    backing.owner = weakref.ref(cache)


def _layer_state(layer: Any, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """(keys, values, counter, length) a layer holds, or None when it holds nothing (not allocated, or empty)."""
    _, sliding = hf_compat.static_layer_classes()
    if not getattr(layer, "is_initialized", False):
        return None
    if isinstance(layer, sliding):
        done = layer.cumulative_length_int
        if done > layer.max_cache_len:
            raise ConfigError(f"cache: a sliding-window layer already holds {done} tokens, more than its window "
                              f"({layer.max_cache_len}): the older ones are gone, so gearcache cannot serve it as "
                              f"a full-length layer. Fix: a new cache (or generate() without cache=)")
    elif type(layer) is served_layer_class():
        done = layer.served_length
    else:
        done = int(layer.cumulative_length)
    if layer.keys.shape[0] != batch:
        raise ConfigError(f"cache: allocated for batch {layer.keys.shape[0]}, called with batch {batch}")
    if done == 0:
        return None
    counter = torch.tensor(done) if isinstance(layer, sliding) else layer.cumulative_length
    return layer.keys, layer.values, counter.to(layer.keys.device), done


def allocate(model: torch.nn.Module, batch: int, length: int) -> Backing:
    """A new backing: transformers' ``StaticCache`` for the model's config with every layer a full-length
    ``StaticLayer``, allocated ``[batch, heads, length, head]`` in the model's dtype and device."""
    from transformers import StaticCache

    static, sliding = hf_compat.static_layer_classes()
    model_config: Any = model.config        # a transformers PretrainedConfig
    cache = StaticCache(config=model_config, max_cache_len=length)
    check_layers(cache)
    cache.layers = [static(max_cache_len=length) for _ in cache.layers]
    param = next(model.parameters())
    shapes = hf_compat.head_shapes(model)
    if shapes is not None:
        cache.early_initialization(batch, shapes[0], shapes[1], param.dtype, param.device)
    else:
        with torch.inference_mode():
            type(model).forward(model, input_ids=torch.zeros(batch, 1, dtype=torch.long, device=param.device),
                                **{hf_compat.cache_keyword(model): cache}, use_cache=True)
    layer: Any          # a StaticLayer, its cumulative_length a tensor once allocated (typed int by transformers)
    for layer in cache.layers:
        layer.cumulative_length = layer.cumulative_length.to(param.device)
    backing = Backing(cache, batch, length, param.device)
    backing.reset()
    return backing
