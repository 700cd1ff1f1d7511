"""The GPU bench's model (bench.py's activation modes): a Llama-style decoder (RMSNorm, RoPE,
SwiGLU MLP, fused attention), its head and loss written out, with torch's checkpointing per
layer behind ``ckpt`` and spillover's chunked loss behind ``chunked_loss``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q1, q2 = q.chunk(2, dim=-1)
    return torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.ckpt = False
        #: the head and loss by spillover's chunked loss (no logits: spillover.loss), in place of
        #: ``F.cross_entropy`` on the fp32 logits
        self.chunked_loss = False

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        dt = self.embed.weight.dtype
        cos, sin = self.cos[:s].to(dt), self.sin[:s].to(dt)
        x = self.embed(idx)
        for layer in self.layers:
            if self.ckpt:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        if self.chunked_loss:
            from spillover.loss import chunked_cross_entropy

            return chunked_cross_entropy(self.norm(x), self.head.weight, tgt)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
