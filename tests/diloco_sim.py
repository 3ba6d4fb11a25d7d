"""A one-process simulation of N DiLoCo workers, streaming included (fragments synced in turn,
averages applied `delay` steps after they were sent, quantized pseudo-gradients with error
feedback), written out from the formulas of engine/diloco.py and engine/diloco_wire.py's
Notes, for the float64 parity tests of test_diloco_streaming.py.

The rank runs (`rank_run`) train test_diloco.py's Net on its data with px.DiLoCo; the
simulation trains `world` copies of it on the same rows.
"""

from __future__ import annotations

import copy

import torch
from test_diloco import _inner, _local_step, _model

import phalanx as px

CHUNK = 128
LEVELS = {"int8": 127, "int4": 7}
# Net's parameters (a.weight 96, a.bias 16, b.weight 48, b.bias 3) cut into runs of about
# equal size, each ending once it reaches its share of the 163 elements
FRAGMENTS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]], 3: [[0], [1], [2, 3]],
             4: [[0], [1], [2], [3]]}


def quantized(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x as the others receive it: per chunk of 128 of its elements (the last padded with
    zeros), whole numbers times max|x| / L."""
    level = LEVELS[dtype]
    flat = torch.zeros(-(-x.numel() // CHUNK) * CHUNK, dtype=x.dtype)
    flat[:x.numel()] = x.reshape(-1)
    chunks = flat.view(-1, CHUNK)
    out = torch.zeros_like(chunks)
    for row in range(chunks.shape[0]):
        s = chunks[row].abs().max() / level
        if s > 0:
            out[row] = torch.round(chunks[row] / s).clamp(-level, level) * s
    return out.view(-1)[:x.numel()].view_as(x)


class Simulation:
    """`world` workers of DiLoCo(sync_every=H, fragments=P, delay=D, keep_local, comm_dtype),
    outer Nesterov SGD (lr, momentum), each worker its own inner optimizer (`kind`)."""

    def __init__(self, world, H, P, D, keep, wire, kind, lr=0.7, momentum=0.9,
                 error_feedback=True):
        self.world, self.H, self.P, self.D, self.keep = world, H, P, D, keep
        self.wire, self.kind, self.lr, self.momentum = wire, kind, lr, momentum
        self.error_feedback = error_feedback
        base = _model()
        self.workers = [copy.deepcopy(base) for _ in range(world)]
        self.opts = [_inner(kind, w) for w in self.workers]
        self.synced = [p.detach().clone() for p in base.parameters()]
        self.velocity = [None] * len(self.synced)
        self.errors = [[None] * len(self.synced) for _ in range(world)]
        self.phase = 0
        self.flight = None  # (fragment, due, averages)
        self.step = 0

    def weights(self, r):
        return list(self.workers[r].parameters())

    def run(self, steps):
        for _ in range(steps):
            for r in range(self.world):
                _local_step(self.workers[r], self.opts[r], self.step, r, self.world)
            self.step += 1
            self.phase = (self.phase + 1) % self.H
            if self.flight is not None and self.flight[1] == self.phase:
                self.apply()
            every = self.H // self.P
            if self.phase % every == 0:
                self.send((self.phase // every - 1) % self.P)
                if self.D == 0:
                    self.apply()
        return self

    @torch.no_grad()
    def send(self, k):
        averages = []
        for i in FRAGMENTS[self.P][k]:
            received = []
            for r in range(self.world):
                x = self.synced[i] - self.weights(r)[i]
                if self.wire is not None and self.error_feedback \
                        and self.errors[r][i] is not None:
                    x = x + self.errors[r][i]
                sent = x if self.wire is None else quantized(x, self.wire)
                if self.wire is not None and self.error_feedback:
                    self.errors[r][i] = x - sent
                received.append(sent)
            averages.append(sum(received) / self.world)
        self.flight = (k, (self.phase + self.D) % self.H, averages)

    @torch.no_grad()
    def apply(self, keep=None):
        k, _, averages = self.flight
        self.flight = None
        keep = self.keep if keep is None else keep
        for i, d in zip(FRAGMENTS[self.P][k], averages):
            v = d.clone() if self.velocity[i] is None else self.momentum * self.velocity[i] + d
            self.velocity[i] = v
            self.synced[i] -= self.lr * (d + self.momentum * v)
            for r in range(self.world):
                w = self.weights(r)[i]
                w.copy_(self.synced[i] if keep == 0 else torch.lerp(self.synced[i], w, keep))

    @torch.no_grad()
    def resize(self, world):
        """A resume at `world` workers (inner SGD without state): the average in flight
        applied, every worker from the synced weights, every error the mean of the old
        workers', the cycle from its start."""
        if self.flight is not None:
            self.apply(keep=0.0)
        errors = []
        for i in range(len(self.synced)):
            saved = [self.errors[r][i] for r in range(self.world)]
            errors.append(None if saved[0] is None else sum(saved) / self.world)
        self.world = world
        self.workers = [copy.deepcopy(self.workers[0]) for _ in range(world)]
        for w in self.workers:
            for p, s in zip(w.parameters(), self.synced):
                p.copy_(s)
        self.opts = [_inner(self.kind, w) for w in self.workers]
        self.errors = [list(errors) for _ in range(world)]
        self.phase = 0
        return self


def diloco(H, P, D, keep, wire, lr=0.7, momentum=0.9, error_feedback=True):
    return px.DiLoCo(sync_every=H, fragments=P, delay=D, keep_local=keep, comm_dtype=wire,
                     outer_lr=lr, outer_momentum=momentum, error_feedback=error_feedback)


def rank_run(configs, steps, kind="adamw"):
    """Each config (H, P, D, keep, wire) trained `steps` steps on this rank: its parameters,
    and the step report of every step."""
    world, rank = px.world_size(), px.rank()
    out = []
    for H, P, D, keep, wire in configs:
        model = _model()
        opt = _inner(kind, model)
        model, opt = px.prepare(model, opt, strategy=diloco(H, P, D, keep, wire))
        reports = []
        for step in range(steps):
            _local_step(model, opt, step, rank, world)
            reports.append(px.step_stats(model))
        out.append(([p.detach().clone() for p in px.unwrap(model).parameters()], reports))
    return out

