"""Prepare a model, train two steps, and end: with `px.shutdown()`, or, with `--no-shutdown`,
by simply returning (a script that forgets it). Every rank prints `CLEAN rank=R` last."""

import sys

import torch
import torch.nn as nn

import phalanx as px

px.init()
strategy = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "ddp"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = px.prepare(model, opt, strategy=strategy)
for _ in range(2):
    x = torch.randn(8, 32)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
rank = px.rank()
if "--no-shutdown" not in sys.argv:
    px.shutdown()
print(f"CLEAN rank={rank}", flush=True)
