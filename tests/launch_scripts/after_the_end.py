"""Train 3 steps, end the job as torch DDP scripts end (or with px.shutdown()), then read what
the peers held: `phalanx run -n 2 after_the_end.py STRATEGY WHAT HOW`. Prints one line per rank,
`AFTER <what> raised <class>: <message>` or `AFTER <what> ok`."""

import sys

import torch
import torch.distributed as dist

import phalanx as px

strategy, what, how = sys.argv[1:4]
px.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = px.prepare(model, opt, strategy=strategy)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
if how == "destroy":
    dist.destroy_process_group()
else:
    px.shutdown()
try:
    if what == "optimizer.state_dict":
        opt.state_dict()
    elif what == "unwrap.state_dict":
        px.unwrap(model).state_dict()
    elif what == "no_grad forward":
        with torch.no_grad():
            model(torch.randn(4, 8))
    elif what == "training step":
        model(torch.randn(4, 8)).sum().backward()
    print(f"AFTER {what} ok", flush=True)
except px.JobEnded as exc:
    print(f"AFTER {what} raised JobEnded: {exc}", flush=True)
