"""The padding proof's edges (gearcache/integrations/hf_proof.py, hf_glue.py): what it takes as given (the glue
between the decoder layers, transformers' masking utilities) is checked, so a model that changes it is served at
exact sizes, never padded. These run the proof only (a trace, no compile). Needs transformers."""
import pytest
import torch

from gearcache.integrations.transformers import ServeGears, enable


def _tiny_llama(layers=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


class MixingNorm(torch.nn.Module):
    """A final norm plus the mean over the call's positions: every position reads the pads."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + x.mean(1, keepdim=True)


def _exact(lm, tmp_path, match):
    served = enable(lm, cache_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=match):
        found = served.prove_padding()
    assert found is not None and served.gears == ServeGears((), (), ()), found
    return found


def test_glue_that_mixes_positions_is_served_at_exact_sizes(tmp_path):
    lm = _tiny_llama()
    lm.model.norm = MixingNorm(lm.model.norm)
    found = _exact(lm, tmp_path, "outside the decoder layers")
    assert "model.norm (MixingNorm)" in found


def test_a_hooked_glue_module_is_served_at_exact_sizes(tmp_path):
    lm = _tiny_llama()
    lm.model.norm.register_forward_hook(lambda module, args, out: out + args[0].mean(1, keepdim=True))
    assert "model.norm (LlamaRMSNorm)" in _exact(lm, tmp_path, "forward hooks")


def test_a_patched_masking_function_is_served_at_exact_sizes(tmp_path, monkeypatch):
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "causal_mask_function", lambda b, h, q, kv: kv >= 0)   # every key
    assert "causal_mask_function" in _exact(_tiny_llama(), tmp_path, "masking utilities")


def test_a_mask_builder_patched_in_the_model_module_is_served_at_exact_sizes(tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.create_causal_mask

    def bidirectional(*args, **kwargs):
        mask = original(*args, **kwargs)
        return None if mask is None else torch.ones_like(mask)
    monkeypatch.setattr(modeling_llama, "create_causal_mask", bidirectional)
    assert "create_causal_mask" in _exact(_tiny_llama(), tmp_path, "patched")


def test_the_plain_model_is_still_proved(tmp_path):
    served = enable(_tiny_llama(), cache_dir=str(tmp_path))
    assert served.prove_padding() is None


def _patch_layer(monkeypatch, mix):
    """``LlamaDecoderLayer.forward`` patched on the class: ``mix(self, hidden)`` first, then the layer's own."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaDecoderLayer.forward

    def forward(self, hidden_states, *args, **kwargs):
        return original(self, mix(self, hidden_states), *args, **kwargs)
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)


def _mix_on_layer_one(layer, h):
    return h + h.mean(1, keepdim=True) if layer.self_attn.layer_idx == 1 else h


def _mix_rows_at_decode(layer, h):
    return h + h.mean(0, keepdim=True) if h.shape[1] == 1 else h


def test_a_layer_that_mixes_positions_by_its_layer_idx_is_served_at_exact_sizes(tmp_path, monkeypatch):
    """Layers of one class are one kind, but layer 1 branches on its ``layer_idx``: its graph is not layer 0's (the
    first trace's value guards do not hold on it), so it is proved on its own."""
    _patch_layer(monkeypatch, _mix_on_layer_one)
    found = _exact(_tiny_llama(layers=3), tmp_path, "decoder layer 1")
    assert "decoder layer 1 (LlamaDecoderLayer, prompt)" in found and "mean" in found


def test_a_layer_that_mixes_rows_only_in_a_decode_step_is_served_at_exact_sizes(tmp_path, monkeypatch):
    """A decode step (one token) is its own graph: a layer mixing the batch's rows there reads padded rows."""
    _patch_layer(monkeypatch, _mix_rows_at_decode)
    found = _exact(_tiny_llama(layers=2), tmp_path, "decode")
    assert "decoder layer 0 (LlamaDecoderLayer, decode)" in found and "mean" in found


