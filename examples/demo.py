"""gearcache demo: a fresh process compiles (cold start), a second fresh process loads (warm start).

    python examples/demo.py            # default store: $GEARCACHE_HOME or ./.gearcache
    python examples/demo.py --small    # a smaller model (quicker compiles); --json: a JSON summary as the last line

Each start runs in its own Python process, as a real server restart would. The demo first removes its own entries
(and only those) from the store, and gives each start empty Inductor and Triton caches of its own
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` pointed at fresh temporary folders): the cold start is cold on
every run, and the warm start loads from gearcache's store alone.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gearcache import cache_compile, counters


class TinyGPT(nn.Module):
    """A two-layer decoder with separate prefill and decode entry points."""

    def __init__(self, vocab=1000, d=256, heads=4, layers=2, tmax=64):
        super().__init__()
        self.heads, self.tmax = heads, tmax
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(tmax, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                 for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.cached_prefill = cache_compile(self.prefill)
        self.cached_decode = cache_compile(self.decode)

    def _attend(self, i, h, kv, pos):
        b, t, d = h.shape
        q, k, v = self.qkv[i](h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        kc, vc = kv[i, 0].index_copy(2, pos, k), kv[i, 1].index_copy(2, pos, v)
        mask = torch.arange(self.tmax, device=h.device)[None, :] <= pos[:, None]
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        h = h + y.transpose(1, 2).reshape(b, t, d)
        return h + self.mlp[i](h), torch.stack([kc, vc])

    def _run(self, ids, kv, pos):
        h = self.wte(ids) + self.wpe(pos)
        new = []
        for i in range(len(self.qkv)):
            h, layer_kv = self._attend(i, h, kv, pos)
            new.append(layer_kv)
        return self.head(h), torch.stack(new)

    def prefill(self, ids, kv, pos):       # ids [B, T], pos [T]
        return self._run(ids, kv, pos)

    def decode(self, ids, kv, pos):        # ids [B, 1], pos [1]
        return self._run(ids, kv, pos)


SMALL = {"vocab": 64, "d": 32, "heads": 2, "layers": 1, "tmax": 48}      # --small
TORCH_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def one_start(small: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    caches = {name: os.environ.get(name) for name in TORCH_CACHES}
    empty = all(path and not (os.path.isdir(path) and os.listdir(path)) for path in caches.values())
    torch.manual_seed(0)
    size = SMALL if small else {}
    model = TinyGPT(**size).to(device).eval()
    layers, heads, d, tmax = len(model.qkv), model.heads, model.head.in_features, model.tmax
    kv = torch.zeros(layers, 2, 1, heads, tmax, d // heads, device=device)
    prompt = torch.randint(0, model.head.out_features, (1, 8), device=device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, kv = model.cached_prefill(prompt, kv, torch.arange(8, device=device))
        first_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        nxt = logits[:, -1:].argmax(-1)
        logits, kv = model.cached_decode(nxt, kv, torch.tensor([8], device=device))
        first_decode = time.perf_counter() - t0
        ref, _ = model.decode(nxt, kv, torch.tensor([8], device=device))
        t0 = time.perf_counter()
        for step in range(9, 41):
            nxt = logits[:, -1:].argmax(-1)
            logits, kv = model.cached_decode(nxt, kv, torch.tensor([step], device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / 32
    return {"device": device, "first_prefill_s": first_prefill, "first_decode_s": first_decode,
            "decode_step_ms": per_step * 1e3, "compiles": counters.compiles, "loads": counters.loads,
            "traces": counters.traces, "torch_caches": {**caches, "empty_at_start": empty}}


def remove_demo_entries(root: str) -> None:
    """Delete this demo's entry manifests and the artifacts they name; nothing else in the store."""
    import shutil

    entries = os.path.join(root, "entries")
    for dirpath, _, files in os.walk(entries) if os.path.isdir(entries) else []:
        if ".TinyGPT." not in os.path.basename(dirpath):
            continue
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                with open(path) as f:
                    akey = json.load(f)["akey"]
                shutil.rmtree(os.path.join(root, "artifacts", akey), ignore_errors=True)
            except (OSError, ValueError, KeyError):
                pass
            os.remove(path)


def start(small: bool) -> dict:
    """Run one start in a fresh process with empty Inductor and Triton caches of its own; its report."""
    with tempfile.TemporaryDirectory(prefix="gearcache-demo-torch-caches-") as folder:
        env = {**os.environ, **{name: os.path.join(folder, name.lower()) for name in TORCH_CACHES}}
        args = [sys.executable, __file__, "--child"] + (["--small"] if small else [])
        out = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    small = "--small" in sys.argv
    if "--child" in sys.argv:
        print(json.dumps(one_start(small)))
        return
    root = os.environ.get("GEARCACHE_HOME") or ".gearcache"
    remove_demo_entries(root)
    print(f"gearcache demo, store: {os.path.abspath(root)}")
    results = []
    for label in ("cold start (trace + compile + publish)", "warm start (load from the store)"):
        t0 = time.perf_counter()
        r = start(small)
        r["process_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"\n{label}, {r['device']}, fresh process:\n"
              f"  first prefill call {r['first_prefill_s']:7.3f} s   first decode call {r['first_decode_s']:7.3f} s\n"
              f"  decode step        {r['decode_step_ms']:7.3f} ms  whole process     {r['process_s']:7.1f} s\n"
              f"  traced {r['traces']}, compiled {r['compiles']}, loaded {r['loads']} entries "
              f"(empty Inductor and Triton caches of its own)")
    cold, warm = results
    speedup = (cold["first_prefill_s"] + cold["first_decode_s"]) / (warm["first_prefill_s"] + warm["first_decode_s"])
    print(f"\nwarm start's first calls are {speedup:.1f}x faster than the cold start's")
    if "--json" in sys.argv:
        print(json.dumps({"cold": cold, "warm": warm, "speedup": speedup}))


if __name__ == "__main__":
    main()
