"""Communication: the ring formulas, and the planner's payload per step against the bytes the
collectives layer counts in a real run of px.prepare."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.engine.policy import POLICIES
from phalanx.planner.comm import collectives, step_time, wire_bytes
from phalanx.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from parity import Chain


@pytest.mark.one_process
@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_ring_bytes_per_rank(world):
    # A ring all-reduce sends each of 2 (N-1) chunks of B/N bytes; reduce-scatter and
    # all-gather N-1 chunks each. Counted here by stepping the ring.
    payload = 6_000_000
    chunk = payload / world
    assert wire_bytes("all_reduce", payload, world) == pytest.approx(2 * (world - 1) * chunk)
    assert wire_bytes("reduce_scatter", payload, world) == pytest.approx((world - 1) * chunk)
    assert wire_bytes("all_gather", payload, world) == pytest.approx((world - 1) * chunk)
    assert wire_bytes("all_reduce", payload, 1) == 0


@pytest.mark.one_process
def test_zero3_gathers_in_every_micro_step_and_reduces_once():
    colls = collectives(POLICIES["zero3"], 100, 100, 4, reduce_scatter=True)
    t1 = step_time(colls, 4, 1.0, 1, 1.0, False)
    t4 = step_time(colls, 4, 1.0, 4, 1.0, False)
    gathers = 2 * wire_bytes("all_gather", 100, 4)
    assert t4.comm_bytes - t1.comm_bytes == pytest.approx(3 * gathers)
    ddp = collectives(POLICIES["ddp"], 100, 100, 4, reduce_scatter=True)
    assert step_time(ddp, 4, 1.0, 4, 1.0, False).comm_bytes == \
        step_time(ddp, 4, 1.0, 1, 1.0, False).comm_bytes


@pytest.mark.one_process
def test_overlap_hides_communication_up_to_the_backward():
    colls = collectives(POLICIES["ddp"], 10**9, 10**9, 8, reduce_scatter=True)
    # 1.75 GB on the wire at 1 GB/s: 1.75 s against 3 s of compute (2 s of it backward)
    t = step_time(colls, 8, compute_s=3.0, grad_accum=1, bandwidth_gbps=1.0, checkpointing=False)
    assert t.comm_s == pytest.approx(1.75)
    assert t.step_s == pytest.approx(3.0)
    assert t.step_no_overlap_s == pytest.approx(4.75)
    t = step_time(colls, 8, compute_s=1.5, grad_accum=1, bandwidth_gbps=1.0, checkpointing=False)
    assert t.step_s == pytest.approx(0.5 + 1.75)  # forward, then communication-bound backward
    assert t.scaling_efficiency == pytest.approx(1.5 / 2.25)


def _model(blocks=False):
    """blocks: an input layer, four repeated blocks and a head (zero3: a root per block, the
    last one kept from forward into backward, and the model-level units kept too)."""
    torch.manual_seed(0)
    if blocks:
        return nn.Sequential(nn.Linear(32, 48), Chain([nn.Sequential(nn.Linear(48, 48),
                                                                     nn.Tanh())
                                                       for _ in range(4)]), nn.Linear(48, 5))
    return nn.Sequential(nn.Linear(32, 200), nn.Tanh(), nn.Linear(200, 100), nn.Tanh(),
                         nn.Linear(100, 5))


CASES = [("ddp", "fp32", False), ("ddp", "bf16", False), ("zero1", "fp32", False),
         ("zero1", "bf16", False), ("zero2", "fp32", False), ("zero2", "bf16", False),
         ("zero3", "fp32", False), ("zero3", "bf16", False), ("zero3", "fp32", True)]


def _counted_payload(steps=2, accum=2):
    from phalanx.comm import records as collectives
    results = []
    for strategy, precision, blocks in CASES:
        model = _model(blocks)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)

        def step(model=model, opt=opt):
            for micro in range(accum):
                x = torch.randn(4, 32)
                ctx = px.no_sync(model) if micro < accum - 1 else torch.enable_grad()
                with ctx:
                    model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step()  # the first step re-lays buckets (a broadcast): not a steady-state step
        collectives.reset_counts()
        for _ in range(steps):
            step()
        results.append({op: b / steps for op, b in collectives.bytes_by_kind().items()})
    return results


def test_planned_payload_matches_the_collectives_counter():
    world = 2
    measured = run_ranks(_counted_payload, world, timeout=120)
    for (strategy, precision, blocks), counted in zip(CASES, measured[0]):
        planned = px.plan(_model(blocks), gpus=world, precision=precision,
                          optimizer="sgd-momentum", strategy=strategy, backend="gloo",
                          grad_accum=2, input_shape="32")[strategy].comm_payload_bytes
        assert set(counted) == set(planned), (strategy, precision)
        for op in planned:
            # buckets carry padding to a multiple of the world size and ddp's used-flags
            assert counted[op] == pytest.approx(planned[op], rel=2e-3), (strategy, precision, op)
