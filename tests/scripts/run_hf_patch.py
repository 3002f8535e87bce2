"""A tiny Llama served through ``integrations.transformers.enable`` while ``LlamaMLP.forward`` is patched on the class
(the Liger/Unsloth pattern), compared with eager ``generate()``. JSON report on the last line.

usage: run_hf_patch.py CACHE_DIR PHASE     (on $GEARCACHE_TEST_DEVICE, default cpu)

PHASE ``plain``: generate, unpatched. ``before``: patch, then ``enable()`` and generate. ``after``: enable, generate,
patch, generate again. Each ``generate()`` is compared with the same generate of an eager copy of the model (greedy
tokens and every step's logits).
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
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from gearcache import counters  # noqa: E402
from gearcache.integrations.transformers import enable  # noqa: E402


def patched_forward(self, x):
    """A fused-style replacement: the same MLP, scaled (so that a stale entry shows)."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 1.5


def generate(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         cache_implementation="static", pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True)
    return out.sequences, torch.stack(out.logits)


def compared(model, twin, ids):
    with torch.inference_mode():
        tokens, logits = generate(model, ids)
        want_tokens, want_logits = generate(twin, ids)
    return {"tokens_equal": bool(torch.equal(tokens, want_tokens)),
            "max_logits_diff": float((logits - want_logits).abs().max())}


def main():
    cache_dir, phase = sys.argv[1:3]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    device = os.environ.get("GEARCACHE_TEST_DEVICE", "cpu")
    model = LlamaForCausalLM(config).eval().to(device)
    twin = copy.deepcopy(model)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]], device=device)
    if phase == "before":
        modeling_llama.LlamaMLP.forward = patched_forward
    enable(model, cache_dir=cache_dir)
    report = {"first": compared(model, twin, ids), "first_counters": dict(vars(counters))}
    if phase == "after":
        modeling_llama.LlamaMLP.forward = patched_forward
        report["second"] = compared(model, twin, ids)
    report["counters"] = dict(vars(counters))
    report["hooks"] = dict(compile_hooks.COUNTS)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
