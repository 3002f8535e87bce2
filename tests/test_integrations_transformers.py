"""gearcache.integrations.transformers: ``enable(model)`` serves ``generate()`` and forwards with a StaticCache.

The end-to-end runs share the corpus' causal LMs (tests/conftest.py ``corpus_cold`` / ``corpus_warm``; workload in
benchmarks/corpus.py): two ``generate()`` calls on a batch of 3 (batch gear 4) with left padding, prompts of 8 and 5
tokens (prompt gear 16), greedy then sampling with a logits processor, a stopping criterion and a streamer, and a
third with a StaticCache of the user's; each equals the eager twin's ``generate()`` (tokens, streamed tokens, logits,
every cache layer's keys/values and position counter), in the compiling process and in a warm fresh process that
compiles nothing, from two entries. The refusals below compile nothing. Needs transformers (the "test" extra)."""
import pytest
import torch

from gearcache import CompilerConfig, cache_compile
from gearcache.errors import ConfigError
from gearcache.integrations import hf_compat
from gearcache.integrations.transformers import ServeGears, disable, enable

CAUSAL = ["llama", "mistral_sliding", "gemma3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CAUSAL)
def test_generate_equals_eager_generate_cold_and_warm(corpus_cold, corpus_warm, name):
    _, cold = corpus_cold(name)
    warm = corpus_warm(name)
    for run in (cold, warm):
        assert run["tokens_match_generate"] is True and run["tokens"] == run["generated"]
        assert run["sampled_match"] is True, "sampling with the same seed draws the same tokens"
        assert run["streamed_match"] is True, "the streamer sees the same tokens"
        assert run["max_abs_diff"] <= 1e-4, "every step's logits"
        assert run["cache_max_abs_diff"] <= 1e-4, "keys/values of every layer, as eager leaves them"
        served, eager = run["cache_lengths"]
        assert served == eager, "every layer's position counter: prompt padding left no trace"
        assert run["second_cache_tokens"] == run["generated"], "a StaticCache of the user's: same tokens"
        assert run["counters_after_second_cache"]["compiles"] == run["counters"]["compiles"], "and no new entry"
    assert warm["counters"]["compiles"] == 0 and warm["hooks"]["dynamo_frames"] == 0
    assert warm["tokens"] == cold["tokens"]


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "num_key_value_heads": 2, **overrides})
    return LlamaForCausalLM(config).eval()


def test_generate_with_a_dynamic_cache_is_refused_with_the_fix(tmp_path):
    lm = _tiny_llama()
    enable(lm, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="cache_implementation='static'"):
        lm.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "without a cache"),
    ({"output_attentions": True}, "output_attentions"),
    ({"inputs_embeds": torch.zeros(1, 2, 32), "input_ids": None}, "inputs_embeds"),
])
def test_forwards_gearcache_does_not_serve_are_refused(tmp_path, kwargs, match):
    from transformers import StaticCache

    lm = _tiny_llama()
    enable(lm, cache_dir=str(tmp_path))
    call = {"input_ids": torch.ones(1, 2, dtype=torch.long), **kwargs}
    if kwargs:      # the cache's keyword of this transformers version ("cache", or "past_key_values" before 5.2x)
        call[hf_compat.cache_keyword(lm)] = StaticCache(config=lm.config, max_cache_len=8)
    with pytest.raises(ConfigError, match=match):
        lm(**call)


def test_a_4d_mask_and_training_mode_are_refused(tmp_path):
    from transformers import StaticCache

    lm = _tiny_llama()
    enable(lm, cache_dir=str(tmp_path))
    cache = StaticCache(config=lm.config, max_cache_len=8)
    with pytest.raises(ConfigError, match="2D masks"):
        lm(input_ids=torch.ones(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 1, 2, 8),
           **{hf_compat.cache_keyword(lm): cache})
    lm.train()
    with pytest.raises(ConfigError, match="training mode"):
        lm(input_ids=torch.ones(1, 2, dtype=torch.long), **{hf_compat.cache_keyword(lm): cache})


def test_a_call_past_the_cache_length_is_refused_as_eager_would_fail(tmp_path):
    from transformers import StaticCache

    lm = _tiny_llama()
    enable(lm, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="max_cache_len=4"):
        lm(input_ids=torch.ones(1, 5, dtype=torch.long),
           **{hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=4)})


