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


def _mixing_mlp_class():
    from transformers.models.llama import modeling_llama

    class MixingMLP(modeling_llama.LlamaMLP):
        def forward(self, x):
            out = super().forward(x)
            return out + out.mean(1, keepdim=True)
    return MixingMLP


def _mixing_mlp_forward(self, x):
    out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return out + out.mean(1, keepdim=True)


def _mix_positions(module, args, out):
    return out + out.mean(1, keepdim=True)


def _set_mlp_through_modules(lm, monkeypatch):
    lm.model.layers[1]._modules["mlp"] = _mixing_mlp_class()(lm.config)


def _shadow_mlp(lm, monkeypatch):
    object.__setattr__(lm.model.layers[1], "mlp", _mixing_mlp_class()(lm.config))


def _reclass_mlp(lm, monkeypatch):
    lm.model.layers[0].mlp.__class__ = _mixing_mlp_class()


def _reclass_layer(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    class MixingLayer(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states + hidden_states.mean(1, keepdim=True), *args, **kwargs)
    lm.model.layers[0].__class__ = MixingLayer


def _patch_mlp_class(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _mixing_mlp_forward)


def _patch_mlp_code(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP.forward, "__code__", _mixing_mlp_forward.__code__)


def _patch_rotary(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb

    def mixing(q, k, *args, **kwargs):
        q, k = original(q, k, *args, **kwargs)
        return q + q.mean(2, keepdim=True), k
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", mixing)


def _hook_glue(lm, monkeypatch):
    lm.model.norm.register_forward_hook(_mix_positions)


def _hook_layer_submodule(lm, monkeypatch):
    lm.model.layers[1].mlp.register_forward_hook(_mix_positions)


def _replace_glue_forward(lm, monkeypatch):
    import types

    norm = lm.model.norm
    norm.forward = types.MethodType(lambda self, x: _mix_positions(self, (x,), type(self).forward(self, x)), norm)


def _patch_glue_class(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward",
                        lambda self, x: _mix_positions(self, (x,), original(self, x)))


def _mixing_attention(lm, monkeypatch):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def mixing(module, *args, **kwargs):
        out, weights = sdpa_attention_forward(module, *args, **kwargs)
        return out + out.mean(1, keepdim=True), weights
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "mixing_sdpa", mixing)
    assert "mixing_sdpa" in AttentionInterface._global_mapping
    lm.set_attn_implementation("mixing_sdpa")


def _replace_layer_through_modules(lm, monkeypatch):
    from transformers.models.llama import modeling_llama

    class MixingLayer(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states + hidden_states.mean(1, keepdim=True), *args, **kwargs)
    lm.model.layers._modules["1"] = MixingLayer(lm.config, 1)


CHANGES_AFTER_THE_PROOF = [_replace_layer_through_modules, _set_mlp_through_modules, _shadow_mlp, _reclass_mlp,
                           _reclass_layer, _patch_mlp_class, _patch_mlp_code, _patch_rotary, _hook_glue,
                           _hook_layer_submodule, _replace_glue_forward, _patch_glue_class, _mixing_attention]


FAST_CHANGES = {_reclass_mlp, _patch_mlp_code}
"""Two changes in the README's test line (~3 s each: a class and a function's code, what no dict shows); the
others (submodules set, hooks, attention functions) in the slow tier, their kinds each covered by a fast test above
(test_a_submodule_replaced_after_the_proof_..., test_a_hooked_glue_module_..., test_an_attention_function_...)."""


@pytest.mark.parametrize("change", [c if c in FAST_CHANGES else pytest.param(c, marks=pytest.mark.slow)
                                    for c in CHANGES_AFTER_THE_PROOF], ids=lambda f: f.__name__.strip("_"))
def test_a_change_that_mixes_positions_after_the_proof_is_refused_at_the_next_call(tmp_path, monkeypatch, change):
    """The proof is an answer about the model as it was. Each change after it makes a position read the pads (each
    was served padded and differed from eager ``generate()``: a re-traced graph served on the proof's old answer, or
    the old graph itself for the changes no watch saw: ``__class__``, ``__code__``, an instance attribute shadowing a
    submodule). Something the proof read changed, so the next call proves the model again (hf_proof_watch.py), and
    that proof fails: the call is refused with the fix, before any compile."""
    from transformers import StaticCache

    from gearcache.errors import ConfigError
    from gearcache.integrations import hf_compat

    lm = _tiny_llama(layers=2)
    served = enable(lm, cache_dir=str(tmp_path))
    assert served.prove_padding() is None
    change(lm, monkeypatch)
    call = {"input_ids": torch.ones(3, 5, dtype=torch.long),
            hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=16)}
    with pytest.raises(ConfigError, match="since enable\\(\\) proved its padding.*disable\\(model\\), then enable"):
        lm(**call)


