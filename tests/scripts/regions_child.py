"""A model of repeated blocks of two kinds served by ``compile_blocks``: prints its outputs' agreement with eager and
the counters as JSON. ``argv``: store folder, then "patched" to run with ``Mlp.forward`` changed after import."""
import gc
import json
import sys

import torch

from gearcache import compile_blocks, counters


class Mlp(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Attn(torch.nn.Module):
    """A block with state written in place: a KV-like buffer passed by the caller and a call counter of its own."""
    def __init__(self, d):
        super().__init__()
        self.norm, self.qkv, self.mlp = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), Mlp(d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, kv):
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        kv[0].copy_(k)
        kv[1].copy_(v)
        self.calls.add_(1)
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return x + y + self.mlp(x + y)


class Gated(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate, self.mlp = torch.nn.Linear(d, d), Mlp(d)

    def forward(self, x):
        return x + torch.sigmoid(self.gate(x)) * self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.embed = torch.nn.Linear(d, d)
        self.attn = torch.nn.ModuleList(Attn(d) for _ in range(n))
        self.gated = torch.nn.ModuleList(Gated(d) for _ in range(2))

    def forward(self, x, kvs):
        h = self.embed(x)
        for i, block in enumerate(self.attn):
            h = block(h, kvs[i]) * 0.5          # glue between blocks: eager
        for block in self.gated:
            h = block(h)
        return h


def patched_forward(self, x):
    return self.down(torch.nn.functional.gelu(self.up(x)))


def main():
    store = sys.argv[1]
    if "patched" in sys.argv[2:]:
        Mlp.forward = patched_forward
    torch.manual_seed(0)
    model, reference = Net().eval(), Net().eval()
    reference.load_state_dict(model.state_dict())
    regions = compile_blocks(model, cache_dir=store)
    before = counters.snapshot()
    same, diffs = True, []
    for rows in (4, 7):
        x = torch.randn(2, rows, 16)
        kvs, kvs_ref = torch.zeros(3, 2, 2, rows, 16), torch.zeros(3, 2, 2, rows, 16)
        with torch.inference_mode():
            for _ in range(2):
                out, want = model(x, kvs), reference(x, kvs_ref)
                diffs.append([(out - want).abs().max().item(), (kvs - kvs_ref).abs().max().item()])
                same &= torch.allclose(out, want, atol=1e-5, rtol=1e-5) and torch.allclose(kvs, kvs_ref, atol=1e-5)
    calls = [int(a.calls) for a in model.attn]
    same &= calls == [int(b.calls) for b in reference.attn]
    delta = counters.delta(before)
    print(json.dumps({"same": bool(same), "kinds": len(regions.kinds), "blocks": len(regions.blocks),
                      "compiles": delta["compiles"], "traces": delta["traces"], "loads": delta["loads"],
                      "entries": sum(cf.entries for cf in regions.cached), "diffs": diffs, "calls": calls}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
