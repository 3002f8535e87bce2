"""Why StaticCacheLM with CUDA graphs (mode="reduce-overhead") returned wrong logits and never updated the cache.

Runs a small transformers causal LM (random weights, float32) with transformers' StaticCache three ways: eager, and
StaticCacheLM with CUDA graphs on a first cache and on a second cache object (as every generate() call makes). After
each call it prints the max |logits - eager| and each layer's ``cumulative_length``, and which tensors the captured
graph reads for the cache (its static addresses) against the cache bound at the call.

usage: python scripts/static_cache_graphs.py [--cache-dir DIR]   (needs a GPU)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from gearcache import CompilerConfig
from gearcache.integrations.transformers import StaticCacheLM


def lengths(cache) -> list[int]:
    return [int(layer.cumulative_length) for layer in cache.layers]


def run(served, model, cache, eager_cache, prompt, steps) -> None:
    ids = prompt
    for i in range(steps + 1):
        want = model(input_ids=ids, past_key_values=eager_cache, use_cache=True).logits
        try:
            got = served(ids, cache)
        except Exception as exc:                    # show what the call raised, and go on to the next cache
            print(f"  call {i}: {type(exc).__name__}: {str(exc)[:300]}")
            return
        diff = (got.float() - want.float()).abs().max().item()
        keys = max((a.keys - b.keys).abs().max().item() for a, b in zip(cache.layers, eager_cache.layers))
        print(f"  call {i} ({'prefill' if i == 0 else 'decode'}): max|logits-eager| {diff:.3g}, max|keys-eager| "
              f"{keys:.3g}, cumulative_length {lengths(cache)} (eager {lengths(eager_cache)})")
        ids = want[:, -1:].argmax(-1)


def graph_addresses(served) -> None:
    graphs = served.cached_step.graphs
    bound = {served._buffers[n].data_ptr(): n for n in served._cache_names}
    for gkey, graphed in graphs.graphs.items():
        entry = graphed.entry
        inputs = entry.manifest["inputs"]
        state = [ref for kind, ref in inputs if kind == "state" and ref.startswith("cache_")]
        print(f"  graph {[tuple(b.shape) for _, b, _ in graphed.copies]}: reads {len(state)} cache buffers; "
              f"mutated inputs {[inputs[j][1] for j in entry.compiled.plan.get('mutated_inputs', [])][:6]}")
    print(f"  bound cache buffers now at {sorted(bound)[:3]}...")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="static_cache_graphs_")
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().cuda()
    served = StaticCacheLM(model, cache_dir=cache_dir, config=CompilerConfig(mode="reduce-overhead"))
    prompt = torch.randint(0, 512, (1, 8), device="cuda")
    with torch.inference_mode():
        for name in ("first cache", "second cache"):
            print(name)
            cache = StaticCache(config=config, max_cache_len=64)
            eager_cache = StaticCache(config=config, max_cache_len=64)
            run(served, model, cache, eager_cache, prompt, steps=3)
            graph_addresses(served)


if __name__ == "__main__":
    main()
