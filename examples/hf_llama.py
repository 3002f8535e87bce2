"""gearcache on a Hugging Face Llama: cached prefill and decode with a static KV cache, decode batch served by gears.

    pip install -e ".[examples]"                      # transformers
    python examples/hf_llama.py                       # a temp store, removed afterwards
    python examples/hf_llama.py --cache-dir /tmp/gc   # keep the store (a second run is warm from its first start)

A ``transformers.LlamaForCausalLM`` built from a small ``LlamaConfig`` (random weights, nothing downloaded) is wrapped
in an ``nn.Module`` whose ``__init__`` does::

    self.cached_prefill = cache_compile(self.prefill, config=CompilerConfig.from_file("configs/llm_prefill.toml"))
    self.cached_decode = cache_compile(self.decode, config=CompilerConfig.from_file("configs/llm_decode.toml"))

The KV cache is one static tensor ``kv [layers, 2, batch, kv_heads, max_len, head_dim]`` passed in and returned
updated (``index_copy`` at the step's positions). Inside the method it is handed to the unmodified HF model as
``past_key_values`` through a small cache object (``TensorKVCache``) that implements the ``update`` call the HF
attention layers make. transformers' own ``StaticCache`` is not used: its tensors (and its position counter) are
plain attributes of a Python object, which a cached method can neither take as an argument nor read as module state,
and it updates them in place, which would miss the caller's tensor whenever a call is padded up to a gear (the
padded copy is what the graph sees).

The decode batch is padded up to the gears of ``configs/llm_decode.toml`` (1, 2, 4, ... 256); prefill pads batch
and prompt length (``configs/llm_prefill.toml``, product policy). ``--gears 2,4`` replaces the batch gears of both.
The example generates a few tokens greedily through the cached methods and checks they equal the tokens the eager HF
model picks (full recompute of the sequence, no cache). It does this twice, each in a fresh process: a cold start
(trace, compile, publish) and a warm start (load only), and prints both starts' first-call times and counters. The
last line of output is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import cold_then_warm, counters_line, run_fresh, start_summary  # noqa: E402

from gearcache import CompilerConfig, cache_compile, counters

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
MAX_LEN = 128          # KV cache slots per sequence: the prompt-length gears (<= 64) plus generated tokens fit


class TensorKVCache:
    """What the HF attention layers need of ``past_key_values``: ``update(k, v, layer_idx)`` returns the layer's full
    keys and values. Functional: each layer's slice of ``kv`` is ``index_copy``-ed (a new tensor), collected in
    ``self.updated`` and returned by the cached method as the new cache. ``real`` ([B, T], True for a real token): a
    pad token's slot keeps its old keys and values, so a prompt padded up to its length gear leaves the cache exactly
    as the unpadded prompt does (gearcache's padding analysis proves that from the graph: the padded rows' positions
    come after the real ones, and what they write is what their slots hold)."""

    def __init__(self, kv: torch.Tensor, positions: torch.Tensor, real: torch.Tensor):
        self.kv, self.positions, self.real = kv, positions, real[:, None, :, None]
        self.updated: list[torch.Tensor] = []

    def _written(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return old.index_copy(2, self.positions, torch.where(self.real, new, old.index_select(2, self.positions)))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys = self._written(self.kv[layer_idx, 0], key_states)
        values = self._written(self.kv[layer_idx, 1], value_states)
        self.updated.append(torch.stack([keys, values]))
        return keys, values


class CachedLlama(torch.nn.Module):
    """A Hugging Face Llama with gearcache'd prefill and decode entry points."""

    def __init__(self, hf_config, prefill_config: CompilerConfig, decode_config: CompilerConfig,
                 cache_dir: str | None = None):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.lm = LlamaForCausalLM(hf_config)
        self.cached_prefill = cache_compile(self.prefill, config=prefill_config, cache_dir=cache_dir)
        self.cached_decode = cache_compile(self.decode, config=decode_config, cache_dir=cache_dir)

    def _forward(self, input_ids, kv, positions):
        real = input_ids >= 0                   # configs/llm_prefill.toml pads prompts with token id -1
        input_ids = input_ids.clamp(min=0)
        cache = TensorKVCache(kv, positions, real)
        # Slot j of the static cache holds position j: a query at position p sees slots 0..p. Passing a prepared 4D
        # mask makes transformers use it as is (True = attend).
        mask = torch.arange(kv.shape[4], device=kv.device)[None, :] <= positions[:, None]
        batch = input_ids.shape[0]
        # cache_position: transformers 4.x would otherwise ask the cache for get_seq_length(); 5.x ignores it.
        out = self.lm(input_ids=input_ids, attention_mask=mask[None, None].expand(batch, 1, -1, -1),
                      position_ids=positions[None].expand(batch, -1), cache_position=positions,
                      past_key_values=cache, use_cache=True)
        return out.logits, torch.stack(cache.updated)

    def prefill(self, input_ids, kv):          # input_ids [B, T] -> logits [B, T, vocab], kv
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self._forward(input_ids, kv, positions)

    def decode(self, input_ids, kv, pos):      # input_ids [B, 1], pos [1]: the step's position -> logits [B, 1, vocab]
        return self._forward(input_ids, kv, pos)


def small_llama_config():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_LEN)
    config._attn_implementation = "sdpa"
    return config


