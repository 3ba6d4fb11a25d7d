"""Train a few steps of ddp with rank 1 misbehaving at step 3 as argv[1] says, for the
launcher's message about it:

  exit      rank 1 calls sys.exit(0) (its script ends; the others go on)
  freeze    rank 1 stops its own process (SIGSTOP), as a frozen rank
  freeze0   rank 0 does (under phalanx run --on-failure restart or stop, its worker serves
            the job's store)
  stuck     rank 1 ignores SIGTERM and sleeps (a rank that does not end when told to)

Every rank writes its pid to argv[2]/pid<rank> first, for the test to look for leftovers.
argv[3], if given: px.init's timeout in seconds ("-": the default); argv[4]: the strategy
(default ddp). Prints `DONE` at the end.
"""

import os
import signal
import sys
import time

import torch
import torch.nn as nn

import phalanx as px

kind, pids = sys.argv[1], sys.argv[2]
px.init(timeout=float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else 600.0)
strategy = sys.argv[4] if len(sys.argv) > 4 else "ddp"
with open(os.path.join(pids, f"pid{px.rank()}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = px.prepare(model, opt, strategy=strategy)
for step in range(6):
    if step == 3 and px.rank() == 0 and kind == "freeze0":
        os.kill(os.getpid(), signal.SIGSTOP)
    if step == 3 and px.rank() == 1:
        if kind == "exit":
            sys.exit(0)
        if kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "stuck":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
px.shutdown()
print("DONE", flush=True)
