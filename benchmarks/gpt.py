"""A GPT of nanoGPT's shape (karpathy/nanoGPT model.py: pre-norm blocks, causal attention through
scaled_dot_product_attention, tied input and output embeddings), for the benchmarks.

    GPT2_124M   n_layer 12, n_head 12, n_embd 768, vocab 50304, block 1024 (124M parameters)
    SMALL       n_layer 6, n_head 6, n_embd 384, vocab 50304, block 256 (about 30M)
    TINY        n_layer 2, n_head 2, n_embd 64, vocab 512, block 64 (checks on a CPU)

`tokens(config, batch, seed)` makes a batch of random token ids, the inputs and the targets
shifted by one, the same on every rank for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_head: int
    n_embd: int
    vocab: int
    block: int


GPT2_124M = Config(12, 12, 768, 50304, 1024)
SMALL = Config(6, 6, 384, 50304, 256)
TINY = Config(2, 2, 64, 512, 64)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.fc, self.proj = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.c.n_head, C // self.c.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.wte, self.wpe = nn.Embedding(c.vocab, c.n_embd), nn.Embedding(c.block, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def tokens(c: Config, batch: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, c.vocab, (batch, c.block + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(c: Config) -> float:
    """Training FLOPs per token, 6N plus attention (Chinchilla's approximation)."""
    n = 12 * c.n_layer * c.n_embd ** 2 + c.vocab * c.n_embd
    return 6 * n + 12 * c.n_layer * c.n_embd * c.block


__all__ = ["Config", "GPT", "GPT2_124M", "SMALL", "TINY", "tokens", "n_params",
           "flops_per_token"]
