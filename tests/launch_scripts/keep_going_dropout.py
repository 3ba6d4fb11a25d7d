"""A model with a dropout layer trained under `phalanx run --on-failure continue`, rank 1 killed
before step 3's forward: `keep_going_dropout.py CKPT_DIR P` (P: the dropout probability)."""

import os
import signal
import sys

import torch

import phalanx as px

ckpt, p = sys.argv[1], float(sys.argv[2])
px.init()
life = int(os.environ.get("PHALANX_JOINING", "0"))
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g),
                                      torch.randn(48, 1, generator=g))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(p),
                            torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = px.prepare(model, optimizer)
loader = px.data_loader(data, batch_size=12 // int(os.environ["WORLD_SIZE"]))
latest = px.latest_checkpoint(ckpt)
step = px.load(latest, model=model, optimizer=optimizer, sampler=loader.sampler)["step"] \
    if latest else 0
for x, y in loader:
    if step == 3 and px.rank() == 1 and life == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    px.save(os.path.join(ckpt, f"step{step:03d}"), model=model, optimizer=optimizer,
            sampler=loader.sampler, step=step, keep_last=2)
px.shutdown()
