"""The training that tests/test_step_vote.py runs on ranks and, as the reference, in one process.

A float64 model of four repeated blocks (zero3's units), SGD with momentum, and a fault that one
rank hits at one step: an out-of-memory error raised in the forward of the second block, or in
the backward arriving there (after the later blocks have sent some of their gradients). Each
way a loop meets the error is one function:

- `caught`: fairseq's loop: `try: forward, loss, backward; except torch.OutOfMemoryError:
  optimizer.zero_grad(); continue` (the failing rank skips its optimizer step);
- `outer`: the error escapes the user's step function (forward, backward, step, zero_grad),
  and an outer loop catches it and goes on: the failing rank makes no call at all before its
  next step's forward;
- `accumulate`: two micro-batches per step, the first under `no_sync`, the error in the first
  (its handler zero_grads and goes on with the second, whose backward communicates);
- `clipped`: as `caught`, with torch's clip_grad_norm_ before the step (a collective of its own
  where gradients are sharded: none in a dropped step, on any rank);
- `scheduled`: the handler goes on to `optimizer.step()` (which changes nothing) and an LR
  scheduler's step, as every rank does;
- `scaled`: torch.amp's GradScaler, the handler going on to `scaler.step` and `scaler.update`.

The reference is one process over the global batch that skips every batch of the step (and
steps the scheduler).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

STEPS, BAD_STEP, ROWS = 6, 3, 4  # the fault's step is after zero3 has seen three whole steps


class Fault(torch.autograd.Function):
    """Identity; its backward raises when armed (an allocation that failed there)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")
        return grad, None


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.out = nn.Linear(width, 3)
        self.fault = None  # "forward" or "backward": armed for the next forward only

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        fault, self.fault = self.fault, None
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                if fault == "forward":
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated in forward)")
                h = Fault.apply(h, fault == "backward")
        return self.out(h)


def batch(step: int, micro: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))


def caught(model, opt, x, y, last, aids, clip=False):
    try:
        F.mse_loss(model(x), y).backward()
    except torch.OutOfMemoryError:
        opt.zero_grad()
        return
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()


def clipped(model, opt, x, y, last, aids):
    caught(model, opt, x, y, last, aids, clip=True)


def scheduled(model, opt, x, y, last, aids):
    try:
        F.mse_loss(model(x), y).backward()
    except torch.OutOfMemoryError:
        opt.zero_grad()
    opt.step()
    aids["sched"].step()
    opt.zero_grad()


def scaled(model, opt, x, y, last, aids):
    scaler = aids["scaler"]
    try:
        scaler.scale(F.mse_loss(model(x), y)).backward()
    except torch.OutOfMemoryError:
        opt.zero_grad()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _step(model, opt, x, y):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def outer(model, opt, x, y, last, aids):
    try:
        _step(model, opt, x, y)
    except torch.OutOfMemoryError:
        pass


def saved(model, opt, x, y, last, aids):
    """`outer`, saving after every step: after its fault the failing rank's next call into
    phalanx is px.save, which makes up the step's collectives first."""
    outer(model, opt, x, y, last, aids)
    if px.unwrap(model) is not model:  # the reference (one plain process) saves nothing
        px.save(os.path.join(os.environ["VOTE_SAVE_DIR"], "latest"), model=model, optimizer=opt)


def accumulate(model, opt, x, y, last, aids):
    # the reference (a plain module) accumulates without one
    sync = contextlib.nullcontext() if last else getattr(model, "no_sync", contextlib.nullcontext)()
    try:
        with sync:
            F.mse_loss(model(x), y).backward()
    except torch.OutOfMemoryError:
        opt.zero_grad()
    if last:
        opt.step()
        opt.zero_grad()


LOOPS = {"caught": caught, "outer": outer, "saved": saved, "accumulate": accumulate,
         "clipped": clipped,
         "scheduled": scheduled, "scaled": scaled}


def train(strategy, loop: str, where: str, bad_rank: int, world: int = 2, steps=STEPS,
          precision: str = "fp32"):
    """On a rank: the prepared model's full parameters after `steps` steps, the fault hit on
    `bad_rank` at BAD_STEP (`where` None: nowhere; "skip": every rank skips that batch). With
    strategy None: the reference, one process over the global batch that skips BAD_STEP where
    the fault is. Returns (parameters, bytes communicated in the last step, the state of
    precision="fp16"'s loss scaler)."""
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if strategy is not None:
        # small buckets: several gradients are on the wire before the backward fault
        model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.001, blocks=[Block],
                                precision=precision)
    # the scale is a power of two: the float64 gradients come back exact
    aids = {"sched": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            "scaler": torch.amp.GradScaler("cpu")}
    rank = px.rank() if strategy is not None else 0
    micros = 2 if loop == "accumulate" else 1
    run = LOOPS[loop]
    for step in range(steps):
        if step == BAD_STEP and (where == "skip" or strategy is None and where is not None):
            if loop == "scheduled":
                aids["sched"].step()
            continue
        for micro in range(micros):
            x, y = batch(step, micro, ROWS * world)
            if strategy is not None:
                x, y = x[ROWS * rank:ROWS * (rank + 1)], y[ROWS * rank:ROWS * (rank + 1)]
            if strategy is not None and rank == bad_rank and step == BAD_STEP and micro == 0:
                px.unwrap(model).fault = where
            run(model, opt, x, y, micro == micros - 1, aids)
    sent = px.step_stats(model).get("comm_bytes") if strategy is not None else None
    scaler = getattr(model, "loss_scaler", None)
    # the state_dict, not the parameters: under zero3 those hold values only while they compute
    return ([v.detach().clone() for v in model.state_dict().values()], sent,
            scaler.state_dict() if scaler is not None else None)


def cases(strategies, combos, **options):
    """On a rank: every (strategy, combo) trained in this one job."""
    return {(strategy, combo): train(strategy, *combo, **options)
            for strategy in strategies for combo in combos}
