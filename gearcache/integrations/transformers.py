"""Serve a transformers causal LM through gearcache with ``generate()`` unchanged: one call, ``enable(model)``.

    from gearcache.integrations.transformers import enable

    enable(model, cache_dir="/srv/gearcache")                  # model: any *ForCausalLM, eval mode
    out = model.generate(ids, attention_mask=mask, max_new_tokens=64, cache_implementation="static")
    logits = model(input_ids=ids, cache=static_cache).logits   # a loop of your own, with transformers' StaticCache

After ``enable``, every forward of ``model`` that carries a transformers ``StaticCache`` (the one ``generate()`` makes
with ``cache_implementation="static"``, which ``enable`` makes the default, or one you pass) runs one cached method,
:meth:`ServedLM.step`, on gear-shaped inputs: prefill and decode steps, any batch, prompt length, attention-mask
length and ``max_new_tokens``, from a few compiled entries that a later process loads with no compiler.

Gears (each a sorted list; a size past the largest is served by an exact entry of its own):

* **batch** ``batch_gears`` (default 1, 2, 4, ... 64): a batch of 3 runs in the 4-row entry; its cache is
  allocated with 4 rows. Padded rows cannot change real ones: no op of the layers mixes rows (proved, below).
* **prompt** ``prompt_gears`` (default 16, 32, ... 8192): a prompt of T tokens is right-padded to the gear G >= T.
  Exact: by the causal mask (proved, below) no real token attends to a later pad; the pads' keys and values,
  written at positions [T, G), are zeroed inside the step and the position counter (``cumulative_length``) is moved
  back by G - T, so the cache after the call is what the unpadded call leaves (docs/TRANSFORMERS.md).
* **cache length** ``cache_len_gears`` (default 256, 512, ... 131072): the cache the graph updates has the gear's
  length, the user's cache is a view of its first L positions (:mod:`.hf_cache`); the 2D attention mask is padded
  to that length with zeros, exactly what transformers does itself up to L, and positions past the current one are
  masked causally anyway. So a new ``max_new_tokens`` or mask length is the same entry.

Padding a prompt, a batch or the cache length is proved exact from each distinct decoder layer's graph before the
first call picks a gear (:mod:`.hf_proof`); a model whose layers mix positions or rows is served at exact sizes
instead, with a warning naming the op; one whose attention over the cache takes a mask the proof does not know is
causal is refused (``ConfigError``) at its first call.

Sliding-window layers (Mistral's ``sliding_window``, Gemma's ``layer_types``) are served as full-length layers: all
positions kept, the model's sliding-window mask selects the window (the same keys as eager attends).

Not served, refused with a ``ConfigError`` naming the fix: a cache other than StaticCache (``DynamicCache``: the
default of plain transformers), beam search, ``inputs_embeds``, 4D or 3D masks/positions, outputs of attentions or
hidden states, a model in training mode, and a model already compiled by ``torch.compile``.
``config=CompilerConfig(mode="reduce-overhead")`` replays one CUDA graph per (batch, prompt or decode, cache-length)
gear: the backing cache's tensors are the graph's static addresses (each gear's backing is allocated once and
reused), the warm-up run before a capture restores the cache it writes, and binding another backing re-captures.
``disable(model)`` undoes ``enable``.

``enable(model, regions="blocks")`` compiles by region instead of the whole step: the step's glue (embedding, masks,
rotary embeddings, final norm, LM head) runs eagerly and each decoder layer through one cached method per distinct
layer (:mod:`.hf_regions`), so a gear costs one layer's compile whatever the layer count; docs/CONFIG.md says when
each is chosen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import warnings
from typing import Any, Callable, Sequence, cast

import torch

from .._torch import nn_modules as torch_nn_modules
from ..api import cache_compile
from ..config import CompilerConfig, normalise_sizes
from ..errors import ConfigError
from ..keys.guard_watch import Watch
from ..ranks.topology import resolve_topology
from ..regions import serve_block
from ..store import Store
from . import hf_cache, hf_compat, hf_prepare, hf_proof_watch, hf_regions

DEFAULT_BATCH_GEARS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROMPT_GEARS = tuple(2 ** k for k in range(4, 14))          # 16 .. 8192
DEFAULT_CACHE_LEN_GEARS = tuple(2 ** k for k in range(8, 18))       # 256 .. 131072


@dataclasses.dataclass(frozen=True)
class ServeGears:
    """The three ladders; ``pick`` returns the smallest size that fits, or the exact size past the largest."""
    batch: tuple[int, ...] = DEFAULT_BATCH_GEARS
    prompt: tuple[int, ...] = DEFAULT_PROMPT_GEARS
    cache_len: tuple[int, ...] = DEFAULT_CACHE_LEN_GEARS

    @classmethod
    def of(cls, batch: Sequence[int] | None, prompt: Sequence[int] | None,
           cache_len: Sequence[int] | None) -> ServeGears:
        def sizes(value: Sequence[int] | int | None, default: tuple[int, ...], name: str) -> tuple[int, ...]:
            if value is None:
                return default
            try:
                return tuple(normalise_sizes(list(value) if not isinstance(value, int) else value, name))
            except (ValueError, TypeError) as exc:
                raise ConfigError(str(exc)) from None
        return cls(sizes(batch, DEFAULT_BATCH_GEARS, "batch_gears"),
                   sizes(prompt, DEFAULT_PROMPT_GEARS, "prompt_gears"),
                   sizes(cache_len, DEFAULT_CACHE_LEN_GEARS, "cache_len_gears"))

    @staticmethod
    def pick(sizes: Sequence[int], n: int, limit: int | None = None) -> int:
        for size in sizes:
            if size >= n and (limit is None or size <= limit):
                return size
        return n


def enable(model: torch.nn.Module, *, cache_dir: str | None = None, config: CompilerConfig | None = None,
           batch_gears: Sequence[int] | None = None, prompt_gears: Sequence[int] | None = None,
           cache_len_gears: Sequence[int] | None = None, regions: str = "whole",
           **cache_compile_kwargs: Any) -> "ServedLM":
    """Route every forward of ``model`` with a StaticCache through gearcache (``generate()`` included); returns the
    :class:`ServedLM`. ``config``, ``cache_compile_kwargs`` (global_rank, ...): ``cache_compile``'s. ``generate()``
    needs ``cache_implementation="static"`` or ``cache=StaticCache(...)`` (its default DynamicCache is refused with
    that fix). ``regions``: ``"whole"`` (a graph of the whole step per gear) or ``"blocks"`` (a graph per distinct
    decoder layer and gear, shared by the layers: hf_regions.py; CONFIG.md says when each is chosen)."""
    if regions not in ("whole", "blocks"):
        raise ConfigError(f"regions={regions!r}: expected 'whole' or 'blocks'")
    if getattr(model, "_gearcache", None) is not None:
        raise ConfigError("enable(model): gearcache is already enabled on this model. Fix: call enable() once "
                          "(disable(model) first to change its options)")
    served = ServedLM(model, gears=ServeGears.of(batch_gears, prompt_gears, cache_len_gears), cache_dir=cache_dir,
                      config=config, regions=regions, **cache_compile_kwargs)
    original_prepare = cast(Callable[..., Any], model.prepare_inputs_for_generation)   # a transformers model's
    object.__setattr__(model, "forward", _Forward(served, model.forward))
    object.__setattr__(model, "prepare_inputs_for_generation", hf_prepare.Prepare(served, model, original_prepare))
    object.__setattr__(model, "get_compiled_call", lambda compile_config=None: model.__call__)
    object.__setattr__(model, "_gearcache", served)
    return served


def disable(model: torch.nn.Module) -> None:
    """Undo :func:`enable`: the model's own forward, ``generate()`` as transformers ships it."""
    served = model.__dict__.pop("_gearcache", None)
    if served is None:
        raise ConfigError("disable(model): gearcache is not enabled on this model")
    for name in ("forward", "prepare_inputs_for_generation", "get_compiled_call"):
        model.__dict__.pop(name, None)
    for layer in served.layers:
        layer.__dict__.pop("forward", None)
    if served._watch is not None:
        served._watch.remove()


