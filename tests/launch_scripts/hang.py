"""Train a few steps with one rank misbehaving as argv[1] says, to provoke a hang report:

  sleep     rank 1 sleeps before step 3's forward (a rank stuck outside any collective)
  skip      rank 1 skips the global_mean of step 3 (a skipped collective)
  extra     rank 1 issues one more global_mean at step 3 (an extra collective)
  steps     rank 1 runs one step fewer (different step counts)
  dead      rank 1 ends its process without a word at step 3 (no traceback, no shutdown)

argv[2]: strategy; argv[3]: shard_size (the last rank then misbehaves). Prints `DONE` at the end.
"""

import os
import sys
import time

import torch
import torch.nn as nn

import phalanx as px

kind = sys.argv[1]
strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
px.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
shard = int(sys.argv[3]) if len(sys.argv) > 3 else None
model, opt = px.prepare(model, opt, strategy=strategy, shard_size=shard)
odd = px.rank() == (1 if shard is None else px.world_size() - 1)
steps = 5 - (kind == "steps" and odd)
for step in range(steps):
    if step == 3 and odd and kind == "sleep":
        time.sleep(600)
    if step == 3 and odd and kind == "dead":
        os._exit(0)
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if not (step == 3 and odd and kind == "skip"):
        px.global_mean(loss.detach(), 1)
    if step == 3 and odd and kind == "extra":
        px.global_mean(loss.detach(), 1)
px.shutdown()
print("DONE", flush=True)