@pytest.mark.parametrize("config, match", [
    (CompilerConfig(inference_config={"dim_gears": {"input_ids": {1: [8, 16]}}}), "dim_gears"),
])
def test_options_not_served_are_refused(tmp_path, config, match):
    with pytest.raises(ConfigError, match=match):
        enable(_tiny_llama(), cache_dir=str(tmp_path), config=config)


def test_the_torch_compile_habit_points_to_enable(tmp_path):
    lm = _tiny_llama()
    with pytest.raises(ConfigError, match="integrations.transformers.enable"):
        lm.forward = cache_compile(lm.forward, cache_dir=str(tmp_path))


def test_enable_twice_is_refused_and_disable_restores_the_model(tmp_path):
    lm = _tiny_llama()
    enable(lm, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="already enabled"):
        enable(lm, cache_dir=str(tmp_path))
    disable(lm)
    assert "forward" not in lm.__dict__ and "prepare_inputs_for_generation" not in lm.__dict__
    with torch.inference_mode():
        assert lm(torch.ones(1, 2, dtype=torch.long)).logits.shape == (1, 2, 64)


def test_gears_pick_the_smallest_fitting_size_else_the_exact_one():
    gears = ServeGears.of([1, 2, 4], [16, 32], [64])
    assert [gears.pick(gears.batch, b) for b in (1, 3, 4, 5)] == [1, 4, 4, 5]
    assert gears.pick(gears.prompt, 20) == 32 and gears.pick(gears.prompt, 20, limit=24) == 20
    with pytest.raises(ConfigError, match="prompt_gears"):
        ServeGears.of(None, [0, 8], None)


def _fresh_mask(user, rows, length, batch, start, tokens, width):
    """The step's mask as a new tensor per call (what StepInputs.fill_mask must equal)."""
    if user is None:
        return torch.ones(rows, length, dtype=torch.bool)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    cols = min(user.shape[1], length)
    mask[:batch, :cols] = user[:, :cols]
    mask[batch:] = True
    mask[:batch, start + tokens:start + width] = True
    return mask


def test_the_step_mask_updated_in_place_equals_a_fresh_mask_call_after_call():
    """One mask tensor per backing, updated in place (one copy per decode step): after any sequence of calls (a padded
    prompt, decode steps, a shorter mask after a longer one, no mask, another batch, left padding) it holds what a
    fresh mask would, at the same address; the pad count is written only when it changes."""
    from gearcache.graphs.graphed_entry import is_static_address
    from gearcache.integrations.hf_cache import StepInputs

    rows, length = 4, 32
    inputs = StepInputs(rows, length, torch.device("cpu"))
    address = inputs.mask.data_ptr()
    left = torch.ones(3, 40, dtype=torch.long)
    left[1, :4] = 0
    left[2, :9] = 0
    calls = [(left[:, :5], 3, 0, 5, 16)]                           # prompt of 5 padded to 16 (pads 5..15)
    calls += [(left[:, :6 + i], 3, 5 + i, 1, 1) for i in range(4)]  # decode steps
    calls += [(left[:, :30], 3, 9, 12, 16),                         # a long mask, pads past the cache's length
              (left[:, :3], 3, 0, 3, 16),                           # then a short one: the old columns are reset
              (None, 3, 3, 1, 1), (left[:2, :7], 2, 6, 1, 1),       # no mask; another batch
              (left[:1, :2].bool(), 1, 1, 1, 1), (torch.ones(1, 50), 1, 2, 1, 1)]   # bool / float / too long
    for user, batch, start, tokens, width in calls:
        got = inputs.fill_mask(user, batch, start, tokens, width)
        assert got is inputs.mask and got.data_ptr() == address
        assert torch.equal(got, _fresh_mask(user, rows, length, batch, start, tokens, width)), (batch, start, tokens)
    assert is_static_address(inputs.mask) and is_static_address(inputs.pad)
    pad = inputs.pad
    assert inputs.pad_count(11) is pad and int(pad) == 11 and pad._version == 1
    assert int(inputs.pad_count(11)) == 11 and pad._version == 1, "the same count: not written again"
    assert int(inputs.pad_count(0)) == 0 and pad._version == 2


def test_model_config_is_part_of_the_key(tmp_path):
    """Equal shapes, another rope_theta: another entry key (the config's digest is a buffer name)."""
    a = enable(_tiny_llama(), cache_dir=str(tmp_path))
    b = enable(_tiny_llama(rope_theta=1234.0), cache_dir=str(tmp_path))
    names = lambda m: {n for n, _ in m.named_buffers() if n.startswith("hf_config_")}   # noqa: E731
    assert names(a) and names(a) != names(b)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")
