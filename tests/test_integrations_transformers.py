"""gearcache.integrations.transformers: a HF causal LM served with transformers' own StaticCache.

The end-to-end runs share the corpus' Llama (tests/conftest.py ``corpus_cold``): greedy decoding through gearcache
equals transformers' eager ``generate(cache_implementation="static")`` token for token, in the compiling process and
in a warm fresh process that compiles nothing; the StaticCache is updated in place like eager's. Needs transformers
(the "test" extra installs it): without it these fail rather than skip."""
import pytest
import torch

from gearcache.errors import ConfigError
from gearcache.integrations.transformers import StaticCacheLM


def test_greedy_tokens_equal_transformers_generate_cold_and_warm(corpus_cold, corpus_warm):
    _, cold = corpus_cold("llama")
    warm = corpus_warm("llama")
    for run in (cold, warm):
        assert run["tokens_match_generate"] is True and run["tokens"] == run["generated"]
        assert run["cache_max_abs_diff"] <= 1e-4, "the StaticCache is updated in place like eager's"
        assert run["second_cache_tokens"] == run["generated"], "a second, new StaticCache reuses the entries"
        assert run["counters_after_second_cache"]["compiles"] == run["counters"]["compiles"]
    assert warm["counters"]["compiles"] == 0 and warm["hooks"]["dynamo_frames"] == 0
    assert warm["tokens"] == cold["tokens"]


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, **overrides)
    return LlamaForCausalLM(config).eval()


def test_sliding_window_cache_is_refused(tmp_path):
    """A sliding-window layer's position is a Python int read while tracing: an entry would replay a stale value."""
    from transformers import StaticCache

    lm = _tiny_llama()
    lm.config.sliding_window = 4
    served = StaticCacheLM(lm, cache_dir=str(tmp_path))
    cache = StaticCache(config=lm.config, max_cache_len=8)
    with pytest.raises(ConfigError, match="StaticSlidingWindowLayer"):
        served(torch.ones(1, 2, dtype=torch.long), cache)


def test_a_dynamic_cache_is_refused(tmp_path):
    from transformers import DynamicCache

    lm = _tiny_llama()
    served = StaticCacheLM(lm, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="StaticCache"):
        served(torch.ones(1, 2, dtype=torch.long), DynamicCache(config=lm.config))


def test_gears_are_refused(tmp_path):
    from gearcache import CompilerConfig

    config = CompilerConfig()
    config.inference_config.dim_gears = {"input_ids": {1: [8, 16]}}
    with pytest.raises(ConfigError, match="dim_gears"):
        StaticCacheLM(_tiny_llama(), config=config, cache_dir=str(tmp_path))


def test_model_config_is_part_of_the_key(tmp_path):
    """Equal shapes, another rope_theta: another entry key (the config's digest is a buffer name)."""
    a = StaticCacheLM(_tiny_llama(), cache_dir=str(tmp_path))
    b = StaticCacheLM(_tiny_llama(rope_theta=1234.0), cache_dir=str(tmp_path))
    names = lambda m: {n for n, _ in m.named_buffers() if n.startswith("hf_config_")}   # noqa: E731
    assert names(a) and names(a) != names(b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")
def test_cuda_graphs_update_the_static_cache_like_eager(tmp_path):
    """mode="reduce-overhead": prefill and decode steps replayed from CUDA graphs equal eager, logits and the cache's
    state (keys, values, cumulative_length) after every call; a second StaticCache (a new request) is captured again
    and equal too. (The cause of the old failure: the warm-up run before a capture advanced the cache's position
    counter a second time, and a graph kept writing the first cache bound.)"""
    from transformers import StaticCache

    from gearcache import CompilerConfig, counters

    model = _tiny_llama().cuda()
    served = StaticCacheLM(model, cache_dir=tmp_path, config=CompilerConfig(mode="reduce-overhead"))
    prompt = torch.randint(0, 64, (1, 5), device="cuda")
    with torch.inference_mode():
        for request in range(2):
            cache = StaticCache(config=model.config, max_cache_len=16)
            eager_cache = StaticCache(config=model.config, max_cache_len=16)
            ids = prompt
            for _ in range(5):
                want = model(input_ids=ids, past_key_values=eager_cache, use_cache=True).logits
                torch.testing.assert_close(served(ids, cache), want)
                for got_layer, want_layer in zip(cache.layers, eager_cache.layers):
                    for attr, value in vars(want_layer).items():
                        if isinstance(value, torch.Tensor):
                            torch.testing.assert_close(getattr(got_layer, attr), value, msg=attr)
                ids = want[:, -1:].argmax(-1)
    assert counters.graph_captures >= 4, "prefill and decode captured for each request's cache"
