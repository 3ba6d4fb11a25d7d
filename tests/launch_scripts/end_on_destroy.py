"""The shortest script that ends as torch DDP scripts end: `phalanx run -n 2 end_on_destroy.py
STRATEGY` trains 3 steps and calls `dist.destroy_process_group()` as its last line."""

import sys

import torch
import torch.distributed as dist

import phalanx as px

px.init()
m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
m, opt = px.prepare(m, opt, strategy=sys.argv[1])
for _ in range(3):
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