def test_cuda_graphs_serve_generate_and_the_static_cache_like_eager(tmp_path):
    """mode="reduce-overhead": generate() replays a CUDA graph per gear and its tokens equal eager generate()'s; a
    decode loop on a user StaticCache equals eager step by step, logits and the cache's state (keys, values,
    cumulative_length) after every call, for two requests (the gear-shaped backing is reused, its graphs too).
    (Graphs used to be wrong here: the warm-up run before a capture advanced the cache's position counter a second
    time, and a graph kept writing the first cache bound.)"""
    import copy

    from transformers import StaticCache

    from gearcache import counters

    eager = _tiny_llama().cuda()
    model = copy.deepcopy(eager)
    enable(model, cache_dir=str(tmp_path), config=CompilerConfig(mode="reduce-overhead"))
    prompt = torch.randint(0, 64, (2, 5), device="cuda")
    with torch.inference_mode():
        for new in (6, 3):
            got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                 do_sample=False, cache_implementation="static")
            want = eager.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                  do_sample=False, cache_implementation="static")
            assert torch.equal(got, want)
        for _ in range(2):
            cache = StaticCache(config=model.config, max_cache_len=16)
            eager_cache = StaticCache(config=model.config, max_cache_len=16)
            kw = hf_compat.cache_keyword(eager)          # past_key_values (5.17) or cache (5.24)
            ids = prompt
            for _ in range(4):
                want = eager(input_ids=ids, use_cache=True, **{kw: eager_cache}).logits
                torch.testing.assert_close(model(input_ids=ids, **{kw: cache}).logits, want)
                for got_layer, want_layer in zip(cache.layers, eager_cache.layers):
                    for attr in ("keys", "values", "cumulative_length"):
                        torch.testing.assert_close(getattr(got_layer, attr), getattr(want_layer, attr), msg=attr)
                ids = want[:, -1:].argmax(-1)
    assert counters.graph_captures >= 2, "prefill and decode gears captured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")
@pytest.mark.parametrize("name", CAUSAL)
def test_cuda_graphs_serve_every_corpus_lm_like_eager_cold_and_warm(tmp_path, name):
    """The corpus workload of the CPU test above on the GPU with mode="reduce-overhead" (a CUDA graph per gear):
    generate() past the sliding window (mistral_sliding, gemma3: a window of 4, prompts of 8 and 5 tokens and 6 new
    ones), greedy and sampling, equal to eager (tokens, logits, every layer's keys/values and position counter), in
    the compiling process and in a warm fresh process that compiles nothing."""
    from conftest import Script, empty_caches_env

    cold = Script("run_corpus_model.py", name, str(tmp_path / "store"), "--cuda-graphs").result(timeout=900)
    warm = Script("run_corpus_model.py", name, str(tmp_path / "store"), "--cuda-graphs", "--hooks",
                  env=empty_caches_env(tmp_path / "caches")).result(timeout=600)
    for run in (cold, warm):
        assert run["tokens_match_generate"] is True and run["tokens"] == run["generated"]
        assert run["sampled_match"] is True and run["streamed_match"] is True
        assert run["max_abs_diff"] <= 1e-4 and run["cache_max_abs_diff"] <= 1e-4
        served, eager = run["cache_lengths"]
        assert served == eager
        assert run["second_cache_tokens"] == run["generated"]
        assert run["counters"]["graph_captures"] >= 2, "prefill and decode gears replay CUDA graphs"
    assert warm["counters"]["compiles"] == 0 and warm["hooks"]["dynamo_frames"] == 0
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.slow
def test_a_class_patched_like_liger_is_served_patched_never_from_the_unpatched_entries(tmp_path):
    """Issue #35: ``LlamaMLP.forward`` patched on the class (Liger/Unsloth) before ``enable()`` in a process whose
    store holds the unpatched model's entries, or after the first ``generate()`` in the compiling process: tokens and
    every step's logits equal eager ``generate()`` of the patched model (tests/scripts/run_hf_patch.py). A later
    process, patched or not, loads the matching entries and traces nothing."""
    import shutil

    from conftest import Script

    store, fresh = tmp_path / "store", tmp_path / "fresh"
    plain = Script("run_hf_patch.py", str(store), "plain").result(timeout=900)
    assert plain["first"]["tokens_equal"] and plain["counters"]["compiles"] >= 1
    shutil.copytree(store, fresh, ignore=shutil.ignore_patterns("leases", "locks", "index"))
    after, before = Script("run_hf_patch.py", str(store), "after"), Script("run_hf_patch.py", str(fresh), "before")
    after, before = after.result(timeout=1200), before.result(timeout=1200)
    for run in (after["first"], after["second"], before["first"]):
        assert run["tokens_equal"] and run["max_logits_diff"] <= 1e-4, (after, before)
    assert after["first_counters"]["loads"] >= 1 and after["counters"]["traces"] > after["first_counters"]["traces"]
    assert before["counters"]["loads"] == 0, "the patched model loaded an unpatched entry"
    # each later process on the store its variant was first served from: a model patched before enable() is served
    # at exact sizes (its MLP's forward is not transformers' own: the padding proof's given), so the padded entries
    # the "after" run left are not its entries
    warm = {phase: Script("run_hf_patch.py", str(folder), phase) for phase, folder in (("before", fresh),
                                                                                        ("plain", store))}
    for phase, script in warm.items():
        report = script.result(timeout=600)
        assert report["first"]["tokens_equal"] and report["first"]["max_logits_diff"] <= 1e-4, (phase, report)
        assert report["counters"]["compiles"] == 0 and report["hooks"]["inductor_codegen"] == 0, (phase, report)
        assert report["counters"]["traces"] == 0 and report["hooks"]["dynamo_frames"] == 0, (phase, report)


