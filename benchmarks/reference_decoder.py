"""Small GPT decoder used to measure the anchors (copied from the project's shared/reference/decoder.py)."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, L, V, TMAX = (int(os.environ.get(k, d)) for k, d in
                    (("A_D", 1024), ("A_H", 16), ("A_L", 8), ("A_V", 32000), ("A_TMAX", 256)))

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.fc1, s.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    def forward(s, x, kv, pos):
        B, T, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        kc = kv[0].index_copy(2, pos, k)
        vc = kv[1].index_copy(2, pos, v)
        mask = (torch.arange(kc.shape[2], device=x.device) <= pos)[None, :]
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, D))
        x = x + s.fc2(F.gelu(s.fc1(s.ln2(x))))
        return x, torch.stack([kc, vc])

class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, D), nn.Embedding(TMAX, D)
        s.blocks = nn.ModuleList([Block() for _ in range(L)])
        s.ln_f = nn.LayerNorm(D)
        s.head = nn.Linear(D, V, bias=False)
    def decode(s, x, kv, pos):  # x [B,1] ids, kv [L,2,B,H,TMAX,hd], pos [1]
        h = s.wte(x) + s.wpe(pos)
        kvs = []
        for i, b in enumerate(s.blocks):
            h, nkv = b(h, kv[i], pos)
            kvs.append(nkv)
        return s.head(s.ln_f(h)), torch.stack(kvs)

def make(dev="cuda", dtype=torch.bfloat16):
    torch.manual_seed(0)
    return GPT().to(dev, dtype).eval()

def inputs(B, dev="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(B)
    x = torch.randint(0, V, (B, 1), generator=g).to(dev)
    kv = torch.randn(L, 2, B, H, TMAX, D // H, generator=g).to(dev, dtype)
    return x, kv, torch.tensor([17], device=dev)
