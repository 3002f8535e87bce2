"""Regional compilation of a served transformers causal LM (``enable(model, regions="blocks")``).

A causal LM's decoder layers repeat one block (or a few kinds), so one compiled entry per kind of block and gear
serves every layer. The served step (``ServedLM.step``) then runs the model's forward eagerly (embedding, masks,
rotary embeddings, final norm, LM head: the cheap glue) and each decoder layer through its :class:`LayerRegion`,
whose cached method :meth:`LayerRegion.run` takes the layer's tensors as arguments:

    run(hidden, mask, cos, sin, position_ids, keys, values, length, pad)

(the call's other keyword arguments, constants such as ``use_cache``, are the region's ``constants``: attribute
values its entries' guards check, never arguments, so no guard is rooted in a variadic parameter).

``keys``, ``values`` and ``length`` are this layer's tensors of the backing cache (gearcache/integrations/hf_cache.py):
the graph updates them in place, as transformers' ``StaticLayer.update`` does (:class:`LayerCache` stands for the
cache in the layer's call, whatever layer index the attention passes), and after a prompt drops the pads' keys and
values and moves ``length`` back by ``pad`` (what the whole step does for every layer). Nothing in ``run`` depends
on which layer it is: the layer's weights are the region's parameters (``layer.*``, graph inputs read at every
call), so the regions of identical layers have one entry key and share one compiled entry (``regions.serve_block``).
A layer whose ``layer_idx`` the forward reads beyond the cache call gets a value guard on it, and so an entry of its
own per index: correct, only slower to compile.

The entry key carries what tells blocks apart: the region's parameter and buffer layout, and a buffer named after
the layer's class and the digest of what that class does (``keys.fingerprints.class_digest``), so two layer classes
with the same weights' layout (Llama's and Mistral's) never share an entry. Which modules are the decoder layers:
the ``nn.ModuleList`` of the model's ``_no_split_modules`` classes with as many items as the text config has hidden
layers, each of whose ``layer_idx`` is its place; a model without one is refused (``regions="whole"`` serves it).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ..errors import ConfigError
from ..keys.fingerprints import class_digest
from . import hf_compat

if TYPE_CHECKING:
    from ..cached_function import CachedFunction


class StepState(Protocol):
    """What a layer's region reads of the served step (``transformers.ServedLM``): the model's cache keyword and the
    step's pad count."""

    @property
    def cache_kw(self) -> str: ...

    current_pad: torch.Tensor | None

FIX = "Fix: enable(model, regions='whole')"
CONSTANTS = (bool, int, float, str, type(None))


class LayerCache:
    """The cache a region's layer is called with: one layer's tensors, updated as transformers' ``StaticLayer``
    updates its own (the layer index and cache kwargs the attention passes are not read)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor):
        self.keys, self.values, self.length = keys, values, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        width = key_states.shape[-2]
        positions = torch.arange(width, device=self.keys.device) + self.length
        self.length.add_(width)
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values


class LayerRegion(torch.nn.Module):
    """One decoder layer as a region (see the module docstring). ``cache_kw``: the layer's keyword for its cache."""

    def __init__(self, layer: torch.nn.Module, cache_kw: str):
        super().__init__()
        self.layer = layer
        self.cache_kw = cache_kw
        self.constants: dict[str, Any] = {}      # the layer call's constant keyword arguments (RegionForward sets)
        kind = type(layer)
        name = re.sub(r"[^A-Za-z0-9_]", "_", kind.__qualname__)
        self.register_buffer(f"block_{name}_{class_digest(kind)[:16]}", torch.empty(0), persistent=False)

    def run(self, hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            position_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
            pad: torch.Tensor) -> torch.Tensor:
        """The cached method: the layer's forward on ``hidden``, its cache tensors updated in place, a prompt's pads
        dropped from them."""
        out = self.layer_call(hidden, mask, cos, sin, position_ids, keys, values, length)
        width = hidden.shape[1]
        if width > 1:
            drop_pads(keys, values, length, width, pad)
        return out

    def layer_call(self, hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   position_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   length: torch.Tensor) -> torch.Tensor:
        """The layer's forward on ``hidden`` with its cache tensors (``run`` without the pads' drop: what the
        padding proof walks, hf_proof.py)."""
        cache = LayerCache(keys, values, length)
        out: torch.Tensor = type(self.layer).forward(self.layer, hidden, attention_mask=mask, position_ids=position_ids,
                                                     position_embeddings=(cos, sin), **{self.cache_kw: cache},
                                                     **self.constants)
        return out