def _replace_mlp_forward(lm, monkeypatch):
    mlp = lm.model.layers[1].mlp
    mlp.forward = _mixing_mlp_forward.__get__(mlp)


@pytest.mark.parametrize("change", [pytest.param(_hook_layer_submodule, marks=pytest.mark.slow),
                                    pytest.param(_shadow_mlp, marks=pytest.mark.slow), _replace_mlp_forward],
                         ids=["hook", "shadow", "instance_forward"])     # one in the README's test line
def test_a_proof_record_is_not_read_for_a_layer_submodule_that_mixes_through_what_its_key_lacks(tmp_path, change):
    """The store's record of the plain model's proof was read for a model of the same classes whose layer's MLP had a
    hook, an instance forward or a shadowing attribute (set before enable()): none is in the proof key, and the
    padded generate() differed from eager (logits by 1e-2). Such a model is proved, not read: exact sizes."""
    assert enable(_tiny_llama(layers=2), cache_dir=str(tmp_path)).prove_padding() is None
    lm = _tiny_llama(layers=2)
    change(lm, None)
    assert "decoder layer 1" in _exact(lm, tmp_path, "decoder layer 1")


@pytest.mark.parametrize("regions", [pytest.param("whole", marks=pytest.mark.slow), "blocks"])
def test_decoder_layers_renumbered_after_the_proof_are_refused_at_the_next_call(tmp_path, regions):
    """A layer's ``layer_idx`` picks the cache layer eager writes; the regions map each layer to the cache layer of
    its place. Swapped after the proof (``layers[0].self_attn.layer_idx = 1`` and back), eager writes each layer's keys
    into the other's cache layer: ``regions="blocks"`` served it, its cache off by 0.5 from eager's (found
    2026-11-27). The proof's watch covers ``layer_idx``: the next call is refused with the fix, before any compile."""
    from transformers import StaticCache

    from gearcache.errors import ConfigError
    from gearcache.integrations import hf_compat

    lm = _tiny_llama(layers=2)
    served = enable(lm, cache_dir=str(tmp_path), regions=regions)
    assert served.prove_padding() is None
    lm.model.layers[0].self_attn.layer_idx, lm.model.layers[1].self_attn.layer_idx = 1, 0
    call = {"input_ids": torch.ones(1, 5, dtype=torch.long),
            hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=16)}
    with torch.inference_mode(), pytest.raises(ConfigError, match="renumbered.*disable\\(model\\), then enable"):
        lm(**call)


def test_decoder_layers_renumbered_before_the_first_call_are_refused_by_regions(tmp_path):
    """``regions="blocks"`` maps each layer to the cache layer of its place at ``enable()``: layers renumbered between
    ``enable()`` and the first call were served with every cache layer off from eager's by 0.5 (the proof's watch
    starts at the first call: found 2026-11-27). The first call checks the layers and refuses, with the fix."""
    from transformers import StaticCache

    from gearcache.errors import ConfigError
    from gearcache.integrations import hf_compat

    lm = _tiny_llama(layers=2)
    enable(lm, cache_dir=str(tmp_path), regions="blocks")
    lm.model.layers[0].self_attn.layer_idx, lm.model.layers[1].self_attn.layer_idx = 1, 0
    call = {"input_ids": torch.ones(1, 5, dtype=torch.long),
            hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=16)}
    with torch.inference_mode(), pytest.raises(ConfigError, match="renumbered.*disable\\(model\\), then enable"):
        lm(**call)