def load_configs(gears: list[int] | None) -> tuple[CompilerConfig, CompilerConfig]:
    prefill = CompilerConfig.from_file(CONFIGS / "llm_prefill.toml")
    decode = CompilerConfig.from_file(CONFIGS / "llm_decode.toml")
    if gears:                                   # --gears: replace the batch gears (lockstep dims keep equal sizes)
        decode.inference_config.dim_gears = {"input_ids": {0: gears}, "kv": {2: gears}}
        seq = prefill.inference_config.dim_gears["input_ids"][1]
        prefill.inference_config.dim_gears = {"input_ids": {0: gears, 1: seq}, "kv": {2: gears}}
    return prefill, decode


def one_start(args) -> dict:
    """One process's start: build the model, prefill, decode ``--new-tokens`` greedily, compare with eager."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    hf_config = small_llama_config()
    prefill_config, decode_config = load_configs(args.gears)
    model = CachedLlama(hf_config, prefill_config, decode_config, cache_dir=args.cache_dir).to(device).eval()
    layers, heads = hf_config.num_hidden_layers, hf_config.num_key_value_heads
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    prompt = torch.randint(1, hf_config.vocab_size, (args.batch, args.prompt_len), device=device)
    kv = torch.zeros(layers, 2, args.batch, heads, MAX_LEN, head_dim, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    report = {"device": device, "batch": args.batch, "prompt_len": args.prompt_len}
    with torch.inference_mode():
        if args.warmup:                         # compile (cold) or load (warm) every decode gear up front
            t0 = time.perf_counter()
            pos = torch.tensor([args.prompt_len], device=device)
            report["warmup_gears"] = model.cached_decode.warmup(prompt[:, :1], kv, pos)
            report["warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits, kv = model.cached_prefill(prompt, kv)
        sync()
        report["first_prefill_s"] = time.perf_counter() - t0
        tokens = [logits[:, -1].argmax(-1)]
        step_times = []
        for i in range(args.new_tokens - 1):
            pos = torch.tensor([args.prompt_len + i], device=device)
            t0 = time.perf_counter()
            logits, kv = model.cached_decode(tokens[-1][:, None], kv, pos)
            sync()
            step_times.append(time.perf_counter() - t0)
            tokens.append(logits[:, -1].argmax(-1))
        report["first_decode_s"] = step_times[0]
        report["decode_step_ms"] = 1e3 * sum(step_times[1:]) / max(1, len(step_times) - 1)
        generated = torch.stack(tokens, 1)
        # Eager reference: the plain HF model, whole sequence recomputed at every step, no cache, no padding.
        seq = prompt
        for _ in range(args.new_tokens):
            nxt = model.lm(input_ids=seq).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
        expected = seq[:, args.prompt_len:]
    report["tokens"] = generated.tolist()
    report["tokens_match_eager"] = torch.equal(generated, expected)
    report["counters"] = {k: v for k, v in vars(counters).items()}
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", help="gearcache store (default: a temp folder, removed afterwards)")
    p.add_argument("--gears", type=lambda s: [int(x) for x in s.split(",")],
                   help="batch gears for prefill and decode, e.g. 1,2,4 (default: those of configs/*.toml)")
    p.add_argument("--batch", type=int, default=3, help="sequences generated at once (default 3: padded to 4)")
    p.add_argument("--prompt-len", type=int, default=5, help="prompt length (default 5: padded to 8)")
    p.add_argument("--new-tokens", type=int, default=6, help="tokens to generate (default 6)")
    p.add_argument("--warmup", action="store_true", help="compile/load every decode gear before the first call")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args, label: str) -> dict:
    """One start in a fresh Python process, with empty Inductor and Triton caches of its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cache-dir", args.cache_dir,
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    if args.gears:
        cmd += ["--gears", ",".join(map(str, args.gears))]
    if args.warmup:
        cmd.append("--warmup")
    return run_fresh(cmd, label)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_start(args)))
        return 0
    cold, warm = cold_then_warm(run_child, args, "hf_llama", "gearcache + transformers LlamaForCausalLM")
    for label, r in (("cold start (trace + compile + publish)", cold), ("warm start (load from the store)", warm)):
        print(f"\n{label}, {r['device']}, fresh process, batch {r['batch']}, prompt {r['prompt_len']}:\n"
              f"  first prefill call {r['first_prefill_s']:7.3f} s   first decode call {r['first_decode_s']:7.3f} s\n"
              f"  decode step        {r['decode_step_ms']:7.3f} ms  whole process     {r['process_s']:7.1f} s\n"
              + counters_line(r) +
              f"  tokens {r['tokens']} {'==' if r['tokens_match_eager'] else '!='} eager")
    speedup = ((cold["first_prefill_s"] + cold["first_decode_s"]) / (warm["first_prefill_s"] + warm["first_decode_s"]))
    print(f"\nwarm start's first calls are {speedup:.1f}x faster than the cold start's")
    ok = cold["tokens_match_eager"] and warm["tokens_match_eager"] and warm["counters"]["compiles"] == 0 \
        and warm["counters"]["traces"] == 0 and cold["tokens"] == warm["tokens"]
    summary = {
        "example": "hf_llama", "ok": ok, "device": cold["device"],
        "tokens_match_eager": cold["tokens_match_eager"] and warm["tokens_match_eager"],
        "cold": start_summary(cold, "first_prefill_s", "first_decode_s"),
        "warm": start_summary(warm, "first_prefill_s", "first_decode_s"),
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
