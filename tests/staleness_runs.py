"""The model, data, one-process references and distributed loop of the staleness tests
(tests/test_staleness.py) and of benchmarks/staleness_convergence.py, in float64.

The delayed reference is [Note: staleness=1] of engine/delayed.py written out in one process:
step t computes the mean gradient g_t over the whole global batch on the weights w_t, then
applies g_{t-1} (clipped, if asked) with the optimizer; the first step applies nothing and does
not run the optimizer.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px

DTYPE = torch.float64
# rows per step: divides by world x accumulation for 1, 2, 3 ranks and 1, 2 micro-steps
GLOBAL = 12
SEED = 1234
DIM = 6


class Net(nn.Module):
    """A layer no forward uses (its gradient is None everywhere, so it is never stepped)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 16)
        self.hidden = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 3)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def make_model(seed=SEED):
    torch.manual_seed(seed)
    return Net().to(DTYPE)


def make_optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    raise ValueError(kind)


def batch(step):
    """The global batch of `step`: a fixed linear map plus noise, so the loss can go down."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, DIM, generator=g, dtype=DTYPE)
    w = torch.linspace(-1.0, 1.0, DIM * 3, dtype=DTYPE).view(DIM, 3)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(GLOBAL, 3, generator=g, dtype=DTYPE)


def reference(steps, opt_kind="sgd", clip=None, staleness=1, losses=None):
    """One process on each whole global batch; `staleness` 1: the delayed update above, 0: the
    ordinary one. Returns the parameters and the optimizer's state_dict; `losses`, a list,
    receives each step's loss (on the weights before that step's update)."""
    model = make_model()
    opt = make_optimizer(opt_kind, model)
    params = list(model.parameters())
    previous = None
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if losses is not None:
            losses.append(loss.item())
        mine = [None if p.grad is None else p.grad.clone() for p in params]
        apply = mine if staleness == 0 else previous
        if apply is not None:
            for p, g in zip(params, apply):
                p.grad = g
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
        previous = mine
        opt.zero_grad()
    return [p.detach().clone() for p in params], opt.state_dict()


def train(model, opt, steps, first=0, accum=1, clip=None):
    """On a rank: this rank's rows of the global batches `first`.. `first+steps-1`, micro-step a
    taking chunk a*world + rank (each rank's loss divided by `accum`)."""
    world, rank = px.world_size(), px.rank()
    rows = GLOBAL // (world * accum)
    for step in range(first, first + steps):
        x, y = batch(step)
        for a in range(accum):
            c = slice((a * world + rank) * rows, (a * world + rank + 1) * rows)
            sync = contextlib.nullcontext() if a == accum - 1 else px.no_sync(model)
            with sync:
                (F.mse_loss(model(x[c]), y[c]) / accum).backward()
        if clip is not None:
            px.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()


def prepared(strategy, opt_kind="sgd", **options):
    """Every rank seeds differently before building, so the initial broadcast is under test."""
    model = make_model(SEED + px.rank())
    opt = make_optimizer(opt_kind, model)
    return px.prepare(model, opt, strategy=strategy, bucket_mb=0.002, staleness=1, **options)


def result(model, opt):
    """The parameters and the optimizer's state as one process has them (a collective)."""
    return ([p.detach().clone() for p in px.unwrap(model).parameters()],
            px.optimizer_state_dict(opt))