def test_a_proof_record_of_fewer_layers_is_not_read_for_more(tmp_path, monkeypatch):
    """The store's record of a 2-layer model's proof (layers 0 and 1 proved) is not the answer for a 3-layer model
    of the same classes and config otherwise, whose layer 2 mixes positions: the layer count is in the proof key."""
    _patch_layer(monkeypatch, lambda layer, h: h + h.mean(1, keepdim=True) if layer.self_attn.layer_idx == 2 else h)
    assert enable(_tiny_llama(layers=2), cache_dir=str(tmp_path)).prove_padding() is None
    assert "decoder layer 2" in _exact(_tiny_llama(layers=3), tmp_path, "decoder layer 2")


def test_a_submodule_replaced_after_the_proof_is_refused_at_the_next_call(tmp_path):
    """The proof read the modules the model had: one set after it (a layer's MLP, the final norm) is refused at the
    next call, as a hook added after the proof is; disable() then enable() proves the model as it is."""
    from transformers import StaticCache

    from gearcache.errors import ConfigError
    from gearcache.integrations import hf_compat
    from gearcache.integrations.transformers import disable

    lm = _tiny_llama(layers=2)
    served = enable(lm, cache_dir=str(tmp_path))
    assert served.prove_padding() is None
    lm.model.layers[1].mlp = type(lm.model.layers[1].mlp)(lm.config)
    call = {"input_ids": torch.ones(1, 2, dtype=torch.long),
            hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=8)}
    with pytest.raises(ConfigError, match="a submodule of it was replaced"):
        lm(**call)
    disable(lm)
    lm.model.norm = MixingNorm(lm.model.norm)
    _exact(lm, tmp_path, "outside the decoder layers")


def test_a_module_function_a_layer_calls_patched_after_the_proof_is_recorded(tmp_path, monkeypatch):
    """The store's record of the proof is read for a model of the same classes: a function of the layer's module
    patched since (the rotary embedding's application adding the mean over the positions) is no part of its key, so
    it is checked in every process."""
    from transformers.models.llama import modeling_llama

    assert enable(_tiny_llama(), cache_dir=str(tmp_path)).prove_padding() is None
    original = modeling_llama.apply_rotary_pos_emb

    def mixing(q, k, *args, **kwargs):
        q, k = original(q, k, *args, **kwargs)
        return q + q.mean(2, keepdim=True), k
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", mixing)
    assert "apply_rotary_pos_emb" in _exact(_tiny_llama(), tmp_path, "patched")


def test_a_mask_function_registered_for_the_attention_is_served_at_exact_sizes(tmp_path, monkeypatch):
    from transformers import masking_utils

    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    original = registry["sdpa"]

    def bidirectional(*args, **kwargs):
        mask = original(*args, **kwargs)
        return None if mask is None else torch.ones_like(mask)
    monkeypatch.setitem(registry, "sdpa", bidirectional)
    assert "sdpa" in _exact(_tiny_llama(), tmp_path, "masking utilities")


def test_an_attention_function_registered_after_the_proof_was_recorded_is_proved_again(tmp_path, monkeypatch):
    """The proof's record is keyed by the function registered for the model's attention implementation: one
    registered since (adding the mean over the positions to the attention's output) is traced, not read."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert enable(_tiny_llama(), cache_dir=str(tmp_path)).prove_padding() is None
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def mixing(*args, **kwargs):
        out, weights = original(*args, **kwargs)
        return out + out.mean(1, keepdim=True), weights
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", mixing)
    assert "mean" in _exact(_tiny_llama(), tmp_path, "decoder layer 0")


def test_an_attention_written_out_is_proved(tmp_path):
    """transformers' eager attention (matmul, the additive causal mask, softmax in float32, matmul) over the cache:
    proved in float32 and bfloat16 (tests/test_integrations_transformers.py serves it padded like eager)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager")
    for dtype in (torch.float32, torch.bfloat16):
        lm = LlamaForCausalLM(config).to(dtype).eval()
        assert lm.config._attn_implementation == "eager"
        assert enable(lm, cache_dir=str(tmp_path / str(dtype))).prove_padding() is None