class ServedLM(torch.nn.Module):
    """The module whose cached method runs the model's forward on a gear-shaped backing cache (``hf_cache``)."""

    def __init__(self, model: torch.nn.Module, *, gears: ServeGears, cache_dir: str | None,
                 config: CompilerConfig | None, regions: str = "whole", **cache_compile_kwargs: Any):
        super().__init__()
        _check_model(model, config)
        torch_nn_modules.install_registration_hook()     # before any trace: every graph sees the same hooks
        self.model = model
        self.gears = gears
        self._cache_kw = hf_compat.cache_keyword(model)
        self._keeps_logits = hf_compat.accepts_logits_to_keep(model)
        self.register_buffer(f"hf_config_{_config_digest(model.config)}", torch.empty(0), persistent=False)
        self._backings: dict[tuple[int, int], hf_cache.Backing] = {}
        self._active: hf_cache.Backing | None = None
        self._cache_names: list[str] = []
        self.current_pad: torch.Tensor | None = None     # the step's pad count (regions read it)
        self.padding_refused: str | None = None          # why the padding proof failed (hf_proof.py), if it did
        self.padded_calls = 0                            # calls served padded (prompt or rows)
        self._proved = False                             # the proof ran (before the first call picks a gear)
        self._proof_layers: list[torch.nn.Module] = []   # the decoder layers the proof read (checked at every call)
        self._swapped = [False]                          # a submodule of the model was set since the proof
        self._watch: torch_nn_modules.SubmoduleWatch | None = None   # what sets it (removed by disable)
        self._proof_watch: Watch | None = None          # what the proof read, watched (hf_proof_watch.py)
        self._proof_snapshot: hf_proof_watch.Snapshot | None = None     # and what it read, as it was
        self.layers: list[torch.nn.Module] = []          # the decoder layers served by region (regions="blocks")
        if regions == "blocks":
            self.cached_step: Callable[..., torch.Tensor] = self.step     # eager glue; each layer's region cached
            self.regions = _serve_regions(self, model, config, cache_dir, **cache_compile_kwargs)
            return
        self.cached_step = self.cached_whole = cache_compile(self.step, config=config, cache_dir=cache_dir,
                                                             **cache_compile_kwargs)
        self.cached_whole.sizes_chosen_by_caller()        # the step's sizes are this module's gears

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             pad: torch.Tensor, keep_last: int) -> torch.Tensor:
        """The cached method: the model's forward on the active backing cache. ``input_ids`` [Bg, G] (the last
        ``pad`` positions are padding), ``attention_mask`` [Bg, Lg] bool, ``position_ids`` [Bg, G]. Returns the
        logits of the last ``keep_last`` real positions ([Bg, keep_last, V]), or of all G when ``keep_last`` is 0."""
        cache = cast(hf_cache.Backing, self._active).cache      # _activate'd by the caller before every step
        width = input_ids.shape[1]
        kwargs: dict[str, Any] = {self._cache_kw: cache}
        keep = None
        if keep_last:
            keep = torch.arange(keep_last, device=input_ids.device) + (width - keep_last) - pad
            if self._keeps_logits:
                kwargs["logits_to_keep"] = keep
        out = type(self.model).forward(self.model, input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=True, **kwargs)
        logits: torch.Tensor = out.logits     # transformers' model output: untyped here
        if keep is not None and not self._keeps_logits:
            logits = logits.index_select(1, keep)
        if width > 1 and not self.layers:           # (regions drop their own layer's pads)
            _drop_pads(cache, width, pad)
        return logits

    def serve(self, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None, keep_last: int) -> torch.Tensor:
        """``model(input_ids=..., cache=cache, ...).logits`` through the cached step, ``cache`` updated in place."""
        if self.model.training:
            raise ConfigError("model is in training mode; gearcache serves inference. Fix: model.eval()")
        batch, tokens = input_ids.shape
        backing = self.bind(cache, batch, need=0)
        watch = self._proof_watch
        if self.padding_refused is None and (self._swapped[0] or watch is None or not watch.valid()):
            self._check_layers_as_proved()      # O(1) per call: a flag and a GuardWatch (hf_proof_watch.py)
        first = cache.layers[0]
        start = first.served_length
        if not first.grows and start + tokens > first.max_cache_len:
            raise ConfigError(f"input_ids: {tokens} tokens after the {start} in the cache do not fit its "
                              f"max_cache_len={first.max_cache_len}. Fix: a larger StaticCache")
        width = 1 if tokens == 1 else self.gears.pick(self.gears.prompt, tokens)
        if start + width > backing.length:
            if first.grows:
                backing = self.bind(cache, batch, need=start + width)
            else:
                width = self.gears.pick(self.gears.prompt, tokens, limit=backing.length - start)
        if keep_last >= tokens:
            keep_last = 0
        ids, mask, positions, pad = _pad_inputs(input_ids, attention_mask, position_ids, start, backing, width)
        if self.layers:
            self.current_pad = pad                      # what the regions read (outside any trace)
        if width != tokens or backing.batch != batch:
            self.padded_calls += 1
        logits = self.cached_step(ids, mask, positions, pad, keep_last)
        for layer in cache.layers:
            layer.served_length += tokens
        served: torch.Tensor = logits[:batch] if keep_last else logits[:batch, :tokens]
        return served

    def bind(self, cache: Any, batch: int, need: int) -> hf_cache.Backing:
        """Bind ``cache`` to the backing of its gears (length >= ``need``) and make that backing's tensors this
        module's buffers (what the step's graph reads and updates)."""
        if not self._proved:
            self.prove_padding()
        backing = hf_cache.bound_backing(cache)
        if backing is None or backing.length < need:
            hf_cache.check_layers(cache)
            allocated = hf_cache.user_batch(cache)
            if allocated is not None and allocated != batch:
                raise ConfigError(f"input_ids: batch {batch}, but the cache was allocated for batch {allocated}")
            length = hf_cache.user_length(cache)
            wanted = max(length or max(hf_compat.generate_length_hint(self.model), 1), need)
            key = (self.gears.pick(self.gears.batch, batch), self.gears.pick(self.gears.cache_len, wanted))
            backing = self._backings.get(key)
            if backing is None:
                backing = self._backings[key] = hf_cache.allocate(self.model, *key)
            hf_cache.bind(cache, backing, batch, length)
        self._activate(backing)
        return backing

    def _layers_bypassing_the_proof(self) -> str | None:
        """What eager runs around a decoder layer's class ``forward`` that the proof (which traces the class's forward,
        hf_proof.py) does not see: forward hooks on the layer or on every module, a forward replaced on the instance
        (the regions' own aside). None when there is none."""
        if torch_nn_modules.has_global_forward_hooks():
            return "forward hooks are registered for every module (the proof traces the layers' class forward alone)"
        for i, layer in enumerate(self._proof_layers):
            own = layer.__dict__.get("forward")
            if torch_nn_modules.has_forward_hooks(layer) or (own is not None and
                                                              not isinstance(own, hf_regions.RegionForward)):
                return (f"decoder layer {i} has forward hooks or a forward replaced on the instance (the proof traces "
                        f"the class's forward alone)")
        return None

    def _check_layers_as_proved(self) -> None:
        """After something the proof read changed (``self._proof_watch``, hf_proof_watch.py): refuse a call after a
        decoder layer got a hook or a replaced forward, or a submodule was set, since the proof; else prove the model
        as it is now, and refuse the call if that proof fails (its padding was proved for the model as it was: a
        padded call could mix positions or rows the proof never saw, and the cache bound now is padded), or watch it
        again if it holds (a change that mixes nothing: served padded)."""
        from . import hf_glue, hf_proof

        bypass = self._layers_bypassing_the_proof()
        if bypass is None and self._swapped[0]:
            bypass = "a submodule of it was replaced (the proof read the modules it had then)"
        if bypass is None and not _same_layers(self.model, self._proof_layers):
            bypass = "its decoder layers were replaced or renumbered (layer_idx: the proof read the layers it had then)"
        if bypass is None and self._proof_snapshot is not None and self._proof_snapshot.changed() is None:
            self._proof_watch, self._proof_snapshot = hf_proof_watch.watch(self.model)     # a false alarm
            return
        if bypass is None:
            layers = self._proof_layers
            found = hf_glue.glue_finding(self.model, layers) or hf_proof.prove(self.model, self._cache_kw, layers)[0]
            bypass = None if found is None else f"the model changed and its padding is no longer proved: {found}"
        if bypass is not None:
            raise ConfigError(f"{type(self.model).__qualname__}: since enable() proved its padding, {bypass}. Fix: "
                              f"disable(model), then enable(model) again (the proof then sees the model as it is; "
                              f"one it refuses is served at exact sizes)")
        self._proof_watch, self._proof_snapshot = hf_proof_watch.watch(self.model)

    def prove_padding(self) -> str | None:
        """Run the padding proof of the model's decoder layers (hf_proof.py) once, before the first call picks a
        gear; when it fails, serve prompts, batches and cache lengths at their exact sizes from then on (warned once,
        with the finding). Returns the finding (None: proved; padded gears are served)."""
        from . import hf_proof

        self._proved = True
        hf_regions.check_places(self.model, self.layers)        # the regions' cache layers: changed since enable()?
        try:
            layers = self.layers or hf_regions.decoder_layers(self.model)
        except ConfigError as exc:
            self.padding_refused = f"its decoder layers were not found ({exc})"
            layers = []
        self._proof_layers = layers
        bypass = None if self.padding_refused is not None else self._layers_bypassing_the_proof()
        if bypass is not None:
            self.padding_refused = bypass
        elif self.padding_refused is None:
            at = self.regions[0] if self.layers else self.cached_whole
            self.padding_refused = hf_proof.proved(self.model, self._cache_kw, layers, at.store, at.topology.folder)
        if self.padding_refused is not None and "(KV cache)" in self.padding_refused:
            raise ConfigError(f"{type(self.model).__qualname__}: its attention over the KV cache does not take the "
                              f"layer's causal mask: {self.padding_refused}. gearcache serves causal LMs (exact "
                              f"sizes would not be eager's either). Fix: disable(model); serve it with torch.compile")
        if self.padding_refused is None and self._watch is None:    # a submodule set from now on: refused
            self._watch = torch_nn_modules.watch_submodules(list(self.model.modules()), self._swapped)
        if self.padding_refused is None:                            # anything else the proof read: proved again
            self._proof_watch, self._proof_snapshot = hf_proof_watch.watch(self.model)
        if self.padding_refused is not None:
            self.gears = ServeGears((), (), ())         # every size exact: pick returns it
            warnings.warn(f"gearcache: {type(self.model).__qualname__}: padding a prompt or a batch is not proved "
                          f"exact: {self.padding_refused}. Its prompts and batches are served at their exact sizes "
                          f"(an entry per prompt length, batch size and cache length)", stacklevel=3)
        return self.padding_refused

    @property
    def cache_kw(self) -> str:
        """The model's keyword for its cache (``cache`` or ``past_key_values``: hf_compat)."""
        return self._cache_kw

    def _activate(self, backing: hf_cache.Backing) -> None:
        if self._active is backing:
            return
        for name in self._cache_names:
            del self._buffers[name]
        self._cache_names = []
        for i, layer in enumerate(backing.cache.layers):
            for attr in ("keys", "values", "cumulative_length"):
                name = f"cache_{i}_{attr}"
                self.register_buffer(name, getattr(layer, attr), persistent=False)
                self._cache_names.append(name)
        self._active = backing