def _mixing_forward(layer):
    """``layer``'s forward replaced on the instance by one that adds the mean over the call's positions (what a padded
    prompt changes)."""
    import types

    original = type(layer).forward

    def forward(self, hidden_states, *args, **kwargs):
        out = original(self, hidden_states, *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        first = first + first.mean(1, keepdim=True)
        return (first, *out[1:]) if isinstance(out, tuple) else first
    layer.forward = types.MethodType(forward, layer)


def test_a_layer_forward_replaced_on_the_instance_is_never_served_padded(tmp_path):
    """The proof traces a decoder layer's class forward: a forward replaced on the instance (or a hook) is what eager
    runs instead, so the model is served at exact sizes (whole), never padded, and a hook or a replaced forward that
    appears after the proof is refused at the next call."""
    from transformers import StaticCache

    patched = _tiny_llama()
    _mixing_forward(patched.model.layers[0])
    served = enable(patched, cache_dir=str(tmp_path / "a"))
    with pytest.warns(UserWarning, match="replaced on the instance"):
        found = served.prove_padding()
    assert found is not None and "decoder layer 0" in found
    assert served.gears == ServeGears((), (), ()), "every size exact"

    lm = _tiny_llama()
    served = enable(lm, cache_dir=str(tmp_path / "b"))
    assert served.prove_padding() is None, "the class's own layers are proved"
    handle = lm.model.layers[0].register_forward_hook(lambda module, args, out: out)
    call = {"input_ids": torch.ones(1, 2, dtype=torch.long),
            hf_compat.cache_keyword(lm): StaticCache(config=lm.config, max_cache_len=8)}
    with pytest.raises(ConfigError, match="decoder layer 0 has forward hooks"):
        lm(**call)
    handle.remove()
    _mixing_forward(lm.model.layers[0])
    with pytest.raises(ConfigError, match="decoder layer 0 has forward hooks or a forward replaced"):
        lm(**call)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral_batched_mm", "mixtral_grouped_mm"])
def test_written_out_attention_and_per_token_experts_are_served_padded_like_eager(tmp_path, family):
    """``attn_implementation="eager"`` (transformers' ``eager_attention_forward``: matmul, the additive mask, softmax,
    matmul; Gemma 2 with its soft cap, the only attention it has) is proved (gearcache/gears/padding_cache.py:
    ``written_out_attention``) and served padded: a left-padded batch of 3 (batch gear 4) of a 7-token prompt
    (prompt gear 16), tokens and every step's logits equal eager ``generate()``. It was refused with a ConfigError
    (2026-11-27) before the walk followed an attention written out. A mixture of experts (Mixtral, 4 experts, top 2)
    routed per token (``experts_implementation="batched_mm"``: the top-k's indices read the experts' weights) is
    proved too; transformers' default ``grouped_mm`` sorts the tokens by expert and is served at exact sizes."""
    import transformers

    torch.manual_seed(0)
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attn_implementation="eager")
    if family == "gemma2":
        config, cls = transformers.Gemma2Config(**dims, head_dim=16), transformers.Gemma2ForCausalLM
    elif family.startswith("mixtral"):
        config = transformers.MixtralConfig(**dims, num_local_experts=4, num_experts_per_tok=2,
                                            experts_implementation=family.split("_", 1)[1])
        cls = transformers.MixtralForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**dims), transformers.LlamaForCausalLM
    lm, eager = cls(config).eval(), cls(config).eval()
    eager.load_state_dict(lm.state_dict())
    served = enable(lm, cache_dir=str(tmp_path))
    if family == "mixtral_grouped_mm":
        with pytest.warns(UserWarning, match="sorts or ranks along a padded dim"):
            served.prove_padding()
    ids = torch.randint(1, 256, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :2], mask[2, :4] = 0, 0
    ids[mask == 0] = 0
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static",
                   output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        got = lm.generate(ids, attention_mask=mask, **options)
        want = eager.generate(ids, attention_mask=mask, **options)
    if family == "mixtral_grouped_mm":
        assert served.padded_calls == 0, "served at exact sizes"
    else:
        assert served.padding_refused is None and served.padded_calls >= 1, "proved, and served padded"
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits)) <= 1e-4


