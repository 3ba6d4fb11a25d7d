"""torch's DDP tutorial's rounds under a launcher: `phalanx run -n 2 rounds.py STRATEGY N`
makes the job's group N times in the same processes (`px.init()`, 3 steps,
`dist.destroy_process_group()`), each round's model from the same seed, and prints
`ROUND k rank=R sum=S` with a checksum of the round's final weights."""

import sys

import torch
import torch.distributed as dist

import phalanx as px

strategy, rounds = sys.argv[1], int(sys.argv[2])
for k in range(rounds):
    px.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    g = torch.Generator().manual_seed(px.rank())
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    total = sum(v.double().sum().item() for v in model.state_dict().values())
    print(f"ROUND {k} rank={px.rank()} sum={total!r}", flush=True)
    dist.destroy_process_group()