def _same_layers(model: torch.nn.Module, proved: list[torch.nn.Module]) -> bool:
    """Whether ``model``'s decoder layers are the ``proved`` ones (the same objects, in order)."""
    try:
        layers = hf_regions.decoder_layers(model)
    except ConfigError:         # a layer of a class the model does not list
        return False
    return len(layers) == len(proved) and all(a is b for a, b in zip(layers, proved))


def _serve_regions(served: ServedLM, model: torch.nn.Module, config: CompilerConfig | None, cache_dir: str | None,
                   global_rank: int | None = None, tp_rank: int | None = None,
                   pp_rank: int | None = None) -> list[Any]:
    """``regions="blocks"``: each decoder layer's forward served by its region's cached method (hf_regions.py)."""
    config = config or CompilerConfig()
    if config.mode == "reduce-overhead":
        raise ConfigError("regions='blocks' with mode='reduce-overhead': CUDA graphs of a regional step are not "
                          "served yet. Fix: enable(model, regions='whole') for CUDA graphs")
    store = Store.from_config(cache_dir, config)
    topology = resolve_topology(global_rank, tp_rank, pp_rank)
    layers = hf_regions.decoder_layers(model)
    for i, layer in enumerate(layers):     # every layer checked before any is served: a refusal changes nothing
        if torch_nn_modules.has_forward_hooks(layer) or "forward" in layer.__dict__:
            raise ConfigError(f"regions='blocks': decoder layer {i} has forward hooks or a replaced forward. "
                              f"{hf_regions.FIX}")
    served.layers = layers
    regions = []
    for i, layer in enumerate(served.layers):
        region = hf_regions.LayerRegion(layer, served.cache_kw)
        cached = serve_block(region, config=config, store=store, topology=topology, method="run")
        layer.__dict__["forward"] = hf_regions.RegionForward(served, i, cached)
        regions.append(cached)
    return regions