def _generate(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


def _assert_generate_equals_eager(model, twin, ids, mask):
    with torch.inference_mode():
        (tokens, logits), (want_tokens, want_logits) = _generate(model, ids, mask), _generate(twin, ids, mask)
    assert torch.equal(tokens, want_tokens)
    assert float((logits - want_logits).abs().max()) <= 1e-4


@pytest.mark.slow
def test_changes_no_dict_records_are_served_like_eager_never_from_the_old_graph(tmp_path, monkeypatch):
    """A batch of 3 left-padded prompts of 5 tokens (batch gear 4, prompt gear 16), served padded; then changes that
    set no dict and no class attribute, each followed by generate() equal to eager's (tokens and every step's logits)
    on the changed model. Each was served from the old graph before (a wrong answer): ``mlp.__class__ = Scaled`` (the
    entries' watch read no class identity), ``LlamaMLP.forward.__code__ = ...`` (no watch read the code, and the
    class's digest was cached by its dict's identities). Both re-trace; the padding proof, proved again, holds (a
    scale mixes nothing). A change that mixes positions is refused at the next call."""
    import copy

    from transformers.models.llama import modeling_llama

    class ScaledMLP(modeling_llama.LlamaMLP):
        def forward(self, x):
            return super().forward(x) * 1.5

    def scaled(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5

    def mixing(self, x):
        out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out + out.mean(1, keepdim=True)

    model = _tiny_llama(num_hidden_layers=2)
    twin = copy.deepcopy(model)
    served = enable(model, cache_dir=str(tmp_path))
    ids = torch.randint(1, 64, (3, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _assert_generate_equals_eager(model, twin, ids * mask, mask)
    for m in (model, twin):
        m.model.layers[0].mlp.__class__ = ScaledMLP
    _assert_generate_equals_eager(model, twin, ids * mask, mask)
    monkeypatch.setattr(modeling_llama.LlamaMLP.forward, "__code__", scaled.__code__)
    _assert_generate_equals_eager(model, twin, ids * mask, mask)
    assert served.padded_calls >= 6 and served.padding_refused is None, "served padded throughout"
    monkeypatch.setattr(modeling_llama.LlamaMLP.forward, "__code__", mixing.__code__)
    with torch.inference_mode(), pytest.raises(ConfigError, match="no longer proved.*aten.mean"):
        _generate(model, ids * mask, mask)


def test_a_config_field_the_forward_ignores_but_generate_masks_with_is_refused(tmp_path):
    """``generate()`` with a static cache builds the 4D mask from the config (``create_masks_for_generate``): a
    ``sliding_window`` set on a Llama makes it a sliding mask, while ``LlamaModel.forward`` (what enable() serves, from
    the 2D mask) builds a causal one; served, its logits differed from eager ``generate()``'s by 0.40 at every size
    (found 2026-11-27). Refused at enable() with the field and the fix; a model whose forward honours the field
    (Mistral) is served."""
    from transformers import MistralConfig, MistralForCausalLM

    with pytest.raises(ConfigError, match=r"config.sliding_window=2: generate\(\) masks with "
                                          r"create_sliding_window_causal_mask.*LlamaModel.forward"):
        enable(_tiny_llama(sliding_window=2), cache_dir=str(tmp_path))
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                               sliding_window=2)).eval()
    disable_after = enable(mistral, cache_dir=str(tmp_path))
    assert disable_after.model is mistral
