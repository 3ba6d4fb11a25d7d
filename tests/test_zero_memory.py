"""What zero2 and zero3 hold beyond the ZeRO formula while they train, counted tensor by tensor
on real ranks: a lone parameter's gradient is reduced in the tensor autograd made (no bucket,
no copy), zero2 holds two units' full gradients at most and zero3, beyond the shards, two
units' worth (a gathered unit and a gradient); the pool the engine keeps is the one the
planner plans; and a rank-dependent branch in the first root of zero3's backward, followed by
more units, trains as one process does instead of hanging (benchmarks/anchors.py measures the
resident memory these make)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import engine_of, run_ranks

D = 128
UNIT = D * D * 4  # one Linear(D, D, bias=False) in fp32


def _lone_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D, bias=False), nn.Tanh())
                           for _ in range(6)])


def _held(strategy):
    """The most full-size storages alive at any hook of three steps: gathered units,
    full-gradient buffers and the gradient autograd has just made, counted once each; and
    whether every lone gradient was reduced in place (its bucket's buffer is `.grad` itself)."""
    model = _lone_model()
    model, opt = px.prepare(model, torch.optim.AdamW(model.parameters()), strategy=strategy,
                            bucket_mb=UNIT / 2**20)  # a unit per weight
    engine = engine_of(model)
    engine.patience = 30.0  # a loaded machine's peer is never given up on here
    inner = px.unwrap(model)
    most, in_place, fresh = [0], [], [None]

    def count(label):
        storages = {}
        for t in [u.flat for u in engine.units if u.gathered and u.reshards] + \
                 [u.bucket.buffer for u in engine.units] + [fresh[0]]:
            if t is not None and t.untyped_storage().nbytes() >= UNIT:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        most[0] = max(most[0], sum(storages.values()))

    def arrives(grad):
        fresh[0] = grad
        count("arrives")
        fresh[0] = None

    def allocating(bucket, allocate):
        def wrapped():
            in_place.append(bucket.buffer is not None)  # a buffer made: a gradient copied
            allocate()
        return wrapped

    for unit in engine.units:
        unit.bucket.allocate = allocating(unit.bucket, unit.bucket.allocate)
    for p in inner.parameters():
        p.register_hook(arrives)
        p.register_post_accumulate_grad_hook(lambda p: count("accumulated"))
    for m in inner.modules():
        m.register_forward_hook(lambda *a: count("forward"))
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + px.rank())
        model(torch.randn(4, D, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return most[0], bool(in_place) and all(in_place), engine.pool is None


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_two_units_at_most_beyond_the_shards_and_no_gradient_copied(strategy):
    for most, in_place, no_pool in run_ranks(_held, 2, args=(strategy,), timeout=120):
        assert no_pool  # no unit borrows: each is one parameter the world size divides
        assert in_place
        assert most == 2 * UNIT, most / UNIT


class Heads(nn.Module):
    """Two equal heads, one chosen by the rank."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, h, rank):
        return self.left(h) if rank == 0 else self.right(h)


class Deep(nn.Module):
    """The heads are the last root of the forward, so the first of backward; five blocks
    follow, each a root to gather again and two units to reduce."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.heads = Heads()

    def forward(self, x, rank=None):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.heads(x, px.rank() if rank is None else rank)


def _deep(reference):
    torch.manual_seed(0)
    model = Deep().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not reference:  # units of one parameter each
        model, opt = px.prepare(model, opt, strategy="zero3", bucket_mb=1e-5)
    for step in range(4):
        ranks = range(2) if reference else [px.rank()]
        loss = 0
        for r in ranks:  # one process: rank r's batch through rank r's head, averaged
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 10 + r),
                            dtype=torch.float64)
            loss = loss + model(x, r).square().mean() / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_branch_on_the_rank_in_the_first_root_of_backward_does_not_hang():
    """Rank 0 reduces the left head's units mid-backward; rank 1 holds them (and every unit
    after them) back to the end of its backward, gathering the five blocks meanwhile. Waiting
    for them mid-backward on rank 0 hung both (before: three units in flight made rank 0
    wait); now rank 0 waits only for what every rank has issued."""
    want = _deep(True)
    for got in run_ranks(_deep, 2, args=(False,), timeout=120):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-14)


class Mixed(nn.Module):
    """Lone units (a weight of its own) and units that borrow (several parameters, or one of
    an odd size that the world does not divide)."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(64, 64, bias=False)
        self.odd = nn.Linear(64, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 64))
                                    for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.odd(self.big(x))


def _pool_bytes(strategy):
    torch.manual_seed(0)
    model = Mixed()
    model, _ = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy,
                          bucket_mb=0.01)
    pool = engine_of(model).pool
    return sum(t.untyped_storage().nbytes() for t in pool.tensors())


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_pool_kept_is_the_planned_pool(strategy):
    kept = run_ranks(_pool_bytes, 2, args=(strategy,))[0]
    with torch.device("meta"):
        model = Mixed()
    plan = px.plan(model, gpus=2, precision="fp32", optimizer="sgd", strategy=strategy,
                   backend="gloo", bucket_mb=0.01, input_shape="64")[strategy]
    # the engine's buffers also hold the used flags of the largest unit's parameters
    assert kept == pytest.approx(plan.buffers_detail["grad_pool"], abs=2 * 4 * 4)
    assert kept > 0