def _drop_pads(cache: Any, width: int, pad: torch.Tensor) -> None:
    """After a forward of ``width`` tokens whose last ``pad`` are padding: zero the pads' keys and values and move
    every layer's position counter back by ``pad``, in the graph (so one graph serves every pad of a gear)."""
    arange = torch.arange(width, device=pad.device)
    real = (arange < width - pad).view(1, 1, width, 1)
    for layer in cache.layers:
        written = layer.cumulative_length - width + arange
        for tensor in (layer.keys, layer.values):
            kept = torch.where(real, tensor.index_select(2, written), torch.zeros((), dtype=tensor.dtype,
                                                                                   device=tensor.device))
            tensor.index_copy_(2, written, kept)
        layer.cumulative_length.sub_(pad)


def _pad_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                start: int, backing: hf_cache.Backing, width: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the gear's shapes. Ids: right-padded with 0, padded rows 0. Mask [Bg, Lg] bool (the backing's, updated
    in place: ``hf_cache.StepInputs``): the user's 2D mask, False after it (as transformers pads it), True over the
    prompt's pads and the padded rows (so every query attends to something: finite values). Positions: the user's
    (default: ``start + arange``); a pad repeats the last real position (valid for learned position tables). Pad: the
    count of padded positions (the backing's 0-dim tensor)."""
    batch, tokens = input_ids.shape
    rows, device = backing.batch, input_ids.device
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ConfigError(f"attention_mask: a {attention_mask.ndim}D mask; gearcache serves 2D masks "
                          f"[batch, length] (transformers builds the rest). Fix: pass the 2D mask")
    if position_ids is not None and position_ids.ndim != 2:
        raise ConfigError(f"position_ids: {position_ids.ndim}D; gearcache serves 2D position ids [batch, tokens]")
    inputs = backing.step_inputs(device)
    mask = inputs.fill_mask(attention_mask, batch, start, tokens, width)
    if position_ids is None:
        position_ids = torch.arange(start, start + tokens, device=device)[None]
    if rows == batch and width == tokens:           # a decode step of a full batch gear: nothing to pad
        positions = position_ids if position_ids.shape == (batch, tokens) else position_ids.expand(batch, tokens)
        return input_ids, mask, positions.contiguous(), inputs.pad_count(0)
    ids = input_ids.new_zeros(rows, width)
    ids[:batch, :tokens] = input_ids
    positions = position_ids.new_zeros(rows, width)
    positions[:batch, :tokens] = position_ids
    positions[:batch, tokens:] = position_ids[:, -1:]
    return ids, mask, positions, inputs.pad_count(width - tokens)


# Forward arguments a served call may carry, with the values that change nothing.
_NEUTRAL = {"output_attentions": (False,), "output_hidden_states": (False,), "use_cache": (True,)}


class _Forward:
    """``model.forward`` after ``enable``: reads transformers' arguments, serves them through :class:`ServedLM`."""

    def __init__(self, served: ServedLM, original: Callable[..., Any]):
        self.served = served
        self.__signature__ = inspect.signature(original)
        self._names = list(self.__signature__.parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs.update(zip(self._names, args))
        if torch.compiler.is_compiling():
            raise ConfigError("torch.compile is tracing a model served by gearcache. Fix: do not torch.compile it "
                              "(gearcache compiles it): call model.generate(...) / model(...) directly")
        served = self.served
        cache = kwargs.pop(served._cache_kw, None)
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        input_ids = kwargs.pop("input_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        position_ids = kwargs.pop("position_ids", None)
        keep_last = kwargs.pop("logits_to_keep", 0)
        return_dict = kwargs.pop("return_dict", None)
        _refuse_arguments(kwargs, cache, input_ids, keep_last)
        logits = served.serve(cache, input_ids, attention_mask, position_ids, keep_last)
        if return_dict is False:
            return logits, cache
        return hf_compat.causal_lm_output(logits, cache, served._cache_kw)


def _refuse_arguments(kwargs: dict[str, Any], cache: Any, input_ids: Any, keep_last: Any) -> None:
    if cache is None:
        raise ConfigError("model(...) without a cache: gearcache serves forwards with transformers' StaticCache. "
                          "Fix: generate(...), or pass cache=StaticCache(config=model.config, max_cache_len=N); "
                          "or gearcache.integrations.transformers.disable(model)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ConfigError(f"input_ids={type(input_ids).__name__}: gearcache serves 2D input_ids [batch, tokens] "
                          f"(not inputs_embeds)")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ConfigError(f"logits_to_keep={keep_last!r}: gearcache serves an int >= 0")
    for name, value in kwargs.items():
        neutral = _NEUTRAL.get(name, ())
        if value is None or (isinstance(value, bool) and value in neutral):
            continue
        raise ConfigError(f"{name}={value!r:.60}: not served by gearcache (its compiled step returns the logits and "
                          f"updates the cache only). Fix: leave {name} unset, or disable(model)")


def _check_model(model: torch.nn.Module, config: CompilerConfig | None) -> None:
    if not hasattr(model, "config") or not callable(getattr(model, "generate", None)):
        raise ConfigError(f"model={type(model).__qualname__}: expected a transformers *ForCausalLM model (it has no "
                          f".config / generate)")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(f"model={type(model).__qualname__}: an encoder-decoder; gearcache serves decoder-only "
                          f"causal LMs through enable()")
    if config is not None and config.inference_config.dim_gears:
        raise ConfigError("config.inference_config.dim_gears must be empty: enable() pads inputs itself. Fix: "
                          "enable(model, batch_gears=..., prompt_gears=..., cache_len_gears=...)")
    types = getattr(hf_compat.text_config(model), "layer_types", None) or []
    if "chunked_attention" in types:
        raise ConfigError("model: layer_types has 'chunked_attention' (chunked masks offset by left padding), "
                          "which gearcache does not serve yet. Fix: serve it with torch.compile")
    if (mismatch := hf_compat.generate_mask_mismatch(model)) is not None:
        raise ConfigError(f"model: {mismatch}. Fix: remove that config field, or use a model class whose forward "
                          f"honours it")
    from transformers import StaticCache

    model_config: Any = model.config        # a transformers PretrainedConfig
    hf_cache.check_layers(StaticCache(config=model_config, max_cache_len=1))


def _config_digest(hf_config: Any) -> str:
    """sha256 of the model config's JSON (what changes the model's code path beyond its weights' shapes)."""
    text = hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else \
        json.dumps(vars(hf_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]
