"""gearcache on a Hugging Face ViT: a cached image classifier whose batch is served by gears.

    pip install -e ".[examples]"                      # transformers
    python examples/hf_vit.py                         # gears 1,2,4,8; a temp store, removed afterwards
    python examples/hf_vit.py --gears 2,4 --cache-dir /tmp/gc

A ``transformers.ViTForImageClassification`` built from a small ``ViTConfig`` (32x32 images, 8x8 patches, hidden 64,
2 layers; random weights, nothing downloaded) is wrapped in an ``nn.Module`` whose ``__init__`` does::

    config = CompilerConfig.from_file("configs/vision_batch.toml")     # gears by name: pixel_values dim 0
    self.cached_classify = cache_compile(self.classify, config=config)

(``gearcache.set_dim_gears(pixel_values, {0: [1, 2, 4, 8]})`` on the first call's tensor does the same without a
config.) ``warmup()`` compiles (cold start) or loads (warm start) every gear, then batches of 1 to the largest gear
are classified, each padded up to its gear and cut back, and compared with the eager HF model. Each start runs in a
fresh process; the example prints both starts' times and counters, and a JSON summary as its last line.
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


class CachedViT(torch.nn.Module):
    def __init__(self, hf_config, config: CompilerConfig, cache_dir: str | None = None):
        super().__init__()
        from transformers import ViTForImageClassification

        self.vit = ViTForImageClassification(hf_config)
        self.cached_classify = cache_compile(self.classify, config=config, cache_dir=cache_dir)

    def classify(self, pixel_values):         # [B, 3, 32, 32] -> logits [B, num_labels]
        return self.vit(pixel_values=pixel_values).logits


def small_vit_config():
    from transformers import ViTConfig

    return ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, num_labels=10)


def one_start(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = CompilerConfig.from_file(CONFIGS / "vision_batch.toml")
    config.inference_config.dim_gears = {"pixel_values": {0: args.gears}}
    model = CachedViT(small_vit_config(), config, cache_dir=args.cache_dir).to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    largest = max(args.gears)
    atol = 1e-4 if device == "cuda" else 1e-5
    report = {"device": device, "gears": args.gears}
    with torch.inference_mode():
        t0 = time.perf_counter()
        report["warmup_gears"] = model.cached_classify.warmup(torch.zeros(largest, 3, 32, 32, device=device))
        sync()
        report["warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.cached_classify(torch.randn(1, 3, 32, 32, device=device))
        sync()
        report["first_call_s"] = time.perf_counter() - t0
        predictions_match, max_diff, batches = True, 0.0, []
        for batch in range(1, largest + 1):
            images = torch.randn(batch, 3, 32, 32, device=device)
            got = model.cached_classify(images)
            want = model.vit(pixel_values=images).logits          # eager HF model, unpadded
            batches.append(batch)
            predictions_match &= got.shape == want.shape and torch.equal(got.argmax(-1), want.argmax(-1))
            max_diff = max(max_diff, (got - want).abs().max().item())
        report["batches"] = batches
        report["predictions_match_eager"] = bool(predictions_match)
        report["logits_close"] = max_diff <= atol
        report["max_abs_diff"] = max_diff
    report["counters"] = {k: v for k, v in vars(counters).items()}
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", help="gearcache store (default: a temp folder, removed afterwards)")
    p.add_argument("--gears", type=lambda s: sorted({int(x) for x in s.split(",")}), default=[1, 2, 4, 8],
                   help="batch gears (default 1,2,4,8); batches 1..largest gear are classified")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args, label: str) -> dict:
    """One start in a fresh Python process, with empty Inductor and Triton caches of its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cache-dir", args.cache_dir,
           "--gears", ",".join(map(str, args.gears))]
    return run_fresh(cmd, label)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_start(args)))
        return 0
    cold, warm = cold_then_warm(run_child, args, "hf_vit",
                                f"gearcache + transformers ViTForImageClassification, gears {args.gears}")
    for label, r in (("cold start (trace + compile + publish)", cold), ("warm start (load from the store)", warm)):
        print(f"\n{label}, {r['device']}, fresh process:\n"
              f"  warmup ({r['warmup_gears']} gears) {r['warmup_s']:7.3f} s   next call (batch 1) "
              f"{r['first_call_s'] * 1e3:7.3f} ms   whole process {r['process_s']:6.1f} s\n"
              + counters_line(r) +
              f"  batches {r['batches'][0]}..{r['batches'][-1]}: predictions "
              f"{'==' if r['predictions_match_eager'] else '!='} eager, max |logit diff| {r['max_abs_diff']:.2e}")
    print(f"\nwarm start's warmup is {cold['warmup_s'] / warm['warmup_s']:.1f}x faster than the cold start's")
    ok = all(r["predictions_match_eager"] and r["logits_close"] for r in (cold, warm)) \
        and warm["counters"]["compiles"] == 0 and warm["counters"]["traces"] == 0
    summary = {
        "example": "hf_vit", "ok": ok, "device": cold["device"], "gears": args.gears,
        "predictions_match_eager": cold["predictions_match_eager"] and warm["predictions_match_eager"],
        "cold": start_summary(cold, "warmup_s", "first_call_s"),
        "warm": start_summary(warm, "warmup_s", "first_call_s"),
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
