"""A tiny Llama served through ``enable(model, regions="blocks")``, compared with eager ``generate()``: tokens, every
step's logits, and every cache layer's keys, values and position counter. JSON report on the last line.

usage: run_hf_regions.py CACHE_DIR LAYERS [patched] [mixing] [batchmix] [fullmask] [rows=N] [whole] [mistral]
                         [corpus=NAME]

``patched``: ``LlamaMLP.forward`` patched on the class before ``enable()``; ``mixing``: patched to add the mean over
the call's positions (not causal: a padded prompt changes it), a refusal reported as ``refused``; ``batchmix``:
the mean over the batch's rows instead; ``fullmask``: ``LlamaAttention.forward`` patched to attend with a full mask
(every key); ``rows=N``: N prompts in a batch (default 1); ``whole``:
``regions="whole"``; ``mistral``: a Mistral model of the same
dimensions (its decoder layer has the same weights' layout as Llama's); ``corpus=NAME``: benchmarks/corpus.py's tiny
model NAME instead (``gemma3``: sliding and full attention layers of one class; LAYERS is then ignored).
"""
import gc
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compile_hooks  # noqa: E402

compile_hooks.install()
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, StaticCache  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from gearcache import counters  # noqa: E402
from gearcache.errors import GearcacheError  # noqa: E402
from gearcache.integrations.transformers import enable  # noqa: E402


def patched_forward(self, x):
    """The same MLP, scaled (so that a stale entry shows)."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 1.5


def mixing_forward(self, x):
    """The MLP plus the mean over the call's positions: every position reads every other, later ones and pads too."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) + x.mean(1, keepdim=True)


def batch_mixing_forward(self, x):
    """The MLP plus the mean over the batch's rows: every row reads every other, padded rows too."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) + x.mean(0, keepdim=True)


ATTENTION_FORWARD = modeling_llama.LlamaAttention.forward


def full_mask_forward(self, *args, **kwargs):
    """The attention with a full mask (every key, later ones and pads too): not causal."""
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
    return ATTENTION_FORWARD(self, *args, **kwargs)


def generate(model, ids, cache):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         past_key_values=cache, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


def caches_diff(a, b):
    diff, lengths = 0.0, []
    from transformers.cache_utils import StaticSlidingWindowLayer

    for x, y in zip(a.layers, b.layers):
        if isinstance(y, StaticSlidingWindowLayer):     # eager keeps the window only (a ring): not comparable
            continue
        n = y.keys.shape[2]
        for mine, theirs in ((x.keys[:, :, :n], y.keys), (x.values[:, :, :n], y.values)):
            diff = max(diff, float((mine - theirs).abs().max()))
        lengths.append([int(x.cumulative_length), int(y.cumulative_length)])
    return diff, lengths


def main():
    cache_dir, layers, *flags = sys.argv[1:]
    torch.manual_seed(0)
    kind = (MistralConfig, MistralForCausalLM) if "mistral" in flags else (LlamaConfig, LlamaForCausalLM)
    config = kind[0](vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=int(layers),
                     num_attention_heads=2, num_key_value_heads=2)
    model = kind[1](config).eval()
    named = [f.split("=", 1)[1] for f in flags if f.startswith("corpus=")]
    if named:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                        "benchmarks"))
        import corpus

        model = corpus.CORPUS[named[0]].build("tiny").eval()
        config = model.config
    twin = copy.deepcopy(model)
    if "patched" in flags:
        modeling_llama.LlamaMLP.forward = patched_forward
    if "mixing" in flags:
        modeling_llama.LlamaMLP.forward = mixing_forward
    if "batchmix" in flags:
        modeling_llama.LlamaMLP.forward = batch_mixing_forward
    if "fullmask" in flags:
        modeling_llama.LlamaAttention.forward = full_mask_forward
    rows = int(next((f.split("=", 1)[1] for f in flags if f.startswith("rows=")), 1))
    served = enable(model, cache_dir=cache_dir, regions="whole" if "whole" in flags else "blocks")
    report = {"runs": []}
    for length in (6, 20):
        ids = torch.randint(1, 64, (rows, length), generator=torch.Generator().manual_seed(length))
        caches = [StaticCache(config=config, max_cache_len=32) for _ in range(2)]
        with torch.inference_mode():
            try:
                tokens, logits = generate(model, ids, caches[0])
            except GearcacheError as exc:
                print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
                return
            want_tokens, want_logits = generate(twin, ids, caches[1])
        cache_diff, lengths = caches_diff(caches[0], caches[1])
        report["runs"].append({"tokens_equal": bool(torch.equal(tokens, want_tokens)),
                               "max_logits_diff": float((logits - want_logits).abs().max()),
                               "cache_diff": cache_diff, "lengths_equal": all(a == b for a, b in lengths)})
    report["entries"] = [cf.entries for cf in served.regions] if served.layers else [served.cached_step.entries]
    report["padding_refused"] = served.padding_refused
    report["padded_calls"] = served.padded_calls
    report["counters"] = dict(vars(counters))
    report["hooks"] = dict(compile_hooks.COUNTS)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
