"""The model corpus (benchmarks/corpus.py), CI's slice: causal LMs served through ``enable(model)`` and called with
``generate()`` (Llama; Mistral with a sliding window; Gemma-3 text with sliding and full layers) and an encoder with
batch gears. Each is compiled cold in one fresh process; a second fresh process, with empty Inductor and Triton
caches, must load every entry through a run plan, compile nothing and match eager."""
import pytest

pytestmark = pytest.mark.slow      # the slow tier (pytest -m slow): CI runs it after the README's line

SLICE = {"llama": 2, "mistral_sliding": 2, "gemma3": 2, "bert": 2}   # entries: prefill gear + decode; two gears


@pytest.mark.parametrize("name", sorted(SLICE))
def test_cold_process_compiles_each_entry_once(corpus_cold, name):
    _, cold = corpus_cold(name)
    assert cold["counters"]["compiles"] == SLICE[name]
    assert cold["counters"]["loads"] == 0
    assert cold["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("name", sorted(SLICE))
def test_warm_process_loads_every_entry_through_run_plans(corpus_warm, name):
    warm = corpus_warm(name)
    c = warm["counters"]
    assert c["loads"] == SLICE[name] and c["direct_loads"] == c["loads"], "every entry through its run plan"
    assert c["compiles"] == 0 and c["traces"] == 0
    assert warm["hooks"] == {"dynamo_frames": 0, "guard_builds": 0, "inductor_compiles": 0, "inductor_codegen": 0,
                             "cpp_builds": 0, "triton_compiles": 0}
    assert warm["max_abs_diff"] <= 1e-4
    if "tokens_match_generate" in warm:
        assert warm["tokens_match_generate"] is True
