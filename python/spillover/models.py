"""A small GPT-style model for the demo, the tests and the benches (no downloads).

Two kinds of attention, chosen by ``GPTConfig.attn``:

- ``"explicit"`` (the default): written out, ``softmax(q kᵀ / √d) v``, so the s×s scores are
  materialised and saved, as in the models whose activation memory spillover exists to cut.
- ``"sdpa"``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, what Hugging Face
  models use by default. A fused kernel where one exists (flash / memory-efficient on CUDA,
  flash on CPU): it saves q, k, v, the output and the row statistics, never the s×s scores,
  so there is far less to recompute or offload per block.

A value other than these two raises ``ValueError`` when the model is built.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ATTENTION_KINDS", "GPTConfig", "GPT", "Block", "synthetic_batch"]

ATTENTION_KINDS = ("explicit", "sdpa")


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 512
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    seq: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    attn: str = "explicit"  # one of ATTENTION_KINDS
    # head + loss through torch's chunked linear_cross_entropy (spillover.loss): no
    # tokens x vocab logits in training. Off by default: the plain model computes its logits
    # as users' models do; spillover.wrap turns it on (GPT.spillover_chunked_loss, the
    # switch spillover.loss.FlagRegion sets) unless wrap(chunked_loss=False).
    chunked_loss: bool = False

    def __post_init__(self) -> None:
        if self.attn not in ATTENTION_KINDS:
            raise ValueError(f"GPTConfig.attn: unknown attention kind {self.attn!r}; choose "
                             f"from {', '.join(map(repr, ATTENTION_KINDS))}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.kind = cfg.attn
        if self.kind == "explicit":
            mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril()
            self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
            return self.proj(y.transpose(1, 2).reshape(b, s, d))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        scores = scores.masked_fill(~self.causal[:s, :s], float("-inf"))
        att = F.softmax(scores, dim=-1)
        att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Optional[GPTConfig] = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # read by forward; spillover.wrap sets it (spillover.loss.FLAG)
        self.spillover_chunked_loss = cfg.chunked_loss

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` is given (with
        ``spillover_chunked_loss``, from ``cfg.chunked_loss`` and set by ``spillover.wrap``,
        computed without the logits: ``spillover.loss``)."""
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        # compiled, the plain loss, as spillover.loss.LossRegion leaves a compiled HF forward:
        # torch's chunked op breaks the graph
        if targets is not None and self.spillover_chunked_loss \
                and not torch.compiler.is_compiling():
            from .loss import chunked_cross_entropy

            return chunked_cross_entropy(x, self.head.weight, targets)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(
    cfg: GPTConfig, batch: int, device: torch.device | str = "cpu", seed: int = 0
) -> tuple:
    """Token ids and next-token targets drawn from a fixed generator (reproducible)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)
