"""bf16-true against bf16 mixed precision: the loss of a small language model after 500 steps,
for each way the fp32 step can round back to bf16 ([Note: bf16-true's step] in
engine/rounding.py), and the step time of each, in one run.

    .venv/bin/python benchmarks/bf16_true.py                 # 500 steps, every variant
    .venv/bin/python benchmarks/bf16_true.py --steps 100

The model: a 2-block GPT (width 128, 4 heads, context 64; 0.43M parameters) over the characters
of this repository's README.md and docs/ (embedded data: nothing downloaded), AdamW at a peak
learning rate of 3e-4 with 50 warm-up steps and a cosine decay to 3e-5, batch 16 x 64
tokens, one process (px.prepare at a world of one runs the same engine and step), one thread.
Variants: precision="bf16" (fp32 masters and state), and precision="bf16-true" rounding back
stochastically (px.prepare's), to nearest, and with a compensation buffer (Kahan). Every
variant sees the same batches from the same initial weights. Reported: the mean training loss
of the last 50 steps, its ratio to bf16 mixed's, the optimizer's bytes per parameter (masters,
state, compensation), and the median step time.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import engine_of

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, WIDTH, HEADS, BLOCKS, BATCH = 64, 128, 4, 2, 16


def corpus() -> tuple[torch.Tensor, int]:
    text = "\n".join(p.read_text() for p in [ROOT / "README.md",
                                            *sorted((ROOT / "docs").rglob("*.md"))])
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lr_at(step: int, steps: int, peak=3e-4, floor=3e-5, warmup=50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def run(variant: str, tokens: torch.Tensor, vocab: int, steps: int):
    torch.manual_seed(0)
    model = GPT(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    precision = "bf16" if variant == "bf16 mixed" else "bf16-true"
    model, opt = px.prepare(model, opt, precision=precision)
    if precision == "bf16-true":
        engine_of(model).optim.round_by(variant.split()[-1])
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(steps):
        starts = torch.randint(0, tokens.numel() - CONTEXT - 1, (BATCH,), generator=g)
        x = torch.stack([tokens[s:s + CONTEXT] for s in starts])
        y = torch.stack([tokens[s + 1:s + CONTEXT + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    n = sum(p.numel() for p in px.unwrap(model).parameters())
    held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    engine = engine_of(model)
    masters = sum(u.master.numel() * u.master.element_size() for u in engine.units
                  if not u.master_is_view) if precision == "bf16" else 0
    lost = engine.optim.compensation
    extra = sum(t.numel() * t.element_size() for t in lost.lost.values()) if lost else 0
    return statistics.fmean(losses[-50:]), (held + masters + extra) / n, statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    px.init()
    tokens, vocab = corpus()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"CPU ({cpu}), 1 thread, torch {torch.__version__}; {args.steps} steps, "
          f"{tokens.numel()} characters, vocabulary {vocab}")
    print("| variant | loss (last 50 steps) | / bf16 mixed | optimizer bytes per parameter "
          "| median step |")
    print("|---|---|---|---|---|")
    base = None
    for variant in ("bf16 mixed", "bf16-true stochastic", "bf16-true nearest",
                    "bf16-true kahan"):
        loss, per_param, step_s = run(variant, tokens, vocab, args.steps)
        base = base or loss
        print(f"| {variant} | {loss:.4f} | {loss / base:.4f} | {per_param:.1f} | "
              f"{step_s * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
