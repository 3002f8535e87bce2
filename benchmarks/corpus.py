"""A model corpus that no one tuned for gearcache: transformers models from small configs, random weights.

Nothing is downloaded: every model is built from a config (``size="tiny"`` for CPU and CI, ``"small"`` for the GPU
benchmark) with ``torch.manual_seed(0)`` weights. Each :class:`CorpusModel` says how a server calls the model:

* ``kind="causal"``: a causal LM served through ``gearcache.integrations.transformers.enable(model)`` and called as
  transformers documents it: ``model.generate(...)`` with its static cache. The workload is two ``generate()``
  calls on a batch of 3 (batch gear 4) with left padding: greedy, then sampling with another prompt length,
  ``max_new_tokens``, a logits processor, a stopping criterion and a streamer; both reach the same two entries
  (prompt gear 16 and decode, batch gear 4, one cache-length gear).
* ``kind="encoder"``: an encoder or vision model whose cached method takes a batch; the batch dim has gears
  (``ENCODER_GEARS``), one entry per gear. The workload calls every gear's size, then sizes that are padded up.

Mistral and Mixtral are built with ``sliding_window=None``; ``mistral_sliding`` (a window of 4 < the prompt) and
``gemma3`` (Gemma-3 text: sliding and full attention layers) cover sliding-window layers. Sizes: ``tiny`` (CPU, CI),
``small`` (the GPU corpus), ``gpu`` (causal LMs: 1024 hidden, 8 layers, 16 heads / 8 KV heads, vocab 32000).

This module imports neither gearcache nor transformers at import time, so tests and benchmarks can list it cheaply.
``workload(model, size, device, dtype)`` builds everything a run needs (see :class:`Workload`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

ENCODER_GEARS = [2, 4]               # batch gears of every encoder (batches 1 and 3 are padded up)
PROMPT_LEN = 8
NEW_TOKENS = 6
BATCH = 3                            # causal LMs: sequences per generate() call (batch gear 4)
SERVE_GEARS = dict(batch_gears=[1, 2, 4, 8], prompt_gears=[16, 32, 64], cache_len_gears=[64, 128, 256])


def _lm_dims(size: str) -> dict[str, int]:
    if size == "tiny":
        return dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_len=64)
    if size == "gpu":
        return dict(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=8, inter=2816, max_len=1024)
    return dict(vocab=8192, hidden=512, layers=4, heads=8, kv_heads=4, inter=1536, max_len=256)


def _llama(size):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = _lm_dims(size)
    return LlamaForCausalLM(LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                                        num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                                        num_key_value_heads=d["kv_heads"], max_position_embeddings=d["max_len"]))


def _qwen3(size):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = _lm_dims(size)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                                        num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                                        num_key_value_heads=d["kv_heads"], head_dim=d["hidden"] // d["heads"],
                                        max_position_embeddings=d["max_len"]))


def _mistral(size):
    from transformers import MistralConfig, MistralForCausalLM
    d = _lm_dims(size)
    return MistralForCausalLM(MistralConfig(vocab_size=d["vocab"], hidden_size=d["hidden"],
                                            intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                                            num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                                            max_position_embeddings=d["max_len"], sliding_window=None))


def _mistral_sliding(size):
    from transformers import MistralConfig, MistralForCausalLM
    d = _lm_dims(size)
    return MistralForCausalLM(MistralConfig(vocab_size=d["vocab"], hidden_size=d["hidden"],
                                            intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                                            num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                                            max_position_embeddings=d["max_len"],
                                            sliding_window=4 if size == "tiny" else 64))


def _gemma3(size):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    d = _lm_dims(size)
    layers = max(d["layers"], 3)
    kinds = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=layers,
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=d["hidden"] // d["heads"],
        max_position_embeddings=d["max_len"], sliding_window=4 if size == "tiny" else 64, layer_types=kinds))


def _qwen3_moe(size):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    d = _lm_dims(size)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
        moe_intermediate_size=d["inter"] // 4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
        head_dim=d["hidden"] // d["heads"], max_position_embeddings=d["max_len"]))


def _mixtral(size):
    from transformers import MixtralConfig, MixtralForCausalLM
    d = _lm_dims(size)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"] // 2, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"], max_position_embeddings=d["max_len"], sliding_window=None))


def _gpt2(size):
    from transformers import GPT2Config, GPT2LMHeadModel
    d = _lm_dims(size)
    return GPT2LMHeadModel(GPT2Config(vocab_size=d["vocab"], n_embd=d["hidden"], n_layer=d["layers"],
                                      n_head=d["heads"], n_positions=d["max_len"]))


def _enc_dims(size: str) -> dict[str, int]:
    if size == "tiny":
        return dict(hidden=64, layers=2, heads=4, inter=128, seq=16, vocab=256)
    return dict(hidden=512, layers=4, heads=8, inter=2048, seq=128, vocab=8192)


def _bert(size):
    from transformers import BertConfig, BertModel
    d = _enc_dims(size)
    model = BertModel(BertConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"],
                                 num_attention_heads=d["heads"], intermediate_size=d["inter"],
                                 max_position_embeddings=max(64, d["seq"])), add_pooling_layer=False)

    def inputs(batch, device, dtype):
        ids = torch.randint(1, d["vocab"], (batch, d["seq"]), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs, lambda out: out.last_hidden_state


def _t5(size):
    from transformers import T5Config, T5EncoderModel
    d = _enc_dims(size)
    model = T5EncoderModel(T5Config(vocab_size=d["vocab"], d_model=d["hidden"], d_kv=d["hidden"] // d["heads"],
                                    d_ff=d["inter"], num_layers=d["layers"], num_heads=d["heads"]))

    def inputs(batch, device, dtype):
        ids = torch.randint(1, d["vocab"], (batch, d["seq"]), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs, lambda out: out.last_hidden_state


def _whisper(size):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    d = _enc_dims(size)
    frames = 2 * d["seq"]                  # input frames; the conv stem halves them to max_source_positions
    model = WhisperEncoder(WhisperConfig(num_mel_bins=16 if size == "tiny" else 80, d_model=d["hidden"],
                                         encoder_layers=d["layers"], encoder_attention_heads=d["heads"],
                                         encoder_ffn_dim=d["inter"], max_source_positions=d["seq"]))

    def inputs(batch, device, dtype):
        return {"input_features": torch.randn(batch, model.config.num_mel_bins, frames, device=device, dtype=dtype)}
    return model, inputs, lambda out: out.last_hidden_state


def _vit(size):
    from transformers import ViTConfig, ViTModel
    d = _enc_dims(size)
    image = 32 if size == "tiny" else 224
    model = ViTModel(ViTConfig(image_size=image, patch_size=8 if size == "tiny" else 16, hidden_size=d["hidden"],
                               num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                               intermediate_size=d["inter"]), add_pooling_layer=False)

    def inputs(batch, device, dtype):
        return {"pixel_values": torch.randn(batch, 3, image, image, device=device, dtype=dtype)}
    return model, inputs, lambda out: out.last_hidden_state


def _resnet(size):
    from transformers import ResNetConfig, ResNetForImageClassification
    tiny = size == "tiny"
    image = 32 if tiny else 224
    model = ResNetForImageClassification(ResNetConfig(
        embedding_size=16 if tiny else 64, hidden_sizes=[16, 32] if tiny else [64, 128, 256, 512],
        depths=[1, 1] if tiny else [2, 2, 2, 2], layer_type="basic", num_labels=10))

    def inputs(batch, device, dtype):
        return {"pixel_values": torch.randn(batch, 3, image, image, device=device, dtype=dtype)}
    return model, inputs, lambda out: out.logits


def _convnext(size):
    from transformers import ConvNextConfig, ConvNextForImageClassification
    tiny = size == "tiny"
    image = 32 if tiny else 224
    model = ConvNextForImageClassification(ConvNextConfig(
        hidden_sizes=[16, 32] if tiny else [96, 192, 384, 768], depths=[1, 1] if tiny else [2, 2, 4, 2],
        num_stages=2 if tiny else 4, num_labels=10))

    def inputs(batch, device, dtype):
        return {"pixel_values": torch.randn(batch, 3, image, image, device=device, dtype=dtype)}
    return model, inputs, lambda out: out.logits


@dataclasses.dataclass(frozen=True)
class CorpusModel:
    name: str
    kind: str                       # "causal" or "encoder"
    build: Callable[[str], Any]     # causal: size -> *ForCausalLM; encoder: size -> (model, inputs, result)


CORPUS: dict[str, CorpusModel] = {m.name: m for m in [
    CorpusModel("llama", "causal", _llama),
    CorpusModel("qwen3", "causal", _qwen3),
    CorpusModel("mistral", "causal", _mistral),
    CorpusModel("mistral_sliding", "causal", _mistral_sliding),
    CorpusModel("gemma3", "causal", _gemma3),
    CorpusModel("mixtral", "causal", _mixtral),
    CorpusModel("qwen3_moe", "causal", _qwen3_moe),
    CorpusModel("gpt2", "causal", _gpt2),
    CorpusModel("bert", "encoder", _bert),
    CorpusModel("t5_encoder", "encoder", _t5),
    CorpusModel("whisper_encoder", "encoder", _whisper),
    CorpusModel("vit", "encoder", _vit),
    CorpusModel("resnet", "encoder", _resnet),
    CorpusModel("convnext", "encoder", _convnext),
]}


class CachedEncoder(torch.nn.Module):
    """An encoder with one cached method taking the model's inputs as a dict; the batch dim of each input has gears
    (``set_dim_gears`` on the first call's tensors)."""

    def __init__(self, model: torch.nn.Module, result: Callable[[Any], torch.Tensor], cache_dir: str | None):
        super().__init__()
        from gearcache import cache_compile

        self.model, self._result = model, result
        self.cached_encode = cache_compile(self.encode, cache_dir=cache_dir)

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._result(self.model(**inputs))


@dataclasses.dataclass
class Workload:
    """One model's run: ``calls`` in order, each ``(label, run)`` where ``run(cached: bool)`` returns an output
    tensor; ``first`` marks the calls that reach an entry for the first time (the "first calls" a benchmark times).
    ``reference()`` returns eager outputs of the very calls, for the max |diff|; ``check()`` (after
    ``reference()``) returns extra facts: for causal LMs ``tokens_match_generate`` and ``cache_max_abs_diff`` (the
    served StaticCache against the eager one)."""
    calls: list[tuple[str, Callable[[bool], torch.Tensor]]]
    first: list[bool]
    reference: Callable[[], list[torch.Tensor]]
    check: Callable[[list[torch.Tensor]], dict[str, Any]]
    objects: dict[str, Any] = dataclasses.field(default_factory=dict)   # what tests look into (model, cache, ...)


def workload(name: str, size: str, device: str, dtype: torch.dtype, cache_dir: str | None,
             config: Any = None) -> Workload:
    """Build corpus model ``name`` (seed 0) on ``device``/``dtype`` and its calls. ``cache_dir=None``: eager only;
    ``config``: the CompilerConfig a causal LM is served with (``mode="reduce-overhead"``: CUDA graphs)."""
    spec = CORPUS[name]
    torch.manual_seed(0)
    if spec.kind == "causal":
        return _causal_workload(spec.build(size), device, dtype, cache_dir, config)
    model, inputs, result = spec.build(size)
    return _encoder_workload(model.to(device, dtype).eval(), inputs, result, device, dtype, cache_dir)


def _causal_workload(lm, device, dtype, cache_dir, config=None) -> Workload:
    """Two ``generate()`` calls (see the module docstring) on ``lm`` served by gearcache (``cached=True``) or on an
    eager twin (same weights, plain transformers); outputs are the per-step logits [B, steps, V]."""
    import copy

    lm = lm.to(device, dtype).eval()
    lm.generation_config.eos_token_id = None            # random weights emit EOS anywhere: never stop on it
    eager = copy.deepcopy(lm)
    if cache_dir is not None:
        from gearcache.integrations.transformers import enable
        enable(lm, cache_dir=cache_dir, config=config, **SERVE_GEARS)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (BATCH, n), generator=gen).to(device) for n in (PROMPT_LEN, PROMPT_LEN - 3)]
    masks = [torch.ones_like(p) for p in prompts]
    for p, m in zip(prompts, masks):                    # left padding, as a tokenizer pads a batch for generate()
        p[1, :3], m[1, :3] = 0, 0
    results: dict[tuple[bool, int], Any] = {}

    def call(i: int, new_tokens: int, sampling: bool):
        def run(cached: bool) -> torch.Tensor:
            from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TopKLogitsWarper
            from transformers.generation.streamers import BaseStreamer

            class StopOnToken(StoppingCriteria):         # a row stops once it samples token 3
                def __call__(self, input_ids, scores, **kwargs):
                    return input_ids[:, -1] == 3

            class Recorder(BaseStreamer):
                def __init__(self):
                    self.tokens = []

                def put(self, value):
                    self.tokens.append(value.tolist())

                def end(self):
                    self.tokens.append("end")

            model = lm if cached else eager
            extra = {}
            if sampling:
                torch.manual_seed(7)
                extra = dict(do_sample=True, temperature=0.9, streamer=Recorder(),
                             logits_processor=LogitsProcessorList([TopKLogitsWarper(20)]),
                             stopping_criteria=StoppingCriteriaList([StopOnToken()]))
            out = model.generate(prompts[i], attention_mask=masks[i], max_new_tokens=new_tokens, pad_token_id=0,
                                 cache_implementation="static", disable_compile=True, return_dict_in_generate=True,
                                 output_logits=True, do_sample=extra.pop("do_sample", False), **extra)
            results[cached, i] = (out, extra.get("streamer"))
            return torch.stack(out.logits, 1)
        return run

    calls = [("generate greedy", call(0, NEW_TOKENS, False)), ("generate sampling", call(1, NEW_TOKENS - 2, True))]

    def reference():
        return [run(False) for _, run in calls]

    def check(outputs):
        served, ref = results[True, 0][0], results[False, 0][0]
        new = lambda out, i: out.sequences[:, prompts[i].shape[1]:]          # noqa: E731
        cache_diff = max(_layer_diff(a, b) for a, b in zip(_cache(served).layers, _cache(ref).layers))
        sampled, sampled_ref = results[True, 1], results[False, 1]
        return {"tokens": new(served, 0).tolist(), "generated": new(ref, 0).tolist(),
                "tokens_match_generate": torch.equal(new(served, 0), new(ref, 0)),
                "sampled_match": torch.equal(new(sampled[0], 1), new(sampled_ref[0], 1)),
                "streamed_match": sampled[1].tokens == sampled_ref[1].tokens,
                "cache_max_abs_diff": cache_diff,
                "cache_lengths": [[_layer_length(layer) for layer in _cache(out).layers] for out in (served, ref)]}

    return Workload(calls, [True, False], reference, check, {"lm": lm, "eager": eager, "prompts": prompts,
                                                             "masks": masks})


