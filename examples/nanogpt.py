"""A nanoGPT-style character model in plain PyTorch, trained on real text (the source of
Python's own textwrap module): what `precision-tool torch-run -- python examples/nanogpt.py`
runs unchanged. Nothing here knows about precision_tool.

    python examples/nanogpt.py [--steps 4] [--plant unscaled-attention|rmsnorm-eps]
                               [--init-scale 32768]

--plant puts in a precision fault for the tool to find: attention scores left unscaled
(q·k of a wide head over unnormalised activations passes fp16's 65504), or an RMSNorm whose epsilon and squares are read
in fp16 (tiny activations square to zero, and 1e-8 is zero in fp16 too: 1/sqrt(0))."""
import argparse
import inspect
import math
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-8):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    def __init__(self, d, heads, scaled=True):
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.scaled:                       # before the product, as fp16 kernels scale
            q = q / math.sqrt(q.shape[-1])
        att = q @ k.transpose(-2, -1)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads, norm, scaled):
        super().__init__()
        # unscaled, the attention also reads the residual stream unnormalised (as post-norm
        # blocks do): its scores grow with the activations
        self.norm1, self.attn = norm(d) if scaled else nn.Identity(), Attention(d, heads, scaled)
        self.norm2 = norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, d=32, heads=2, layers=2, norm=nn.LayerNorm, scaled=True,
                 embed_std=0.02):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        nn.init.normal_(self.tok.weight, std=embed_std)
        nn.init.normal_(self.pos.weight, std=embed_std)
        self.blocks = nn.ModuleList(Block(d, heads, norm, scaled) for _ in range(layers))
        self.norm, self.head = norm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--plant", choices=["unscaled-attention", "rmsnorm-eps"], default=None)
    ap.add_argument("--init-scale", type=float, default=2.0 ** 15,
                    help="GradScaler's first loss scale")
    args = ap.parse_args()
    text = inspect.getsource(textwrap)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    block, batch = 32, 8
    if args.plant == "unscaled-attention":     # wide heads of large activations
        model = GPT(len(chars), block, d=64, heads=1, scaled=False, embed_std=40.0)
    elif args.plant == "rmsnorm-eps":          # activations of 1e-4: their squares flush
        model = GPT(len(chars), block, norm=RMSNorm, embed_std=1e-4)
    else:
        model = GPT(len(chars), block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        start = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in start.tolist()])
        y = torch.stack([data[s + 1:s + block + 1] for s in start.tolist()])
        loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
