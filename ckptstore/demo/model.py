"""A small byte-level decoder-only transformer (GPT-style, pre-LayerNorm, learned positions)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        # dropout draws from the torch RNG, so resuming bit-exactly needs the RNG state restored
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        x = x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)
        return x


class ByteGPT(nn.Module):
    VOCAB = 256

    def __init__(self, layers: int = 4, d_model: int = 256, heads: int = 4, context: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(self.VOCAB, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, self.VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
