"""Run one corpus model's workload (benchmarks/corpus.py) through gearcache; print a JSON report on the last line.

usage: run_corpus_model.py MODEL CACHE_DIR [--hooks] [--cuda-graphs] [--background]
--hooks: counters on the compiler entry points (compile_hooks.py), and 3 module hooks registered first.
--cuda-graphs: on the GPU, served with mode="reduce-overhead" (a CUDA graph per gear).
--background: on_new_signature="background" (gearcache/compiling/background.py): the workload runs eagerly while its
entries
compile in a worker; then the compiles are waited for and the workload runs again, compiled ("again_*" keys).
Causal LMs also generate once more with a StaticCache of the user's (another length, the same gears: no new entry).
"""
import gc
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "benchmarks"))
if "--hooks" in sys.argv:
    import compile_hooks

    compile_hooks.install()
import torch

if "--hooks" in sys.argv:     # a warm process that registered more hooks than the cold one before enable(): a hook's
    _others = [torch.nn.Identity().register_forward_hook(lambda *a: None) for _ in range(3)]   # key is no guard

import corpus
from gearcache import CompilerConfig, counters, wait_for_background_compiles
from gearcache.integrations import hf_compat

name, cache_dir = sys.argv[1], sys.argv[2]
device, options = "cpu", {}
if "--cuda-graphs" in sys.argv:
    device, options["mode"] = "cuda", "reduce-overhead"
if "--background" in sys.argv:
    options["on_new_signature"] = "background"
config = CompilerConfig(**options) if options else None
w = corpus.workload(name, "tiny", device, torch.float32, cache_dir, config)
outputs, _ = corpus.run_workload(w, cached=True, device=device)
report = {"model": name, "entries_first_calls": sum(w.first)}
report["counters"] = {k: v for k, v in vars(counters).items()}      # before any eager reference work
if "--hooks" in sys.argv:
    report["hooks"] = dict(compile_hooks.COUNTS)
with torch.inference_mode():
    report["max_abs_diff"] = corpus.max_abs_diff(outputs, w.reference())
    report.update(w.check(outputs))
    if "prompts" in w.objects:
        from transformers import StaticCache

        o = w.objects
        cache = StaticCache(config=o["lm"].config, max_cache_len=corpus.PROMPT_LEN + corpus.NEW_TOKENS + 3)
        keyword = hf_compat.cache_keyword(o["lm"])          # cache (transformers 5.24) or past_key_values (5.17)
        again = o["lm"].generate(o["prompts"][0], attention_mask=o["masks"][0], **{keyword: cache}, pad_token_id=0,
                                 max_new_tokens=corpus.NEW_TOKENS, do_sample=False)
        report["second_cache_tokens"] = again[:, corpus.PROMPT_LEN:].tolist()
        report["counters_after_second_cache"] = {k: v for k, v in vars(counters).items()}
if "--background" in sys.argv:       # the same model and caches again, once the compiles are loaded
    report["settled"] = wait_for_background_compiles()
    outputs_again, _ = corpus.run_workload(w, cached=True, device=device)
    report["again_counters"] = {k: v for k, v in vars(counters).items()}
    with torch.inference_mode():
        report["again_max_abs_diff"] = corpus.max_abs_diff(outputs_again, w.reference())
        report["again"] = w.check(outputs_again)
print(json.dumps(report))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
