"""Shared pieces of the parity tests: small models, their data, and one training loop that runs
either as the single-process reference (plain PyTorch) or on a rank after `px.prepare`.

The rule every parity test checks: N ranks with per-rank batch b (and A accumulation
micro-steps) end with the same parameters as one process with batch N*A*b.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import phalanx as px

DIM = 12


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No conv bias before BatchNorm: its gradient is exactly zero (BN removes the mean), and
        # Adam would turn the round-off in that zero into full-size steps.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    """Returns a dict, and checkpoints its encoder layer (non-reentrant)."""

    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True, bias=False)
        # bias=False: the attention key bias has an exactly-zero gradient, and Adam turns the
        # round-off noise in a zero gradient into full-size steps, which no parity test survives.
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = checkpoint(self.layer, h, use_reentrant=False)
        return {"logits": self.head(h), "hidden": h}


class Branchy(nn.Module):
    """Two branches chosen per call, and one parameter no forward ever uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(DIM, 16)
        self.left = nn.Linear(16, 4)
        self.right = nn.Linear(16, 4)
        self.never_used = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, branch: int):
        h = torch.tanh(self.trunk(x))
        out = self.left(h) if branch == 0 else self.right(h)
        return out, h  # a tuple


MODELS = {"mlp": MLP, "cnn": CNN, "transformer": TinyTransformer, "branchy": Branchy}


def make_model(name: str) -> nn.Module:
    torch.manual_seed(1234)  # every rank and the reference start from the same weights
    return MODELS[name]()


def make_data(name: str, rows: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if name == "cnn":
        return torch.randn(rows, 3, 6, 6, generator=g), torch.randn(rows, 4, generator=g)
    if name == "transformer":
        tokens = torch.randint(0, 20, (rows, 5), generator=g)
        return tokens, torch.randint(0, 20, (rows, 5), generator=g)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, 4, generator=g)


def loss_of(name: str, model, x, y, chunk: int):
    """The loss of one rank's (or micro-step's) batch; `chunk` picks Branchy's branch."""
    if name == "transformer":
        out = model(x)
        return F.cross_entropy(out["logits"].reshape(-1, 20), y.reshape(-1))
    if name == "branchy":
        out, _ = model(x, branch=chunk % 2)
        return F.mse_loss(out, y)
    return F.mse_loss(model(x), y)


def make_optimizer(kind: str, model: nn.Module):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "adamw2":  # two param groups with their own learning rates and decay
        decay = [p for p in params if p.dim() > 1]
        other = [p for p in params if p.dim() <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": other, "lr": 0.003, "weight_decay": 0.0}], lr=0.01)
    raise ValueError(kind)


def train(name: str, opt_kind: str, world: int, b: int, steps: int = 5, accum: int = 1,
          clip: float | None = None, prepare_kwargs: dict | None = None):
    """Train and return the final parameters (fp32, cloned, in model order).

    With `prepare_kwargs=None` this is the single-process reference: one process on the whole
    global batch of world*accum*b rows per step, with the loss of each rank's chunk averaged,
    exactly the objective that data parallelism optimises. Otherwise it runs on a rank.
    """
    model = make_model(name)
    optimizer = make_optimizer(opt_kind, model)
    reference = prepare_kwargs is None
    if not reference:
        model, optimizer = px.prepare(model, optimizer, **prepare_kwargs)
    rank = 0 if reference else px.rank()
    for step in range(steps):
        x, y = make_data(name, world * accum * b, step)
        if reference:
            # Micro-step a holds chunks a*world .. a*world+world-1 (one per rank). BatchNorm
            # (synchronized) sees a micro-step's chunks together, so those run as one batch;
            # Branchy picks its branch per chunk, so it runs chunk by chunk.
            losses = []
            for a in range(accum):
                rows = slice(a * world * b, (a + 1) * world * b)
                if name == "branchy":
                    losses += [loss_of(name, model, x[c * b:(c + 1) * b], y[c * b:(c + 1) * b], c)
                               for c in range(a * world, (a + 1) * world)]
                else:
                    losses.append(loss_of(name, model, x[rows], y[rows], 0))
            loss = sum(losses) / len(losses)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            for a in range(accum):
                c = a * world + rank  # micro-step a of this rank
                # alternate the two spellings of the same context
                no_sync = px.no_sync(model) if step % 2 else model.no_sync()
                sync = contextlib.nullcontext() if a == accum - 1 else no_sync
                with sync:
                    loss = loss_of(name, model, x[c * b:(c + 1) * b], y[c * b:(c + 1) * b], c)
                    (loss / accum).backward()
            if clip is not None:
                px.clip_grad_norm_(model, clip)
        optimizer.step()
        optimizer.zero_grad()
        if not reference:
            with torch.no_grad():  # an evaluation pass between steps must change nothing
                model.eval()
                loss_of(name, model, x[:b], y[:b], 0)
                model.train()
    module = px.unwrap(model)
    return [p.detach().float().clone() for p in module.parameters()]


def assert_params_close(got, want, rtol=1e-5, context=""):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= rtol * scale + 1e-7, (
            f"{context}: parameter {i} differs by {err:.3e} (relative {err / max(scale, 1e-12):.3e})")