def _cache(output) -> Any:
    """The cache a ``generate()`` output returns: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def _layer_length(layer) -> int:
    """Tokens a cache layer has seen (a sliding-window layer counts them in a Python int)."""
    return getattr(layer, "cumulative_length_int", None) or int(layer.cumulative_length)


def _layer_diff(served, ref) -> float:
    """max |diff| of a served layer's keys/values against eager's: every position of a full layer; for an eager
    sliding-window layer (it keeps the last ``window`` positions, oldest first), those positions."""
    seen, size = _layer_length(ref), ref.keys.shape[2]
    if seen <= size:
        return max_abs_diff([served.keys[:, :, :size], served.values[:, :, :size]], [ref.keys, ref.values])
    return max_abs_diff([served.keys[:, :, seen - size:seen], served.values[:, :, seen - size:seen]],
                        [ref.keys, ref.values])


def _encoder_workload(model, inputs, result, device, dtype, cache_dir) -> Workload:
    sizes = ENCODER_GEARS + [1, 3]              # every gear once, then sizes padded up to a gear
    batches = [inputs(b, device, dtype) for b in sizes]
    wrapped = None
    if cache_dir is not None:
        from gearcache import set_dim_gears

        wrapped = CachedEncoder(model, result, cache_dir)
        for x in batches[0].values():          # the first call's marks make the gear plan
            set_dim_gears(x, {0: ENCODER_GEARS})
    calls = [(f"batch {b}", (lambda inputs: lambda cached: (wrapped.cached_encode(inputs) if cached
                                                             else result(model(**inputs))))(x))
             for b, x in zip(sizes, batches)]
    return Workload(calls, [True] * len(ENCODER_GEARS) + [False, False],
                    lambda: [result(model(**x)) for x in batches], lambda outputs: {})


def run_workload(w: Workload, cached: bool, device: str) -> tuple[list[torch.Tensor], list[float]]:
    """Run the workload's calls in order under inference mode; returns their outputs and wall times (each call
    timed to the device synchronising)."""
    import time

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    outputs, times = [], []
    with torch.inference_mode():
        sync()
        for _, run in w.calls:
            t0 = time.perf_counter()
            outputs.append(run(cached))
            sync()
            times.append(time.perf_counter() - t0)
    return outputs, times


def max_abs_diff(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest |a - b| over all calls' outputs (inf if a shape differs)."""
    worst = 0.0
    for a, b in zip(outputs, reference):
        if a.shape != b.shape:
            return float("inf")
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst
