"""A plain decoder-only transformer built from a `TransformerShape`.

It exists so that the planner's arithmetic can be checked against something real: the tests
build it from a config and measure what autograd saves, and the plan-vs-measured benchmark
trains it. Its parameters are exactly `TransformerShape.param_shapes()` and its attention is
written out (no fused kernel), so it saves exactly the tensors of [Note: Activation formula]
in transformer.py. Positions are learned when the shape says so and absent otherwise (rotary
embeddings add no parameters and are left out).

It is also the module a config stands for where the layout of modules matters: zero3's roots
(which units are gathered together, and which stay gathered from forward into backward) are
the engine's own on it, built on the meta device (`on_meta`, read by layout.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .finetune import add_lora
from .transformer import TransformerShape

__all__ = ["ReferenceTransformer", "Block", "PROJECTIONS", "on_meta"]


class Attention(nn.Module):
    def __init__(self, s: TransformerShape, dropout: float, attention: str = "eager"):
        super().__init__()
        self.attention = attention
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.q = nn.Linear(s.hidden, s.hidden, bias=s.bias)
        self.k = nn.Linear(s.hidden, s.kv_hidden, bias=s.bias)
        self.v = nn.Linear(s.hidden, s.kv_hidden, bias=s.bias)
        self.out = nn.Linear(s.hidden, s.hidden, bias=s.bias)
        self.dropout = dropout

    def forward(self, x, causal):
        b, t, h = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.attention == "sdpa":  # a fused kernel (flash attention where available)
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
                enable_gqa=self.kv_heads != self.heads)
            return self.out(y.transpose(1, 2).reshape(b, t, h))
        if self.kv_heads != self.heads:  # grouped-query attention: share each k/v head
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        y = (probs @ v).transpose(1, 2).reshape(b, t, h)
        return self.out(y)


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, s: TransformerShape, attn_dropout: float, hidden_dropout: float,
                 attention: str = "eager"):
        super().__init__()
        # registered in the order Hugging Face's layers register theirs (it decides the
        # engine's units, so a config is planned as its model is trained): GPT-2's each norm
        # before what it feeds, Llama's (gated) attention, then MLP, then both norms
        self.gated = s.gated_mlp
        if not self.gated:
            self.norm1 = nn.LayerNorm(s.hidden, bias=s.bias)
        self.attn = Attention(s, attn_dropout, attention)
        if not self.gated:
            self.norm2 = nn.LayerNorm(s.hidden, bias=s.bias)
        if self.gated:
            self.gate = nn.Linear(s.hidden, s.intermediate, bias=s.bias)
        self.up = nn.Linear(s.hidden, s.intermediate, bias=s.bias)
        self.down = nn.Linear(s.intermediate, s.hidden, bias=s.bias)
        if self.gated:
            self.norm1 = nn.LayerNorm(s.hidden, bias=s.bias)
            self.norm2 = nn.LayerNorm(s.hidden, bias=s.bias)
        self.hidden_dropout = hidden_dropout

    def mlp(self, x):
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))

    def forward(self, x, causal):
        x = x + F.dropout(self.attn(self.norm1(x), causal), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.hidden_dropout, self.training)


class ReferenceTransformer(nn.Module):
    """`model(ids) -> logits`; `model.loss(ids, targets)` is the mean cross-entropy.

    `attention="eager"` writes attention out (softmax over an s x s matrix); "sdpa" uses
    `F.scaled_dot_product_attention`, whose kernels keep no s x s matrix."""

    def __init__(self, s: TransformerShape, dropout: float = 0.1, attention: str = "eager"):
        super().__init__()
        self.shape = s
        attn_p = dropout if s.attn_dropout else 0.0
        hidden_p = dropout if s.hidden_dropout else 0.0
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.positions = (nn.Embedding(s.learned_positions, s.hidden)
                          if s.learned_positions else None)
        self.blocks = nn.ModuleList(Block(s, attn_p, hidden_p, attention) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.hidden, bias=s.bias)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied_embeddings:
            self.head.weight = self.embed.weight
        self.hidden_dropout = hidden_p

    def forward(self, ids):
        x = self.embed(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        x = F.dropout(x, self.hidden_dropout, self.training)
        # One causal mask for all layers (True above the diagonal: future positions).
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        for block in self.blocks:
            x = block(x, causal)
        return self.head(self.norm(x))

    def loss(self, ids, targets):
        logits = self(ids)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def example_input(self, batch_size: int, seq_len: int):
        """What the planner's traced forward feeds the model (see trace.py)."""
        return (torch.zeros(batch_size, seq_len, dtype=torch.long,
                            device=self.embed.weight.device),)


# A Llama-style block's projections by their Hugging Face names (finetune.py's LoRA targets on a
# config), and where the reference model keeps each.
PROJECTIONS = {"q_proj": "attn.q", "k_proj": "attn.k", "v_proj": "attn.v", "o_proj": "attn.out",
               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def on_meta(s: TransformerShape, lora: tuple[int, tuple[str, ...]] | None = None) -> nn.Module:
    """The reference model of `s` on the meta device (no memory), with LoRA adapters of rank
    `lora[0]` beside the projections `lora[1]` names (Hugging Face names, as a config's LoRA
    takes them: finetune.py), the rest frozen."""
    with torch.device("meta"):
        model = ReferenceTransformer(s, dropout=0.0)
    if lora is not None:
        rank, targets = lora
        add_lora(model, rank, tuple(PROJECTIONS[t] for t in targets))
    return model
