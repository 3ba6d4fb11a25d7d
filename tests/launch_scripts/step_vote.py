"""One rank's step raises an out-of-memory error and the loop catches it: the script the
launcher cases of tests/test_step_vote.py start (`phalanx run`, with and without `--on-failure
continue`), written as a user would.

    step_vote.py OUT [--strategy ddp] [--fault RANK@STEP] [--where backward|forward]
        [--loop caught|outer] [--skip STEP] [--steps 8]

float64, four repeated blocks (zero3's units), SGD with momentum; a px.data_loader (whose
sampler keeps continue mode's ledger) with a global batch of 12 rows (4 per rank at 3 ranks),
two epochs of `--steps` batches each. `--loop caught`: `try: forward, backward; except
torch.OutOfMemoryError: optimizer.zero_grad(); continue`. `--loop outer`: the error escapes the step
function (forward, backward, step, zero_grad) and the loop around it goes on. `--skip S` leaves out
the batch of step S (the reference, in a world of one). Rank 0 writes the final weights (one flat
tensor) to OUT. Every worker prints `START rank=R pid=P` and `END rank=R pid=P world=W steps=N`.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--fault", default=None)
parser.add_argument("--where", default="backward")
parser.add_argument("--loop", default="caught")
parser.add_argument("--skip", type=int, default=None)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

px.init()
rank, world = px.rank(), px.world_size()
print(f"START rank={rank} pid={os.getpid()}", flush=True)
fault = tuple(map(int, args.fault.split("@"))) if args.fault else None


class Fault(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return grad, None


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.out = torch.nn.Linear(16, 1)
        self.armed = None

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        armed, self.armed = self.armed, None
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                if armed == "forward":
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                h = Fault.apply(h, armed == "backward")
        return self.out(h)


torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = px.prepare(model, optimizer, strategy=args.strategy, bucket_mb=0.001,
                              blocks=[Block])


def step(x, y):
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(12 * args.steps, 6, generator=g),
                                      torch.randn(12 * args.steps, 1, generator=g))
loader = px.data_loader(data, batch_size=12 // world)
at = -1
for epoch in range(2):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        at += 1
        if at == args.skip:
            continue
        if fault == (rank, at):
            px.unwrap(model).armed = args.where
        if args.loop == "outer":
            try:
                step(x, y)
            except torch.OutOfMemoryError:
                pass
            continue
        try:
            F.mse_loss(model(x), y).backward()
        except torch.OutOfMemoryError:
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
# the full values, as one process holds them (under zero3 state_dict() reads the peers' shards)
weights = torch.cat([v.reshape(-1) for v in px.unwrap(model).state_dict().values()])
if rank == 0:
    torch.save(weights, args.out)
print(f"END rank={rank} pid={os.getpid()} world={world} "
      f"steps={px.step_stats(model).get('step', -1) + 1}", flush=True)
px.shutdown()
