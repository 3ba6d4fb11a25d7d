"""Train a model with frozen parameters through a killed rank under `phalanx run --on-failure
continue`: the script tests/test_keep_going_frozen.py starts (the loop of keep_going.py, with
a LoRA-like model instead of its MLP).

    keep_going_frozen.py OUT CKPT_DIR [--strategy zero3] [--model lora|frozen-base]
        [--epochs 2] [--samples 96] [--kill RANK@STEP,...] [--kill-in forward|backward]

The model: a frozen input projection, three blocks (each a frozen base Linear with a trainable
low-rank pair A/B beside it, as LoRA makes them) and a frozen head. `--model lora` (the
default) wraps it as PEFT's `PeftModel` wraps its model: the wrapper's child `base_model`
holds it as `base_model.model`, and the wrapper's forward calls that directly, never
`base_model`'s own forward, so under zero3 the units of the projection and the head (rooted at
`base_model`) are gathered where their modules are first used ([Note: a root whose module is
not called] in engine/zero3_roots.py). `--model frozen-base` is the model alone.

float64; a global batch of 12 samples (4 per rank at 3 ranks), so any world size trains on
the same samples; a px.save after every step, and keep_going.py's resume lines. `--kill R@S`:
the first worker of rank R SIGKILLs itself in step S: before the forward (`--kill-in forward`,
the default) or inside the backward of the second block, once backward has gathered it
(`--kill-in backward`). Rank 0 writes the final weights (one flat tensor) to OUT. Every
worker prints `START rank=R pid=P life=L` and `END rank=R pid=P life=L world=W`, and a kill
`FAULT rank=R kind=kill step=S`.
"""

import argparse
import os
import signal

import torch
from torch import nn

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("ckpt")
parser.add_argument("--strategy", default="zero3")
parser.add_argument("--model", choices=("lora", "frozen-base"), default="lora")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=96)
parser.add_argument("--kill", default="")
parser.add_argument("--kill-in", choices=("forward", "backward"), default="forward")
args = parser.parse_args()

px.init()
rank = int(os.environ.get("RANK", "0"))  # the launch rank: a replacement keeps it
life = int(os.environ.get("PHALANX_JOINING", "0"))
first = life == 0  # the worker that is killed on purpose
print(f"START rank={rank} pid={os.getpid()} life={life}", flush=True)
kills = {tuple(map(int, item.split("@"))) for item in args.kill.split(",") if item}
where = {"step": 0, "now": 0}  # steps taken (the loop's count), the step in progress


def die(part):
    if first and (rank, where["now"]) in kills and args.kill_in == part:
        print(f"FAULT rank={rank} kind=kill step={where['now']}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        die("backward")
        return grad


class Adapted(nn.Module):
    """A frozen base projection with a trainable low-rank pair A/B beside it (LoRA's shape)."""

    def __init__(self, width, r=2):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(width, r, bias=False)
        self.lora_B = nn.Linear(r, width, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class Block(nn.Module):
    def __init__(self, width, dies=False):
        super().__init__()
        self.proj = Adapted(width)
        self.dies = dies

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return x + (DieInBackward.apply(h) if self.dies else h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16, dies=i == 1) for i in range(3)])
        self.head = nn.Linear(16, 1)
        self.inp.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Holder(nn.Module):
    """PEFT's LoraModel: holds the model as `.model`; its own forward is never called."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


class Wrapped(nn.Module):
    """PEFT's PeftModel: calls `base_model.model` directly, skipping `base_model`."""

    def __init__(self, model):
        super().__init__()
        self.base_model = Holder(model)

    def forward(self, x):
        return self.base_model.model(x)


torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(args.samples, 8, generator=g),
                                      torch.randn(args.samples, 1, generator=g))
model = Wrapped(Net()) if args.model == "lora" else Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
model, optimizer = px.prepare(model, optimizer, strategy=args.strategy)
loader = px.data_loader(data, batch_size=12 // int(os.environ.get("WORLD_SIZE", "1")))
start = 0
ckpt = px.latest_checkpoint(args.ckpt)
if ckpt is not None:
    saved = px.load(ckpt, model=model, optimizer=optimizer, sampler=loader.sampler)
    start, where["step"] = saved["epoch"], saved["step"]
for epoch in range(start, args.epochs):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        where["now"] = where["step"]
        die("forward")
        where["step"] += 1
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        px.save(os.path.join(args.ckpt, f"step{where['step']:05d}"), model=model,
                optimizer=optimizer, sampler=loader.sampler, epoch=epoch, step=where["step"],
                keep_last=2)
# the full values, as one process holds them (under zero3 the parameters exist only while
# their unit computes; state_dict() reads the peers' shards)
weights = torch.cat([v.reshape(-1) for v in px.unwrap(model).state_dict().values()])
if px.rank() == 0:
    torch.save(weights, args.out)
print(f"END rank={rank} pid={os.getpid()} life={life} world={px.world_size()}", flush=True)
px.shutdown()