def drop_pads(keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, width: int, pad: torch.Tensor) -> None:
    """After ``width`` tokens whose last ``pad`` are padding: zero the pads' keys and values and move the position
    counter back by ``pad`` (in the graph: one graph serves every pad of a gear)."""
    arange = torch.arange(width, device=pad.device)
    real = (arange < width - pad).view(1, 1, width, 1)
    written = length - width + arange
    for tensor in (keys, values):
        kept = torch.where(real, tensor.index_select(2, written), torch.zeros((), dtype=tensor.dtype,
                                                                               device=tensor.device))
        tensor.index_copy_(2, written, kept)
    length.sub_(pad)


class RegionForward:
    """A decoder layer's ``forward`` while regions serve it (its instance attribute): the layer's call, mapped onto
    its region's cached method with this layer's tensors of the cache the model passes (the backing's)."""

    def __init__(self, served: StepState, index: int, cached: CachedFunction):
        self.served = served            # the ServedLM: its ``current_pad`` for this step
        self.index = index
        self.cached = cached

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any,
                 **kwargs: Any) -> Any:
        if args:
            raise ConfigError(f"regions='blocks': decoder layer {self.index} was called with {len(args) + 2} "
                              f"positional arguments; regions map keyword calls only. {FIX}")
        cache = kwargs.pop(self.served.cache_kw, None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        cos_sin = kwargs.pop("position_embeddings", None)
        position_ids = kwargs.pop("position_ids", None)
        if cache is None or cos_sin is None or not isinstance(position_ids, torch.Tensor):
            raise ConfigError(f"regions='blocks': decoder layer {self.index} was called without a cache, position "
                              f"embeddings or position ids, which its region takes. {FIX}")
        odd = [k for k, v in kwargs.items() if not isinstance(v, CONSTANTS)]
        if odd:
            raise ConfigError(f"regions='blocks': decoder layer {self.index} was called with {odd[0]}="
                              f"{type(kwargs[odd[0]]).__name__}; a region takes tensors it knows and constants. {FIX}")
        region = cast(LayerRegion, self.cached.module)
        if region.constants != kwargs:          # (a change is seen by the entries' guard watch)
            region.constants = kwargs
        layer = cache.layers[self.index]
        cos, sin = cos_sin
        return self.cached(hidden_states, attention_mask, cos, sin, position_ids, layer.keys, layer.values,
                           layer.cumulative_length, self.served.current_pad)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order (see the module docstring); ``ConfigError`` when it has none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    count = getattr(hf_compat.text_config(model), "num_hidden_layers", None)
    for module in model.modules():
        if (isinstance(module, torch.nn.ModuleList) and count and len(module) == count
                and all(type(layer).__name__ in names for layer in module)):
            layers = list(module)
            if all(_layer_indexes(layer) <= {i} for i, layer in enumerate(layers)):
                return layers
    raise ConfigError(f"regions='blocks': {type(model).__qualname__} has no list of {count} decoder layers of its "
                      f"_no_split_modules classes, each using the cache layer of its place. {FIX}")


def check_places(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """``ConfigError`` unless ``model``'s decoder layers are still the regions' ``layers`` (the same objects in order,
    each using the cache layer of its place: a region writes the cache layer of its layer's place at ``enable()``,
    eager the one its ``layer_idx`` names); nothing to check without regions (``layers`` empty)."""
    try:
        now = decoder_layers(model) if layers else layers
    except ConfigError:
        now = []
    if len(now) != len(layers) or any(a is not b for a, b in zip(now, layers)):
        raise ConfigError(f"{type(model).__qualname__}: regions='blocks': its decoder layers were replaced or "
                          f"renumbered (layer_idx) since enable(); each region writes the cache layer of its place. "
                          f"Fix: disable(model), then enable(model) again")


def _layer_indexes(layer: torch.nn.Module) -> set[int]:
    """The ``layer_idx`` attributes of a decoder layer and its submodules (the cache layer its attention uses)."""
    indexes = (getattr(m, "layer_idx", None) for m in layer.modules())
    return {i for i in indexes if isinstance(i, int)}
